"""The scaler's membership decisions as pure functions: no I/O, no clock, no randomness.

``initial_plan`` forms generation 1; ``on_fault`` turns the current plan plus the failed
pods and the live spares into plan ``g+1`` (replace, else shrink) or a ``Wait``.
Ranks stay stable: a spare takes the failed rank's number; when shrinking, the highest
ranks move into the holes so the ranks stay ``0..W-1``. The global batch never changes;
``schemas.batching.shares`` spreads its micro-batches over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from schemas import num_micro_batches, shares
from schemas.messages import Member, Plan

MAX_FENCED = 256  # plan.fenced keeps the most recent fenced pods, not all of history


@dataclass(frozen=True)
class PolicyConfig:
    workers: int = 2
    min_replicas: int = 1
    max_replicas: int = 64
    global_batch_size: int = 64
    micro_batch_size: int = 8

    def __post_init__(self) -> None:
        m = num_micro_batches(self.global_batch_size, self.micro_batch_size)
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas ({self.min_replicas}) <= "
                             f"max_replicas ({self.max_replicas})")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.min_replicas > m:
            raise ValueError(f"min_replicas {self.min_replicas} exceeds the {m} micro-batches "
                             "of the global batch")

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
              lr_factor: float = 1.0) -> Plan:
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
        spares=[*extra, *spares], reason="initial")


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
                  lr_factor=1.0)
    if not holes:
        return make_plan(plan.generation + 1, members, spares=pool,
                         reason="replace " + ", ".join(replaced), **common)
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
                     **common)
