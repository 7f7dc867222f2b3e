"""What the job leaves on disk: last-resort checkpoints and the per-pod result file.

``Checkpoints`` wraps ``agent/checkpoint.py`` for the session: a periodic save after each
commit on rank 0, a save on ``ceaseless up``'s request (it is being stopped), the final one
at the end of the job, and ``CEASELESS_RESUME_FROM`` loaded once before the first plan.
``write_result`` writes ``<run_dir>/results/<pod>.json`` (and the exact parameters with
``CEASELESS_SAVE_PARAMS=1``), atomically.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from plumbing import logs

from .train_state import TrainState

log = logs.get("agent")


class Checkpoints:
    """``CEASELESS_CHECKPOINT_DIR`` (+ ``_EVERY``, default 200 steps, ``_KEEP``, default 3,
    ``_MINUTES``): rank 0 writes last-resort checkpoints there; ``CEASELESS_RESUME_FROM``:
    a checkpoint (or a directory of them: the newest) every pod starts from."""

    def __init__(self) -> None:
        env = os.environ.get
        self.writer: Any = None
        if env("CEASELESS_CHECKPOINT_DIR"):
            from .checkpoint import Checkpointer

            try:
                every = int(env("CEASELESS_CHECKPOINT_EVERY") or 200)
                keep = int(env("CEASELESS_CHECKPOINT_KEEP") or 3)
                minutes = float(env("CEASELESS_CHECKPOINT_MINUTES") or 0)
            except ValueError as e:
                raise ValueError(f"CEASELESS_CHECKPOINT_EVERY / _KEEP / _MINUTES: {e}") from None
            self.writer = Checkpointer(env("CEASELESS_CHECKPOINT_DIR"), every, keep,
                                       interval_s=minutes * 60 if minutes > 0 else None)
        self._resume_from = env("CEASELESS_RESUME_FROM") or None
        self._handled: str | None = None   # the last checkpoint request answered

    def resume(self, state: TrainState) -> None:
        """Every pod that starts a resumed job loads ``CEASELESS_RESUME_FROM`` before its
        first plan; in the job's first generation rank 0's state is the one the members
        start from, as at step 0. Once: a recovery never reads it.

        A spare does without it when it is gone (the job's own checkpoints rotated it
        away): a spare holds nothing the job needs, and takes the state from its peers
        when promoted, as any pod joining a live job does (`ceaseless up` gives the
        variable only to the pods that start the job; issue 33). A worker must have it:
        without it the job would silently start over."""
        path, self._resume_from = self._resume_from, None
        if path is None or state.last_committed >= 0:
            return
        from . import checkpoint

        found = checkpoint.resolve(path)
        if found is None:
            if os.environ.get("CEASELESS_ROLE") == "spare":
                log.warning("no checkpoint to resume from; a spare takes the state from "
                            "its peers", resume_from=path)
                return
            raise FileNotFoundError(f"CEASELESS_RESUME_FROM={path}: no complete checkpoint "
                                    "there (a step-N directory with a manifest.json)")
        step = checkpoint.load(found, state)
        log.info("resumed from a checkpoint", path=str(found), step=step)

    def after_commit(self, rank: int | None, s: int, state: TrainState) -> None:
        if self.writer is not None and rank == 0:
            self.writer.after_commit(s, state)

    def on_request(self, req: str | None, rank: int | None, state: TrainState) -> None:
        """At a step boundary: `ceaseless up` asked for a checkpoint (it is being stopped);
        rank 0 starts writing the committed state. `up` waits for a manifest newer than its
        request, so the training thread does not wait (it would look absent to the peers);
        a save still running finishes after the request and does as well."""
        c = self.writer
        if c is None or req is None or req == self._handled:
            return
        self._handled = req
        if rank != 0 or state.last_committed < 0:
            return
        started = state.last_committed in c.saved or c.save(state.last_committed, state)
        log.info("checkpoint on request", step=state.last_committed, request=req,
                 started=bool(started))

    def final(self, rank: int | None, state: TrainState) -> None:
        """At the end of the job (rank 0): the final state too, then wait for the writes."""
        c = self.writer
        if c is None or rank != 0:
            return
        c.wait(300)  # a periodic save of this very step may still be running
        if state.last_committed >= 0 and state.last_committed not in c.saved:
            c.save(state.last_committed, state)
        if not c.wait(300):
            log.warning("a checkpoint was still being written at exit", dir=str(c.dir))


def write_result(run_dir: str | None, pod: str, rank: int | None, generation: int,
                 world_size: int | None, state: TrainState, losses: dict[int, float],
                 commits: Any) -> None:
    if not run_dir:
        return
    out = Path(run_dir) / "results"
    out.mkdir(parents=True, exist_ok=True)
    res = {"pod": pod, "rank": rank, "generation": generation,
           "world_size": world_size, "final_step": state.last_committed,
           "shard": state.shard,
           "param_sha256": state.param_sha256(),
           "losses": {str(k): (v if v is None or math.isfinite(v) else None)
                      for k, v in sorted(losses.items())},
           "skipped_steps": list(state.skipped),
           "commits": [[k, round(t, 6)] for k, t in commits]}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        res["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
    if os.environ.get("CEASELESS_SAVE_PARAMS") == "1":  # exact values, for comparisons
        from .state import local

        params = {f"{n}.{k}": local(t).detach().cpu().clone()
                  for n, o in sorted(state.objs.items()) if isinstance(o, torch.nn.Module)
                  for k, t in o.state_dict().items()}
        tmp_pt = out / f".{pod}.pt.tmp"
        torch.save(params, tmp_pt)
        tmp_pt.replace(out / f"{pod}.pt")
    tmp = out / f".{pod}.json.tmp"
    tmp.write_text(json.dumps(res))
    tmp.replace(out / f"{pod}.json")
