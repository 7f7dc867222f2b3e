"""Pydantic v2 models of every message on the bus: the wire contract.

Every model forbids unknown fields, bounds its sizes and carries ``schema_version``.
A payload that does not validate is dropped by the bus layer (``plumbing.bus``)
with the subject and the reason logged; it never reaches a handler.
"""

from __future__ import annotations

import time
import uuid
from enum import Enum
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .subjects import ID_PATTERN

SCHEMA_VERSION = 1
# The largest job the wire describes (issue 45: was 8,192). A job's size is its policy's; this
# only bounds what a receiver accepts. Messages that name every member grow with it
# (docs/benchmarks.md, "Message sizes"): at 65,536 a plan no longer fits MAX_PAYLOAD_BYTES.
MAX_MEMBERS = 65536
# Pods a service keeps per-pod state for at most (members and spares, bounding what spoofed
# pod ids can make it hold).
MAX_PODS = 2 * MAX_MEMBERS
MAX_PAYLOAD_BYTES = 1024 * 1024  # NATS' default max_payload

PodId = Annotated[str, Field(pattern=ID_PATTERN, description="stable pod id")]
Rank = Annotated[int, Field(ge=0, lt=MAX_MEMBERS)]
Generation = Annotated[int, Field(ge=0)]
# -1 means "nothing committed yet".
Step = Annotated[int, Field(ge=-1, le=2**53)]
Text = Annotated[str, Field(max_length=2048)]
Timestamp = Annotated[float, Field(ge=0, description="seconds since the epoch")]
Digest = Annotated[str, Field(pattern=r"^[0-9a-f]{0,64}$")]


def now() -> float:
    return time.time()


def new_id() -> str:
    return uuid.uuid4().hex[:16]


def _version_required(schema: dict[str, Any]) -> None:
    """The exported JSON Schema requires ``schema_version``, as every subscriber does
    (``plumbing.bus.decode`` drops a payload without it): the version is what tells a later
    wire apart, so it is never assumed. The Python models fill it in for our publishers."""
    req = schema.setdefault("required", [])
    if "schema_version" not in req:
        req.insert(0, "schema_version")


Term = Annotated[int, Field(ge=0, le=2**53)]  # a service lease term (services/common/lease.py)

class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_enum_values=False,
                              json_schema_extra=_version_required)
    subject_kind: ClassVar[str] = ""

    schema_version: Literal[1] = SCHEMA_VERSION


# ----------------------------------------------------------------------------- enums
class Role(str, Enum):
    worker = "worker"
    spare = "spare"


class AgentState(str, Enum):
    starting = "starting"
    waiting = "waiting"        # connected, not (yet) a member: a spare, or before the first plan
    training = "training"
    recovering = "recovering"
    done = "done"              # reached total steps; its heartbeats stop on purpose
    leaving = "leaving"


class FaultKind(str, Enum):
    crash = "crash"            # the actuator saw the process exit non-zero
    hang = "hang"              # heartbeats go on but the step stopped advancing
    exception = "exception"    # the agent reported an error
    lost = "lost"              # heartbeats stopped
    # alive and stepping, but its compute of a step takes a factor over the other members'
    # for a sustained window: swapped for a live spare at a step boundary (a planned move).
    # Added 2026-12-06 (issue 32).
    straggler = "straggler"
    # a member's state differed from the other replicas' (silent data corruption). Added
    # 2026-12-06 (issue 32).
    corruption = "corruption"


class ReportKind(str, Enum):
    exception = "exception"      # user code or the agent raised
    peer_error = "peer_error"    # a collective raised (peer reset, timeout)
    digest_mismatch = "digest_mismatch"
    fenced = "fenced"            # this pod found it is not in the current plan
    recovery_failed = "recovery_failed"
    # the pod's own watchdog: its training thread made no progress for the stall timeout
    # (added 2026-12-04, issue 20; an older monitor drops it as malformed, logged)
    stalled = "stalled"
    # a preemption notice (SIGTERM to a member, `ceaseless inject preempt`): the pod asks to
    # leave at a step boundary before its deadline (``error``: "deadline <s>"); the scaler
    # plans a spare into its rank (or a shrink), a planned move, not a fault. Added
    # 2026-12-06 (issue 32); an older monitor or scaler drops it as malformed, logged.
    preempted = "preempted"
    # this member's state digest differed from the majority's at a verification (silent data
    # corruption, agent/verify.py): it is fenced and replaced. Added 2026-12-06 (issue 32).
    corruption = "corruption"


class InjectAction(str, Enum):
    kill = "kill"
    hang = "hang"
    resume = "resume"
    exception = "exception"
    # the agent's training thread blocks for good while its heartbeats go on (a deadlock in
    # user code); its stall watchdog must find it. Added 2026-12-04 (issue 20).
    stall = "stall"
    # this rank's loss and gradients of one step become NaN before the sync: the non-finite
    # guard skips that step on every rank alike. Added 2026-12-06 (issue 32).
    nan = "nan"
    # a preemption notice to that pod, as SIGTERM gives one (``deadline_s``). Added
    # 2026-12-06 (issue 32).
    preempt = "preempt"
    # that rank's training thread computes each step ``factor`` times as long (a slow GPU).
    # Added 2026-12-06 (issue 32).
    slow = "slow"
    # flip one bit of one element of that rank's parameters (``tensor``: its name; default
    # the first) before the sync of its step. Added 2026-12-06 (issue 32).
    bitflip = "bitflip"
    # a whole emulated host (``ceaseless up --hosts``): every process on it killed at once,
    # its link cut first where it has one (``host``). Added 2026-12-06 (issue 42).
    host_loss = "host-loss"
    # that host's link cut for ``for_s`` seconds with its processes alive, then healed.
    # Added 2026-12-06 (issue 42).
    partition = "partition"
    # a lost host back, as a replacement machine with its name, address and disk: its link
    # healed, its nats-server started again on its ports and store (it catches up from its
    # peers), its service instances started again (standbys: the leases are held
    # elsewhere), new pods placed there again (``host``). Added 2026-12-07 (issue 42).
    host_return = "host-return"


# injections the supervisor runs on a whole host, not a pod's
HOST_ACTIONS = (InjectAction.host_loss, InjectAction.partition, InjectAction.host_return)


class CapacityChange(str, Enum):
    add = "add"
    remove = "remove"


class LifecycleEvent(str, Enum):
    started = "started"
    exited = "exited"


class ActuatorAction(str, Enum):
    start = "start"
    stop = "stop"
    kill = "kill"


# ----------------------------------------------------------------------------- agent
class Heartbeat(Message):
    subject_kind: ClassVar[str] = "heartbeat"
    pod: PodId
    role: Role
    generation: Generation
    rank: Rank | None = None
    step: Step = -1
    digest: Digest = ""
    ts: Timestamp = Field(default_factory=now)
    state: AgentState = AgentState.waiting
    step_time: Annotated[float, Field(ge=0)] | None = None
    loss: float | None = None
    pid: Annotated[int, Field(ge=0)] | None = None
    # where the pod's model trains ("cpu", "cuda:0 [GPU 3]"; None: nothing registered yet).
    # Added 2026-12-04 (issue 19), optional: older agents' heartbeats still validate.
    device: Annotated[str, Field(max_length=64)] | None = None
    # wall time until which this member works alone (``with s.solo():``, e.g. a rank-0
    # evaluation) while its peers wait in the collective; None: not in a solo. Added
    # 2026-12-04 (issue 23), optional: older agents' heartbeats still validate.
    solo_until: Annotated[float, Field(ge=0)] | None = None
    # median seconds of the member's own compute of its recent steps (from the step's start
    # to its gradient sync: not the wait for the others), what the health monitor compares
    # to find a straggler. Added 2026-12-06 (issue 32), optional.
    compute_time: Annotated[float, Field(ge=0)] | None = None
    # the committed step ``digest`` was taken at, when not ``step``: agents compute it on
    # the device and read it a step later, so a steady heartbeat carries the previous
    # step's. None: ``step``'s. Added 2026-12-06 (issue 43), optional: older agents'
    # heartbeats still validate and mean what they meant.
    digest_step: Step | None = None
    # wall time this member's gradient all-reduce began waiting, once it has waited the
    # agent's stuck_report_after (None: not waiting). Carried by every heartbeat while the wait
    # lasts, in place of a peer_error report per heartbeat interval (N reports a second at N
    # ranks): the wait's first report is still sent. Added 2026-12-07 (issue 45), optional.
    waiting_since: Timestamp | None = None
    # sharded jobs: the step after ``step`` whose gradients this member holds fully summed
    # (its shard position's sum across replicas completed) while the step's last collective,
    # the world's loss sum, failed here: other members may have committed it. The state
    # broker may have it finish that step at the next handoff (``agent/rollforward.py``)
    # instead of losing its shard position. None: nothing pending. Added 2026-12-08
    # (issue 21's sharded path), optional.
    pending_step: Step | None = None

    @property
    def step_digest(self) -> str:
        """The digest of ``step`` ("" when the digest names another step, or none)."""
        return self.digest if self.digest_step in (None, self.step) else ""


MAX_HOST_PODS = 64  # heartbeats in one HeartbeatBatch: a host's pods (8 GPUs a node, typically)


class HeartbeatBatch(Message):
    """A host's relay -> health monitor: the latest heartbeat of each of its host's pods that
    it received since its previous batch, one message per heartbeat interval (issue 45). At
    16,384 pods one process cannot read 65,536 messages a second (nats-py's per-message cost);
    a host's pods' heartbeats in one message amortise it. The relay is a pod of the host
    (agent/hostbeat.py: the lowest-named pod that hears no batch from a lower one); its pods
    send their ``Heartbeat`` on ``hostbeat.<host>.<pod>`` and, while no batch of the host
    carried them within two intervals (the relay lost), on ``heartbeat.<pod>`` as before, so
    a lost relay loses no other pod's heartbeats. Each heartbeat means exactly what it means
    on its own subject. Added 2026-12-07 (issue 45)."""
    subject_kind: ClassVar[str] = "heartbeats"
    host: Annotated[str, Field(pattern=ID_PATTERN)]
    relay: PodId  # the pod that relayed it
    beats: Annotated[list[Heartbeat], Field(max_length=MAX_HOST_PODS)]
    ts: Timestamp = Field(default_factory=now)

    @model_validator(mode="after")
    def _one_per_pod(self) -> "HeartbeatBatch":
        if len({hb.pod for hb in self.beats}) != len(self.beats):
            raise ValueError("a pod appears twice in beats")
        return self


class Seen(BaseModel):
    """One pod in a ``HealthView``: its last heartbeat and how long ago the monitor got it."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    hb: Heartbeat
    age: Annotated[float, Field(ge=0, le=3600)]


MAX_VIEW_PODS = 512  # full heartbeats per message: well under MAX_PAYLOAD_BYTES
MAX_VIEW_LIVE = 4096  # compact entries per message (at most ~160 bytes each)
# messages of one listing: enough for MAX_PODS full heartbeats, MAX_VIEW_PODS per message
MAX_VIEW_CHUNKS = -(-MAX_PODS // MAX_VIEW_PODS)


class HealthView(Message):
    """Health monitor -> scaler, state broker: the heartbeats it received, so that one
    process reads every agent's heartbeat instead of three (docs/architecture.md,
    "Heartbeat fan-in"). ``pods``: full last heartbeats, of the pods that just appeared or
    changed generation, state, role or rank (sent at once), or of every watched pod when
    ``full`` (a complete listing in ``chunks`` messages, every few intervals). ``live``,
    ``gens``, ``steps``, ``digests``, ``ages``: every watched pod in compact form, each
    ``interval``: its generation, last committed step and that step's digest, and seconds
    since its last heartbeat. Consumers read heartbeats themselves while no view arrives."""
    subject_kind: ClassVar[str] = "health"
    monitor: Annotated[str, Field(max_length=64)]
    seq: Annotated[int, Field(ge=0)]
    full: bool = False
    chunk: Annotated[int, Field(ge=0, lt=MAX_VIEW_CHUNKS)] = 0
    chunks: Annotated[int, Field(ge=1, le=MAX_VIEW_CHUNKS)] = 1
    interval: Annotated[float, Field(gt=0, le=60)]
    pods: Annotated[list[Seen], Field(max_length=MAX_VIEW_PODS)] = []
    live: Annotated[list[PodId], Field(max_length=MAX_VIEW_LIVE)] = []
    gens: Annotated[list[Generation], Field(max_length=MAX_VIEW_LIVE)] = []
    steps: Annotated[list[Step], Field(max_length=MAX_VIEW_LIVE)] = []
    digests: Annotated[list[Digest], Field(max_length=MAX_VIEW_LIVE)] = []
    ages: Annotated[list[Annotated[float, Field(ge=0, le=3600)]],
                    Field(max_length=MAX_VIEW_LIVE)] = []
    ts: Timestamp = Field(default_factory=now)

    @model_validator(mode="after")
    def _same_lengths(self) -> "HealthView":
        if not (len(self.live) == len(self.gens) == len(self.steps) == len(self.digests)
                == len(self.ages)):
            raise ValueError("live, gens, steps, digests and ages must have the same length")
        return self


class Report(Message):
    subject_kind: ClassVar[str] = "report"
    pod: PodId
    report: ReportKind
    generation: Generation
    rank: Rank | None = None
    step: Step = -1
    error: Text = ""
    ts: Timestamp = Field(default_factory=now)


class Recovery(Message):
    subject_kind: ClassVar[str] = "recovery"
    incident: Annotated[str, Field(max_length=128)]
    generation: Generation
    pod: PodId
    rank: Rank
    phases: Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[float, Field(ge=0)]],
                      Field(max_length=32)]
    restore_step: Step
    lost_steps: Annotated[int, Field(ge=0)] = 0
    bytes_received: Annotated[int, Field(ge=0)] = 0
    downtime: Annotated[float, Field(ge=0)] | None = None
    ts: Timestamp = Field(default_factory=now)


# ----------------------------------------------------------------------------- control plane
class Fault(Message):
    subject_kind: ClassVar[str] = "fault"
    incident: Annotated[str, Field(max_length=128)]
    pod: PodId
    kind: FaultKind
    detected_at: Timestamp
    last_seen: Timestamp
    generation: Generation
    rank: Rank | None = None
    role: Role = Role.worker
    detection_latency: Annotated[float, Field(ge=0)] | None = None
    reason: Text = ""
    # straggler: its own compute of a step over the members' median (what the scaler cuts
    # its share of micro-batches by when no spare can take its place). Added 2026-12-06
    # (issue 32), optional: older services ignore it.
    slowness: Annotated[float, Field(ge=1, le=1e6)] | None = None
    # The lease term of the service instance that published it (issue 42, added 2026-12-06,
    # optional: None from an older publisher, accepted as before). Receivers ignore a term
    # older than the newest they saw from that service: a deposed instance's message.
    term: Term | None = None


class JobFailedKind(str, Enum):
    script_error = "script_error"    # the same exception at the same step on a second pod
    repeated_hang = "repeated_hang"  # a second pod hung at the step where another had hung


class JobFailed(Message):
    """The health monitor's verdict that a failure is the script's, not the machines' (issue
    33): the same failure at the same step on a second pod. Recovering again would burn pod
    after pod on it; the launcher stops the job (exit 1) and shows ``error``. Added
    2026-12-05 on its own subject (``job_failed``): older consumers never see it."""
    subject_kind: ClassVar[str] = "job_failed"
    kind: JobFailedKind
    step: Step                # the last committed step both pods held when they failed
    generation: Generation    # of the second occurrence
    pods: Annotated[list[PodId], Field(min_length=2, max_length=16)]
    error: Text               # the script's error with its traceback, or what hung
    hint: Text = ""
    ts: Timestamp = Field(default_factory=now)
    term: Term | None = None  # the publisher's lease term (issue 42): see Fault.term


class Member(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    pod: PodId
    rank: Rank


class Plan(Message):
    subject_kind: ClassVar[str] = "plan"
    generation: Annotated[int, Field(ge=1)]
    members: Annotated[list[Member], Field(max_length=MAX_MEMBERS)]
    world_size: Annotated[int, Field(ge=1, le=MAX_MEMBERS)]
    global_batch_size: Annotated[int, Field(ge=1)]
    micro_batch_size: Annotated[int, Field(ge=1)]
    shares: dict[Rank, Annotated[int, Field(ge=1)]]
    lr_factor: Annotated[float, Field(gt=0, le=1000)] = 1.0
    reason: Text = ""
    incident: Annotated[str, Field(max_length=128)] | None = None
    spares: Annotated[list[PodId], Field(max_length=MAX_MEMBERS)] = []
    fenced: Annotated[list[PodId], Field(max_length=MAX_MEMBERS)] = []
    # Planned (elastic) transitions apply from this step on, at a step boundary; None = now.
    apply_step: Annotated[int, Field(ge=0)] | None = None
    # lr_factor is reached over this many steps from the previous plan's (linear ramp).
    lr_warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    # Sharded models (FSDP2 inside a replica): ranks ``j*k .. j*k+k-1`` form replica ``j``;
    # rank ``r`` holds shard ``r % k`` of the model and optimizer (docs/sharded.md). 1: every
    # rank holds the whole model. Added 2026-12-05 (issue 21), optional: older plans validate.
    shard_size: Annotated[int, Field(ge=1, le=MAX_MEMBERS)] = 1
    term: Term | None = None  # the publisher's lease term (issue 42): see Fault.term
    ts: Timestamp = Field(default_factory=now)

    @property
    def replicas(self) -> int:
        return self.world_size // self.shard_size

    def shard_of(self, rank: int) -> int:
        """The shard position of ``rank`` (0 unsharded)."""
        return rank % self.shard_size

    @model_validator(mode="after")
    def _consistent(self) -> "Plan":
        ranks = sorted(m.rank for m in self.members)
        if ranks != list(range(self.world_size)):
            raise ValueError(f"member ranks {ranks} are not 0..{self.world_size - 1}")
        pods = [m.pod for m in self.members]
        if len(set(pods)) != len(pods):
            raise ValueError("a pod appears twice among the members")
        if set(pods) & set(self.spares):
            raise ValueError("a member is also listed as a spare")
        if sorted(self.shares) != list(range(self.world_size)):
            raise ValueError("shares must name every rank exactly once")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError("global_batch_size must be a multiple of micro_batch_size")
        if sum(self.shares.values()) * self.micro_batch_size != self.global_batch_size:
            raise ValueError("shares do not add up to the global batch")
        k = self.shard_size
        if self.world_size % k:
            raise ValueError(f"world_size {self.world_size} is not a multiple of shard_size {k}")
        if k > 1 and any(self.shares[r] != self.shares[r - r % k] for r in self.shares):
            raise ValueError("the ranks of a replica must have equal shares")
        return self

    # O(1) lookups: services ask rank_of() for every heartbeat, with thousands of members.
    # The index is built on first use, kept in the instance __dict__ (not a field: pydantic's
    # equality and dumps ignore it) and keyed on the members list, since
    # model_copy(update=...) copies __dict__ without running validators.
    def _lookup(self) -> tuple[Any, dict[str, int], dict[int, str]]:
        ix = self.__dict__.get("_member_index")
        if ix is None or ix[0] is not self.members:
            ix = (self.members, {m.pod: m.rank for m in self.members},
                  {m.rank: m.pod for m in self.members})
            self.__dict__["_member_index"] = ix
        return ix

    def rank_of(self, pod: str) -> int | None:
        return self._lookup()[1].get(pod)

    def pod_of(self, rank: int) -> str | None:
        return self._lookup()[2].get(rank)


# ----------------------------------------------------------------------------- large plans
# A plan whose encoding is over INLINE_PLAN_BYTES is not sent whole (issue 45): it is stored in
# KV parts (``schemas.subjects.plan_part_key``) and a ``PlanRef`` names it, on the ``plan``
# subject and in KV ``plan``, with the change from the previous generation where that is
# small. One ``PlanRef`` is a few hundred bytes whatever the job's size; an agent holding the
# base plan applies the change, any other reads the parts (plumbing/plan_wire.py).
PLAN_REF_VERSION = 2
INLINE_PLAN_BYTES = 64 * 1024   # up to this a plan goes whole (schema_version 1, as before)
PLAN_PART_BYTES = 512 * 1024    # one KV value: half the max payload, headers leave room
MAX_PLAN_PARTS = 64             # 32 MiB: every member and spare with a 64-character pod id
MAX_CHANGE = 4096               # entries of a change; a larger one is not sent (parts are)
# Plan's fields a change may set, each a JSON scalar: all but its lists (and the version).
PLAN_LISTS = ("members", "shares", "spares", "fenced")
PLAN_SCALARS = tuple(f for f in Plan.model_fields if f not in (*PLAN_LISTS, "schema_version"))
Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class PlanChange(BaseModel):
    """Generation ``base_generation``'s plan (digest ``base_digest``) turned into the new one:
    ``fields`` set (Plan's scalars that differ), the members and shares of these ranks set,
    the ranks from the new world size on dropped, the spares and fenced lists replaced when
    given. Applied, the result validates as a ``Plan`` and must have the ref's digest."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    base_generation: Annotated[int, Field(ge=1)]
    base_digest: Sha256
    fields: Annotated[dict[Literal[PLAN_SCALARS],  # type: ignore[valid-type]
                           int | float | str | None],
                      Field(max_length=len(PLAN_SCALARS))] = {}
    members: Annotated[list[Member], Field(max_length=MAX_CHANGE)] = []
    shares: Annotated[dict[Rank, Annotated[int, Field(ge=1)]], Field(max_length=MAX_CHANGE)] = {}
    spares: Annotated[list[PodId], Field(max_length=MAX_CHANGE)] | None = None
    fenced: Annotated[list[PodId], Field(max_length=MAX_CHANGE)] | None = None


class PlanRef(Message):
    """A plan too large to send whole (added 2026-12-07, issue 45; ``schema_version`` 2 on the
    ``plan`` subject and in KV ``plan``: an older reader drops it, logged). The plan itself is
    its canonical encoding (``plumbing.plan_wire.encode``: members and shares in rank order),
    ``size`` bytes with SHA-256 ``digest``, in ``parts`` KV values
    ``plan_part_key(digest, i)``. ``generation``, ``world_size``, ``term`` and ``ts`` are the
    plan's (a receiver judges staleness before reading anything)."""
    subject_kind: ClassVar[str] = "plan"
    schema_version: Literal[2] = PLAN_REF_VERSION  # type: ignore[assignment]
    generation: Annotated[int, Field(ge=1)]
    world_size: Annotated[int, Field(ge=1, le=MAX_MEMBERS)]
    term: Term | None = None
    ts: Timestamp
    digest: Sha256
    size: Annotated[int, Field(ge=1, le=MAX_PLAN_PARTS * PLAN_PART_BYTES)]
    parts: Annotated[int, Field(ge=1, le=MAX_PLAN_PARTS)]
    change: PlanChange | None = None

    @model_validator(mode="after")
    def _parts_cover(self) -> "PlanRef":
        if -(-self.size // PLAN_PART_BYTES) != self.parts:
            raise ValueError(f"{self.size} bytes are {-(-self.size // PLAN_PART_BYTES)} parts, "
                             f"not {self.parts}")
        return self


class Transfer(Message):
    subject_kind: ClassVar[str] = "transfer"
    generation: Annotated[int, Field(ge=1)]
    restore_step: Step
    # recipient rank -> the source ranks it receives from (striped over them)
    sources: dict[Rank, Annotated[list[Rank], Field(min_length=1, max_length=MAX_MEMBERS)]]
    # every member's committed step, as the broker saw it
    steps: dict[Rank, Step] = {}
    digest: Digest = ""
    incident: Annotated[str, Field(max_length=128)] | None = None
    term: Term | None = None  # the publisher's lease term (issue 42): see Fault.term
    # The ``ts`` of the plan it was decided for (issue 42, added 2026-12-06, optional: None
    # from an older broker, accepted as before): a plan's identity every agent knows (a KV
    # revision is not: plans reach agents as messages). An agent ignores a verdict decided
    # for another plan of its generation (a stale broker instance's, an earlier run's).
    plan_ts: Timestamp | None = None
    ts: Timestamp = Field(default_factory=now)

    @model_validator(mode="after")
    def _no_self(self) -> "Transfer":
        recipients = set(self.sources)  # once: linear in the sources, not quadratic
        for r, srcs in self.sources.items():
            if r in srcs:
                raise ValueError(f"rank {r} cannot be its own source")
            if not recipients.isdisjoint(srcs):
                raise ValueError("a source is also a recipient")
        return self


class StateLost(Message):
    subject_kind: ClassVar[str] = "state_lost"
    generation: Annotated[int, Field(ge=1)]
    incident: Annotated[str, Field(max_length=128)] | None = None
    reason: Text
    best_step: Step = -1
    term: Term | None = None  # the publisher's lease term (issue 42): see Fault.term
    plan_ts: Timestamp | None = None  # the plan it was decided for: see Transfer.plan_ts
    ts: Timestamp = Field(default_factory=now)


class HighWater(BaseModel):
    """KV ``committed`` (``schemas.subjects.COMMITTED_KEY``; written by the state broker
    only): the highest step the job's members were seen to commit, who reported it and in
    which plan generation. A restarted broker starts from it, so members that hold no state
    after step N was committed are a total loss whatever process restarted (issue 41), and
    ``ceaseless up`` reads it to say which steps a restart from a checkpoint recomputes."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    step: Annotated[int, Field(ge=0, le=2**53)]
    generation: Generation
    pod: PodId
    ts: Timestamp = Field(default_factory=now)


class Decision(Message):
    subject_kind: ClassVar[str] = "decision"
    request_id: Annotated[str, Field(max_length=128)]
    accepted: bool
    reason: Text
    generation: Generation | None = None
    # A release is answered twice: accepted (what will happen), then completed (the slots
    # are free; ``pods`` names them).
    completed: bool = False
    pods: Annotated[list[PodId], Field(max_length=MAX_MEMBERS)] = []
    target: Annotated[int, Field(ge=1, le=MAX_MEMBERS)] | None = None
    ts: Timestamp = Field(default_factory=now)


# ----------------------------------------------------------------------------- operator / infra
class Capacity(Message):
    subject_kind: ClassVar[str] = "capacity"
    change: CapacityChange
    count: Annotated[int, Field(ge=1, le=MAX_MEMBERS)]
    reason: Text = ""
    request_id: Annotated[str, Field(max_length=128)] = Field(default_factory=new_id)


class Priority(Message):
    subject_kind: ClassVar[str] = "priority"
    request_id: Annotated[str, Field(max_length=128)] = Field(default_factory=new_id)
    release: Annotated[int, Field(ge=1, le=MAX_MEMBERS)]
    priority: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    reason: Text = ""
    # The pods to give back (e.g. those on a node being drained): the named idle spares are
    # stopped, then the named members leave; empty: idle spares first, then the highest
    # ranks. Added 2026-12-05 (issue 22), optional: older requests still validate.
    pods: Annotated[list[PodId], Field(max_length=MAX_MEMBERS)] = []


class Inject(Message):
    subject_kind: ClassVar[str] = "inject"
    action: InjectAction
    pod: PodId | None = None
    rank: Rank | None = None
    at_step: Annotated[int, Field(ge=0)] | None = None
    # preempt: seconds the pod has before it must be gone (None: its default). Added
    # 2026-12-06 (issue 32), optional.
    deadline_s: Annotated[float, Field(gt=0, le=86400)] | None = None
    # slow: how many times as long each step's compute takes. Added 2026-12-06, optional.
    factor: Annotated[float, Field(ge=1, le=1000)] | None = None
    # bitflip: the parameter's name (``model.named_parameters()``). Added 2026-12-06.
    tensor: Annotated[str, Field(max_length=256)] | None = None
    # Answered on ``decision`` with this id: accepted (who runs it, when) or refused with the
    # reason, by the pod that runs it or by the supervisor. Added 2026-12-06 (issue 41),
    # optional: older requests still validate (and get an id nobody waits for).
    request_id: Annotated[str, Field(max_length=128)] = Field(default_factory=new_id)
    # host-loss / partition / host-return: the emulated host (``h1``..); partition: for how
    # long. Added 2026-12-06 (issue 42), optional: a pod or rank injection names no host.
    host: Annotated[str, Field(pattern=r"^h[1-9][0-9]?$")] | None = None
    for_s: Annotated[float, Field(gt=0, le=3600)] | None = None

    @model_validator(mode="after")
    def _target(self) -> "Inject":
        if self.action in HOST_ACTIONS:
            if self.host is None or self.pod is not None or self.rank is not None:
                raise ValueError(f"{self.action.value} names a host (and no pod or rank)")
            if (self.action == InjectAction.partition) != (self.for_s is not None):
                raise ValueError("a partition, and only a partition, needs for_s")
            return self
        if self.host is not None or self.for_s is not None:
            raise ValueError(f"{self.action.value} names no host")
        if (self.pod is None) == (self.rank is None):
            raise ValueError("name exactly one of pod or rank")
        return self

    @property
    def by_pod(self) -> bool:
        """Run by the pod itself, at its step's gradient sync (the next one, or ``at_step``);
        otherwise a signal from the supervisor (kill, hang, resume)."""
        return self.action not in (InjectAction.resume, *HOST_ACTIONS) and (
            self.at_step is not None or self.action not in (InjectAction.kill, InjectAction.hang))


class Lifecycle(Message):
    subject_kind: ClassVar[str] = "lifecycle"
    pod: PodId
    event: LifecycleEvent
    role: Role = Role.worker
    pid: Annotated[int, Field(ge=0)] | None = None
    exit_code: int | None = None
    ts: Timestamp = Field(default_factory=now)


class ActuatorCommand(Message):
    subject_kind: ClassVar[str] = "actuator"
    action: ActuatorAction
    pod: PodId | None = None
    role: Role = Role.spare
    # a capacity add's pods, started at once (was at most 1,024: a larger add failed)
    count: Annotated[int, Field(ge=1, le=MAX_MEMBERS)] = 1
    reason: Text = ""
    # The lease term of the scaler that sent it (issue 42, added 2026-12-06, optional: None
    # from an older sender or an operator's tool, always acted on). The actuator refuses a
    # command of an older term than one it has acted on: a deposed scaler's.
    term: Term | None = None


class ActuatorReply(Message):
    subject_kind: ClassVar[str] = "actuator_reply"
    ok: bool
    pods: Annotated[list[PodId], Field(max_length=MAX_MEMBERS)] = []  # (the pods started)
    error: Text = ""


class ServiceStatus(BaseModel):
    """The reply of a service's status endpoint (``svc.<service>.status``, NATS micro; what
    ``ceaseless status`` reads): these fields in every service's, the service's own view
    besides (the scaler's plan and policy, the monitor's pods, the broker's commits), which
    is for people and not a contract. A request/reply, not a published message: no
    ``schema_version``. On a status that could not be built: ``service`` and ``error``."""

    model_config = ConfigDict(extra="allow")
    service: Annotated[str, Field(max_length=64)]
    job: Annotated[str, Field(pattern=ID_PATTERN)] | None = None
    uptime_s: Annotated[float, Field(ge=0)] | None = None
    received: dict[str, int] = {}   # payloads accepted, by message kind
    dropped: dict[str, int] = {}    # payloads dropped, by "kind:reason"
    handler_errors: Annotated[int, Field(ge=0)] = 0
    error: str | None = None


# Message kinds by subject kind (``Subjects.kind_of``).
BY_KIND: dict[str, type[Message]] = {
    m.subject_kind: m
    for m in (Heartbeat, HeartbeatBatch, Report, Recovery, Fault, Plan, Transfer, StateLost, Decision,
              Capacity, Priority, Inject, Lifecycle, ActuatorCommand, HealthView, JobFailed)
}

# The replies of request/reply subjects, by the request's kind: ``actuator`` is answered with
# an ``ActuatorReply``, a service's ``svc.<service>.status`` with a ``ServiceStatus``.
REPLIES: dict[str, type[BaseModel]] = {"actuator": ActuatorReply,
                                       "service_status": ServiceStatus}
