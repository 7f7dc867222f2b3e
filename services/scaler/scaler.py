"""The scaler: the only writer of membership plans.

* Lease ``scaler_lease`` in the job's KV bucket (services/common/lease.py: ``{holder,
  expires, term}``, renewed every ``lease_ttl / 3``). Only the holder acts; a standby tracks
  heartbeats and faults and keeps trying; the plans it writes carry its term.
* The plan lives in KV key ``plan``. It advances only by compare-and-set on the revision
  the decision was based on (the first plan by create) and is published on the ``plan``
  subject only after the write succeeded. A lost race reloads the plan and decides again,
  so two scalers can never produce two different plans of one generation.
* Decisions are pure functions in ``policy``; this module does I/O, timing and tracing.
* No hidden state: the plan is in KV; liveness is rebuilt from heartbeats. After a (re)start
  members of the stored plan that stay silent for the grace period are handled as faulted.
* Elastic scaling: capacity and priority requests change the target replica count (KV key
  ``scale``, with the releases still waiting for their slots); the tick loop moves the
  world size toward it with planned transitions (``Plan.apply_step``: members switch at a
  step boundary, no abort, no lost step), one transition at a time, faults first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
import uuid
from dataclasses import dataclass
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from opentelemetry import context as otel_context
from opentelemetry import trace

from schemas.timeouts import DEFAULTS, VIEW_INTERVAL
from schemas import PLAN_KEY
from schemas.policy import (DEPARTURES_KEY, SCALE_KEY, SCRIPT_KEY, Departure, Departures,
                            PendingRelease, ScaleState, ScalingPolicy,
                            ScriptInfo)
from schemas.messages import (ActuatorAction, ActuatorCommand, ActuatorReply, AgentState,
                              Capacity, CapacityChange, Decision, Fault, FaultKind, Heartbeat,
                              JobFailed, Lifecycle, LifecycleEvent, Plan, Priority, Report, ReportKind,
                              Role)
from plumbing import telemetry
from plumbing.bounded import BoundedSet
from plumbing.bus import Bus, Envelope, watch_key
from services.common.heartbeats import HeartbeatFeed
from plumbing.terms import NewestTerm
from services.common.lease import LeaseState
from services.common.plans import PlanFollower
from services.common.service import Service, wait_event

from . import policy
from .policy import PolicyConfig, Wait
from .replay import Inherited, inherit

tracer = trace.get_tracer("ceaseless")
GONE_STATES = (AgentState.done, AgentState.leaving)
MAX_TRACKED = 16384
ELASTIC_PERIOD_S = 0.25  # the elastic pass when nothing kicked it (it scans every pod)
START_TIMEOUT = 30.0  # wait this long for the desired workers, then start with >= min_replicas
FENCE_TIMEOUT = 0.5   # the actuator kill request (best effort)


@dataclass
class PodSeen:
    role: Role
    generation: int
    state: AgentState
    rank: int | None
    last: float  # monotonic time of the last heartbeat
    step: int = -1
    step_time: float | None = None  # the agent's median, or estimated from the view's steps
    since: float = 0.0  # monotonic time this generation was first heard of


@dataclass
class Pending:
    """A member fault not yet turned into a plan."""

    pod: str
    incident: str
    kind: str
    ctx: otel_context.Context | None
    since: float


class Scaler(Service):
    name = "scaler"
    description = "single writer of membership plans (faults, capacity, priority)"
    warm_up = 1.0  # fault timeouts a started scaler listens before it replays faults

    def __init__(self, bus: Bus, *, workers: int = 2, min_replicas: int = 1,
                 max_replicas: int = 64, global_batch_size: int = 64, micro_batch_size: int = 8,
                 lease_ttl: float | None = None, start_timeout: float = START_TIMEOUT,
                 fault_timeout: float = DEFAULTS["fault_timeout"],
                 fence_timeout: float = FENCE_TIMEOUT, tick_interval: float = 0.05,
                 scaler_id: str | None = None, policy: ScalingPolicy | None = None,
                 actuator_timeout: float = 5.0, shard_size: int = 1,
                 batch_from_script: bool = False, instance_id: str | None = None) -> None:
        super().__init__(bus, instance_id=scaler_id or instance_id or
                         f"scaler-{uuid.uuid4().hex[:8]}",
                         lease_ttl=lease_ttl)
        # shard_size k > 1 (issue 21): ``workers`` counts ranks, every replica count (target,
        # min/max_replicas, request counts) counts replicas of k ranks (plan.replicas).
        if policy is None:
            self.cfg = PolicyConfig(workers=workers, min_replicas=min_replicas,
                                    max_replicas=max_replicas,
                                    global_batch_size=global_batch_size,
                                    micro_batch_size=micro_batch_size, shard_size=shard_size)
        else:
            self.cfg = PolicyConfig.from_policy(policy, workers=workers,
                                                global_batch_size=global_batch_size,
                                                micro_batch_size=micro_batch_size,
                                                shard_size=shard_size)
        self.actuator_timeout = actuator_timeout
        # No batch given by the operator: the global/micro batch above is a placeholder for
        # the first plan; the script's own (KV ``script``, rank 0 at its first step) sizes
        # every plan made after it arrives (shares, the largest replica count).
        self.batch_from_script = batch_from_script
        self.script: ScriptInfo | None = None
        self.scale: ScaleState | None = None   # cache of KV ``scale``
        self.scale_revision: int | None = None
        self.start_timeout = start_timeout
        self.fault_timeout = fault_timeout
        self.fence_timeout = fence_timeout
        self.tick_interval = tick_interval
        self.scaler_id = self.instance_id
        self.log = self.log.bind(scaler_id=self.scaler_id)
        self.plans = PlanFollower(bus, self.log, poll_interval=1.0)
        self.kv: Any = None
        # the monitor's verdict that the failure is the script's: no plan after it (a
        # promoted spare would meet the same bug while the launcher stops the job)
        self.job_failed: JobFailed | None = None
        # the newest health monitor term seen: a deposed monitor's faults are ignored
        self.monitor_term = NewestTerm("health_monitor")
        self.replayed = 0  # faults read back from the job stream on taking the lease
        self._replaying = False  # the lease was just taken: faults being read back
        self._listening_since = time.monotonic()  # its view of the pods is built from here
        self.t0 = time.monotonic()
        # lease (Service, services/common/lease.py): only its holder acts; a standby tracks
        # heartbeats and faults
        self.holder_since: float | None = None
        self._reconciled = False
        # liveness, rebuilt from heartbeats / lifecycle
        self.pods: dict[str, PodSeen] = {}
        self.dead = BoundedSet(MAX_TRACKED)       # faulted or exited non-zero: never used again
        self.dropped = BoundedSet(MAX_TRACKED)    # declared faulted while not a member
        self._dropped_n = 0                       # how many were ever added to dropped
        self._dead_checked: tuple = ()            # (plan generation, _dropped_n) last seen
        self.done = BoundedSet(MAX_TRACKED)       # exited 0
        self.pending: dict[str, Pending] = {}
        # members to plan out at a step boundary: pod -> (why, the fault's incident or None):
        # a preemption notice ("preempted"), a straggler ("straggler")
        self.preempting: dict[str, tuple[str, str | None]] = {}
        # stragglers without a spare: (slowness, incident), their share cut at a boundary
        self.sharing: dict[str, tuple[float, str]] = {}
        # both kept in KV ``departures``: read once per lease term, written when they change
        self._departures_loaded = False
        self._departures_saved: Departures | None = None
        self.waiting: str = ""       # why the last decision was Wait
        self.fence_requested = BoundedSet(MAX_TRACKED)
        self._dead_logged = BoundedSet(MAX_TRACKED)
        self.plans_written = 0
        self.cas_conflicts = 0
        self.ignored: dict[str, int] = {}
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._last_wait_log = ""
        self._last_elastic = 0.0
        self._elastic_due = False
        # heartbeats from the monitor's health view, or read directly while there is none
        self.feed = HeartbeatFeed(bus, self.log, self._on_heartbeat, self._on_beats)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.kv = await self.bus.kv()
        await super().start()

    def parts(self) -> list:
        return [self.plans, self.feed]

    def subscriptions(self) -> list:
        s = self.bus.subjects
        return [(s.lifecycle(), Lifecycle, self._on_lifecycle), (s.fault, Fault, self._on_fault),
                (s.report(), Report, self._on_report),
                (s.capacity, Capacity, self._on_capacity),
                (s.priority, Priority, self._on_priority),
                (s.job_failed, JobFailed, self._on_job_failed)]

    async def _on_job_failed(self, m: JobFailed, env: Envelope) -> None:
        if self.monitor_term.stale(m.term, "job_failed"):
            self._ignore(env.subject, "job_failed of a deposed monitor (older term)")
            return
        if self.job_failed is None:
            self.job_failed = m
            self.log.warning("the job failed (the script's bug): no more plans",
                             kind=m.kind.value, step=m.step, pods=m.pods)

    async def on_start(self) -> None:
        self.t0 = time.monotonic()
        self.spawn(self._tick_loop())
        # the script's batch (with --batch-from-script) and a DDP script's fixed world size
        self.spawn(self._watch_script())
        self.log.info("scaler started", generation=self.plans.generation,
                      workers=self.cfg.workers, min_replicas=self.cfg.min_replicas,
                      shard_size=self.cfg.shard_size)

    # ------------------------------------------------------------------ lease
    def on_lease_acquired(self, term: int) -> None:
        self.holder_since = time.monotonic()
        self._reconciled = False
        self._departures_loaded = False
        self._replaying = True  # no decision before the faults are read back
        self.spawn(self._replay_faults(term))
        self._kick.set()

    async def _replay_faults(self, term: int) -> None:
        """Taking the lease: what the previous holder knew, read back from the job stream
        (a standby started after it, or a restart, never heard it): the faults since the
        current plan, the dead pods and dropped spares, the script's failure. The tick
        decides nothing in this term before they are in."""
        # A scaler that just started (a restart in place takes its own lease back at once)
        # has heard no heartbeat yet: it listens a fault timeout first, or a replayed fault
        # finds "no live spare" and shrinks the job while the spare is alive
        await asyncio.sleep(max(0.0, self._listening_since + self.warm_up * self.fault_timeout
                                - time.monotonic()))
        plan, got = self.plans.plan, Inherited()
        try:
            if plan is not None:
                got = await inherit(self.bus, plan, self.log)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no stream (yet): the monitor's next declarations count
            self.log.warning("faults not replayed", error=str(e)[:200])
        async with self._lock:
            self._inherit(got)
            for f, env in got.unplanned:
                self.monitor_term.note(f.term)
                try:
                    await self._fault(f, env)
                except Exception as e:  # one bad fault must not block the term
                    self.log.warning("replayed fault not handled", pod=f.pod,
                                     error=str(e)[:200])
            self._replaying = False
        self.replayed += len(got.unplanned)
        if got.unplanned or got.dropped or got.dead:
            self.log.info("faults replayed", term=term, faults=len(got.unplanned),
                          dropped=len(got.dropped), dead=len(got.dead),
                          generation=plan.generation if plan else None,
                          pending=sorted(self.pending))
        self._kick.set()

    def _inherit(self, got: Inherited) -> None:
        """The dead pods and dropped spares read back (under the lock): never planned with
        again; a dropped spare the current plan made a member is faulted at the next tick
        (``_dead_members``)."""
        for pod in got.dead:
            self.dead.add(pod)
        for pod in got.dropped:
            self.dead.add(pod)
            if pod not in self.dropped:
                self.dropped.add(pod)
                self._dropped_n += 1
            self.pods.pop(pod, None)
        if got.job_failed is not None and self.job_failed is None:
            self.job_failed = got.job_failed
            self.log.warning("the job failed (the script's bug), read back: no more plans",
                             kind=got.job_failed.kind.value, step=got.job_failed.step)

    def on_lease_lost(self, holder: str | None) -> None:
        self.holder_since = None

    @property
    def holder(self) -> bool:
        return self.lease.state is LeaseState.ACTIVE

    @property
    def lease_holder(self) -> str | None:
        return self.lease.holder

    # ------------------------------------------------------------------ inputs
    def _ignore(self, subject: str, reason: str, level: str = "info", **kw: Any) -> None:
        key = reason.split(":")[0][:60]
        self.ignored[key] = self.ignored.get(key, 0) + 1
        getattr(self.log, level)("ignored message", subject=subject, reason=reason, **kw)

    async def _on_heartbeat(self, hb: Heartbeat, subject: str, age: float = 0.0) -> None:
        seen = self.pods.get(hb.pod)
        if hb.pod in self.dead:
            if hb.pod not in self._dead_logged:  # it heartbeats until killed: log once
                self._dead_logged.add(hb.pod)
                self._ignore(subject, "heartbeat of a faulted pod", pod=hb.pod)
            return
        if seen is not None and hb.generation < seen.generation:
            self._ignore(subject, f"stale generation {hb.generation} < {seen.generation}",
                         level="debug", pod=hb.pod)
            return
        # a pod appeared (capacity may now suffice) or entered a generation / changed state
        # (a transition in flight may be complete): decide now
        new = (seen is None or now_alive(seen, self.fault_timeout) is False
               or seen.generation != hb.generation or seen.state != hb.state)
        if seen is None and len(self.pods) >= MAX_TRACKED:
            self._forget_silent()
        same = seen is not None and seen.generation == hb.generation
        last = time.monotonic() - age
        self.pods[hb.pod] = PodSeen(role=hb.role, generation=hb.generation, state=hb.state,
                                    rank=hb.rank, last=last, step=hb.step,
                                    step_time=hb.step_time or (seen.step_time if same else None),
                                    since=seen.since if same else last)
        if new:
            self._kick.set()

    def _on_beats(self, pods: list[str], gens: list[int], steps: list[int],
                  digests: list[str], ages: list[float]) -> None:
        """The monitor's compact listing: liveness and steps of pods already known here (a
        pod in another generation waits for its full heartbeat)."""
        now, ft, kick = time.monotonic(), self.fault_timeout, False
        for pod, g, step, age in zip(pods, gens, steps, ages):
            seen = self.pods.get(pod)
            if seen is None or seen.generation != g or step < seen.step:
                continue
            last = now - age
            if last > seen.last:
                kick = kick or now - seen.last > ft  # silent until now: alive again
                if seen.step_time is None and step > seen.step >= 0:
                    # full heartbeats (with the agent's step time) come seldom in the view
                    seen.step_time = (last - seen.last) / (step - seen.step)
                seen.last, seen.step = last, step
        if kick:
            self._kick.set()

    def _forget_silent(self) -> None:
        now = time.monotonic()
        for pod in [p for p, s in self.pods.items() if now - s.last > 10 * self.fault_timeout]:
            del self.pods[pod]

    async def _on_lifecycle(self, ev: Lifecycle, env: Envelope) -> None:
        if ev.event != LifecycleEvent.exited:
            return
        seen = self.pods.pop(ev.pod, None)
        if ev.exit_code == 0 or (seen is not None and seen.state == AgentState.done):
            # (a non-zero exit after the pod said it was done is its script's failure after
            # the loop, not a fault: nothing to plan, as the health monitor decides too)
            self.done.add(ev.pod)
        else:
            self.dead.add(ev.pod)  # the health monitor's fault triggers the plan
        self.log.info("pod exited", pod=ev.pod, exit_code=ev.exit_code)

    async def _on_report(self, r: Report, env: Envelope) -> None:
        """A preemption notice (the agents' other reports are the health monitor's)."""
        if r.report != ReportKind.preempted:
            return
        plan = self.plans.plan
        if plan is None or plan.rank_of(r.pod) is None or r.pod in self.pending:
            self._ignore(env.subject, "preemption notice of a pod that is not a live member",
                         pod=r.pod)
            return
        # In memory only: a notice outlives no deadline (seconds), and a scaler restarted
        # meanwhile lets the pod leave as a crash, which is recovered like any.
        self.preempting[r.pod] = ("preempted", None)
        self.log.info("preemption notice: planning its departure", pod=r.pod,
                      detail=r.error[:200])
        self._kick.set()

    def _departures_now(self) -> Departures:
        return Departures(
            leaving=[Departure(pod=p, why=w, incident=i)
                     for p, (w, i) in sorted(self.preempting.items())],
            sharing=[Departure(pod=p, why="straggler", incident=i, slowness=max(1.0, r))
                     for p, (r, i) in sorted(self.sharing.items())])

    async def _sync_departures(self) -> None:
        """KV ``departures``: read once per lease term (a restarted scaler goes on with the
        notices the last one had not planned yet), written when they change."""
        if not self._departures_loaded:
            self._departures_loaded = True
            try:
                entry = await self.kv.get(DEPARTURES_KEY)
                stored = (Departures.model_validate_json(entry.value) if entry.value
                          else Departures())
            except (KeyNotFoundError, NotFoundError):
                stored = Departures()
            except ValueError as e:
                self.log.error("KV departures do not validate; ignoring them",
                               error=str(e)[:300])
                stored = Departures()
            for d in stored.leaving:
                self.preempting.setdefault(d.pod, (d.why, d.incident))
            for d in stored.sharing:
                self.sharing.setdefault(d.pod, (d.slowness or 1.0, d.incident or ""))
            if stored.leaving or stored.sharing:
                self.log.info("notices taken over from KV", leaving=len(stored.leaving),
                              sharing=len(stored.sharing))
            self._departures_saved = stored
        now = self._departures_now()
        if now != self._departures_saved:
            try:
                await self.kv.put(DEPARTURES_KEY, now.model_dump_json().encode())
            except Exception as e:  # kept in memory; written again at the next decision
                self.log.warning("could not write KV departures", error=str(e)[:200])
                return
            self._departures_saved = now

    async def _share_out(self, plan: Plan, now: float) -> None:
        """A straggler without a spare: a plan with its share cut, at a step boundary."""
        for pod in [p for p in self.sharing if plan.rank_of(p) is None]:
            del self.sharing[pod]
        if not self.sharing or self._not_entered(plan):
            return
        apply = self._apply_step(plan, now)
        if apply is None:
            self._note_wait("sharing out a straggler's micro-batches: waiting for the "
                            "members' step time")
            self._kick_later(VIEW_INTERVAL)
            return
        pod = sorted(self.sharing)[0]
        ratio, incident = self.sharing.pop(pod)
        d = policy.share_out(plan, pod, ratio, apply, incident=incident)
        if isinstance(d, Wait):
            self._note_wait(f"straggler {pod}: {d.reason}")
        elif d is not None:
            await self._commit(d, self.plans.revision, [])

    async def _preemptions(self, plan: Plan, now: float) -> None:
        """Members that gave notice leave at the next step boundary: a planned plan."""
        for pod in [p for p in self.preempting if plan.rank_of(p) is None]:
            del self.preempting[pod]  # gone (planned, or failed meanwhile)
        if not self.preempting or self._not_entered(plan):
            return  # nothing to do, or a transition is in flight: after it
        apply = self._apply_step(plan, now)
        if apply is None:
            self._note_wait("placing a departure: waiting for the members' step time")
            self._kick_later(VIEW_INTERVAL)
            return
        pods = sorted(self.preempting)
        why, incident = self.preempting[pods[0]]
        d = policy.on_preempt(plan, pods, self.alive_spares(plan, now), self.cfg, apply,
                              incident=incident or f"preempt-{pods[0]}-g{plan.generation + 1}",
                              why=why)
        if d is None:
            self.preempting.clear()
        elif isinstance(d, Wait):
            self._note_wait(f"preempted {pods}: {d.reason}")
        else:
            await self._commit(d, self.plans.revision, [])

    async def _on_fault(self, f: Fault, env: Envelope) -> None:
        if self.monitor_term.stale(f.term, "fault"):
            self._ignore(env.subject, f"fault of monitor term {f.term} < "
                         f"{self.monitor_term.term}: a deposed monitor's", pod=f.pod,
                         incident=f.incident)
            return
        await self._fault(f, env)

    async def _fault(self, f: Fault, env: Envelope) -> None:
        """A fault, live or replayed (a replayed one was true when its monitor declared it:
        no term check)."""
        plan = self.plans.plan
        if plan is not None and f.generation > plan.generation:
            await self.plans.refresh()
            plan = self.plans.plan
        if plan is None:
            self.dead.add(f.pod)
            self.pods.pop(f.pod, None)
            self._ignore(env.subject, "fault before the first plan: pod dropped", pod=f.pod,
                         incident=f.incident)
            return
        if f.generation > plan.generation:
            self._ignore(env.subject, f"fault of future generation {f.generation} > "
                         f"{plan.generation}", level="warning", pod=f.pod, incident=f.incident)
            return
        if f.pod in plan.fenced or f.pod in self.pending:
            self._ignore(env.subject, "already handled", pod=f.pod, incident=f.incident)
            return
        if f.kind == FaultKind.straggler:  # alive: swapped at a step boundary, if a spare can
            if plan.rank_of(f.pod) is not None and f.pod not in self.preempting and \
                    self.alive_spares(plan, time.monotonic()):
                self.preempting[f.pod] = ("straggler", f.incident)
                self.log.info("straggler: planning its swap for a spare", pod=f.pod,
                              incident=f.incident, reason=f.reason[:200])
                self._kick.set()
            elif self.script is not None and self.script.fixed_world_size is not None:
                # a DDP drop-in script splits its micro-batches itself: a plan's shares
                # would not reach it
                self._ignore(env.subject, "straggler without a live spare in a drop-in job "
                             "(the script splits its own micro-batches)", pod=f.pod,
                             incident=f.incident)
            elif plan.rank_of(f.pod) is not None and f.slowness:
                # no spare: its micro-batches are shared out to the others, by the slowness
                # the monitor measured (the heartbeats the scaler sees are too old for it)
                self.sharing[f.pod] = (f.slowness, f.incident)
                self.log.info("straggler without a spare: sharing out its micro-batches",
                              pod=f.pod, ratio=round(f.slowness, 2), incident=f.incident)
                self._kick.set()
            else:
                self._ignore(env.subject, "straggler: no live spare, and no slowness measured "
                             "(an older health monitor)", pod=f.pod, incident=f.incident)
            return
        if plan.rank_of(f.pod) is None:
            self.dead.add(f.pod)
            self.dropped.add(f.pod)
            self._dropped_n += 1
            was_spare = f.pod in self.pods or f.pod in plan.spares
            self.pods.pop(f.pod, None)
            self._ignore(env.subject, "spare dropped from the pool" if was_spare
                         else "not a member", pod=f.pod, incident=f.incident)
            return
        seen = self.pods.get(f.pod)
        if (f.generation < plan.generation and seen is not None
                and seen.generation >= plan.generation
                and time.monotonic() - seen.last <= self.fault_timeout):
            self._ignore(env.subject, f"stale fault: generation {f.generation} but the pod "
                         f"heartbeats generation {seen.generation}", level="warning",
                         pod=f.pod, incident=f.incident)
            return
        self.dead.add(f.pod)
        self.pending[f.pod] = Pending(pod=f.pod, incident=f.incident, kind=f.kind.value,
                                      ctx=env.ctx, since=time.monotonic())
        self.log.info("fault accepted", subject=env.subject, pod=f.pod, incident=f.incident,
                      kind=f.kind.value, generation=plan.generation, acting=self.acting)
        self._kick.set()

    async def _on_capacity(self, msg: Capacity, env: Envelope) -> None:
        why = f" ({msg.reason})" if msg.reason else ""
        if msg.change == CapacityChange.add:
            await self._request(env.subject, msg.request_id,
                                lambda plan, target: policy.on_capacity_add(target, msg.count,
                                                                            self.cfg),
                                start=msg.count * self.cfg.shard_size, why=why)
        else:
            await self._request(env.subject, msg.request_id,
                                lambda plan, target: policy.on_release(
                                    plan.replicas, target, msg.count,
                                    self.alive_spares(plan), self.cfg, what="capacity remove"),
                                release=msg.count, why=why)

    async def _on_priority(self, msg: Priority, env: Envelope) -> None:
        why = f" (priority {msg.priority}{': ' + msg.reason if msg.reason else ''})"
        await self._request(env.subject, msg.request_id,
                            lambda plan, target: policy.on_release(
                                plan.replicas, target, msg.release, self.alive_spares(plan),
                                self.cfg, what="release", pods=msg.pods),
                            release=msg.release, why=why, pods=msg.pods)

    async def _request(self, subject: str, request_id: str, decide: Any, *, start: int = 0,
                       release: int = 0, why: str = "", pods: list[str] | None = None) -> None:
        """One capacity/priority request: the policy decides, the target goes to KV, and
        the requester is answered (accepted with what will happen, or refused with why)."""
        if not self.acting:
            self._ignore(subject, "not the lease holder; the holder answers",
                         request_id=request_id)
            return
        try:
            await self._request_locked(subject, request_id, decide, start=start,
                                       release=release, why=why, pods=pods or [])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the requester always gets an answer
            self.log.exception("request failed", subject=subject, request_id=request_id)
            await self._answer(subject, request_id, False,
                               f"the scaler could not act on it: {type(e).__name__}: "
                               f"{str(e)[:200]}")

    async def _request_locked(self, subject: str, request_id: str, decide: Any, *, start: int,
                              release: int, why: str, pods: list[str]) -> None:
        async with self._lock:
            plan = self.plans.plan
            if plan is None:
                await self._answer(subject, request_id, False, "no plan yet: the job has not "
                                   "started; send the request once it trains")
                return
            await self._load_scale()
            target = self._target(plan)
            d = decide(plan, target)
            if isinstance(d, policy.Refused):
                await self._answer(subject, request_id, False, d.reason + why)
                return
            st = ScaleState(target=d.target, reason=d.reason + why, request_id=request_id,
                            updated=time.time(),
                            releases=list(self.scale.releases) if self.scale else [])
            if release:
                # The idle spares it stops count as leaving until their processes have
                # exited (_stop_spare): the release completes, naming them, only then
                # (issue 41: it answered `completed` with no pod while the spare still ran).
                st.releases.append(PendingRelease(request_id=request_id, count=release,
                                                  since=time.time(), subject=subject,
                                                  pods=list(pods),
                                                  leaving=list(d.stop_spares)))
                for pod in d.stop_spares:  # a stop is on its way: no second one
                    self.fence_requested.add(pod)
            if not await self._store_scale(st):
                await self._answer(subject, request_id, False, "the scale state changed "
                                   "concurrently (another scaler?); send the request again")
                return
        # Outside the lock: the actuator may take seconds (or not exist, as under compose).
        note = ""
        if start:
            pods, err = await self._actuate(ActuatorCommand(
                action=ActuatorAction.start, role=Role.spare, count=start,
                reason=f"capacity add: {request_id}"))
            note = (f"; started {', '.join(pods)} as spare(s)" if not err else
                    f"; no pods started ({err}): start {start} pod(s) with role spare")
        await self._answer(subject, request_id, True, st.reason + note, target=d.target)
        for pod in d.stop_spares:  # outside the lock: a stop waits for the process to exit
            self.spawn(self._stop_spare(pod, request_id))
        self._kick.set()

    async def _answer(self, subject: str, request_id: str, accepted: bool, reason: str,
                      target: int | None = None, completed: bool = False,
                      pods: list[str] | None = None) -> None:
        self.log.info("request " + ("completed" if completed else
                                    "accepted" if accepted else "refused"),
                      subject=subject, request_id=request_id, reason=reason, pods=pods)
        await self.bus.publish(self.bus.subjects.decision, Decision(
            request_id=request_id, accepted=accepted, reason=reason[:2048],
            generation=self.plans.generation or None, target=target, completed=completed,
            pods=pods or []))

    async def _actuate(self, cmd: ActuatorCommand) -> tuple[list[str], str]:
        """A command stamped with this scaler's lease term: the actuator refuses an older
        term than one it has acted on (a deposed scaler's)."""
        term = self.term
        if term is None:
            return [], "not the lease holder"
        try:
            reply = await self.bus.request(self.bus.subjects.actuator,
                                           cmd.model_copy(update={"term": term}), ActuatorReply,
                                           timeout=self.actuator_timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return [], f"no actuator answered: {type(e).__name__}"
        return (reply.pods, "") if reply.ok else ([], reply.error or "actuator refused")

    async def _stop_spare(self, pod: str, request_id: str) -> None:
        """Stop a released idle spare; the actuator answers once its process has exited,
        and only then is it freed (from ``leaving``)."""
        pods, err = await self._actuate(ActuatorCommand(action=ActuatorAction.stop, pod=pod,
                                                        reason=f"released: {request_id}"))
        self.log.info("spare released", pod=pod, request_id=request_id, error=err or None)
        self.done.add(pod)  # not a spare any more, whether or not the actuator answered
        self.pods.pop(pod, None)
        async with self._lock:
            await self._load_scale()
            if self.scale is None:
                return
            for r in self.scale.releases:
                if r.request_id == request_id and pod not in r.freed:
                    if pod in r.leaving:
                        r.leaving.remove(pod)
                    r.freed.append(pod)
            await self._store_scale(self.scale)
        self._kick.set()

    # ------------------------------------------------------------------ the script's batch
    async def _watch_script(self) -> None:
        """Follow KV ``script`` (rank 0 writes it at its first step) and adopt its batch."""
        await watch_key(self.kv, SCRIPT_KEY, self._adopt_script, "the script's batch")

    def _adopt_script(self, value: bytes) -> None:
        try:
            info = ScriptInfo.model_validate_json(value)
        except ValueError as e:
            self.log.warning("KV script does not validate; ignoring it", error=str(e)[:300])
            return
        self.script = info
        cfg = self.cfg
        if info.fixed_world_size is not None:
            cfg = self._fixed_world(cfg, info.fixed_world_size)
        batch = (info.global_batch_size, info.micro_batch_size)
        if self.batch_from_script and batch != (cfg.global_batch_size, cfg.micro_batch_size):
            try:
                sized = dataclasses.replace(cfg, global_batch_size=batch[0],
                                            micro_batch_size=batch[1])
            except ValueError as e:  # e.g. fewer micro-batch rows than min_replicas
                self.log.warning("cannot size plans with the script's batch; keeping the "
                                 "current one", script=list(batch), error=str(e)[:300],
                                 current=[cfg.global_batch_size, cfg.micro_batch_size])
            else:
                self.log.info("sizing plans with the script's batch", script=list(batch),
                              was=[cfg.global_batch_size, cfg.micro_batch_size],
                              total=info.total, pod=info.pod)
                cfg = sized
        if cfg == self.cfg:
            return
        self.cfg = cfg
        self._kick.set()

    def _fixed_world(self, cfg: PolicyConfig, world: int) -> PolicyConfig:
        """A DDP drop-in script's world size: min = max replicas = that (no shrink, no
        growth), whatever the flags or the policy file said."""
        reps = max(1, world // cfg.shard_size)
        if (cfg.min_replicas, cfg.max_replicas) == (reps, reps):
            return cfg
        try:
            fixed = dataclasses.replace(
                cfg, min_replicas=reps, max_replicas=reps,
                scaling=cfg.scaling.model_copy(update={"min_replicas": reps,
                                                       "max_replicas": reps,
                                                       "replica_discrete_values": None}))
        except ValueError as e:
            self.log.warning("cannot keep the script's world size fixed", world=world,
                             error=str(e)[:300])
            return cfg
        self.log.info("the script keeps its world size: no shrink, no growth (a fault "
                      "without a live spare waits for a replacement)", replicas=reps,
                      was=[cfg.min_replicas, cfg.max_replicas])
        return fixed

    # ------------------------------------------------------------------ scale state (KV)
    def _target(self, plan: Plan) -> int:
        if self.scale is not None:
            return self.scale.target
        return max(plan.replicas, self.cfg.target_replicas)

    async def _load_scale(self) -> None:
        try:
            entry = await self.kv.get(SCALE_KEY)
        except (KeyNotFoundError, NotFoundError):
            self.scale, self.scale_revision = None, None
            return
        if entry.value is None:
            self.scale, self.scale_revision = None, None
            return
        try:
            self.scale = ScaleState.model_validate_json(entry.value)
            self.scale_revision = entry.revision
        except ValueError as e:
            self.log.error("KV scale state does not validate; ignoring it", error=str(e)[:300])
            self.scale, self.scale_revision = None, entry.revision

    async def _store_scale(self, st: ScaleState) -> bool:
        data = st.model_dump_json().encode()
        try:
            if self.scale_revision is None:
                rev = await self.kv.create(SCALE_KEY, data)
            else:
                rev = await self.kv.update(SCALE_KEY, data, last=self.scale_revision)
        except KeyWrongLastSequenceError:
            await self._load_scale()
            return False
        self.scale, self.scale_revision = st, rev
        return True

    # ------------------------------------------------------------------ liveness views
    def _alive(self, pod: str, now: float) -> bool:
        s = self.pods.get(pod)
        return (s is not None and pod not in self.dead and pod not in self.done
                and s.state not in GONE_STATES and now - s.last <= self.fault_timeout)

    def alive_spares(self, plan: Plan | None, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        members = {m.pod for m in plan.members} if plan else set()
        fenced = set(plan.fenced) if plan else set()
        return sorted(
            p for p, s in self.pods.items()
            if self._alive(p, now) and p not in members and p not in fenced
            and s.state == AgentState.waiting
            and (plan is not None or s.role == Role.spare))

    def alive_waiting_workers(self, now: float) -> list[str]:
        return sorted(p for p, s in self.pods.items()
                      if self._alive(p, now) and s.role == Role.worker
                      and s.state == AgentState.waiting)

    # ------------------------------------------------------------------ decisions
    async def _tick_loop(self) -> None:
        while True:
            kicked = await wait_event(self._kick, self.tick_interval)
            self._kick.clear()
            if not self.acting or self._replaying:
                continue
            try:
                async with self._lock:
                    await self._decide(kicked)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.exception("decision failed", error=str(e)[:200])
                await asyncio.sleep(self.tick_interval)

    async def _decide(self, kicked: bool = True) -> None:
        if self.plans.problem:
            return  # KV holds a plan that does not validate: never write over it blindly
        now = time.monotonic()
        plan = self.plans.plan
        if plan is None:
            if self.plans.revision is not None:
                return
            timed_out = now - self.t0 >= self.start_timeout
            d = policy.initial_plan(self.alive_waiting_workers(now), self.alive_spares(None, now),
                                    self.cfg, timed_out=timed_out)
            if isinstance(d, Wait):
                self._note_wait(d.reason)
                return
            last = await self._last_generation()
            if last > 0:  # the key was deleted: never reuse a generation agents have seen
                d = d.model_copy(update={
                    "generation": last + 1,
                    "reason": f"initial (plan key was deleted after generation {last})"})
            await self._commit(d, None, [])
            return
        if plan.shard_size != self.cfg.shard_size:
            # never mix: members were sharded for the stored plan's positions
            self._note_wait(f"the stored plan has shard_size {plan.shard_size} but this "
                            f"scaler runs with --shard-size {self.cfg.shard_size}; restart it "
                            f"with --shard-size {plan.shard_size}")
            return
        await self._sync_departures()
        self._reconcile(plan, now)
        self._dead_members(plan, now)
        for pod in [p for p in self.pending if plan.rank_of(p) is None]:
            del self.pending[pod]  # handled by a plan (possibly another scaler's)
        if not self.pending and self.preempting:
            await self._preemptions(plan, now)
            await self._sync_departures()
            if self.preempting:
                return
        if not self.pending and self.sharing:
            await self._share_out(plan, now)
            await self._sync_departures()
            if self.sharing:
                return
        if not self.pending:
            self.waiting = ""
            # The elastic pass scans every pod: on a kick (a pod appeared or changed state,
            # a request, a timer), else at most every ELASTIC_PERIOD_S (thousands of pods).
            self._elastic_due = self._elastic_due or kicked
            since = now - self._last_elastic
            if (self._elastic_due and since >= self.tick_interval) or since >= ELASTIC_PERIOD_S:
                self._last_elastic, self._elastic_due = now, False
                await self._elastic(plan, now)
            return
        pend = sorted(self.pending.values(), key=lambda p: p.since)
        for p in pend:
            if p.pod not in self.fence_requested:
                self.fence_requested.add(p.pod)
                self._tasks = [t for t in self._tasks if not t.done()]
                self.spawn(self._fence(p.pod, p.incident))
        d = policy.on_fault(plan, [p.pod for p in pend], self.alive_spares(plan, now), self.cfg,
                            incident=pend[0].incident)
        if d is None:
            self.pending.clear()
            return
        if isinstance(d, Wait):
            self._note_wait(d.reason)
            return
        await self._commit(d, self.plans.revision, pend)

    # ------------------------------------------------------------------ elastic
    async def _elastic(self, plan: Plan, now: float) -> None:
        """No fault pending: finish releases, then move toward the target replica count with
        one planned transition at a time."""
        await self._load_scale()
        entering = self._not_entered(plan)
        if entering:
            if plan.apply_step is not None and \
                    time.time() - plan.ts > self.cfg.policy.scaling_timeout_s:
                for pod in entering:  # a joiner that never trained: drop it like a fault
                    if pod in self.pending:
                        continue
                    inc = f"inc-{pod}-g{plan.generation}"
                    self.log.warning("member not training after the scaling timeout; dropped",
                                     pod=pod, generation=plan.generation, incident=inc,
                                     scaling_timeout_s=self.cfg.policy.scaling_timeout_s)
                    self.dead.add(pod)
                    self.pending[pod] = Pending(pod=pod, incident=inc, kind="lost", ctx=None,
                                                since=now)
                self._kick.set()
            return
        await self._releases(plan, now)
        target = self._target(plan)
        spares = self.alive_spares(plan, now)
        want = policy.desired_size(plan.replicas, target,
                                   len(spares) // self.cfg.shard_size, self.cfg)
        if want == plan.replicas:
            return
        snooze = self.cfg.policy.scale_up_snooze_s
        if want > plan.replicas and time.time() - plan.ts < snooze:
            self._note_wait(f"scale-up to {want} snoozed until {snooze:g}s after the last "
                            "change")
            self._kick_later(snooze - (time.time() - plan.ts))
            return
        apply = self._apply_step(plan, now)
        if apply is None:
            self._note_wait("placing the transition: waiting for the members' step time")
            self._kick_later(VIEW_INTERVAL)
            return
        why = self.scale.reason if self.scale is not None and self.scale.reason else (
            f"target {target}")
        named = [p for r in (self.scale.releases if self.scale is not None else [])
                 for p in r.pods if p not in r.freed and p not in r.leaving]
        new = policy.scale_plan(plan, target, spares, self.cfg, apply_step=apply, reason=why,
                                incident=f"scale-g{plan.generation + 1}", leave=named)
        if new is None:
            return
        leaving = [m.pod for m in plan.members if new.rank_of(m.pod) is None]
        if await self._commit(new, self.plans.revision, []) and leaving \
                and self.scale is not None:
            for r in self.scale.releases:  # named pods to the release that named them
                mine = [p for p in leaving if p in r.pods]
                need = self._pods_of(r) - len(r.freed) - len(r.leaving)
                take = (mine + [p for p in leaving if p not in mine])[:max(0, need)]
                r.leaving += take
                leaving = [p for p in leaving if p not in take]
            await self._store_scale(self.scale)

    def _kick_later(self, delay: float) -> None:
        asyncio.get_running_loop().call_later(max(0.01, delay), self._kick.set)

    def _not_entered(self, plan: Plan) -> list[str]:
        """Members of ``plan`` not (yet) training in its generation: a transition in flight."""
        out = []
        for m in plan.members:
            s = self.pods.get(m.pod)
            if s is None or s.generation < plan.generation or s.state not in (
                    AgentState.training, AgentState.done):  # done: it trained to the end
                if m.pod not in self.done:
                    out.append(m.pod)
        return out

    def _apply_step(self, plan: Plan, now: float) -> int | None:
        """The first step of the new generation: after the step the members are computing
        now, far enough ahead (``transition_lead_s``) for the plan to reach all of them.
        None while no member's step time is known yet and its generation is young: the
        heartbeats seen lag, and with fast steps a guess lands in the past (the members
        then discard the step they were computing; seen in CI as a release at step 2 placed
        while the members computed step 7)."""
        best, times, young = -1, [], False
        for m in plan.members:
            s = self.pods.get(m.pod)
            if s is None:
                continue
            young = young or now - s.since < 2 * VIEW_INTERVAL + 0.5
            est = s.step
            if s.step_time:  # heartbeats lag: estimate where the member is by now
                est += int((now - s.last) / s.step_time)
                times.append(s.step_time)
            best = max(best, est)
        times.sort()
        st = times[len(times) // 2] if times else None
        if st is None and young:
            return None
        lead = self.cfg.policy.transition_lead_s
        ahead = 1 + (max(1, math.ceil(lead / st)) if st else 2)
        return max(0, best + ahead)

    def _gone(self, pod: str, now: float) -> bool:
        if pod in self.done or pod in self.dead:
            return True
        s = self.pods.get(pod)
        if s is None:
            return True
        return now - s.last > self.fault_timeout or (
            s.state in GONE_STATES and now - s.last > 1.0)

    async def _releases(self, plan: Plan, now: float) -> None:
        """Answer releases whose slots are free; stop leaving members that overstay."""
        st = self.scale
        if st is None or not st.releases:
            return
        keep, changed = [], False
        for r in st.releases:
            for pod in list(r.leaving):
                if self._gone(pod, now):
                    r.leaving.remove(pod)
                    r.freed.append(pod)
                    changed = True
                elif time.time() - max(plan.ts, r.since) > \
                        self.cfg.policy.graceful_shutdown_timeout_s \
                        and pod not in self.fence_requested:  # (a spare: stop never sent)
                    self.fence_requested.add(pod)
                    self.log.warning("leaving member still running after the graceful shutdown "
                                     "timeout; stopping it", pod=pod, request_id=r.request_id)
                    self.spawn(self._actuate(ActuatorCommand(
                        action=ActuatorAction.stop, pod=pod, reason="graceful shutdown timeout")))
            unassigned = self._pods_of(r) - len(r.freed) - len(r.leaving)
            if not r.leaving and (unassigned <= 0 or plan.replicas <= st.target):
                took = time.time() - r.since
                await self._answer(r.subject, r.request_id, True,
                                   f"released: {', '.join(r.freed) or 'no pod'} free after "
                                   f"{took:.2f}s", completed=True, pods=r.freed,
                                   target=st.target)
                changed = True
                continue
            keep.append(r)
        if changed:
            st.releases = keep
            await self._store_scale(st)

    def _pods_of(self, r: PendingRelease) -> int:
        """The pods a release frees: ``count`` replicas of ``shard_size`` pods each."""
        return r.count * self.cfg.shard_size

    async def _last_generation(self) -> int:
        """The highest plan generation in the KV history of ``plan`` (0 if none)."""
        try:
            hist = await self.kv.history(PLAN_KEY)
        except Exception:  # NoKeysError: no history at all
            return 0
        best = 0
        for e in hist:
            try:
                best = max(best, int(json.loads(e.value or b"{}").get("generation", 0)))
            except Exception:
                continue
        return best

    def _note_wait(self, reason: str) -> None:
        self.waiting = reason
        if reason != self._last_wait_log:
            self._last_wait_log = reason
            self.log.info("waiting", reason=reason, generation=self.plans.generation)

    def _dead_members(self, plan: Plan, now: float) -> None:
        """A member whose fault was declared while it was not one is faulted now. (A spare's
        fault that arrives while a plan promoting it is being written finds it still a spare
        and only drops it from the pool; the monitor declares a pod once, so without this the
        new plan kept a dead member and the job waited for it for ever.) Only the monitor's
        declarations count: a member merely seen exiting is the monitor's to declare (with
        the monitor down, the job waits for it, as the control-plane tests check)."""
        key = (plan.generation, self._dropped_n)
        if self._dead_checked == key:  # nothing new since the last look
            return
        self._dead_checked = key
        for m in plan.members:
            if m.pod in self.dropped and m.pod not in self.pending \
                    and m.pod not in plan.fenced:
                incident = f"inc-{m.pod}-g{plan.generation}"
                self.log.warning("a member of the new plan had already failed; handled as "
                                 "faulted", pod=m.pod, rank=m.rank, incident=incident)
                self.pending[m.pod] = Pending(pod=m.pod, incident=incident, kind="crash",
                                              ctx=None, since=now)

    def _reconcile(self, plan: Plan, now: float) -> None:
        """Once per lease term, after the grace period: silent members count as faulted."""
        if self._reconciled or self.holder_since is None:
            return
        if now - self.t0 < 2 * self.fault_timeout:
            return
        self._reconciled = True
        # once a term: after this line a member's silence is the health monitor's to report
        self.log.info("lease term reconciled", generation=plan.generation)
        for m in plan.members:
            s = self.pods.get(m.pod)
            if m.pod in self.pending or m.pod in self.done:
                continue
            if s is not None and s.state in GONE_STATES:
                continue
            if s is not None and now - s.last <= self.fault_timeout and m.pod not in self.dead:
                continue
            incident = f"inc-{m.pod}-g{plan.generation}"
            self.log.warning("member silent after restart; handled as faulted", pod=m.pod,
                             rank=m.rank, incident=incident, generation=plan.generation)
            self.dead.add(m.pod)
            self.pending[m.pod] = Pending(pod=m.pod, incident=incident, kind="lost", ctx=None,
                                          since=now)

    async def _commit(self, new: Plan, revision: int | None, pend: list[Pending]) -> bool:
        if self.job_failed is not None:
            self._note_wait("the job failed (the script's bug): no more plans")
            return False
        term, cur = self.term, self.plans.plan
        if term is None or (cur is not None and cur.term is not None and cur.term > term):
            # the lease ran out (or a newer scaler wrote): a deposed scaler plans nothing
            self._note_wait("not the lease holder: no plan")
            return False
        new = new.model_copy(update={"ts": time.time(), "term": term})
        parent = pend[0].ctx if pend and pend[0].ctx is not None else None
        links = [trace.Link(trace.get_current_span(p.ctx).get_span_context())
                 for p in pend[1:] if p.ctx is not None]
        attrs = {"ceaseless.job": self.bus.subjects.job, "ceaseless.generation": new.generation,
                 "ceaseless.world_size": new.world_size, "ceaseless.reason": new.reason}
        if new.incident:
            attrs["ceaseless.incident"] = new.incident
        if pend:
            attrs["ceaseless.pod"] = ",".join(p.pod for p in pend)
        with tracer.start_as_current_span("plan", context=parent, links=links,
                                          attributes=attrs) as span:
            data = new.model_dump_json().encode()
            try:
                if revision is None:
                    rev = await self.kv.create(PLAN_KEY, data)
                else:
                    rev = await self.kv.update(PLAN_KEY, data, last=revision)
            except KeyWrongLastSequenceError:
                self.cas_conflicts += 1
                span.set_attribute("ceaseless.cas_conflict", True)
                self.log.warning("plan compare-and-set lost; reloading", generation=new.generation,
                                 revision=revision)
                await self.plans.refresh()
                self._kick.set()
                return False
            ctx = trace.set_span_in_context(span)
            self.plans.set_local(new, rev, ctx)
            self.plans_written += 1
            try:  # the scaler is the single writer of membership: it owns the gauge
                telemetry.instruments().record_membership(new.world_size)
            except Exception:
                pass
            for p in pend:
                self.pending.pop(p.pod, None)
            self.waiting = ""
            self.log.info("plan committed", generation=new.generation, revision=rev,
                          world_size=new.world_size, reason=new.reason, incident=new.incident,
                          members={m.rank: m.pod for m in new.members}, spares=new.spares)
            await self.bus.publish(self.bus.subjects.plan, new,
                                   msg_id=f"plan-g{new.generation}-r{rev}", ctx=ctx)
        return True

    async def _fence(self, pod: str, incident: str) -> None:
        if self.term is None:  # deposed meanwhile: the holder fences
            return
        cmd = ActuatorCommand(action=ActuatorAction.kill, pod=pod, reason=f"fenced: {incident}",
                              term=self.term)
        try:
            reply = await self.bus.request(self.bus.subjects.actuator, cmd, ActuatorReply,
                                           timeout=self.fence_timeout)
            self.log.info("fence requested", pod=pod, incident=incident, ok=reply.ok,
                          error=reply.error or None)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("fence failed (best effort)", pod=pod, incident=incident,
                             error=f"{type(e).__name__}: {str(e)[:160]}")

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        plan = self.plans.plan
        now = time.monotonic()
        return {
            "scaler_id": self.scaler_id,
            "lease_holder": self.acting,
            "lease": self.lease.status(),
            "plan": None if plan is None else {
                "generation": plan.generation, "revision": self.plans.revision,
                "members": {m.rank: m.pod for m in plan.members},
                "world_size": plan.world_size, "shard_size": plan.shard_size,
                "replicas": plan.replicas, "shares": plan.shares, "reason": plan.reason,
                "incident": plan.incident, "spares": plan.spares, "fenced": plan.fenced[-16:],
            },
            "plan_problem": self.plans.problem or None,
            "alive_spares": self.alive_spares(plan, now),
            "heartbeats_from": self.feed.source,
            "alive_pods": sorted(p for p in self.pods if self._alive(p, now)),
            "pending": {p.pod: {"incident": p.incident, "kind": p.kind,
                                "age": round(now - p.since, 3)} for p in self.pending.values()},
            "waiting": self.waiting or None,
            "scale": None if self.scale is None else {
                "target": self.scale.target, "reason": self.scale.reason,
                "request_id": self.scale.request_id, "updated": self.scale.updated,
                "releases": [r.model_dump() for r in self.scale.releases]},
            "last_change": {"generation": plan.generation, "reason": plan.reason,
                            "ts": plan.ts} if plan is not None else None,
            "plans_written": self.plans_written,
            "cas_conflicts": self.cas_conflicts,
            "ignored": dict(self.ignored),
            "policy": {"workers": self.cfg.workers, "shard_size": self.cfg.shard_size,
                       "min_replicas": self.cfg.min_replicas,
                       "max_replicas": self.cfg.max_replicas,
                       "global_batch_size": self.cfg.global_batch_size,
                       "micro_batch_size": self.cfg.micro_batch_size,
                       # flags: the operator's; script: the script's (KV `script`);
                       # default: no batch given and the script's not known yet
                       "batch_source": (
                           "flags" if not self.batch_from_script else
                           "script" if self.script is not None and (
                               self.script.global_batch_size,
                               self.script.micro_batch_size) == (
                               self.cfg.global_batch_size, self.cfg.micro_batch_size)
                           else "default"),
                       "fault_timeout": self.fault_timeout, "start_timeout": self.start_timeout,
                       **self.cfg.policy.model_dump(exclude={"min_replicas", "max_replicas"})},
        }


def now_alive(seen: PodSeen, fault_timeout: float) -> bool:
    return time.monotonic() - seen.last <= fault_timeout

