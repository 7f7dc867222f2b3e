"""A distributed session's start and stop (``Session.__enter__`` / ``__exit__``): logs and
telemetry, the runtime (its thread, the bus), the membership and the stepper wired together;
at the end, the script's own exception reported (with its traceback) and the runtime
stopped."""

from __future__ import annotations

import os
from typing import Any

from schemas.messages import AgentState, ReportKind
from plumbing import logs

from .config import AgentConfig
from .incident import Timeline, describe, not_the_scripts
from .inject import Injector
from .membership import Membership
from .runtime import Runtime
from .stepper import Stepper
from .train_state import TrainState

log = logs.get("agent")


def start(cfg: AgentConfig, state: TrainState, timeline: Timeline, global_batch_size: int,
          injector: Injector, backend: str | None) -> tuple[Runtime, Membership, Stepper]:
    logs.configure("agent", os.environ.get("CEASELESS_LOG_LEVEL", "info"))
    try:
        from plumbing import telemetry

        telemetry.init("agent", run_dir=cfg.run_dir, job=cfg.job, pod=cfg.pod)
    except Exception as e:
        log.warning("telemetry disabled", error=str(e)[:200])
    rt = Runtime(cfg)
    m = Membership(cfg, rt, state, timeline)
    if backend is not None:  # the script registered its model before entering the session
        m.backend = backend
    stepper = Stepper(global_batch_size, state, cfg, rt, m, injector)
    rt.start()
    m.install_sigterm()
    # Import now (heartbeats already run, saying ``starting``: the imports hold the
    # interpreter and, on a loaded machine, can delay them for seconds, which the health
    # monitor allows a starting pod), not on a promoted spare's critical path.
    from . import collectives, handoff, state as _state, store  # noqa: F401
    if cfg.shard_size > 1:  # a promoted spare shards its model first: FSDP2
        import torch.distributed.fsdp  # noqa: F401  (imports DTensor, the mesh...)

        from . import sharded  # noqa: F401
    rt.update(now=True, state=AgentState.waiting)
    return rt, m, stepper


def stop(rt: Runtime, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
    if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
        if rt.hb.state == AgentState.done:
            # after the loop (the job's training is done): the script's own failure, its
            # exit code says so; not a fault to recover from
            log.warning("exception after training finished",
                        error=f"{exc_type.__name__}: {exc}")
        else:
            kind = ReportKind.recovery_failed if not_the_scripts(exc) else ReportKind.exception
            rt.report_sync(kind, describe(exc_type, exc, tb))
            rt.update(state=AgentState.leaving)
    rt.stop()
    try:
        from plumbing import telemetry

        telemetry.shutdown()
    except Exception:
        pass
