"""The newest lease term seen from a service (issue 42). Each service may run standbys; what
its active instance publishes carries that instance's lease term (services/common/lease.py).
A message of an older term than the newest seen comes from a deposed instance and is
ignored; None (a publisher older than terms) is always taken. Used by the agents (plans,
transfers, state_lost) and by the scaler (faults, job_failed)."""

from __future__ import annotations

from typing import Any

from schemas.messages import Plan, StateLost, Transfer


class NewestTerm:
    """(Under the caller's lock, if any.) ``stale(term)``: True for an older term than the
    newest seen (logged on ``log`` when given); otherwise the term is noted as the newest."""

    def __init__(self, service: str, log: Any = None) -> None:
        self.service = service
        self.log = log
        self.term: int | None = None
        self.ignored = 0

    def note(self, term: int | None) -> None:
        """A term seen without judging its message (a fault read back from the stream)."""
        if term is not None and (self.term is None or term > self.term):
            self.term = term

    def stale(self, term: int | None, what: str = "message") -> bool:
        if term is None:
            return False
        if self.term is not None and term < self.term:
            self.ignored += 1
            if self.log is not None:
                self.log.info("ignored message", what=what, service=self.service, term=term,
                              reason=f"term {term} < {self.term}: a deposed instance's")
            return True
        self.term = term
        return False


def of_plan(msg: Transfer | StateLost, plan: Plan | None, log: Any = None) -> bool:
    """False for a broker's verdict decided for another plan of ``plan``'s generation than
    ``plan`` (its ``plan_ts`` differs: a stale broker instance's, or an earlier run's of the
    job); logged on ``log``. No ``plan_ts`` (an older broker) or another generation: True."""
    if msg.plan_ts is None or plan is None or msg.generation != plan.generation \
            or msg.plan_ts == plan.ts:
        return True
    if log is not None:
        log.info("ignored message", what=type(msg).__name__, generation=msg.generation,
                 reason=f"decided for the plan of {msg.plan_ts}, not the current one of "
                        f"{plan.ts}: a stale broker's")
    return False
