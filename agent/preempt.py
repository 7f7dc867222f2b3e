"""Preemption notices: a member told it will be stopped (SIGTERM from Kubernetes, Slurm, a
spot reclaim; ``ceaseless inject preempt``) asks to leave at a step boundary instead of
dying in the middle of one (issue 32).

The first notice reports ``preempted`` (with the deadline) to the scaler, which plans a
spare into this pod's rank, or a shrink, as a planned transition at the next step boundary:
the pod then leaves like a released one (exit 0), a spare holding the state takes over, and
nothing is recomputed; no fault. A second notice, or the deadline passing first, ends the
process at once as SIGTERM did before (the job then recovers from a crash).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Callable

from schemas.messages import ReportKind
from plumbing import logs

log = logs.get("agent")
DEFAULT_DEADLINE_S = 30.0  # Kubernetes' default termination grace period


def default_deadline() -> float:
    return float(os.environ.get("CEASELESS_PREEMPT_DEADLINE") or DEFAULT_DEADLINE_S)


class Preemption:
    def __init__(self, report: Callable[[ReportKind, str], None]) -> None:
        self._report = report          # non-blocking: the runtime's thread publishes it
        self._lock = threading.Lock()
        self.deadline: float | None = None  # wall time; None: no notice yet

    def notice(self, deadline_s: float | None, source: str) -> None:
        """A notice (any thread, a signal handler included): the first asks to leave, a
        second ends the process now."""
        with self._lock:
            first = self.deadline is None
            if first:
                d = deadline_s if deadline_s is not None else default_deadline()
                self.deadline = time.time() + d
        if not first:
            log.warning("second preemption notice: exiting now", source=source)
            exit_now()
        log.warning("preemption notice: leaving at a step boundary", source=source,
                    deadline_s=round(d, 3))
        self._report(ReportKind.preempted, f"deadline {d:g}s ({source})")
        t = threading.Timer(d, self._expired)
        t.daemon = True
        t.start()

    def _expired(self) -> None:
        log.error("preemption deadline passed before a planned departure: exiting now")
        exit_now()


def exit_now() -> None:
    """As the SIGTERM that a member got before notices existed: the default action."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
