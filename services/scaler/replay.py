"""What a scaler taking the lease must not lose (issue 42). The previous holder kept in
memory only: the faults declared since the current plan that no plan handled yet, the pods
it knew dead (a spare dropped from the pool, a member whose fault raced the plan that
promoted it) and the script's failure. The health monitor declares a pod once, so the new
holder reads them back from the job stream (``CEASELESS_<JOB>``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from plumbing.bus import Bus, Envelope
from schemas.messages import Fault, FaultKind, JobFailed, Plan, Role
from services.common.history import read_back

MAX_REPLAY = 4096     # unplanned faults replayed at most (a plan's worth; the rest were planned)
SLACK_S = 1.0         # clock slack between the plan's writer and the stream's timestamps


@dataclass
class Inherited:
    """What the stream says, read once when the lease is taken."""

    # faults of the plan's generation or a later one, since the plan: replayed as if heard
    unplanned: list[tuple[Fault, Envelope]] = field(default_factory=list)
    # pods declared faulted while not a member (never used again; a member of the plan
    # among them is faulted now: the plan promoted a spare whose fault it raced)
    dropped: list[str] = field(default_factory=list)
    # pods declared faulted as members of an earlier plan (fenced since, or gone)
    dead: list[str] = field(default_factory=list)
    job_failed: JobFailed | None = None


def classify(plan: Plan, faults: list[tuple[Fault, Envelope]]) -> Inherited:
    """Pure: sort the stream's faults by what the new holder must do with them. A
    straggler's fault kills nothing (the pod stays alive until swapped): only a recent one
    is replayed. A member's fault of an older generation that was not planned out was
    judged stale by the scaler of that time (the pod heartbeat the newer generation): it
    stays ignored."""
    out = Inherited()
    members = {m.pod for m in plan.members}
    for f, env in faults:
        recent = f.generation >= plan.generation and f.detected_at >= plan.ts - SLACK_S
        if recent:
            out.unplanned.append((f, env))
            continue
        if f.kind == FaultKind.straggler or f.generation > plan.generation:
            continue  # (a later generation before this plan: another run's, on a kept bus)
        was_member = f.rank is not None and f.role == Role.worker
        if not was_member:
            out.dropped.append(f.pod)
        elif f.pod not in members or f.pod in plan.fenced:
            out.dead.append(f.pod)
    out.unplanned = out.unplanned[-MAX_REPLAY:]
    return out


async def inherit(bus: Bus, plan: Plan, log: Any) -> Inherited:
    """Every fault in the job stream, classified against ``plan``, and the job's failure."""
    s = bus.subjects
    out = classify(plan, await read_back(bus, s.fault, Fault, log))
    failed = await read_back(bus, s.job_failed, JobFailed, log, last_only=True)
    if failed and failed[-1][0].generation <= plan.generation:  # (else another run's)
        out.job_failed = failed[-1][0]
    return out

