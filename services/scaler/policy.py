"""The scaler's membership decisions as pure functions: no I/O, no clock, no randomness.

``initial_plan`` forms generation 1; ``on_fault`` turns the current plan plus the failed
pods and the live spares into plan ``g+1`` (replace, else shrink) or a ``Wait``;
``on_capacity`` / ``on_release`` turn capacity and priority requests into a new target
replica count (or a refusal that says why) and ``scale_plan`` turns the target into a
planned transition at a step boundary.
Ranks stay stable: a spare takes the failed rank's number; when shrinking, the highest
ranks move into the holes so the ranks stay ``0..W-1``. The global batch never changes
(but once: a scaler told to take the script's batch adopts it for the plans it makes once
rank 0 wrote KV ``script``, ``plan_batch``); ``schemas.batching.shares`` spreads its
micro-batches over the ranks.

Sharded models (``shard_size`` k > 1, issue 21): the job is ``R`` replicas of k ranks; rank
``r`` is replica ``r // k`` at shard position ``r % k``. Every replica count here (targets,
min/max_replicas, ``sizes()``, per-scale lr factors, request counts) counts replicas, and a
plan only ever adds or drops whole replicas. A member keeps its shard position for ever
(``rank % k`` never changes while it stays a member): holes are filled by spares (which have
no position yet), and a replica moves whole into a dropped replica's slots. Members of a
dropped replica that did not fail are released (neither spares nor fenced: they exit).
With k == 1 every function behaves as it did before sharding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from schemas import num_micro_batches, shares
from schemas.batching import uneven_shares
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
    # Ranks per replica (FSDP inside a replica); ``workers`` counts ranks, every replica
    # count (min/max_replicas, targets, sizes) counts replicas of ``shard_size`` ranks.
    shard_size: int = 1
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
        k = self.shard_size
        if k < 1:
            raise ValueError(f"shard_size must be >= 1, not {k}")
        if m % k:
            raise ValueError(f"the global batch has {m} micro-batches, not a multiple of the "
                             f"shard size {k}: every rank of a replica computes as many "
                             "micro-batches as the others")
        if self.workers % k:
            raise ValueError(f"workers {self.workers} is not a multiple of the shard size {k} "
                             "(whole replicas only)")
        m //= k  # micro-batch rows: one per replica at least
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= "
                             f"max_replicas ({self.max_replicas})")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.min_replicas > m:
            per = f" per shard (shard size {k})" if k > 1 else ""
            raise ValueError(f"min_replicas {self.min_replicas} exceeds the {m} micro-batches"
                             f"{per} of the global batch")

    @classmethod
    def from_policy(cls, policy: ScalingPolicy, *, workers: int, global_batch_size: int,
                    micro_batch_size: int, shard_size: int = 1) -> "PolicyConfig":
        return cls(workers=workers, min_replicas=policy.min_replicas,
                   max_replicas=policy.max_replicas, global_batch_size=global_batch_size,
                   micro_batch_size=micro_batch_size, shard_size=shard_size, scaling=policy)

    @property
    def policy(self) -> ScalingPolicy:
        assert self.scaling is not None
        return self.scaling

    def sizes(self) -> list[int]:
        """The replica counts the policy allows that the global batch can be spread over
        (at most ``num_micro // shard_size``: every replica computes one row at least)."""
        return self.policy.sizes(limit=self.num_micro // self.shard_size)

    @property
    def num_micro(self) -> int:
        return num_micro_batches(self.global_batch_size, self.micro_batch_size)

    @property
    def target_replicas(self) -> int:
        """The initial replica count: ``workers // shard_size`` capped by max_replicas and
        the micro-batch rows."""
        k = self.shard_size
        return max(1, min(self.workers // k, self.max_replicas, self.num_micro // k))

    @property
    def target_workers(self) -> int:
        """The initial world size in ranks: ``target_replicas * shard_size``."""
        return self.target_replicas * self.shard_size


@dataclass(frozen=True)
class Wait:
    """No plan can be made now; ``reason`` says what is missing."""

    reason: str


def make_plan(generation: int, members: dict[int, str], *, global_batch_size: int,
              micro_batch_size: int, spares: Iterable[str] = (), reason: str = "",
              incident: str | None = None, fenced: Iterable[str] = (),
              lr_factor: float = 1.0, apply_step: int | None = None,
              lr_warmup_steps: int = 0, shard_size: int = 1) -> Plan:
    """A validated plan; ``members`` maps rank -> pod and must cover 0..W-1 (W a multiple
    of ``shard_size``)."""
    w = len(members)
    member_pods = set(members.values())
    return Plan(
        generation=generation,
        members=[Member(pod=members[r], rank=r) for r in sorted(members)],
        world_size=w,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        shares=shares(num_micro_batches(global_batch_size, micro_batch_size), w, shard_size),
        lr_factor=lr_factor,
        reason=reason,
        incident=incident,
        spares=sorted(set(spares) - member_pods),
        fenced=_bounded(fenced),
        apply_step=apply_step,
        lr_warmup_steps=lr_warmup_steps,
        shard_size=shard_size,
        ts=0.0,
    )


def _move_replicas(members: dict[int, str], source: dict[int, str], dsts: Iterable[int],
                   srcs: Iterable[int], k: int) -> list[str]:
    """Whole replicas ``srcs[n]`` move into the free slots of replicas ``dsts[n]`` (rank
    ``src*k+i`` -> ``dst*k+i``: every pod keeps its shard position); ``members`` is updated,
    the pods are read from ``source``. Returns what moved, for the plan's reason."""
    moves = []
    for dst, src in zip(dsts, srcs):
        pods = [source[src * k + i] for i in range(k)]
        for i, pod in enumerate(pods):
            members.pop(src * k + i, None)
            members[dst * k + i] = pod
        moves.append(f"rank {src} ({pods[0]}) moves to rank {dst}" if k == 1 else
                     f"replica {src} ({', '.join(pods)}) moves to replica {dst} (ranks "
                     f"{src * k}-{src * k + k - 1} -> {dst * k}-{dst * k + k - 1})")
    return moves


def _bounded(pods: Iterable[str]) -> list[str]:
    seen: dict[str, None] = {}
    for p in pods:
        seen.pop(p, None)
        seen[p] = None
    return list(seen)[-MAX_FENCED:]


def plan_batch(plan: Plan, cfg: PolicyConfig, world_size: int) -> dict[str, int]:
    """The batch plan ``g+1`` carries: the config's (the operator's flags, or the training
    script's own once the scaler adopted it: ``Scaler.batch_from_script``), else, when that
    cannot be spread over ``world_size`` ranks, the current plan's. With an unchanged config
    (the usual case) this is the plan's own: the global batch never changes."""
    for B, m in ((cfg.global_batch_size, cfg.micro_batch_size),
                 (plan.global_batch_size, plan.micro_batch_size)):
        try:
            shares(num_micro_batches(B, m), world_size, plan.shard_size)
        except ValueError:
            continue
        return {"global_batch_size": B, "micro_batch_size": m}
    return {"global_batch_size": plan.global_batch_size,
            "micro_batch_size": plan.micro_batch_size}


def initial_plan(workers: Iterable[str], spares: Iterable[str], cfg: PolicyConfig,
                 timed_out: bool = False) -> Plan | Wait:
    """Generation 1 from the live waiting pods.

    ``workers``: live worker-role pods waiting for a plan; ``spares``: live spare-role pods.
    With ``cfg.workers`` workers (capped by max_replicas and the micro-batch count) the first
    ones by pod id get ranks 0..N-1 and the rest become spares; after the start timeout
    (``timed_out``) any number >= min_replicas will do. Sharded (k = ``cfg.shard_size``):
    ``R * k`` workers for ``R = cfg.target_replicas`` (after the timeout: as many whole
    replicas as there are workers, at least min_replicas); the rest are spares.
    """
    ws = sorted(set(workers))
    k = cfg.shard_size
    want = cfg.target_workers
    if len(ws) < want and not (timed_out and len(ws) // k >= cfg.min_replicas):
        more = f", or {cfg.min_replicas * k} after the start timeout" if not timed_out else ""
        return Wait(f"waiting for workers: {len(ws)} of {want} alive{more}")
    n = min(want, len(ws) // k * k)
    chosen = ws[:n]
    extra = ws[n:]
    return make_plan(
        1, dict(enumerate(chosen)),
        global_batch_size=cfg.global_batch_size, micro_batch_size=cfg.micro_batch_size,
        spares=[*extra, *spares], reason="initial", lr_factor=cfg.policy.lr_factor(n // k),
        shard_size=k)


def gone_spares(plan: Plan, alive_spares: Iterable[str]) -> list[str]:
    """The previous plan's spares no longer alive in the scaler's view: fenced, so that one
    that comes back (a partitioned host healed) exits and is replaced, instead of following
    the job as a spare no plan names (the host chaos run: a spare short for good)."""
    alive = set(alive_spares)
    return [p for p in plan.spares if p not in alive and p not in plan.fenced]


def on_fault(plan: Plan, failed: str | Iterable[str], alive_spares: Iterable[str],
             cfg: PolicyConfig, incident: str | None = None) -> Plan | Wait | None:
    """Plan ``g+1`` after the members ``failed`` died, or ``Wait``, or None if none of
    ``failed`` is a member (nothing to do: faults are idempotent).

    Every failed rank goes to a live spare (spares in pod-id order, failed ranks in rank
    order); holes left when spares run out are closed by shrinking (the highest ranks move
    into them) if at least ``min_replicas`` stay; otherwise wait for capacity. A plan that
    would still contain a failed pod is never produced.

    Sharded (k = ``plan.shard_size`` > 1): holes are counted per replica. When the spares
    cannot fill every hole, the spares complete as many replicas as they can -- replicas
    with the fewest holes first, then the lowest replica index (with k == 1 this is the
    rule above) -- and every replica still holding a hole is dropped whole: no spare is
    spent on it, its surviving members are released (in neither members, spares nor
    fenced: they exit). The highest-numbered intact replicas then move whole into the
    dropped slots below the new world size (rank ``r`` of replica ``s`` goes to
    ``r - (s - d) * k`` for destination replica ``d``: shard positions are kept), so the
    ranks stay ``0..W-1``. Wait when fewer than min_replicas replicas would remain.
    """
    failed_set = {failed} if isinstance(failed, str) else set(failed)
    by_rank = {m.rank: m.pod for m in plan.members}
    dead = sorted(r for r, p in by_rank.items() if p in failed_set)
    if not dead:
        return None
    k = plan.shard_size
    n_rep = plan.replicas
    dead_pods = [by_rank[r] for r in dead]
    excluded = set(by_rank.values()) | failed_set | set(plan.fenced)
    pool = sorted(set(alive_spares) - excluded)
    holed: dict[int, list[int]] = {}
    for r in dead:
        holed.setdefault(r // k, []).append(r)
    # Complete as many replicas as the spares allow: fewest holes first, then lowest index.
    fill, dropped, left = set(), [], len(pool)
    for j in sorted(holed, key=lambda j: (len(holed[j]), j)):
        if len(holed[j]) <= left:
            fill.add(j)
            left -= len(holed[j])
        else:
            dropped.append(j)
    dropped.sort()
    members = {r: p for r, p in by_rank.items() if r not in dead}
    replaced: list[str] = []
    for r in dead:
        if r // k in fill:
            spare = pool.pop(0)
            members[r] = spare
            replaced.append(f"{by_rank[r]} with {spare}")
    fenced = [*plan.fenced, *dead_pods, *gone_spares(plan, alive_spares)]
    common = dict(incident=incident, fenced=fenced,
                  lr_warmup_steps=cfg.policy.lr_warmup_steps, shard_size=k)
    if not dropped:
        return make_plan(plan.generation + 1, members, spares=pool,
                         reason="replace " + ", ".join(replaced),
                         lr_factor=cfg.policy.lr_factor(len(members) // k),
                         **plan_batch(plan, cfg, len(members)), **common)
    holes = [r for j in dropped for r in holed[j]]
    new_rep = n_rep - len(dropped)
    new_ws = new_rep * k
    if new_rep < max(1, cfg.min_replicas):
        if k == 1:
            return Wait(
                f"waiting for capacity: {', '.join(by_rank[r] for r in holes)} failed, no "
                f"live spare, and shrinking to {new_ws} would go below min_replicas "
                f"{cfg.min_replicas}")
        return Wait(
            f"waiting for capacity: {', '.join(by_rank[r] for r in holes)} failed, not enough "
            f"live spares to complete replica(s) {', '.join(map(str, dropped))}, and dropping "
            f"them would leave {new_rep} replica(s) of {k}, below min_replicas "
            f"{cfg.min_replicas}")
    released = [by_rank[r] for j in dropped for r in range(j * k, j * k + k)
                if r not in holed[j]]
    for j in dropped:
        for r in range(j * k, j * k + k):
            members.pop(r, None)
    # Whole replicas >= new_rep move (highest first) into the dropped slots below new_rep.
    low = [j for j in dropped if j < new_rep]
    movers = sorted((j for j in range(new_rep, n_rep) if j not in dropped), reverse=True)
    moves = _move_replicas(members, members, low, movers, k)
    parts = [f"replace {', '.join(replaced)}"] if replaced else []
    if k == 1:
        parts.append(f"shrink: {', '.join(by_rank[r] for r in holes)} failed, no live spare"
                     + (f", {'; '.join(moves)}" if moves else "")
                     + f", world size {plan.world_size} -> {new_ws}")
    else:
        parts.append(f"shrink: {', '.join(by_rank[r] for r in holes)} failed, not enough live "
                     f"spares for replica(s) {', '.join(map(str, dropped))}: dropped"
                     + (f", {', '.join(released)} released" if released else "")
                     + (f", {'; '.join(moves)}" if moves else "")
                     + f", world size {plan.world_size} -> {new_ws} ({n_rep} -> {new_rep} "
                     f"replicas of {k})")
    return make_plan(plan.generation + 1, members, spares=pool, reason="; ".join(parts),
                     lr_factor=cfg.policy.lr_factor(new_rep),
                     **plan_batch(plan, cfg, new_ws), **common)


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



def on_preempt(plan: Plan, pods: str | Iterable[str], alive_spares: Iterable[str],
               cfg: PolicyConfig, apply_step: int, incident: str | None = None,
               why: str = "preempted") -> Plan | Wait | None:
    """Members ``pods`` gave notice that they will be stopped (preemption), or straggle
    (``why``): the plan their
    failure would get (a live spare into each rank, else a shrink, else ``Wait``), but as a
    planned transition at ``apply_step`` that fences nobody: they leave by themselves at
    that step boundary, the others keep computing, nothing is recomputed. None: none of
    ``pods`` is a member."""
    d = on_fault(plan, pods, alive_spares, cfg, incident=incident)
    if not isinstance(d, Plan):
        return d
    gone = {pods} if isinstance(pods, str) else set(pods)
    leaving = sorted(p for p in gone if plan.rank_of(p) is not None)
    return d.model_copy(update={
        "apply_step": apply_step, "fenced": [p for p in d.fenced if p not in gone],
        "reason": f"{why}: {', '.join(leaving)} leave at step {apply_step}"[:2000]})

def share_out(plan: Plan, pod: str, ratio: float, apply_step: int,
              incident: str | None = None) -> Plan | Wait | None:
    """A straggler and no spare to swap in: the same members at step ``apply_step``, the
    straggler's micro-batches cut by its slowness (``ratio``: its own compute of a step over
    the others' median) and shared out to the others; the global batch is unchanged.
    Weights are speeds (micro-batches per second of compute), so a second look after the
    change refines the first. None: not a member, or the shares would not change; ``Wait``:
    a sharded job (a replica's ranks compute equal shares)."""
    r = plan.rank_of(pod)
    if r is None:
        return None
    if plan.shard_size > 1:
        return Wait("a straggler in a sharded replica needs a spare (its ranks compute "
                    "equal shares)")
    weights = {q: n / (max(1.0, ratio) if q == r else 1.0) for q, n in plan.shares.items()}
    try:
        new = uneven_shares(sum(plan.shares.values()), weights)
    except ValueError as e:
        return Wait(str(e))
    if new == plan.shares:
        return None
    data = plan.model_dump()
    data.update(generation=plan.generation + 1, shares=new, apply_step=apply_step,
                incident=incident, fenced=[], ts=0.0,
                reason=(f"straggler: {pod} computes {new[r]} of {sum(new.values())} "
                        f"micro-batches from step {apply_step} (was {plan.shares[r]}; "
                        f"{ratio:.1f}x slower)")[:2000])
    return Plan.model_validate(data)


def on_capacity_add(target: int, count: int, cfg: PolicyConfig) -> TargetChange | Refused:
    """``count`` new slots: the target grows by ``count`` up to ``max_replicas`` (and the
    number of micro-batches); the new pods join as spares and are promoted up to it.
    Sharded: ``count`` and the target are replicas (the scaler starts ``count * k`` pods)
    and the micro-batch limit is ``num_micro // k``."""
    top = max(cfg.sizes() or [cfg.min_replicas])
    if target >= top:
        k = cfg.shard_size
        batch = (f"{cfg.num_micro} micro-batches" if k == 1 else
                 f"{cfg.num_micro} micro-batches = {cfg.num_micro // k} per shard of {k}")
        return Refused(f"capacity add {count}: already at the largest allowed replica count "
                       f"{top} (max_replicas {cfg.max_replicas}, {batch})")
    new = min(top, target + count)
    capped = f" (capped at {top})" if target + count > top else ""
    return TargetChange(new, f"capacity add {count}: target {target} -> {new} replicas{capped}")


def on_release(replicas: int, target: int, count: int, idle_spares: Iterable[str],
               cfg: PolicyConfig, what: str = "release",
               pods: Iterable[str] = ()) -> TargetChange | Refused:
    """Give back ``count`` replicas: idle spares first (highest pod ids), then the highest
    ranks. With ``pods`` named (the pods of a node being drained) only those: the named idle
    spares are stopped and the rest of the count leaves as a shrink (``scale_plan``'s
    ``leave`` names the members that go). Refused when the members left would be fewer than
    ``min_replicas`` or not a replica count the policy allows.

    ``replicas`` is the current replica count (the world size when unsharded). Sharded
    (k = ``cfg.shard_size``): k idle spares make one replica-equivalent; the idle spares
    (named ones only, if any are named) are stopped in whole groups of k, highest pod ids
    first, up to ``count`` groups (a remainder of fewer than k stays idle); the rest of the
    count leaves as whole member replicas (``scale_plan``: replicas holding a named pod
    first, then the highest)."""
    k = cfg.shard_size
    named = set(pods)
    idle = sorted((p for p in idle_spares if not named or p in named), reverse=True)
    groups = min(count, len(idle) // k)
    stop = tuple(idle[:groups * k])
    shrink = count - groups
    if shrink == 0:
        return TargetChange(min(target, max(replicas, cfg.min_replicas)),
                            f"{what} {count}: stopping idle spare(s) {', '.join(stop)}",
                            stop_spares=stop)
    new = replicas - shrink
    have = f"only {len(stop)} idle spare(s)" + (f" ({groups} replica(s) of {k})" if k > 1
                                                else "")
    if new < cfg.min_replicas:
        return Refused(f"{what} {count}: {have}; shrinking {replicas} "
                       f"-> {new} replicas would go below min_replicas {cfg.min_replicas}")
    if new not in cfg.sizes():
        return Refused(f"{what} {count}: {new} replicas is not an allowed replica count "
                       f"(allowed: {', '.join(map(str, cfg.sizes()))})")
    spares_part = f"stopping idle spare(s) {', '.join(stop)}, " if stop else ""
    size = (f"world size {replicas} -> {new}" if k == 1 else
            f"replicas {replicas} -> {new} (world size {replicas * k} -> {new * k})")
    return TargetChange(new, f"{what} {count}: {spares_part}{size}",
                        stop_spares=stop, shrink_by=shrink)


def desired_size(replicas: int, target: int, n_spares: int, cfg: PolicyConfig) -> int:
    """The largest allowed replica count within the target and the pods at hand (members +
    live spares); the current size if none is. Sharded: ``replicas`` and ``n_spares``
    count replicas (pass ``plan.replicas`` and ``len(spares) // k``)."""
    limit = min(target, replicas + n_spares)
    ok = [n for n in cfg.sizes() if n <= limit]
    return max(ok) if ok else replicas


def scale_plan(plan: Plan, target: int, alive_spares: Iterable[str], cfg: PolicyConfig, *,
               apply_step: int, reason: str = "", incident: str | None = None,
               leave: Iterable[str] = ()) -> Plan | None:
    """Plan ``g+1`` that moves the world size toward ``target`` from ``apply_step`` on (a
    planned transition at a step boundary), or None when no change is possible or needed.
    Growing promotes live spares (pod-id order) into ranks W..; shrinking drops the members
    named in ``leave`` first (a release that named them: a node being drained), then the
    highest ranks (their slots are released, they do not become spares); the highest ranks
    that stay move into the holes, so the ranks stay ``0..W-1``. Other ranks stay put.

    Sharded (k = ``plan.shard_size`` > 1): ``target`` counts replicas; growing appends whole
    replicas of k spares (fewer than k spares at hand: no new replica); shrinking drops
    whole replicas (one holding a pod named in ``leave`` first, then the highest) and moves
    the highest remaining replicas whole into the dropped slots (shard positions kept)."""
    k = plan.shard_size
    w, n_rep = plan.world_size, plan.replicas
    members_now = {m.pod for m in plan.members}
    pool = sorted(set(alive_spares) - members_now - set(plan.fenced))
    new_rep = desired_size(n_rep, target, len(pool) // k, cfg)
    if new_rep == n_rep:
        return None
    new_w = new_rep * k
    by_rank = {m.rank: m.pod for m in plan.members}
    sized = f"{w} -> {new_w}" if k == 1 else (
        f"{n_rep} -> {new_rep} replicas of {k} (world size {w} -> {new_w})")
    if new_w > w:
        joiners = pool[:new_w - w]
        members = {**by_rank, **{w + i: p for i, p in enumerate(joiners)}}
        spares = pool[new_w - w:]
        what = f"grow {sized}: {', '.join(joiners)} join"
    else:
        named = set(leave)
        has_named = {j: any(by_rank[j * k + i] in named for i in range(k))
                     for j in range(n_rep)}
        order = sorted(range(n_rep), key=lambda j: (not has_named[j], -j))
        gone = set(order[:n_rep - new_rep])
        leaving = [by_rank[r] for r in sorted(by_rank) if r // k in gone]
        members = {r: p for r, p in by_rank.items() if r < new_w and r // k not in gone}
        movers = sorted((j for j in range(new_rep, n_rep) if j not in gone), reverse=True)
        moves = _move_replicas(members, by_rank,
                               sorted(j for j in range(new_rep) if j in gone), movers, k)
        spares = pool
        what = f"shrink {sized}: {', '.join(leaving)} leave" + (
            f", {'; '.join(moves)}" if moves else "")
    return make_plan(plan.generation + 1, members, **plan_batch(plan, cfg, new_w),
                     spares=spares,
                     reason=f"{what} at step {apply_step}" + (f" ({reason})" if reason else ""),
                     incident=incident, fenced=[*plan.fenced, *gone_spares(plan, pool)],
                     lr_factor=cfg.policy.lr_factor(new_rep),
                     lr_warmup_steps=cfg.policy.lr_warmup_steps, apply_step=apply_step,
                     shard_size=k)
