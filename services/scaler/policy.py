"""The scaler's membership decisions as pure functions: no I/O, no clock, no randomness.

``initial_plan`` forms generation 1; ``on_fault`` turns the current plan plus the failed
pods and the live spares into plan ``g+1`` (replace, else shrink) or a ``Wait``;
``on_capacity`` / ``on_release`` turn capacity and priority requests into a new target
replica count (or a refusal that says why) and ``scale_plan`` turns the target into a
planned transition at a step boundary.
Ranks stay stable: a spare takes the failed rank's number; when shrinking, the highest
ranks move into the holes so the ranks stay ``0..W-1``. The global batch never changes;
``schemas.batching.shares`` spreads its micro-batches over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from schemas import num_micro_batches, shares
from schemas.messages import Member, Plan
from schemas.policy import ScalingPolicy

MAX_FENCED = 256  # plan.fenced keeps the most recent fenced pods, not all of history


@dataclass(frozen=True)
class PolicyConfig:
    workers: int = 2
    min_replicas: int = 1
    max_replicas: int = 64
    global_batch_size: int = 64
    micro_batch_size: int = 8
    # The elastic part of the policy; None: defaults with min/max_replicas above.
    scaling: ScalingPolicy | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.scaling is None:
            if self.min_replicas <= self.max_replicas:
                object.__setattr__(self, "scaling", ScalingPolicy(
                    min_replicas=max(1, self.min_replicas), max_replicas=self.max_replicas))
        elif (self.scaling.min_replicas, self.scaling.max_replicas) != (
                self.min_replicas, self.max_replicas):
            raise ValueError("min/max_replicas differ from the scaling policy's; build the "
                             "config with PolicyConfig.from_policy")
        m = num_micro_batches(self.global_batch_size, self.micro_batch_size)
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= "
                             f"max_replicas ({self.max_replicas})")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.min_replicas > m:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds the {m} micro-batches "
                             "of the global batch")

    @classmethod
    def from_policy(cls, policy: ScalingPolicy, *, workers: int, global_batch_size: int,
                    micro_batch_size: int) -> "PolicyConfig":
        return cls(workers=workers, min_replicas=policy.min_replicas,
                   max_replicas=policy.max_replicas, global_batch_size=global_batch_size,
                   micro_batch_size=micro_batch_size, scaling=policy)

    @property
    def policy(self) -> ScalingPolicy:
        assert self.scaling is not None
        return self.scaling

    def sizes(self) -> list[int]:
        """The replica counts the policy allows that the global batch can be spread over."""
        return self.policy.sizes(limit=self.num_micro)

    @property
    def num_micro(self) -> int:
        return num_micro_batches(self.global_batch_size, self.micro_batch_size)

    @property
    def target_workers(self) -> int:
        """The initial world size: ``workers`` capped by max_replicas and the micro-batches."""
        return max(1, min(self.workers, self.max_replicas, self.num_micro))


@dataclass(frozen=True)
class Wait:
    """No plan can be made now; ``reason`` says what is missing."""

    reason: str


def make_plan(generation: int, members: dict[int, str], *, global_batch_size: int,
              micro_batch_size: int, spares: Iterable[str] = (), reason: str = "",
              incident: str | None = None, fenced: Iterable[str] = (),
              lr_factor: float = 1.0, apply_step: int | None = None,
              lr_warmup_steps: int = 0) -> Plan:
    """A validated plan; ``members`` maps rank -> pod and must cover 0..W-1."""
    w = len(members)
    member_pods = set(members.values())
    return Plan(
        generation=generation,
        members=[Member(pod=members[r], rank=r) for r in sorted(members)],
        world_size=w,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        shares=shares(num_micro_batches(global_batch_size, micro_batch_size), w),
        lr_factor=lr_factor,
        reason=reason,
        incident=incident,
        spares=sorted(set(spares) - member_pods),
        fenced=_bounded(fenced),
        apply_step=apply_step,
        lr_warmup_steps=lr_warmup_steps,
        ts=0.0,
    )


def _bounded(pods: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for p in pods:
        seen.pop(p, None)
        seen[p] = None
    return list(seen)[-MAX_FENCED:]


def initial_plan(workers: Iterable[str], spares: Iterable[str], cfg: PolicyConfig,
                 timed_out: bool = False) -> Plan | Wait:
    """Generation 1 from the live waiting pods.

    ``workers``: live worker-role pods waiting for a plan; ``spares``: live spare-role pods.
    With ``cfg.workers`` workers (capped by max_replicas and the micro-batch count) the first
    ones by pod id get ranks 0..N-1 and the rest become spares; after the start timeout
    (``timed_out``) any number >= min_replicas will do.
    """
    ws = sorted(set(workers))
    want = cfg.target_workers
    if len(ws) < want and not (timed_out and len(ws) >= cfg.min_replicas):
        more = f", or {cfg.min_replicas} after the start timeout" if not timed_out else ""
        return Wait(f"waiting for workers: {len(ws)} of {want} alive{more}")
    chosen = ws[:want]
    extra = ws[want:]
    return make_plan(
        1, dict(enumerate(chosen)),
        global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
        spares=[*extra, *spares], reason="initial", lr_factor=cfg.policy.lr_factor(len(chosen)))


def on_fault(plan: Plan, failed: str | Iterable[str], alive_spares: Iterable[str],
             cfg: PolicyConfig, incident: str | None = None) -> Plan | Wait | None:
    """Plan ``g+1`` after the members ``failed`` died, or ``Wait``, or None if none of
    ``failed`` is a member (nothing to do: faults are idempotent).

    Every failed rank goes to a live spare (spares in pod-id order, failed ranks in rank
    order); holes left when spares run out are closed by shrinking (the highest ranks move
    into them) if at least ``min_replicas`` stay; otherwise wait for capacity. A plan that
    would still contain a failed pod is never produced.
    """
    failed_set = {failed} if isinstance(failed, str) else set(failed)
    by_rank = {m.rank: m.pod for m in plan.members}
    dead = sorted(r for r, p in by_rank.items() if p in failed_set)
    if not dead:
        return None
    dead_pods = [by_rank[r] for r in dead]
    excluded = set(by_rank.values()) | failed_set | set(plan.fenced)
    pool = sorted(set(alive_spares) - excluded)
    members = {r: p for r, p in by_rank.items() if r not in dead}
    replaced: list[str] = []
    holes: list[int] = []
    for r in dead:
        if pool:
            spare = pool.pop(0)
            members[r] = spare
            replaced.append(f"{by_rank[r]} with {spare}")
        else:
            holes.append(r)
    fenced = [*plan.fenced, *dead_pods]
    common = dict(global_batch_size=plan.global_batch_size,
                  micro_batch_size=plan.micro_batch_size, incident=incident, fenced=fenced,
                  lr_warmup_steps=cfg.policy.lr_warmup_steps)
    if not holes:
        return make_plan(plan.generation + 1, members, spares=pool,
                         reason="replace " + ", ".join(replaced),
                         lr_factor=cfg.policy.lr_factor(len(members)), **common)
    new_ws = plan.world_size - len(holes)
    if new_ws < max(1, cfg.min_replicas):
        return Wait(
            f"waiting for capacity: {', '.join(by_rank[r] for r in holes)} failed, no live "
            f"spare, and shrinking to {new_ws} would go below min_replicas {cfg.min_replicas}")
    # Shrink: ranks >= new_ws move (highest first) into the holes below new_ws.
    low_holes = sorted(r for r in holes if r < new_ws)
    movers = sorted((r for r in members if r >= new_ws), reverse=True)
    moves = []
    for hole, src in zip(low_holes, movers):
        members[hole] = members.pop(src)
        moves.append(f"rank {src} ({members[hole]}) moves to rank {hole}")
    parts = [f"replace {', '.join(replaced)}"] if replaced else []
    parts.append(f"shrink: {', '.join(by_rank[r] for r in holes)} failed, no live spare"
                 + (f", {'; '.join(moves)}" if moves else "")
                 + f", world size {plan.world_size} -> {new_ws}")
    return make_plan(plan.generation + 1, members, spares=pool, reason="; ".join(parts),
                     lr_factor=cfg.policy.lr_factor(new_ws), **common)


# ----------------------------------------------------------------------------- elastic
@dataclass(frozen=True)
class Refused:
    """The policy refuses a request; ``reason`` is the answer the requester gets."""

    reason: str


@dataclass(frozen=True)
class TargetChange:
    """A request the policy accepts: the new target replica count, the idle spares to stop
    (released first) and the answer."""

    target: int
    reason: str
    stop_spares: tuple[str, ...] = ()
    shrink_by: int = 0


def on_capacity_add(target: int, count: int, cfg: PolicyConfig) -> TargetChange | Refused:
    """``count`` new slots: the target grows by ``count`` up to ``max_replicas`` (and the
    number of micro-batches); the new pods join as spares and are promoted up to it."""
    top = max(cfg.sizes() or [cfg.min_replicas])
    if target >= top:
        return Refused(f"capacity add {count}: already at the largest allowed replica count "
                       f"{top} (max_replicas {cfg.max_replicas}, {cfg.num_micro} micro-batches)")
    new = min(top, target + count)
    capped = f" (capped at {top})" if target + count > top else ""
    return TargetChange(new, f"capacity add {count}: target {target} -> {new} replicas{capped}")


def on_release(world_size: int, target: int, count: int, idle_spares: Iterable[str],
               cfg: PolicyConfig, what: str = "release",
               pods: Iterable[str] = ()) -> TargetChange | Refused:
    """Give back ``count`` replicas: idle spares first (highest pod ids), then the highest
    ranks. With ``pods`` named (the pods of a node being drained) only those: the named idle
    spares are stopped and the rest of the count leaves as a shrink (``scale_plan``'s
    ``leave`` names the members that go). Refused when the members left would be fewer than
    ``min_replicas`` or not a replica count the policy allows."""
    named = set(pods)
    idle = sorted((p for p in idle_spares if not named or p in named), reverse=True)
    stop = tuple(idle[:count])
    shrink = count - len(stop)
    if shrink == 0:
        return TargetChange(min(target, max(world_size, cfg.min_replicas)),
                            f"{what} {count}: stopping idle spare(s) {', '.join(stop)}",
                            stop_spares=stop)
    new = world_size - shrink
    if new < cfg.min_replicas:
        return Refused(f"{what} {count}: only {len(stop)} idle spare(s); shrinking {world_size} "
                       f"-> {new} replicas would go below min_replicas {cfg.min_replicas}")
    if new not in cfg.sizes():
        return Refused(f"{what} {count}: {new} replicas is not an allowed replica count "
                       f"(allowed: {', '.join(map(str, cfg.sizes()))})")
    spares_part = f"stopping idle spare(s) {', '.join(stop)}, " if stop else ""
    return TargetChange(new, f"{what} {count}: {spares_part}world size {world_size} -> {new}",
                        stop_spares=stop, shrink_by=shrink)


def desired_size(world_size: int, target: int, n_spares: int, cfg: PolicyConfig) -> int:
    """The largest allowed replica count within the target and the pods at hand (members +
    live spares); the current size if none is."""
    limit = min(target, world_size + n_spares)
    ok = [n for n in cfg.sizes() if n <= limit]
    return max(ok) if ok else world_size


def scale_plan(plan: Plan, target: int, alive_spares: Iterable[str], cfg: PolicyConfig, *,
               apply_step: int, reason: str = "", incident: str | None = None,
               leave: Iterable[str] = ()) -> Plan | None:
    """Plan ``g+1`` that moves the world size toward ``target`` from ``apply_step`` on (a
    planned transition at a step boundary), or None when no change is possible or needed.
    Growing promotes live spares (pod-id order) into ranks W..; shrinking drops the members
    named in ``leave`` first (a release that named them: a node being drained), then the
    highest ranks (their slots are released, they do not become spares); the highest ranks
    that stay move into the holes, so the ranks stay ``0..W-1``. Other ranks stay put."""
    w = plan.world_size
    members_now = {m.pod for m in plan.members}
    pool = sorted(set(alive_spares) - members_now - set(plan.fenced))
    new_w = desired_size(w, target, len(pool), cfg)
    if new_w == w:
        return None
    by_rank = {m.rank: m.pod for m in plan.members}
    if new_w > w:
        joiners = pool[:new_w - w]
        members = {**by_rank, **{w + i: p for i, p in enumerate(joiners)}}
        spares = pool[new_w - w:]
        what = f"grow {w} -> {new_w}: {', '.join(joiners)} join"
    else:
        named = set(leave)
        order = sorted(by_rank, key=lambda r: (by_rank[r] not in named, -r))
        gone = set(order[:w - new_w])
        leaving = [by_rank[r] for r in sorted(gone)]
        members = {r: p for r, p in by_rank.items() if r < new_w and r not in gone}
        movers = sorted((r for r in by_rank if r >= new_w and r not in gone), reverse=True)
        moves = []
        for hole, src in zip(sorted(r for r in range(new_w) if r not in members), movers):
            members[hole] = by_rank[src]
            moves.append(f"rank {src} ({by_rank[src]}) moves to rank {hole}")
        spares = pool
        what = f"shrink {w} -> {new_w}: {', '.join(leaving)} leave" + (
            f", {'; '.join(moves)}" if moves else "")
    return make_plan(plan.generation + 1, members, global_batch_size=plan.global_batch_size,
                     micro_batch_size=plan.micro_batch_size, spares=spares,
                     reason=f"{what} at step {apply_step}" + (f" ({reason})" if reason else ""),
                     incident=incident, fenced=plan.fenced,
                     lr_factor=cfg.policy.lr_factor(new_w),
                     lr_warmup_steps=cfg.policy.lr_warmup_steps, apply_step=apply_step)
