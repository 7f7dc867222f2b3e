"""A user's script that uses the README's patterns together (issue 33): ``agent.init``
without a ``with`` block, rank-0 set-up with ``s.on_rank0``, ``s.join(start=k)`` before the
loop and ``s.steps(total, start=k)``, a rank-0 evaluation inside ``s.solo`` that uses what the
set-up made (a NameError/AttributeError if the set-up did not run on this pod),
``max_grad_norm=0.0`` (clipping off) and a save after the loop on rank 0.

argv: total steps, start step. Records per pod under ``<run dir>/patterns/``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import agent

total, start = int(sys.argv[1]), int(sys.argv[2])
out = Path(os.environ.get("CEASELESS_RUN_DIR", ".")) / "patterns"
out.mkdir(parents=True, exist_ok=True)

s = agent.init(global_batch_size=8, seed=0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)
data = torch.utils.data.TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
s.register(model=model, optimizer=opt, scheduler=sched)

logger = None  # made by the rank-0 set-up, as `wandb.init(...)` would be


def _record(event: str) -> None:
    with open(out / "events.jsonl", "a") as f:
        f.write(json.dumps({"pod": s.pod, "event": event, "rank": s.rank,
                            "step": s.last_committed}) + "\n")


def setup() -> None:
    global logger
    logger = open(out / f"metrics-{s.pod}.log", "a")
    _record("setup")


def teardown() -> None:
    logger.close()
    _record("teardown")


s.on_rank0(setup, teardown)
if s.join(start=start) and s.rank == 0:
    _record("joined as rank 0")

for step in s.steps(total=total, start=start):
    for x, y in s.batches(data, micro_batch_size=2):
        s.backward(torch.nn.functional.mse_loss(model(x), y))
    if s.step(max_grad_norm=0.0) and s.rank == 0:
        logger.write(f"{step} {s.loss}\n")  # fails on a rank 0 whose set-up never ran
        if step % 10 == 0:
            with s.solo(max_s=30):
                logger.flush()
    time.sleep(0.05)  # faults land mid-training

if s.rank == 0:
    (out / "saved").write_text(s.pod)
