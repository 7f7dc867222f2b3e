"""The state broker: who holds which committed state -> one ``transfer`` (or ``state_lost``)
per plan generation.

For plan generation ``g`` it waits (up to ``member_wait``) until every member heartbeated
``generation == g`` (agents do so at once on adopting a plan, with ``step`` = the last
committed step and its ``digest``). Then ``restore_step`` = the highest step among them;
sources = the members at ``restore_step`` whose digest is the majority digest there;
recipients = every other member, each given all sources, rotated by the recipient's index
so the load spreads. At ``restore_step == -1`` (nothing committed: generation 1) rank 0 is
the source so every rank starts from identical weights -- unless some member once reported
a committed step (the high-water mark): then the state died with the old members and a
``state_lost`` goes out instead. The mark is kept in KV ``committed`` too (``high_water.py``)
and read before any plan, so this holds for a broker restarted after the members died. In generation 1 rank 0 is the source also when it holds a
step (the scripts restored their own checkpoint, ``s.steps(total, start=...)``).

A member that has not reported by ``member_wait`` but is alive (a heartbeat within
``live_s``) is waited for up to ``state_wait``: deciding without it gains nothing (the
generation's group cannot form without it) and can lose what it holds: a higher committed
step (a member still stuck in an abandoned rendezvous of the previous generation: its steps
dropped, or the state declared lost while it holds it), or, in generation 1, rank 0's
state (its restored checkpoint), which every rank must start from. A slow machine (a pod
still importing or building its model when the first plan comes) is no reason to decide
without it. While no member at all has reported there is nothing to decide: the broker
waits on, however long, until one does or a newer plan replaces this one (a generation
given up with no reporter never got a transfer: its members waited for one in vain and
left after their recovery timeout, shrinking the job).

No hidden state: after a restart the broker handles the current plan again unless the job
stream already holds a transfer/state_lost of that generation (transfers are idempotent),
with the high-water mark it read from KV.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace

from schemas.messages import MAX_PODS, Heartbeat, Plan, StateLost, Transfer
from plumbing.bus import Bus, Envelope
from services.common.heartbeats import HeartbeatFeed
from services.common.plans import PlanFollower
from services.common.service import STATUS_ITEMS, Service, cancel_all, wait_event

from .high_water import HighWaterRecord

tracer = trace.get_tracer("ceaseless")
MAX_SOURCES = 8  # sources one recipient stripes over
MEMBER_WAIT = 10.0  # every member's heartbeat of a new generation is waited for this long
STATE_WAIT = 30.0   # ... and a live member this long (with no reporter: until one reports)


@dataclass
class Committed:
    generation: int
    step: int
    digest: str
    rank: int | None
    ts: float  # wall clock of the last heartbeat
    pending: int | None = None  # Heartbeat.pending_step (sharded: a step it can finish)


def decide_transfer(plan: Plan, reported: dict[int, tuple[int, str]], high_water: int,
                    incident: str | None = None, pending: dict[int, int] | None = None
                    ) -> Transfer | StateLost | None:
    """Pure: the transfer (or state_lost) for ``plan`` given each reporting member's
    ``rank -> (step, digest)``. None if nobody reported. ``pending``: sharded members' steps
    they can finish (``Heartbeat.pending_step``)."""
    if not reported:
        return None
    if plan.shard_size > 1:
        return _decide_sharded(plan, reported, high_water, incident, pending or {})
    steps = {r: s for r, (s, _) in sorted(reported.items())}
    restore = max(steps.values())
    ranks = sorted(m.rank for m in plan.members)
    if plan.generation == 1 and restore >= 0:
        # The job's first generation with committed state: the scripts restored their own
        # checkpoint (``s.steps(total, start=...)``). As at step -1, every rank starts from
        # rank 0's state, whatever the others loaded (a script that loads on rank 0 only);
        # members that hold the same step and digest need nothing.
        source = 0 if 0 in reported else min(reported)
        restore, digest = reported[source]
        sources = [r for r in sorted(reported) if reported[r] == (restore, digest)]
    elif restore == -1:
        if high_water >= 0:
            return StateLost(
                generation=plan.generation, incident=incident, best_step=-1,
                reason=(f"no member of generation {plan.generation} holds committed state "
                        f"(all at step -1) but step {high_water} was committed before: the "
                        "state died with the previous members; restart from a checkpoint or "
                        "from scratch"))
        source = 0 if 0 in reported else min(reported)
        sources, digest = [source], reported[source][1]
    else:
        top = [r for r in sorted(reported) if reported[r][0] == restore]
        digest = _majority(top, reported)
        sources = [r for r in top if reported[r][1] == digest]
    plan_sources = _stripe([r for r in ranks if r not in sources], sources)
    return Transfer(generation=plan.generation, restore_step=restore, sources=plan_sources,
                    steps=steps, digest=digest, incident=incident)


def _majority(top: list[int], reported: dict[int, tuple[int, str]]) -> str:
    """The digest most of ``top`` hold; ties: the lowest rank's digest wins."""
    votes = Counter(reported[r][1] for r in top)
    return max(votes, key=lambda d: (votes[d], -min(r for r in top if reported[r][1] == d)))


def _stripe(recipients: list[int], sources: list[int]) -> dict[int, list[int]]:
    """Each recipient stripes over up to MAX_SOURCES of the sources, rotated so that the
    recipients spread over every source. Not all of them: a transfer naming every source for
    every recipient grows as recipients x sources (over NATS' 1 MB at ~700 x 700 ranks)."""
    n = len(sources)
    k = min(n, MAX_SOURCES)
    return {r: [sources[(i + j) % n] for j in range(k)] for i, r in enumerate(recipients)}


def _decide_sharded(plan: Plan, reported: dict[int, tuple[int, str]], high_water: int,
                    incident: str | None, pending: dict[int, int]) -> Transfer | StateLost:
    """``decide_transfer`` for a sharded plan (k = ``plan.shard_size`` > 1, issue 21): rank
    ``r`` holds shard ``r % k``, so the decision is made per shard position ``i``.

    ``restore_step`` is the highest committed step over all reporters. For every position
    the sources are the reporters at that position holding ``restore_step`` with that
    position's majority digest; a recipient at position ``i`` gets only sources of position
    ``i`` (striped over up to MAX_SOURCES, rotated). A position without a reporter at
    ``restore_step`` means that shard of the state is gone: ``StateLost`` naming it.
    Generation 1 at step -1: position ``i``'s source is rank ``i`` (replica 0), else the
    lowest reporting rank at that position. Generation 1 with a restored step: per position,
    the same source and the reporters there holding its step and digest (every position's
    source must hold the same step: one checkpoint). ``Transfer.digest`` is position 0's
    (informational: every position has its own).

    A step commits on each rank on its own, after the step's last collective (the world's
    loss sum): a fault during it can leave one position's members at ``restore_step`` and
    another's one step behind, every copy of the step before overwritten. Those behind hold
    the step's gradients fully summed (``pending``, reported as ``restore_step``): they
    finish the step at the handoff (``agent/rollforward.py``) and are that position's
    sources; ``Transfer.steps`` shows them one step behind, which is how every member knows."""
    k = plan.shard_size
    g = plan.generation
    steps = {r: s for r, (s, _) in sorted(reported.items())}
    restore = max(steps.values())
    at: dict[int, list[int]] = {i: [] for i in range(k)}
    for r in sorted(reported):
        at[r % k].append(r)

    def lost(reason: str) -> StateLost:
        return StateLost(generation=g, incident=incident, best_step=restore,
                         reason=reason + f" (shard size {k}, generation {g})")

    if restore == -1 and high_water >= 0:
        return StateLost(
            generation=g, incident=incident, best_step=-1,
            reason=(f"no member of generation {g} holds committed state (all at step -1) but "
                    f"step {high_water} was committed before: the state died with the previous "
                    "members; restart from a checkpoint or from scratch"))
    sources: dict[int, list[int]] = {}
    digests: dict[int, str] = {}
    for i in range(k):
        if not at[i]:
            return lost(f"no replica holds shard {i} at step {restore}: no member at shard "
                        f"position {i} reported")
        if g == 1 or restore == -1:
            # the first generation (or nothing committed yet): replica 0's shard, as rank 0
            # is the source unsharded; members holding the same step and digest need nothing
            src = i if i in reported else at[i][0]
            first = sources[0][0] if i else src
            if reported[src][0] != reported[first][0]:
                return lost(f"shard {i} (rank {src}) holds step {reported[src][0]} but shard 0 "
                            f"(rank {first}) holds step {reported[first][0]}: the shards were "
                            "not restored from one checkpoint")
            if restore == -1:
                sources[i], digests[i] = [src], reported[src][1]
            else:
                sources[i] = [r for r in at[i] if reported[r] == reported[src]]
                digests[i] = reported[src][1]
            continue
        top = [r for r in at[i] if reported[r][0] == restore]
        if not top:
            # members that finish the step at the handoff (see above), one is enough; the
            # digest they will hold is not known yet
            roll = [r for r in at[i] if pending.get(r) == restore
                    and reported[r][0] == restore - 1]
            if roll:
                sources[i], digests[i] = roll, ""
                continue
            best = max(reported[r][0] for r in at[i])
            return lost(f"no replica holds shard {i} at step {restore} (the members at shard "
                        f"position {i} hold step {best} at most)")
        digests[i] = _majority(top, reported)
        sources[i] = [r for r in top if reported[r][1] == digests[i]]
    restore_step = restore if g > 1 and restore >= 0 else reported[sources[0][0]][0]
    plan_sources: dict[int, list[int]] = {}
    for i in range(k):
        src = set(sources[i])
        recipients = [m.rank for m in sorted(plan.members, key=lambda m: m.rank)
                      if m.rank % k == i and m.rank not in src]
        plan_sources.update(_stripe(recipients, sources[i]))
    return Transfer(generation=g, restore_step=restore_step,
                    sources=dict(sorted(plan_sources.items())), steps=steps, digest=digests[0],
                    incident=incident)


class StateBroker(Service):
    name = "state_broker"
    description = "committed state per pod -> transfer plans"

    def __init__(self, bus: Bus, *, member_wait: float = MEMBER_WAIT,
                 state_wait: float = STATE_WAIT, live_s: float = 2.0,
                 instance_id: str | None = None, lease_ttl: float | None = None) -> None:
        if not (0 < member_wait <= state_wait):
            raise ValueError("member_wait must be positive and at most state_wait")
        super().__init__(bus, instance_id=instance_id, lease_ttl=lease_ttl)
        self.member_wait = member_wait
        self.state_wait = state_wait
        self.live_s = live_s
        self.plans = PlanFollower(bus, self.log, on_change=self._on_plan)
        self.pods: dict[str, Committed] = {}
        # the highest step a member committed, in memory and in KV (read before any plan)
        self.record = HighWaterRecord(bus, self.log)
        self.handled_generation = 0
        self.last_result: dict[str, Any] | None = None
        self._task: asyncio.Task | None = None
        self._task_gen = 0
        self._changed = asyncio.Event()
        self._published: set[int] = set()
        self._unpublished = 0  # a generation decided while a standby: redone on taking over
        self.transfers_published = 0
        self.state_lost_published = 0
        # heartbeats from the monitor's health view, or read directly while there is none
        self.feed = HeartbeatFeed(bus, self.log, self._on_heartbeat, self._on_beats)

    def parts(self) -> list:
        # the stored high water first: the plan follower adopts the KV plan -> _on_plan
        return [self.record, self.feed, self.plans]

    @property
    def high_water(self) -> int:
        return self.record.step

    async def on_start(self) -> None:
        self.log.info("state broker started", generation=self.plans.generation,
                      member_wait=self.member_wait, high_water=self.high_water)

    def on_lease_acquired(self, term: int) -> None:
        """Taking over: the current generation's outcome, unless the job stream holds it
        (the previous broker published it), is decided again from fresh heartbeats."""
        plan = self.plans.plan  # (a decision still in flight publishes at its end)
        if plan is not None and self._unpublished == plan.generation:
            self.spawn(self._take_over(plan))

    async def _take_over(self, plan: Plan) -> None:
        if await self._already_published(plan) or self.plans.generation != plan.generation:
            return
        self.log.info("taking over the generation's transfer", generation=plan.generation,
                      term=self.term)
        self.handled_generation = min(self.handled_generation, plan.generation - 1)
        await self._on_plan(None, plan)

    async def stop(self) -> None:
        if self._task is not None:  # the transfer in flight
            await cancel_all([self._task])
        await super().stop()

    # ------------------------------------------------------------------ inputs
    async def _on_heartbeat(self, hb: Heartbeat, subject: str, age: float = 0.0) -> None:
        cur = self.pods.get(hb.pod)
        if cur is not None and hb.generation < cur.generation:
            self._ignore(subject, f"stale generation {hb.generation} < {cur.generation}",
                         level="debug", pod=hb.pod)
            return
        if cur is None and len(self.pods) >= MAX_PODS:
            self._forget_old()
        self.pods[hb.pod] = Committed(generation=hb.generation, step=hb.step, digest=hb.step_digest,
                                      rank=hb.rank, ts=time.time() - age,
                                      pending=hb.pending_step)
        self._note_step(hb.pod, hb.step, self.plans.plan)
        if cur is None or cur.generation != hb.generation:
            self._changed.set()  # a pod entered a generation: the member wait re-checks

    def _on_beats(self, pods: list[str], gens: list[int], steps: list[int],
                  digests: list[str], ages: list[float]) -> None:
        """The monitor's compact listing: committed steps and liveness of pods known here in
        the same generation (entering a generation comes as a full heartbeat)."""
        now = time.time()
        plan = self.plans.plan
        for pod, g, step, digest, age in zip(pods, gens, steps, digests, ages):
            c = self.pods.get(pod)
            if c is None or c.generation != g or step < c.step:
                continue
            if step != c.step:
                c.pending = None  # it committed again: nothing of before is pending
            c.step, c.digest, c.ts = step, digest, max(c.ts, now - age)
            self._note_step(pod, step, plan)

    def _note_step(self, pod: str, step: int, plan: Plan | None) -> None:
        # the high-water mark counts members only: a stray pod cannot invent progress
        if step > self.record.step and plan is not None and plan.rank_of(pod) is not None:
            self.record.note(step, plan.generation, pod)

    def _forget_old(self) -> None:
        plan = self.plans.plan
        keep = {m.pod for m in plan.members} if plan else set()
        for pod in sorted((p for p in self.pods if p not in keep),
                          key=lambda p: self.pods[p].ts)[: len(self.pods) // 4 + 1]:
            del self.pods[pod]

    async def _on_plan(self, old: Plan | None, new: Plan) -> None:
        if new.generation <= self.handled_generation:
            return
        if old is None and await self._already_published(new):
            self.handled_generation = max(self.handled_generation, new.generation)
            self.log.info("transfer of the current generation already published",
                          generation=new.generation)
            return
        if self.plans.generation != new.generation:
            return  # a newer plan arrived while we looked at the stream
        if self._task is not None and not self._task.done():
            self.log.info("generation superseded before its transfer", generation=self._task_gen,
                          by=new.generation)
            self._task.cancel()
        self._task_gen = new.generation
        self._task = asyncio.create_task(self._handle(new))

    async def _already_published(self, plan: Plan) -> bool:
        """After a restart: does the job stream already hold this plan's outcome? (Same
        generation and not older than the plan, so a previous run of the job does not count.)"""
        s = self.bus.subjects
        for subject in (s.transfer, s.state_lost):
            try:
                msg = await self.bus.js.get_last_msg(s.stream, subject)
                obj = json.loads(msg.data)
                ours = (msg.headers or {}).get("Nats-Msg-Id", "").startswith(
                    f"{subject.rsplit('.', 1)[-1]}-g")
                if ours and obj.get("generation") == plan.generation and \
                        float(obj.get("ts", 0)) >= plan.ts:
                    return True
            except Exception:
                continue
        return False

    # ------------------------------------------------------------------ one generation
    def _reported(self, plan: Plan) -> tuple[dict[int, tuple[int, str]], list[str]]:
        got, missing = {}, []
        for m in plan.members:
            c = self.pods.get(m.pod)
            if c is not None and c.generation == plan.generation:
                got[m.rank] = (c.step, c.digest)
            else:
                missing.append(m.pod)
        return got, missing

    def _pending(self, plan: Plan) -> dict[int, int]:
        """Members' steps they can finish (``Heartbeat.pending_step``), this generation's."""
        out = {}
        for m in plan.members:
            c = self.pods.get(m.pod)
            if c is not None and c.generation == plan.generation and c.pending is not None:
                out[m.rank] = c.pending
        return out

    def _alive_missing(self, plan: Plan) -> list[str]:
        """Members that have not reported the generation but are alive (a heartbeat of an
        older generation, or of none yet, within ``live_s``): see the module doc."""
        now = time.time()
        out = []
        for m in plan.members:
            c = self.pods.get(m.pod)
            if c is not None and c.generation < plan.generation and now - c.ts <= self.live_s:
                out.append(m.pod)
        return out

    async def _handle(self, plan: Plan) -> None:
        try:
            await self._handle_generation(plan)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.exception("transfer planning failed", generation=plan.generation,
                               error=str(e)[:200])

    async def _handle_generation(self, plan: Plan) -> None:
        g = plan.generation
        t0 = time.monotonic()
        deadline = t0 + self.member_wait
        extended = False
        while True:
            reported, missing = self._reported(plan)
            if not missing:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                alive = self._alive_missing(plan)
                if not reported or (alive and time.monotonic() - t0 < self.state_wait):
                    if not extended:
                        extended = True
                        self.log.warning("members alive have not reported the generation; "
                                         "waiting for them", generation=g, alive=alive,
                                         missing=missing, reported=len(reported),
                                         up_to=self.state_wait if reported else None)
                    left = 0.25 if not reported else \
                        min(0.25, t0 + self.state_wait - time.monotonic())
                else:
                    self.log.warning("members did not report the generation in time",
                                     generation=g, missing=missing,
                                     waited=round(time.monotonic() - t0, 3))
                    break
            self._changed.clear()
            await wait_event(self._changed, left)
        if self.plans.generation != g:
            return  # superseded while waiting
        result = decide_transfer(plan, reported, self.high_water, plan.incident,
                                 self._pending(plan))
        self.handled_generation = max(self.handled_generation, g)
        if result is None:
            self.log.error("no member reported the generation; no transfer", generation=g)
            self.last_result = {"generation": g, "kind": "none", "missing": missing}
            return
        for attempt in range(3):
            try:
                await self._publish(plan, result, missing)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self._published.discard(g)
                self.log.warning("publishing the transfer failed", generation=g,
                                 attempt=attempt + 1, error=str(e)[:200])
                await asyncio.sleep(0.2)

    async def _publish(self, plan: Plan, result: Transfer | StateLost, missing: list[str]) -> None:
        g = plan.generation
        if g in self._published:
            return
        term = self.term
        if term is None:  # a standby: the active broker publishes (or we, on taking over)
            self._unpublished = g
            self.log.info("standby: transfer not published", generation=g)
            return
        self._published.add(g)
        # stamped with this broker's term: an agent takes the newest broker's transfer of a
        # generation, and the message ids of two terms differ (no deduplication between them);
        # and with the plan's identity: an agent ignores one decided for another plan
        result = result.model_copy(update={"term": term, "plan_ts": plan.ts})
        parent: otel_context.Context | None = self.plans.contexts.get(g)
        attrs = {"ceaseless.job": self.bus.subjects.job, "ceaseless.generation": g,
                 "ceaseless.world_size": plan.world_size}
        if plan.incident:
            attrs["ceaseless.incident"] = plan.incident
        s = self.bus.subjects
        with tracer.start_as_current_span("transfer_plan", context=parent,
                                          attributes=attrs) as span:
            ctx = trace.set_span_in_context(span)
            if isinstance(result, StateLost):
                span.set_attribute("ceaseless.reason", result.reason[:512])
                span.set_attribute("ceaseless.restore_step", -1)
                self.log.error("state lost", generation=g, reason=result.reason,
                               high_water=self.high_water)
                self.last_result = {"generation": g, "kind": "state_lost",
                                    "reason": result.reason, "missing": missing}
                await self.bus.publish(s.state_lost, result, msg_id=f"state_lost-g{g}-t{term}",
                                       ctx=ctx)
                self.state_lost_published += 1
                return
            span.set_attribute("ceaseless.restore_step", result.restore_step)
            n_src = len(set().union(*result.sources.values())) if result.sources else 0
            span.set_attribute("ceaseless.reason",
                               f"{len(result.sources)} recipient(s) from {n_src} source(s)")
            self.last_result = {
                "generation": g, "kind": "transfer", "restore_step": result.restore_step,
                "sources": {r: v for r, v in result.sources.items()}, "steps": result.steps,
                "digest": result.digest, "missing": missing, "ts": result.ts}
            self.log.info("transfer plan", generation=g, restore_step=result.restore_step,
                          sources=result.sources, steps=result.steps, missing=missing or None)
            await self.bus.publish(s.transfer, result, msg_id=f"transfer-g{g}-t{term}", ctx=ctx)
            self.transfers_published += 1
        for old in [x for x in self._published if x < g - 16]:
            self._published.discard(old)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        plan = self.plans.plan
        members = {m.pod: m.rank for m in plan.members} if plan else {}
        return {
            "generation": self.plans.generation,
            "handled_generation": self.handled_generation,
            "waiting_for": (None if self._task is None or self._task.done()
                            else {"generation": self._task_gen,
                                  "missing": (self._reported(plan)[1][:STATUS_ITEMS]
                                              if plan else [])}),
            "high_water": self.high_water,
            "high_water_kv": self.record.status(),
            "heartbeats_from": self.feed.source,
            "pods": self.listed(((p, {"rank": members.get(p, c.rank), "member": p in members,
                                      "gen": c.generation, "step": c.step,
                                      "digest": c.digest[:16],
                                      "age": round(time.time() - c.ts, 3)})
                                 for p, c in sorted(self.pods.items())), len(self.pods)),
            "pods_total": len(self.pods),
            "last_transfer": self.last_result,
            "transfers_published": self.transfers_published,
            "state_lost_published": self.state_lost_published,
            "ignored": dict(self.ignored),
        }
