"""One rank of a two-rank FSDP2 job whose peer fails mid-step (tests/test_sharded.py).

    python -m tests.helpers.fsdp_fault RANK PORT MODE OUT

MODE ``exit``: rank 1 exits before step 2's forward; ``hang``: it blocks for ever there and
rank 0's abort flag is set 1 s later (as a newer plan does). Rank 0 runs step 2's forward
and backward: neither may raise into the script, and the shard group holds the failure.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from agent.groups import make_group
from agent.sharded import ShardGroup

rank, port, mode, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
# the test process hosts the store (a port picked free, then bound by rank 0 after its
# imports, was taken meanwhile: EADDRINUSE in CI)
store = dist.TCPStore("127.0.0.1", port, 2, False,
                      timeout=__import__("datetime").timedelta(seconds=30))
group = ShardGroup(rank, 2)
abort = threading.Event()
group.swap(make_group(dist.PrefixStore("g1.", store), rank, 2, 30), 1, abort, timeout_s=20)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
for layer in (model[0], model[2], model):
    fully_shard(layer, mesh=group.mesh())
for step in range(3):
    if step == 2 and rank == 1:
        store.set("dying", "1")
        if mode == "exit":
            os._exit(0)
        threading.Event().wait()  # a hang (SIGSTOP-like): only its peer's abort ends step 2
    if step == 2:
        store.wait(["dying"])
        if mode == "hang":
            threading.Timer(1.0, abort.set).start()
    t0 = time.monotonic()
    loss = model(torch.randn(16, 8)).pow(2).mean()
    loss.backward()
    if step < 2:
        assert group.failure is None
        model.zero_grad()
took = time.monotonic() - t0
with open(out, "w") as f:
    json.dump({"failure": group.failure, "took": took}, f)
sys.stdout.flush()
os._exit(0)  # a parked backend may still wait on the dead peer
