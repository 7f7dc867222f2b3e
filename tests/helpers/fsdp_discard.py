"""One rank of a two-rank FSDP2 job whose step 1 is abandoned (tests/test_sharded.py).

    python -m tests.helpers.fsdp_discard RANK PORT MODE OUT

MODE ``plain``: steps 0-2. ``discard``: step 1's forward runs on both ranks, then a newer
plan sets the abort flag: rank 0 skips its backward (``Stepper.backward`` does, once the
flag is set), rank 1 was already in its backward, which runs on (its collectives return at
once). The step is discarded (``sharded.reset_iteration``, as ``Stepper.discard`` does),
the group moves to generation 2, and step 1 is computed again there. Writes the losses and
the full parameters to ``OUT``: they must equal the plain run's.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from agent.groups import make_group
from agent.sharded import ShardGroup, reset_iteration

rank, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
# the test process hosts the store (a port picked free, then bound by rank 0 after its
# imports, was taken meanwhile: EADDRINUSE in CI)
store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
group = ShardGroup(rank, 2)
abort = threading.Event()
group.swap(make_group(dist.PrefixStore("g1.", store), rank, 2, 30), 1, abort, timeout_s=20)


class Net(torch.nn.Module):
    """The root holds parameters of its own (a GPT's embeddings), smaller than a block's."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.blocks = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.Tanh(),
                                          torch.nn.Linear(256, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x))


torch.manual_seed(0)
model = Net()
for layer in (model.blocks[0], model.blocks[2], model):
    fully_shard(layer, mesh=group.mesh())
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int) -> torch.Tensor:
    return torch.randn(16, 8, generator=torch.Generator().manual_seed(100 * step + rank))


losses = []
for step in range(3):
    if step == 1 and mode == "discard":
        model(batch(step)).pow(2).mean()  # the abandoned attempt's forward, on both ranks
        store.set(f"forward-{rank}", "1")
        store.wait(["forward-0", "forward-1"])
        abort.set()  # a newer plan
        if rank == 1:
            model(batch(step)).pow(2).mean().backward()
        reset_iteration([model])
        opt.zero_grad()
        old = group.swap(make_group(dist.PrefixStore("g2.", store), rank, 2, 30), 2,
                         threading.Event(), timeout_s=20)
        old.close()
    loss = model(batch(step)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    losses.append(loss.item())
torch.save({"losses": losses, "failure": group.failure,
            "params": {k: v.full_tensor() for k, v in model.state_dict().items()}}, out)
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)  # a parked backend may still wait on its peer
