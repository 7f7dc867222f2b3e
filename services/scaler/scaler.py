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
* Its parts, each with one job (this class feeds them and applies what they decide):
  ``liveness`` (the pods seen, dead, dropped, done), ``faults`` (what a fault means),
  ``departures`` (KV ``departures``), ``scale_store`` (KV ``scale``), ``actuation`` (term-
  stamped actuator requests), ``script`` (the script's batch and world size), ``replay``
  (what a new lease holder reads back from the job stream), ``writer`` (KV ``plan``: the
  compare-and-set, the trace, the message).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from schemas.timeouts import DEFAULTS, VIEW_INTERVAL
from schemas.policy import SCRIPT_KEY, PendingRelease, ScaleState, ScalingPolicy, ScriptInfo
from schemas.messages import (ActuatorAction, ActuatorCommand, Capacity, CapacityChange,
                              Decision, Fault, Heartbeat, JobFailed, Lifecycle,
                              LifecycleEvent, Plan, Priority, Report, ReportKind, Role)
from plumbing.bounded import BoundedSet
from plumbing.bus import Bus, Envelope, watch_key
from plumbing.terms import NewestTerm
from services.common.heartbeats import HeartbeatFeed
from services.common.lease import LeaseState
from services.common.plans import PlanFollower
from services.common.service import STATUS_ITEMS, Service, wait_event

from . import faults, policy, script
from .actuation import Actuation
from .departures import DepartureBook
from .faults import Act, Pending
from .liveness import MAX_TRACKED, Liveness, PodSeen
from .policy import PolicyConfig, Wait
from .replay import Inherited, inherit
from .scale_store import ScaleStore
from .writer import PlanWriter

ELASTIC_PERIOD_S = 0.25  # the elastic pass when nothing kicked it (it scans every pod)
START_TIMEOUT = 30.0  # wait this long for the desired workers, then start with >= min_replicas
FENCE_TIMEOUT = 0.5   # the actuator kill request (best effort)


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
        # the parts, each with one job; the data flows through this class's handlers
        self.live = Liveness(fault_timeout, self._ignore, self.log)  # the pods, from heartbeats
        self.departures = DepartureBook(self.log)  # members to plan out at a step boundary
        self.scales = ScaleStore(self.log)         # KV ``scale``: target and releases
        self.writer = PlanWriter(bus, self.plans, self.log)  # KV ``plan``, then its message
        self.actuation = Actuation(bus, self.log, lambda: self.term,
                                   timeout=actuator_timeout, fence_timeout=fence_timeout)
        self._dead_checked: tuple = ()            # (plan generation, dropped_n) last seen
        self.pending: dict[str, Pending] = {}     # member faults not planned yet
        self.waiting: str = ""       # why the last decision was Wait
        self.fence_requested = BoundedSet(MAX_TRACKED)
        self._lock = asyncio.Lock()
        self._kick = asyncio.Event()
        self._last_wait_log = ""
        self._last_elastic = 0.0
        self._elastic_due = False
        # heartbeats from the monitor's health view, or read directly while there is none
        self.feed = HeartbeatFeed(bus, self.log, self._on_heartbeat, self._on_beats,
                                  on_resume=self.live.resumed)
        self.live.horizon = self.feed.horizon

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.kv = self.departures.kv = self.scales.kv = self.writer.kv = await self.bus.kv()
        await super().start()

    # the parts' state, by the names the scaler's tests and status use
    @property
    def pods(self) -> dict[str, PodSeen]:
        return self.live.pods

    @property
    def dead(self) -> BoundedSet:
        return self.live.dead

    @property
    def dropped(self) -> BoundedSet:
        return self.live.dropped

    @property
    def _dropped_n(self) -> int:
        return self.live.dropped_n

    @_dropped_n.setter
    def _dropped_n(self, n: int) -> None:
        self.live.dropped_n = n

    @property
    def done(self) -> BoundedSet:
        return self.live.done

    @property
    def preempting(self) -> dict[str, tuple[str, str | None]]:
        return self.departures.preempting

    @property
    def sharing(self) -> dict[str, tuple[float, str]]:
        return self.departures.sharing

    @property
    def plans_written(self) -> int:
        return self.writer.written

    @property
    def cas_conflicts(self) -> int:
        return self.writer.cas_conflicts

    @property
    def scale(self) -> ScaleState | None:
        return self.scales.state

    def parts(self) -> list:
        return [self.plans, self.feed]

    def subscriptions(self) -> list:
        s = self.bus.subjects
        return [(s.lifecycle(), Lifecycle, self._on_lifecycle), (s.fault, Fault, self._on_fault),
                # only preemption notices: not the N peer_error reports a second that N
                # members waiting in an all-reduce send (issue 45)
                (s.report(), Report, self._on_report,
                 f'"{ReportKind.preempted.value}"'.encode()),
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
        self.departures.reset()
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
        # finds "no live spare" and shrinks the job while the spare is alive. Not for a new
        # job (no plan: nothing to replay, and the initial plan waits for its workers'
        # heartbeats itself): that wait cost every job's start a fault timeout.
        if self.plans.plan is not None:
            await asyncio.sleep(max(0.0, self._listening_since
                                    + self.warm_up * self.fault_timeout - time.monotonic()))
        try:  # a scaler cut off (a partitioned host's) heard no plan meanwhile: the faults
            # since the plan it holds include those the current one handled
            await self.plans.refresh()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("plan not read on taking the lease", error=str(e)[:200])
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
            self.live.drop(pod)
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
    async def _on_heartbeat(self, hb: Heartbeat, subject: str, age: float = 0.0) -> None:
        if self.live.heartbeat(hb, subject, age):
            self._kick.set()

    def _on_beats(self, pods: list[str], gens: list[int], steps: list[int],
                  digests: list[str], ages: list[float]) -> None:
        if self.live.beats(pods, gens, steps, ages):
            self._kick.set()

    async def _on_lifecycle(self, ev: Lifecycle, env: Envelope) -> None:
        if ev.event == LifecycleEvent.exited:
            self.live.exited(ev)

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

    async def _sync_departures(self) -> None:
        await self.departures.sync()

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
        no term check): judged (faults.py), then applied here."""
        plan = self.plans.plan
        if plan is not None and f.generation > plan.generation:
            await self.plans.refresh()
            plan = self.plans.plan
        v = faults.judge(
            f, plan, pending=self.pending, preempting=self.preempting,
            has_spare=lambda: bool(self.alive_spares(plan, time.monotonic())),
            dropin=self.script is not None and self.script.fixed_world_size is not None,
            was_spare=f.pod in self.pods or (plan is not None and f.pod in plan.spares),
            seen=self.pods.get(f.pod), fault_timeout=self.fault_timeout,
            quiet=self._quiet(f.pod))
        if v.act is Act.FORGET:
            self.dead.add(f.pod)
            self.pods.pop(f.pod, None)
        elif v.act is Act.DROP:
            self.live.drop(f.pod)
        elif v.act is Act.SWAP:
            self.preempting[f.pod] = ("straggler", f.incident)
            self.log.info("straggler: planning its swap for a spare", pod=f.pod,
                          incident=f.incident, reason=f.reason[:200])
            self._kick.set()
        elif v.act is Act.SHARE:
            self.sharing[f.pod] = (f.slowness or 1.0, f.incident)
            self.log.info("straggler without a spare: sharing out its micro-batches",
                          pod=f.pod, ratio=round(f.slowness or 1.0, 2), incident=f.incident)
            self._kick.set()
        elif v.act is Act.ACCEPT:
            assert plan is not None
            self.dead.add(f.pod)
            self.pending[f.pod] = Pending(pod=f.pod, incident=f.incident, kind=f.kind.value,
                                          ctx=env.ctx, since=time.monotonic())
            self.log.info("fault accepted", subject=env.subject, pod=f.pod,
                          incident=f.incident, kind=f.kind.value, generation=plan.generation,
                          acting=self.acting)
            self._kick.set()
        if v.reason:
            self._ignore(env.subject, v.reason, level=v.level, pod=f.pod, incident=f.incident)

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
        return await self.actuation.actuate(cmd)

    async def _stop_spare(self, pod: str, request_id: str) -> None:
        """Stop a released idle spare; the actuator answers once its process has exited,
        and only then is it freed (from ``leaving``)."""
        pods, err = await self._actuate(ActuatorCommand(action=ActuatorAction.stop, pod=pod,
                                                        reason=f"released: {request_id}"))
        self.log.info("spare released", pod=pod, request_id=request_id, error=err or None)
        self.live.released(pod)  # whether or not the actuator answered
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
        cfg = script.adopt(self.cfg, info, self.batch_from_script, self.log)
        if cfg == self.cfg:
            return
        self.cfg = cfg
        self._kick.set()

    # ------------------------------------------------------------------ scale state (KV)
    def _target(self, plan: Plan) -> int:
        return self.scales.target(plan, self.cfg)

    async def _load_scale(self) -> None:
        await self.scales.load()

    async def _store_scale(self, st: ScaleState) -> bool:
        return await self.scales.store(st)

    # ------------------------------------------------------------------ liveness views
    def _alive(self, pod: str, now: float) -> bool:
        return self.live.alive(pod, now)

    def alive_spares(self, plan: Plan | None, now: float | None = None) -> list[str]:
        return self.live.alive_spares(plan, now)

    def _quiet(self, pod: str) -> float | None:
        """How long ``pod`` counts as silent here (None: never heard): up to the feed's
        horizon, from when this scaler could hear; 0 while it hears no pod at all (a fault's
        staleness is then judged by the generations alone: CI once accepted a stale fault of
        a live member whose heartbeats a loaded monitor's view had not brought yet)."""
        seen, now = self.pods.get(pod), time.monotonic()
        if seen is None:
            return None
        return 0.0 if self.live.deaf(now) else self.live.quiet(seen, now)

    def alive_waiting_workers(self, now: float) -> list[str]:
        return self.live.alive_waiting_workers(now)

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
        if self.live.deaf(now):
            # every pod is silent to this scaler (its route to theirs stuck after a
            # partition): a spare would look dead and the job shrink; a plan could not reach
            # the pods anyway. Plan once a pod is heard (its spares get a fault timeout then).
            self._note_wait("no pod heard: the spares cannot be told alive; waiting to hear them")
            return
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
        return self.live.not_entered(plan)

    def _apply_step(self, plan: Plan, now: float) -> int | None:
        return self.live.apply_step(plan, now, self.cfg.policy.transition_lead_s)

    def _gone(self, pod: str, now: float) -> bool:
        return self.live.gone(pod, now)

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
        return await self.writer.last_generation()

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
        for p in faults.dead_members(plan, self.dropped, self.pending, now):
            self.log.warning("a member of the new plan had already failed; handled as "
                             "faulted", pod=p.pod, rank=plan.rank_of(p.pod), incident=p.incident)
            self.pending[p.pod] = p

    def _reconcile(self, plan: Plan, now: float) -> None:
        """Once per lease term, after the grace period: silent members count as faulted.
        The grace runs from the start, or from when pods were heard again after none was
        (a view blind since then, as a restart's), and no member is silent while no pod is
        heard at all: after a partition JetStream may answer (the lease taken) while the
        route that carries the pods' heartbeats is still stuck (docs/cluster.md)."""
        if self._reconciled or self.holder_since is None:
            return
        since = self.live.hearing.since
        if now - max(self.t0, since) < 2 * self.fault_timeout or self.live.deaf(now):
            return
        self._reconciled = True
        # once a term: after this line a member's silence is the health monitor's to report
        self.log.info("lease term reconciled", generation=plan.generation)
        for p in faults.silent_members(plan, self.pods, self.pending, self.done, self.dead,
                                       self.fault_timeout, self.live.horizon(now), since):
            self.log.warning("member silent after restart; handled as faulted", pod=p.pod,
                             rank=plan.rank_of(p.pod), incident=p.incident,
                             generation=plan.generation)
            self.dead.add(p.pod)
            self.pending[p.pod] = p

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

        def written() -> None:
            for p in pend:
                self.pending.pop(p.pod, None)
            self.waiting = ""
        if not await self.writer.write(new, revision, pend, written):
            self._kick.set()  # reloaded: decide again
            return False
        return True

    async def _fence(self, pod: str, incident: str) -> None:
        await self.actuation.fence(pod, incident)

    # ------------------------------------------------------------------ status
    def status(self) -> dict[str, Any]:
        plan = self.plans.plan
        now = time.monotonic()
        alive = sorted(p for p in self.pods if self._alive(p, now))
        return {
            "scaler_id": self.scaler_id,
            "lease_holder": self.acting,
            "lease": self.lease.status(),
            "plan": None if plan is None else {
                "generation": plan.generation, "revision": self.plans.revision,
                # the first ranks' (the whole plan is in KV: `ceaseless status` reads it there)
                "members": self.listed(((m.rank, m.pod) for m in plan.members),
                                       plan.world_size),
                "world_size": plan.world_size, "shard_size": plan.shard_size,
                "replicas": plan.replicas,
                "shares": self.listed(plan.shares.items(), plan.world_size),
                "reason": plan.reason,
                "incident": plan.incident, "spares": plan.spares, "fenced": plan.fenced[-16:],
            },
            "plan_problem": self.plans.problem or None,
            "alive_spares": self.alive_spares(plan, now),
            "heartbeats_from": self.feed.source,
            "hearing": self.live.hearing.status(now),
            "alive_pods": alive[:STATUS_ITEMS],  # (the first: Service.listed)
            "alive_pods_total": len(alive),
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

