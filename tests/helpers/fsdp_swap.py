"""One rank of a two-rank FSDP2 job on a ``ShardGroup`` (tests/test_sharded.py).

    python -m tests.helpers.fsdp_swap RANK PORT SWAP_AT OUT

Trains 6 steps of a small model sharded with ``fully_shard``; with ``SWAP_AT`` >= 0 the
group's backend is replaced by a new generation's (fresh store prefix) before that step and
the old one aborted. Before step 3 it snapshots the sharded state (this rank's shards of the
model and the optimizer, ``agent/state.py``), and after step 5 restores it and trains steps
3-5 again. Writes the losses and the full parameters (gathered) to ``OUT``.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import threading

from agent.groups import make_group
from agent.sharded import ShardGroup
from agent.state import snapshot

rank, port, swap_at, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
# the test process hosts the store (a port picked free, then bound by rank 0 after its
# imports, was taken meanwhile: EADDRINUSE in CI)
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=__import__("datetime").timedelta(seconds=30))
group = ShardGroup(rank, 2)
abort = threading.Event()
group.swap(make_group(dist.PrefixStore("g1.", store), rank, 2, 30), 1, abort)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
for layer in (model[0], model[2], model):
    fully_shard(layer, mesh=group.mesh())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
local_shapes = [tuple(p.to_local().shape) for p in model.parameters()]


def train(step: int) -> float:
    g = torch.Generator().manual_seed(100 * step + rank)
    loss = model(torch.randn(16, 8, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


losses, snap = [], None
for step in range(6):
    if step == swap_at:
        old = group.swap(make_group(dist.PrefixStore("g2.", store), rank, 2, 30), 2, abort)
        old.abort()  # the old generation's backend is gone: nothing may still use it
    if step == 3:  # the committed state after step 2, this rank's shards only
        snap = snapshot({"model": model, "optimizer": opt})
    losses.append(train(step))
full = {k: v.full_tensor() for k, v in model.state_dict().items()}
# back to the snapshot (as a recovery does) and the same steps again
snap.restore({"model": model, "optimizer": opt})
again = [train(step) for step in range(3, 6)]
torch.save({"losses": losses, "params": full, "local_shapes": local_shapes, "again": again,
            "snap_bytes": snap.nbytes,
            "again_params": {k: v.full_tensor() for k, v in model.state_dict().items()}}, out)
# Everything is written: skip the interpreter's teardown, where destroying the groups' gloo
# threads and the TCPStore's could abort the process ("terminate called without an active
# exception", exit -6: seen in CI) after the work was done.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
