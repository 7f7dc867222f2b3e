"""A user's script that saves and restores its own checkpoint (model, optimizer, scheduler)
and continues with ``s.steps(total, start=...)`` (the training-loop issue, item 7)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import agent


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--start", type=int)
    p.add_argument("--load")
    p.add_argument("--save")
    a = p.parse_args()
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, dtype=torch.float64),
                                          torch.randn(64, 1, dtype=torch.float64))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                torch.nn.Linear(8, 1)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))
    if a.load:  # every pod loads the same checkpoint
        ck = torch.load(a.load)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
    first = None
    with agent.Session.from_env(global_batch_size=16, seed=0) as s:
        s.register(model=model, optimizer=opt, scheduler=sched)
        for step in s.steps(total=a.steps, start=a.start):
            first = step if first is None else first
            for x, y in s.batches(data, micro_batch_size=4):
                s.backward(torch.nn.functional.mse_loss(model(x), y))
            s.step()
        if a.save and s.rank == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict()}, a.save)
        out = Path(os.environ.get("CEASELESS_RUN_DIR", ".")) / "first"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{s.pod}.json").write_text(json.dumps({"first": first, "rank": s.rank}))


if __name__ == "__main__":
    main()
