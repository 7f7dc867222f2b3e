"""What the scaler does with a fault (pure judgement; the scaler applies it): a member's
fault becomes ``Pending`` (planned out at the next decision), a straggler is swapped for a
spare or has its share cut, a non-member is dropped from the pool, and a stale or repeated
one is ignored with its reason. Also the members found faulted without a fault of their
own: a dropped spare the plan promoted, a member silent when the lease was taken."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable

from opentelemetry import context as otel_context

from plumbing.bounded import BoundedSet
from schemas.messages import Fault, FaultKind, Plan
from services.common.hearing import quiet

from .liveness import GONE_STATES, PodSeen


@dataclass
class Pending:
    """A member fault not yet turned into a plan."""

    pod: str
    incident: str
    kind: str
    ctx: otel_context.Context | None
    since: float


class Act(str, Enum):
    IGNORE = "ignore"        # nothing to do (``reason``, logged at ``level``)
    FORGET = "forget"        # before the first plan: never used, nothing to plan
    DROP = "drop"            # not a member: dropped from the pool, never used again
    SWAP = "swap"            # a straggler with a live spare: swapped at a step boundary
    SHARE = "share"          # a straggler without one: its micro-batches shared out
    ACCEPT = "accept"        # a member's fault: planned out


@dataclass(frozen=True)
class Verdict:
    act: Act
    reason: str = ""
    level: str = "info"


def judge(f: Fault, plan: Plan | None, *, pending: dict[str, Pending],
          preempting: dict[str, tuple[str, str | None]], has_spare: Callable[[], bool],
          dropin: bool, was_spare: bool, seen: PodSeen | None,
          fault_timeout: float, quiet: float | None = None) -> Verdict:
    """``has_spare`` is asked only for a member straggler (it scans every pod). ``quiet``:
    how long ``seen``'s pod counts as silent (``Liveness.quiet``, 0 while the scaler hears no
    pod at all: no silence is evidence then); None: since its last heartbeat."""
    if plan is None:
        return Verdict(Act.FORGET, "fault before the first plan: pod dropped")
    if f.generation > plan.generation:
        return Verdict(Act.IGNORE, f"fault of future generation {f.generation} > "
                       f"{plan.generation}", "warning")
    if f.pod in plan.fenced or f.pod in pending:
        return Verdict(Act.IGNORE, "already handled")
    member = plan.rank_of(f.pod) is not None
    if f.kind == FaultKind.straggler:  # alive: swapped at a step boundary, if a spare can
        if member and f.pod not in preempting and has_spare():
            return Verdict(Act.SWAP)
        if dropin:
            # a DDP drop-in script splits its micro-batches itself: a plan's shares would
            # not reach it
            return Verdict(Act.IGNORE, "straggler without a live spare in a drop-in job "
                           "(the script splits its own micro-batches)")
        if member and f.slowness:
            # no spare: its micro-batches are shared out to the others, by the slowness
            # the monitor measured (the heartbeats the scaler sees are too old for it)
            return Verdict(Act.SHARE)
        return Verdict(Act.IGNORE, "straggler: no live spare, and no slowness measured "
                       "(an older health monitor)")
    if not member:
        return Verdict(Act.DROP, "spare dropped from the pool" if was_spare else "not a member")
    if quiet is None and seen is not None:
        quiet = time.monotonic() - seen.last
    if (f.generation < plan.generation and seen is not None
            and seen.generation >= plan.generation and quiet is not None
            and quiet <= fault_timeout):
        return Verdict(Act.IGNORE, f"stale fault: generation {f.generation} but the pod "
                       f"heartbeats generation {seen.generation}", "warning")
    return Verdict(Act.ACCEPT)


def dead_members(plan: Plan, dropped: BoundedSet, pending: dict[str, Pending],
                 now: float) -> list[Pending]:
    """Members whose fault was declared while they were not members (a spare's fault that
    arrived while a plan promoting it was being written only dropped it from the pool; the
    monitor declares a pod once, so without this the new plan kept a dead member and the
    job waited for it for ever). Only the monitor's declarations count: a member merely
    seen exiting is the monitor's to declare."""
    return [Pending(pod=m.pod, incident=f"inc-{m.pod}-g{plan.generation}", kind="crash",
                    ctx=None, since=now)
            for m in plan.members
            if m.pod in dropped and m.pod not in pending and m.pod not in plan.fenced]


def silent_members(plan: Plan, pods: dict[str, PodSeen], pending: dict[str, Pending],
                   done: BoundedSet, dead: BoundedSet, fault_timeout: float,
                   now: float, since: float) -> list[Pending]:
    """Members silent (or known dead) when a lease term is reconciled: faulted. Silence is
    counted from ``since`` at the earliest (the scaler's hearing: a member not heard since
    then has a full fault timeout from it)."""
    out = []
    for m in plan.members:
        s = pods.get(m.pod)
        if m.pod in pending or m.pod in done:
            continue
        if s is not None and s.state in GONE_STATES:
            continue
        if quiet(s.last if s else None, since, now) <= fault_timeout and m.pod not in dead:
            continue
        out.append(Pending(pod=m.pod, incident=f"inc-{m.pod}-g{plan.generation}", kind="lost",
                           ctx=None, since=now))
    return out
