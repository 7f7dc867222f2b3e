"""The agent's ports (issue 29): what each part needs of its collaborators, as small
``typing.Protocol``s, so that a part can be read, and driven in a test, without the whole.

The runtime (``runtime.Runtime``) is split by user: a part asks only for the ports it calls
(``SoloRuntime`` for ``solo.py``, ``StepRuntime`` for the stepper...); the one ``Runtime``
satisfies all of them. The membership (``membership.Membership``) likewise: ``Entrant`` is
what ``handoff.enter`` needs, ``Resumer`` what ``prejoin.resume_in_place`` adds to it, and
``StepMember`` what the stepper uses. The configuration is ``config.AgentConfig`` (frozen).

Bottom of the imports: nothing of the agent but ``config`` and ``vocab``, at run time or
under TYPE_CHECKING, so that any part may import it without a cycle (tests/test_layers.py).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol, Sequence

from schemas.messages import Heartbeat, Inject, Plan, ReportKind

from .config import AgentConfig
from .vocab import Arrival, Phase

__all__ = [
    "KV", "Stores", "Heartbeats", "Reports", "SoloRuntime", "InjectRuntime", "KVRuntime",
    "ShadowRuntime", "PrejoinRuntime", "HandoffRuntime", "StepRuntime", "MembershipRuntime",
    "Group", "HeldState", "Incidents", "Faults", "Entrant", "Resumer", "StepMember", "Placement",
    "AgentConfig",
]


# ---------------------------------------------------------------------------- the KV buckets
class KV(Protocol):
    """A key-value bucket (``store.Bucket``): the job's KV (done, solo, script)."""

    def put(self, key: str, value: bytes) -> Any: ...
    def get(self, key: str) -> bytes | None: ...


class Stores(KV, Protocol):
    """The store bucket: a rendezvous store per prefix, the spares' requests (watched)."""

    def rendezvous(self, prefix: str, timeout: float | None = None) -> Any: ...
    def watch(self, prefix: str, on_put: Callable[[str, bytes], None]) -> Callable[[], None]: ...


# ---------------------------------------------------------------------------- the runtime
class Heartbeats(Protocol):
    """The pod's heartbeat: fields updated (``now``: published at once)."""

    def update(self, now: bool = False, **fields: Any) -> None: ...


class Reports(Protocol):
    """A report to the control plane, waited for (bounded)."""

    def report_sync(self, kind: ReportKind, error: str, timeout: float = 2.0) -> None: ...


class SoloRuntime(Heartbeats, Protocol):
    """``solo.py``: the job's KV (a solo declared, read by the peers' collectives), the
    heartbeat's ``solo_until`` and the stall watchdog's progress."""

    cfg: AgentConfig
    kv: Any  # KV once started

    def progress(self) -> None: ...


class InjectRuntime(Protocol):
    """``inject.Injector``: the injections due at a step, a refusal of one whose step passed,
    and the stall flag it sets."""

    injected_stall: bool

    def take_injections(self, step: int) -> list[Inject]: ...
    def refuse_injection(self, inj: Inject, reason: str) -> None: ...


class KVRuntime(Protocol):
    """``script_batch.check_plan_batch``: the job's KV only."""

    kv: Any  # KV once started


class ShadowRuntime(Heartbeats, Protocol):
    """``shadow_roles``: the store bucket (requests, pair stores), the heartbeat (the step a
    spare holds), and a wake-up of the training thread's wait when something arrived."""

    stores: Any  # Stores once started

    def notify(self) -> None: ...


class PrejoinRuntime(ShadowRuntime, Protocol):
    """``prejoin.Prejoin`` (a helper thread): the plan's arrival time, the abort flag, the
    broker's transfer plan, and stopping the step when it cannot be resumed."""

    cfg: AgentConfig
    abort: threading.Event

    @property
    def plan_at(self) -> float: ...
    @property
    def plan(self) -> Plan | None: ...
    def wait_transfer(self, generation: int, timeout: float) -> Arrival | None: ...
    def interrupt(self) -> None: ...


class HandoffRuntime(PrejoinRuntime, SoloRuntime, Protocol):
    """``handoff.enter`` and ``prejoin.resume_in_place``: the current plan, joining its
    generation, taking over a prejoin's group."""

    @property
    def plan(self) -> Plan | None: ...
    @property
    def plan_ctx(self) -> Any: ...
    def join(self, generation: int, world_size: int = 0) -> None: ...
    def take_prejoin(self, generation: int) -> Any: ...


class StepRuntime(HandoffRuntime, InjectRuntime, Reports, Protocol):
    """``stepper.Stepper``: the step's collective handshakes with the runtime's thread (a
    prejoin claimed at the collective, its start and end), the abort flag, progress for the
    stall watchdog, reports, and what the injector, solo and resuming in place need."""

    step_began: float  # monotonic: the step's start (its compute time counts from here)

    def claim_collective(self, generation: int) -> Any: ...
    def enter_collective(self) -> None: ...
    def end_collective(self) -> None: ...


class MembershipRuntime(StepRuntime, Protocol):
    """``membership.Membership``: all of the above, and the inbox (``take_plans``, ``wait``), the
    factory of prejoins, the step's end, the process's stop."""

    start_prejoin: Callable[[Plan, int, int, str], Any] | None
    on_preempt: Callable[[float | None], None] | None

    @property
    def hb(self) -> Heartbeat: ...
    def submit(self, coro: Any) -> Any: ...
    def report(self, kind: ReportKind, error: str) -> Any: ...
    @property
    def abort_at(self) -> float: ...
    def take_plans(self) -> list[Arrival]: ...
    @property
    def done(self) -> dict | None: ...
    def wait(self, ready: Callable[[], Any], timeout: float | None) -> Any: ...
    def end_step(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...


# ---------------------------------------------------------------------------- the others
class Group(Protocol):
    """A generation's process group as the stepper uses it (``collectives.AbortableGroup``)."""

    bucket_bytes: int

    def allreduce_(self, tensors: Sequence[Any], abort: threading.Event | None,
                   slice_s: float | None = None, timeout_s: float | None = None,
                   extend: Callable[[], float | None] | None = None,
                   op_timeout_s: float | None = None) -> None: ...
    def close(self) -> None: ...


class HeldState(Protocol):
    """What entering a generation needs of the ``train_state.TrainState``."""

    last_committed: int
    lr_factor: float
    shard: Any
    loss: float | None
    skipped: list[int]
    pending: tuple[int, float] | None  # rollforward.py

    def update(self, f: float, skip: bool = False) -> None: ...
    def note_commit(self, s: int, loss: float, skipped: bool) -> None: ...

    def digest(self) -> str: ...
    def snapshot(self) -> Any: ...
    def describe(self) -> Any: ...
    def destinations(self, skeleton: dict[str, Any]) -> Any: ...
    def restore(self, st: Any, default_step: int = -1) -> int: ...
    def forget(self) -> None: ...
    def zero_grad(self) -> None: ...


class Incidents(Protocol):
    """``incident.Timeline``: the incident being recovered from (None: none), opened."""

    incident: Any

    def open(self, reason: str, notice: float | None = None, **kw: Any) -> Any: ...


class Faults(Protocol):
    """``inject.Injector`` as the stepper calls it, before the gradient sync of a step."""

    slow: float  # an injected slowness (1.0: none)

    def before_sync(self, rt: InjectRuntime, s: int) -> None: ...
    def take_nan(self) -> bool: ...
    def summed(self, s: int) -> None: ...
    def flip_bit(self, modules: list) -> None: ...
    def absent(self, s: int) -> bool: ...


# ---------------------------------------------------------------------------- the membership
class Entrant(Protocol):
    """What entering a generation (``handoff.enter``) needs of the pod's membership."""

    cfg: AgentConfig
    backend: str
    state: HeldState
    timeline: Incidents
    group: Any          # the generation's AbortableGroup (None until built)
    sharding: Any       # sharded.Sharding of a sharded job
    follower: Any       # shadow_roles.ShadowFollower
    leader: Any         # shadow_roles.ShadowLeader
    diverged: tuple[int, str | None] | None  # handoff.disagreed, until verify.py rolls back

    @property
    def rt(self) -> HandoffRuntime: ...
    def take_early_join(self, plan: Plan, rank: int, backend: str) -> Any: ...
    def newest_plan(self) -> Arrival | None: ...
    def joined(self, plan: Plan, rank: int | None) -> None: ...
    def restored(self, plan: Plan, restore_step: int) -> None: ...
    def close_group(self) -> None: ...


class Resumer(Entrant, Protocol):
    """``prejoin.resume_in_place``: entering, and discarding the step when that fails."""

    rank: int | None
    world_size: int | None

    def discard(self, reason: str, phase: Phase = Phase.INTERRUPTED) -> bool: ...


class StepMember(Resumer, Protocol):
    """``stepper.Stepper`` and the reductions (``reduction.py``): the joined generation,
    its group, this pod's rank in it and the sharding, if any."""

    generation: int

    @property
    def rt(self) -> StepRuntime: ...
    @property
    def is_member(self) -> bool: ...


class Placement(Protocol):
    """``sharded.replica_mesh`` / ``check_registered``: a sharded job's position, placing
    the pod first (``Membership.await_position``)."""

    phase: Phase
    sharding: Any       # sharded.Sharding once the position is known

    def await_position(self) -> int | None: ...
    def start_early_join(self, backend: str) -> None: ...
