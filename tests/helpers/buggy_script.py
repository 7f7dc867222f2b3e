"""A script with a bug (issue 33), for ``tests/test_script_bugs_e2e.py``.

argv: total steps, the step at which it fails, and how: ``raise`` (every rank raises the
same error there) or ``hang`` (rank 0 works longer than the collective timeout there, at the
top of the step, outside ``s.solo``, as nanoGPT's evaluation does)."""

from __future__ import annotations

import sys
import time

import torch

import agent


def check_batch(step: int, bad: int) -> None:
    if step == bad:
        raise ValueError(f"the batch of step {step} has the wrong shape")


total, bad, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
with agent.Session.from_env(global_batch_size=8, seed=0) as s:
    s.register(model=model, optimizer=opt)
    for step in s.steps(total=total):
        if how == "hang" and step == bad and s.rank == 0:
            time.sleep(600)  # an evaluation without s.solo
        for x, y in s.batches(data, micro_batch_size=2):
            if how == "raise":
                check_batch(step, bad)
            s.backward(torch.nn.functional.mse_loss(model(x), y))
        s.step()
        time.sleep(0.02)
