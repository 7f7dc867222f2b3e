"""The agent's shared vocabulary, at the bottom of its imports (issue 29): the errors every
layer raises or catches, the membership phases and their table of allowed moves, what a plan
arriving during a step means (``plan_arrival`` and ``can_resume``, pure), and what the
training thread's waits return (``Arrival``). It imports nothing of the agent but its
config, so any part may import it without a cycle.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from schemas.messages import Heartbeat, Plan, StateLost, Transfer

from .config import AgentConfig


# ---------------------------------------------------------------------------- errors
class Aborted(Exception):
    """The caller's abort event was set (a newer plan, a fault): the operation was abandoned."""


class PeerError(Exception):
    """A collective failed: a peer reset the connection, it timed out, or the group broke."""


class CollectiveTimeout(PeerError):
    """A collective ran past its timeout: every peer that could fail it was alive."""


class JobStateLost(RuntimeError):
    """No member holds the committed state: training cannot go on."""


class Phase(enum.Enum):
    OUTSIDE = "outside"          # started; no plan has named this pod yet
    RECOVERING = "recovering"    # waiting for a plan that includes this pod, or entering it
    SPARE = "spare"              # in the spare pool (following the job when it can)
    MEMBER = "member"            # holds a rank in the current generation
    INTERRUPTED = "interrupted"  # a member whose step was discarded: recovers next
    FAILED = "failed"            # an attempt failed: the wait for a newer plan is bounded
    REDO = "redo"                # entered a newer generation during a step gone stale
    RELEASED = "released"        # a planned shrink released this pod's slot
    FINISHED = "finished"        # the job finished (as a member, or before promotion)


_MOVES: dict[Phase, set[Phase]] = {
    Phase.OUTSIDE: {Phase.RECOVERING},
    Phase.RECOVERING: {Phase.MEMBER, Phase.SPARE, Phase.RELEASED, Phase.FINISHED,
                       Phase.RECOVERING},
    Phase.SPARE: {Phase.RECOVERING, Phase.MEMBER, Phase.FINISHED, Phase.RELEASED, Phase.SPARE},
    Phase.MEMBER: {Phase.INTERRUPTED, Phase.FAILED, Phase.REDO, Phase.RECOVERING, Phase.SPARE,
                   Phase.RELEASED, Phase.FINISHED},
    Phase.INTERRUPTED: {Phase.RECOVERING, Phase.FAILED},
    Phase.FAILED: {Phase.RECOVERING},
    Phase.REDO: {Phase.MEMBER},
    Phase.RELEASED: set(),
    Phase.FINISHED: set(),
}
# a member whose step was thrown away, for one reason or another
DISCARDED = (Phase.INTERRUPTED, Phase.FAILED, Phase.REDO)


class Verdict(enum.Enum):
    NOTHING = "nothing"  # not for the running step (none, stale, or due at a later boundary)
    ABORT = "abort"      # discard the step in flight and recover
    RESUME = "resume"    # finish the step and all-reduce it in the new group (prejoin.py)


@dataclass(frozen=True)
class StepView:
    """What the runtime knows of the training thread when a plan arrives."""

    joined_generation: int
    step_in_flight: int | None
    in_collective: bool
    aborted: bool
    world_size: int
    prejoining: bool
    hb: Heartbeat


def plan_arrival(plan: Plan, v: StepView, cfg: AgentConfig) -> Verdict:
    """A plan newer than the joined generation arrived while the training thread works. A
    planned (elastic) plan is entered at its step boundary, unless this pod already started
    a step at or past it (its peers entered the plan there: the step's collective would
    only time out). A fault plan aborts the step, unless it can be resumed in place."""
    if v.joined_generation <= 0 or plan.generation <= v.joined_generation:
        return Verdict.NOTHING  # before the first join the training thread waits for plans
    if plan.apply_step is not None:
        late = v.step_in_flight is not None and v.step_in_flight >= plan.apply_step
        return Verdict.ABORT if late else Verdict.NOTHING
    if v.prejoining:  # a second fault plan during the step: the ordinary way
        return Verdict.ABORT
    return Verdict.RESUME if can_resume(cfg, plan, v.hb, v.joined_generation, v.world_size,
                                        v.step_in_flight, v.in_collective,
                                        v.aborted) else Verdict.ABORT


def can_resume(cfg: Any, plan: Plan, hb: Heartbeat, joined_generation: int, world_size: int,
               step: int | None, in_collective: bool, aborted: bool) -> bool:
    """A fault plan arriving while step ``step`` is computed may be resumed in place: it
    keeps this pod's rank and the world size, the step has not reached its collective, and
    steps are short enough that the replacement's wait stays well inside the collective
    timeout (no median step time yet: no resume)."""
    if not cfg.resume_in_place or plan.apply_step is not None or step is None \
            or in_collective or aborted or hb.rank is None \
            or plan.rank_of(cfg.pod) != hb.rank or hb.generation != joined_generation \
            or hb.step != step - 1 or plan.world_size != world_size:
        return False
    return hb.step_time is not None and hb.step_time <= cfg.collective_timeout / 4


@dataclass(frozen=True)
class Arrival:
    """What reaches the training thread: a plan from the runtime's inbox (consumed once,
    ``Runtime.take_plans``), or what one of its waits returned (``Membership._await_plan``,
    ``Runtime.wait_transfer``)."""

    kind: str            # "plan" | "done" | "released" | "shadow" | "transfer" | "lost" | "abort"
    plan: Plan | None = None
    ctx: Any = None
    transfer: Transfer | None = None
    lost: StateLost | None = None
    at: float = 0.0      # wall time the plan arrived


# ---------------------------------------------------------------------------- a step's life
class StepPhase(enum.Enum):
    """Where the training thread is in a step, as the runtime's thread sees it (``Runtime``
    records it under its lock; a plan arriving is judged against it, ``plan_arrival``)."""

    IDLE = "idle"            # between steps (or the step is over: committed or discarded)
    COMPUTING = "computing"  # forward/backward of a step: a fault plan may resume it in place
    REDUCING = "reducing"    # in the gradient all-reduce: a fault plan aborts it


STEP_MOVES: dict[StepPhase, set[StepPhase]] = {
    # begin_step; a metric all-reduce of the script's (s.all_reduce) between steps
    StepPhase.IDLE: {StepPhase.IDLE, StepPhase.COMPUTING, StepPhase.REDUCING},
    # claim/enter_collective; end_step (discarded, or a planned plan at the boundary)
    StepPhase.COMPUTING: {StepPhase.COMPUTING, StepPhase.REDUCING, StepPhase.IDLE},
    # end_collective (summed or failed: the step commits or is discarded) or end_step
    StepPhase.REDUCING: {StepPhase.REDUCING, StepPhase.IDLE},
}


@dataclass(frozen=True)
class StepLife:
    phase: StepPhase = StepPhase.IDLE
    step: int | None = None     # the step in flight (COMPUTING, REDUCING)
    since: float | None = None  # monotonic: entered the all-reduce (REDUCING)

    def to(self, phase: StepPhase, step: int | None = None,
           since: float | None = None) -> "StepLife":
        """The next state; a move the table does not allow is a bug, refused."""
        if phase not in STEP_MOVES[self.phase]:
            raise RuntimeError(f"step life: {self.phase.value} -> {phase.value} is not a move")
        return StepLife(phase, step, since)
