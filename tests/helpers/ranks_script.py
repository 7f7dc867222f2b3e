"""A user's script for the honest-ranks test: records what ``s.rank`` / ``s.is_member`` say
before the loop, after ``s.join()``, and after the loop, and saves "the model" on rank 0
after the loop, as a user would (``if s.rank == 0: save()``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

import agent


def main() -> None:
    steps = int(sys.argv[1])
    out = Path(os.environ.get("CEASELESS_RUN_DIR", ".")) / "ranks"
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    rec: dict = {}
    with agent.Session.from_env(global_batch_size=8, seed=0) as s:
        s.register(model=model, optimizer=opt)
        rec["before"] = [s.rank, s.world_size, s.is_member]
        rec["join"] = s.join()
        rec["joined"] = [s.rank, s.world_size, s.is_member]
        for step in s.steps(total=steps):
            for x, y in s.batches(data, micro_batch_size=2):
                s.backward(torch.nn.functional.mse_loss(model(x), y))
            s.step()
            if step == steps - 1:  # a metric averaged over the members
                t = torch.tensor([float(s.rank)])
                rec["all_reduce"] = [s.all_reduce(t), float(t)]
        rec["after"] = [s.rank, s.world_size, s.is_member]
        if s.rank == 0:
            (out / "saved").write_text(s.pod)
        if os.environ.get("RANKS_FAIL_AFTER") == s.pod:  # the script's own bug, after the loop
            raise RuntimeError("failure after the loop")
    (out / f"{s.pod}.json").write_text(json.dumps(rec))


if __name__ == "__main__":
    main()
