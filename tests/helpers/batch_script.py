"""A user's own script for `ceaseless up -- python -m tests.helpers.batch_script ...` (issue 33):
its own step total, batch arithmetic and start step (``s.steps(total, start=k)``: the script
restored its own checkpoint of step k - 1), none of them `up`'s flags.

After the session it records, in ``<run dir>/pending/<pod>.json``, the asyncio tasks still
pending on the agent runtime's loop (none should be: each would be "destroyed but pending"
at exit), after a ``gc.collect()`` that makes such a destruction happen now, in the log.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
from datetime import timedelta
from pathlib import Path

import torch

import agent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--start", type=int, default=None)
    ap.add_argument("--global-batch-size", type=int, default=16)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.utils.data.TensorDataset(torch.randn(256, 4), torch.randn(256, 1))
    with agent.Session.from_env(global_batch_size=args.global_batch_size, seed=0) as s:
        s.register(model=model, optimizer=opt)
        for _step in s.steps(total=args.steps, start=args.start):
            for x, y in s.batches(data, micro_batch_size=args.micro_batch_size):
                s.backward(torch.nn.functional.mse_loss(model(x), y))
            s.step()
        store = None
        if s.runtime is not None:
            # What a rendezvous with a late peer leaves behind in the last generation's
            # group (never closed): the c10d store's KV watcher, started by a wait on a key
            # not there yet. Kept referenced, as the group keeps its store.
            store = s.runtime.stores.rendezvous(f"issue33.{s.pod}.", timeout=0.2)
            try:
                store.wait(["never-set"], timedelta(seconds=0.2))
            except Exception:
                pass
    rt = s.runtime
    if rt is None or rt._loop is None:
        return
    gc.collect()
    pending = [repr(t)[:300] for t in asyncio.all_tasks(rt._loop) if not t.done()]
    out = Path(os.environ.get("CEASELESS_RUN_DIR", ".")) / "pending"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{s.pod}.json").write_text(json.dumps(pending))
    del store


if __name__ == "__main__":
    main()
