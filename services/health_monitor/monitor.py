"""The health monitor: heartbeats, lifecycle events and agent reports -> one ``fault`` per
incident.

Rules (docs/architecture.md, recovery step 1):

* lifecycle ``exited`` with a non-zero code -> ``crash`` (exit 0, or any code after the pod's
  last heartbeat said ``done``: the pod is done, forgotten); an exit code a process ends
  with on its own (1-127: an uncaught exception is 1) waits ``suspect_timeout`` for the pod's
  exception report, which travels on another subject and may be read after it (then the
  report decides); a kill by signal is a crash at once;
* no heartbeat for ``fault_timeout`` -> ``lost`` (not for pods whose last state is done/leaving;
  a pod whose heartbeat still says ``starting``, not a member, has ``stall_timeout``: its
  imports and set-up hold the interpreter, on a loaded machine for seconds; a member never
  heard from has a grace from the plan or from its lifecycle ``started``, whichever is
  later; a pod that dies before it heartbeats is the actuator's ``exited``); while no pod
  at all is heard for ``fault_timeout`` the silence is the monitor's own (a stuck route
  between servers, ``services/common/hearing.py``): nothing is lost, and once a pod is heard
  every pod's silence is counted without that gap; so after the server did not answer a
  PING, or the lease renewals, only without the longest stretch in which no pod was heard
  (a reader that fell behind in a burst heard pods all along: its silence counts in full);
* a member in state ``training`` whose step did not advance for ``stall_timeout`` while
  another member's did -> ``hang``;
* a report of kind exception / digest_mismatch / recovery_failed -> ``exception``; an
  ``exception`` (the script's own, the pod ends with it) is judged by the failure it
  describes whatever the generation when it arrives (a pod that never entered the first
  plan's generation reports generation 0), and held a moment while another member at the
  same step could still raise the same (every rank raising at once is the common case: the
  verdict ``job_failed`` then comes before any fault, so no spare is promoted into the bug);
  after ``job_failed`` no fault is declared (the launcher stops the job); of kind
  ``stalled`` (the member's own watchdog: no step boundary and no collective for its stall
  timeout, e.g. a training thread stuck in user code while heartbeats go on) -> ``hang``;
* a ``peer_error`` report makes every member of the current generation whose heartbeat is
  older than ``suspect_timeout`` ``lost`` at once (``pods`` is kept in the order the pods
  were last heard from, so a report looks only at the silent ones); a waiting member reports
  once per wait, then each of its heartbeats says so (``waiting_since``) and counts as a
  repeat (issue 45: a report per heartbeat interval was N more messages a second at N ranks);
* absent member: while members keep reporting that they wait in the gradient all-reduce
  (``peer_error`` or ``waiting_since`` every heartbeat interval, then the timeout itself), a
  member that is alive but not among them once one has waited the agents' ``collective_timeout`` -> ``hang``
  (issue 24: a member that left the collective for any reason must not leave its peers
  waiting for ever; one that merely works longer, a rank-0 evaluation, has until then, or
  until the bound it declared with ``Session.solo`` plus that timeout).

Every pod that heartbeats is watched (members and spares alike), and so are members of the
current plan (from KV) that have not heartbeated yet, after a grace period. After a fault
for pod P, P is no longer watched. The incident id is ``inc-<pod>-g<generation>`` with the
current plan's generation; a fault is published once, with ``Nats-Msg-Id`` = incident.
Nothing here survives a restart, and nothing needs to: the plan is in KV (its ``fenced``
list says who was already handled), the rest comes back with the next heartbeats.
"""

from __future__ import annotations

from schemas.timeouts import DEFAULTS as TIMEOUTS
from schemas.timeouts import check_timeouts

import asyncio
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Iterable

from opentelemetry import context as otel_context
from opentelemetry import trace

from schemas.messages import MAX_PODS  # bounds what spoofed pod ids can make it track
from schemas.messages import (AgentState, Fault, FaultKind, Heartbeat, HeartbeatBatch, JobFailed,
                              JobFailedKind, Lifecycle, LifecycleEvent, Plan, Report,
                              ReportKind, Role)
from plumbing.bounded import BoundedSet
from plumbing.bus import Bus, Envelope
from services.common.hearing import Ear, Hearing
from services.common.heartbeats import VIEW_INTERVAL, ViewPublisher
from services.common.history import read_back
from services.common.plans import PlanFollower
from services.common.service import Service

from . import stragglers
from .repeats import Failure, RepeatDetector, injected

tracer = trace.get_tracer("ceaseless")
GONE_STATES = (AgentState.done, AgentState.leaving)
EXCEPTION_REPORTS = (ReportKind.exception, ReportKind.digest_mismatch, ReportKind.recovery_failed)
CHECK_INTERVAL = 0.05  # seconds between liveness checks
# A straggler: its own compute of a step over STRAGGLER_FACTOR x the others' (or its own
# slowdown over that factor x theirs) for most of STRAGGLER_WINDOW_S seconds (stragglers.py)
STRAGGLER_FACTOR, STRAGGLER_WINDOW_S = stragglers.FACTOR, stragglers.WINDOW_S
# Members the straggler rule judges per pass at most: a larger job's members are judged
# every ceil(members / this) passes (a pass over 16,384 members with their paces took
# 150 ms, 4 times a second; the rule's window is 10 s, its judgments need not be 0.25 s apart)
STRAGGLER_PASS_MEMBERS = 4096


@dataclass
class PodView:
    pod: str
    role: Role
    generation: int = 0
    rank: int | None = None
    step: int = -1
    state: AgentState = AgentState.waiting
    last_hb: float = 0.0          # monotonic
    last_seen: float = 0.0        # wall clock, for Fault.last_seen
    last_advance: float = 0.0     # monotonic: last step change (or generation/state change)
    last_advance_wall: float = 0.0
    heartbeated: bool = False     # False: seeded from the plan, never heard from
    hb: Heartbeat | None = None   # the last one accepted (what the health view publishes)
    deadline_extra: float = 0.0   # grace added to fault_timeout (seeded members)
    solo_until: float | None = None  # wall (the agent's clock): it works alone until then
    solo_ended: float | None = None  # monotonic: when its heartbeat said the solo ended
    compute_time: float | None = None  # its own compute of a step (median of its recent)


@dataclass
class Held:
    """An exception report whose fault waits: another member may raise the same."""
    report: Report
    until: float                  # monotonic: declared then at the latest


@dataclass
class Exit:
    """A non-zero exit that may come with the script's exception report: the report is on
    another subject, sent by the pod (the exit by its actuator), and may be read after it."""
    ev: Lifecycle
    until: float                  # monotonic: a crash then, if no report came


# Exit codes a Python process ends with on its own (an uncaught exception: 1), which may
# follow an exception report; a kill by signal (negative, or 128 + N from a shell) does not.
REPORTED_EXITS = range(1, 128)
# Faults found by judging the pods against the plan (silence, stall, pace), found again by
# the next check; not one-shot events (an exit, an exception report), which are declared
JUDGED = (FaultKind.lost, FaultKind.hang, FaultKind.straggler)
# How long the link check waits for its PONG while pods are heard (the reader behind, not
# the link down), in fault timeouts: past it the link counts as down (no silence counts)
LINK_WAIT = 4


@dataclass
class Waiting:
    """A member's run of peer_error reports in one generation: it waits in a collective."""
    generation: int
    since: float                  # monotonic: the first report of the run
    last: float                   # monotonic: the latest
    step: int = -1                # the member's last committed step while it waits


class HealthMonitor(Service):
    name = "health_monitor"
    description = "liveness and progress -> fault events"

    def __init__(self, bus: Bus, *, fault_timeout: float = TIMEOUTS["fault_timeout"],
                 stall_timeout: float = TIMEOUTS["stall_timeout"],
                 suspect_timeout: float = TIMEOUTS["suspect_timeout"],
                 collective_timeout: float = TIMEOUTS["collective_timeout"],
                 check_interval: float = CHECK_INTERVAL,
                 view_interval: float | None = VIEW_INTERVAL,
                 straggler_factor: float = STRAGGLER_FACTOR,
                 straggler_window: float = STRAGGLER_WINDOW_S,
                 instance_id: str | None = None, lease_ttl: float | None = None) -> None:
        check_timeouts(True, suspect_timeout=suspect_timeout, fault_timeout=fault_timeout,
                       stall_timeout=stall_timeout, collective_timeout=collective_timeout)
        super().__init__(bus, instance_id=instance_id, lease_ttl=lease_ttl)  # (a contradictory configuration was refused above)
        self.fault_timeout = fault_timeout
        self.stall_timeout = stall_timeout
        self.collective_timeout = collective_timeout  # the agents': the absent-member rule
        self.suspect_timeout = suspect_timeout
        self.check_interval = check_interval
        self.straggler_factor = straggler_factor  # 0: no straggler rule
        self.straggler_window = straggler_window
        # every member's recent compute paces and slow judgments (bounded, per generation)
        # (a factor > 0 and <= 1, or a window <= 0, is refused here with the reason)
        self.paces = stragglers.Tracker(
            stragglers.Rule(factor=straggler_factor, window=straggler_window)
            if straggler_factor > 0 else stragglers.Rule())
        self.plans = PlanFollower(bus, self.log, on_change=self._on_plan)
        # every watched pod, least recently heard first (``_heard_at`` moves a pod to the
        # end as its ``last_hb`` is set): the silent ones are a prefix, found without a scan
        self.pods: OrderedDict[str, PodView] = OrderedDict()
        self.peer_errors = 0        # peer_error reports taken
        self.peer_error_looked = 0  # pods they looked at (the silent prefix, plus one each)
        self.check_looked = 0       # pods the liveness checks looked at (the silent prefix)
        self.faulted = BoundedSet(MAX_PODS)     # pods a fault was declared for: not watched any more
        self.gone = BoundedSet(MAX_PODS)        # exited 0: done
        self.incidents = BoundedSet(MAX_PODS)   # incident ids declared (dedupe)
        self.faults: deque[dict[str, Any]] = deque(maxlen=200)
        self.latencies: deque[float] = deque(maxlen=1000)
        self._stale_logged: set[tuple[str, int]] = set()
        self._link_down_since: float | None = None
        # no pod heard at all for a fault timeout is this monitor's own outage (hearing.py)
        self.hearing = Hearing(fault_timeout, time.monotonic())
        self._last_stall_check = 0.0
        self.straggler_pass_members = STRAGGLER_PASS_MEMBERS
        self._stall_passes = 0
        self.straggler_passes = 0  # passes of the straggler rule (status: "checks")
        self.waiting: dict[str, Waiting] = {}   # members reporting a collective wait
        self._all_waiting_logged = 0            # generation last logged with nobody absent
        # the same failure at the same step on a second pod: the script's (repeats.py)
        self.repeats = RepeatDetector()
        self.job_failed: JobFailed | None = None
        self.held: dict[str, Held] = {}  # exception reports not declared yet (watched pods)
        # non-zero exits whose crash waits a message's time for the pod's exception report
        # (CI: the exit read first made w1 a crash; both members' so, spares promoted into
        # the script's set-up error)
        self.exits: dict[str, Exit] = {}
        # cleared while the lease was just taken and the declared faults are read back
        self._inherited = asyncio.Event()
        self._inherited.set()
        # A standby's: the members' exits it heard and could not declare (pod -> what
        # _declare was given), declared when it takes the lease (``_declare_kept``). An exit
        # is said once: without this, a host loss that took the active monitor with its
        # members was found only by their silence, a fault timeout after the take.
        self._kept_exits: OrderedDict[str, dict[str, Any]] = OrderedDict()
        # The heartbeats it reads, for the scaler and the broker (services/common/heartbeats.py)
        self.view = (ViewPublisher(bus, self.log, self._heard, view_interval,
                                   active=lambda: self.acting)
                     if view_interval else None)

    # ------------------------------------------------------------------ lifecycle
    def parts(self) -> list:
        return [self.plans]

    def subscriptions(self) -> list:
        s = self.bus.subjects
        return [(s.heartbeat(), Heartbeat, self._on_heartbeat),
                (s.heartbeats(), HeartbeatBatch, self._on_batch),
                (s.report(), Report, self._on_report),
                (s.lifecycle(), Lifecycle, self._on_lifecycle)]

    async def on_start(self) -> None:
        self.spawn(self._check_loop())
        if self.view is not None:
            self.spawn(self.view.run())
        self.log.info("health monitor started", generation=self.plans.generation,
                      fault_timeout=self.fault_timeout, stall_timeout=self.stall_timeout,
                      suspect_timeout=self.suspect_timeout)

    def on_lease_acquired(self, term: int) -> None:
        """After an outage of the bus (its renewals failed, so its checks stopped) the pods'
        silence was the monitor's own, as when the link check fails: the longest stretch no
        pod was heard since the renewal failed is not counted (``_grace``). The pods the
        previous holder declared are read back before this one declares anything: a pod is
        declared once (a standby declared nothing, so it did not note them)."""
        now = time.monotonic()
        outage = self.hearing.unwatch("lease", now)
        if self.lease.outage:
            # Cut off while another instance acted (a partitioned host's monitor, its lease
            # taken on the side with the quorum): it heard its own host's pods, not the
            # others', so all of that time is its own silence, not theirs (a loaded run of
            # the partition test declared two healthy members lost after the heal). After a
            # holder's loss (an election) only the stretch no pod was heard is: the lost
            # host's pods' silence counts.
            self._grace(now, max(outage, self.lease.acted_while_cut_off()),
                        "the bus did not answer the lease renewals")
        self._inherited.clear()
        self.spawn(self._inherit(term))
        self.spawn(self._declare_kept(term))

    def on_lease_lost(self, holder: str | None) -> None:
        super().on_lease_lost(holder)
        if self.lease.outage:  # a renewal failed: how long no pod is heard is kept
            self.hearing.watch("lease")

    async def _declare_kept(self, term: int) -> None:
        """The exits this instance heard as a standby, of pods still members of the plan
        and not declared by the previous holder (read back first): declared now, with the
        exit's own time (the detection latency includes the take-over)."""
        await self._inherited.wait()
        kept, self._kept_exits = self._kept_exits, OrderedDict()
        for pod, kw in kept.items():
            if self.term != term or not self._is_member(pod):
                continue
            if await self._declare(pod, FaultKind.crash, **kw):
                self.log.info("declared an exit heard as a standby", pod=pod, term=term)

    async def _inherit(self, term: int) -> None:
        """The plan and the previous holder's declarations, read before this one declares:
        an instance that was cut off (a partitioned host's) heard no plan meanwhile, and
        judged against the old generation its peers' stale reports and the members it no
        longer watches would declare healthy pods."""
        faults: list = []
        failed: list = []
        try:
            try:
                await self.plans.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the poll tries again; the read-back below still runs
                self.log.warning("plan not read on taking the lease", error=str(e)[:200])
            s = self.bus.subjects
            faults = await read_back(self.bus, s.fault, Fault, self.log)
            failed = await read_back(self.bus, s.job_failed, JobFailed, self.log,
                                     last_only=True)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # no stream (yet): nothing was declared
            self.log.warning("declared faults not read back", error=str(e)[:200])
        finally:
            for f, _env in faults:
                self.incidents.add(f.incident)
                if f.kind != FaultKind.straggler:  # (a straggler stays watched)
                    self.faulted.add(f.pod)
                    self.pods.pop(f.pod, None)
            if failed and self.job_failed is None:
                self.job_failed = failed[-1][0]
            self._inherited.set()
        if faults or failed:
            self.log.info("declared faults read back", term=term, faults=len(faults),
                          job_failed=bool(failed))

    async def _read_back(self) -> None:
        """A declaration waits for the read-back of the previous holder's (a one-shot
        event, an exit, must not be dropped meanwhile); bounded: a duplicate declaration
        is only ignored by the scaler, a missing one stalls the job."""
        if not self._inherited.is_set():
            try:
                await asyncio.wait_for(self._inherited.wait(), self.fault_timeout)
            except asyncio.TimeoutError:
                self.log.warning("declaring before the declared faults were read back")

    # ------------------------------------------------------------------ plan
    @property
    def plan(self) -> Plan | None:
        return self.plans.plan

    @property
    def generation(self) -> int:
        return self.plans.generation

    def _is_member(self, pod: str) -> bool:
        return self.plan is not None and self.plan.rank_of(pod) is not None

    def _on_plan(self, old: Plan | None, new: Plan) -> None:
        now, wall = time.monotonic(), time.time()
        self.waiting.clear()  # a new generation: new collectives
        for pod in new.fenced:  # handled by the scaler: never watch again
            if pod not in self.faulted:
                self.faulted.add(pod)
            self.pods.pop(pod, None)
        for m in new.members:
            v = self.pods.get(m.pod)
            if v is None:
                if m.pod in self.faulted or m.pod in self.gone:
                    continue
                # never heard from: watch it, with a grace period to start heartbeating
                self.pods[m.pod] = PodView(pod=m.pod, role=Role.worker, rank=m.rank,
                                           last_hb=now, last_seen=wall, last_advance=now,
                                           last_advance_wall=wall,
                                           deadline_extra=self.fault_timeout)
            else:
                v.rank = m.rank
                v.last_advance, v.last_advance_wall = now, wall  # recovery is not a stall
        self.log.info("plan adopted", generation=new.generation, world_size=new.world_size,
                      members={m.rank: m.pod for m in new.members[:64]})  # a line, not MBs

    # ------------------------------------------------------------------ inputs
    async def _on_heartbeat(self, hb: Heartbeat, env: Envelope) -> None:
        now = time.monotonic()
        self._hear(now)  # (a faulted pod's heartbeat also says the bus carries)
        if self._take(hb, env.subject, now, time.time()):
            await self._suspect(hb, env)

    async def _on_batch(self, batch: HeartbeatBatch, env: Envelope) -> None:
        """A host's pods' heartbeats in one message (plumbing/hostbeat.py): each taken as if
        it came on its own subject (a pod falling back to direct heartbeats while its relay
        is lost may be heard both ways: each is a heartbeat it sent). The clocks are read
        once a batch: at 65,536 heartbeats a second every µs a heartbeat is 0.07 of a core."""
        if env.subject.rsplit(".", 1)[-1] != batch.host:
            self._ignore(env.subject, f"subject names another host than {batch.host!r}",
                         level="warning")
            return
        now, wall = time.monotonic(), time.time()
        self._hear(now)
        for hb in batch.beats:
            if self._take(hb, env.subject, now, wall):
                await self._suspect(hb, env)

    def _take(self, hb: Heartbeat, subject: str, now: float, wall: float) -> bool:
        """One heartbeat received at ``now`` (monotonic) / ``wall``. True: it says its
        member waits in a collective (``_suspect`` it, as a repeat of its report)."""
        if hb.pod in self.faulted or hb.pod in self.gone:
            key = (hb.pod, -1)
            if key not in self._stale_logged and len(self._stale_logged) < MAX_PODS:
                self._stale_logged.add(key)
                self._ignore(subject, "pod already faulted or done: not watched", pod=hb.pod)
            return False
        v = self.pods.get(hb.pod)
        if v is not None and hb.generation < v.generation:
            key = (hb.pod, hb.generation)
            if key not in self._stale_logged and len(self._stale_logged) < MAX_PODS:
                self._stale_logged.add(key)
                self._ignore(subject, f"stale generation {hb.generation} < {v.generation}",
                             pod=hb.pod)
            return False
        if v is None:
            if len(self.pods) >= MAX_PODS:
                self._ignore(subject, "too many pods tracked", level="warning", pod=hb.pod)
                return False
            v = self.pods[hb.pod] = PodView(pod=hb.pod, role=hb.role, generation=hb.generation,
                                            step=hb.step, state=hb.state, last_advance=now,
                                            last_advance_wall=wall)
            self.log.info("watching pod", pod=hb.pod, role=hb.role.value,
                          generation=hb.generation, member=self._is_member(hb.pod))
        if (hb.step != v.step or hb.generation != v.generation
                or (hb.state != v.state and hb.state == AgentState.training)):
            v.last_advance, v.last_advance_wall = now, wall
        plan = self.plans.plan
        plan_rank = plan.rank_of(hb.pod) if plan is not None else None
        if (plan_rank is not None and hb.rank is not None and hb.rank != plan_rank
                and hb.generation == self.generation):
            self._ignore(subject, f"rank {hb.rank} differs from the plan's {plan_rank}; "
                         "using the plan's", level="debug", pod=hb.pod)
        v.role, v.generation, v.step, v.state = hb.role, hb.generation, hb.step, hb.state
        v.rank = plan_rank if plan_rank is not None else hb.rank
        self._heard_at(v, now)
        v.last_seen, v.heartbeated, v.deadline_extra = wall, True, 0.0
        if hb.solo_until is not None:
            v.solo_until, v.solo_ended = hb.solo_until, None
        elif v.solo_until is not None:
            v.solo_until, v.solo_ended = None, now
        v.compute_time = hb.compute_time
        if hb.compute_time is not None and hb.state == AgentState.training:
            self.paces.observe(hb.pod, hb.generation, hb.compute_time)
        if self.view is not None:
            self.view.note(v.hb, hb)
        v.hb = hb
        return hb.waiting_since is not None  # as a repeat of its peer_error report

    def _hear(self, now: float) -> None:
        """A pod's message arrived. The first after no pod was heard for a fault timeout ends
        the monitor's own outage: that gap is no pod's silence (one heard a moment later is
        not lost; the route that carries their messages just came back)."""
        gap = self.hearing.heard(now)
        if gap is not None and self.pods:
            self._grace(now, gap, f"no pod was heard for {gap:.3f}s")

    def _heard_at(self, v: PodView, now: float) -> None:
        """``v`` was heard from at ``now`` (monotonic, never earlier than any before): the
        only place ``last_hb`` moves forward for one pod, keeping ``pods`` in that order."""
        v.last_hb = now
        self.pods.move_to_end(v.pod)

    def _heard(self, pods: Iterable[str] | None) -> list[tuple[Heartbeat, float]]:
        views = self.pods.values() if pods is None else (self.pods.get(p) for p in pods)
        return [(v.hb, v.last_hb) for v in views if v is not None and v.hb is not None]

    async def _on_lifecycle(self, ev: Lifecycle, env: Envelope) -> None:
        if ev.event == LifecycleEvent.started:
            v = self.pods.get(ev.pod)
            if v is not None and not v.heartbeated:  # a member seeded from the plan: its
                self._heard_at(v, time.monotonic())  # grace runs from now
                v.last_seen = time.time()
            return
        if ev.event != LifecycleEvent.exited:
            return
        if ev.pod in self.faulted:
            self._ignore(env.subject, "pod already faulted", pod=ev.pod)
            return
        if ev.pod in self.held:  # its exception report decides, not its exit code
            self._ignore(env.subject, "exit of a pod whose exception report is held", pod=ev.pod)
            return
        if ev.exit_code == 0:
            self.pods.pop(ev.pod, None)
            self.gone.add(ev.pod)
            self.log.info("pod done", pod=ev.pod)
            return
        if ev.pod not in self.pods and not self._is_member(ev.pod):
            self._ignore(env.subject, "exit of a pod that is not watched", pod=ev.pod,
                         exit_code=ev.exit_code)
            return
        v = self.pods.get(ev.pod)
        if v is not None and v.heartbeated and v.state == AgentState.done:
            # It finished training (or left, job done) before it exited: whatever failed after
            # that (the script's own code after the loop) is the script's to report (`up`
            # says so); a recovery would have nothing to recover.
            self.pods.pop(ev.pod, None)
            self.gone.add(ev.pod)
            self.log.warning("pod exited with a non-zero code after it was done; not a fault",
                             pod=ev.pod, exit_code=ev.exit_code)
            return
        if ev.exit_code in REPORTED_EXITS and ev.pod not in self.exits:
            self.exits[ev.pod] = Exit(ev, time.monotonic() + self.suspect_timeout)
            return
        await self._declare_exit(ev)

    async def _declare_exit(self, ev: Lifecycle) -> None:
        v = self.pods.get(ev.pod)
        await self._declare(ev.pod, FaultKind.crash, last_seen=v.last_seen if v else ev.ts,
                            since=ev.ts, reason=f"process exited with code {ev.exit_code}",
                            role=ev.role if v is None else None)

    async def _release_exits(self, now: float) -> None:
        """The exits whose report did not come in a message's time: crashes."""
        for pod, x in list(self.exits.items()):
            if now >= x.until:
                del self.exits[pod]
                if pod not in self.faulted and pod not in self.held:
                    await self._declare_exit(x.ev)

    async def _on_report(self, r: Report, env: Envelope) -> None:
        self._hear(time.monotonic())  # before a peer_error looks for silent members
        if r.report == ReportKind.exception:
            await self._on_exception(r, env)
            return
        if r.report == ReportKind.corruption:  # judged by the failure it describes, too
            await self._on_corruption(r, env)
            return
        if r.generation < self.generation:
            self._ignore(env.subject, f"stale generation {r.generation} < {self.generation}",
                         pod=r.pod, report=r.report.value)
            return
        if r.report in EXCEPTION_REPORTS:  # digest_mismatch, recovery_failed: this generation's
            if not self._reporter_watched(r, env):
                return
            v = self.pods.get(r.pod)
            error = (r.error.strip().splitlines() or [""])[0]
            await self._declare(r.pod, FaultKind.exception,
                                last_seen=v.last_seen if v else r.ts, since=r.ts,
                                reason=f"{r.report.value}: {error}"[:2000])
        elif r.report == ReportKind.stalled:
            if r.pod in self.faulted or not self._is_member(r.pod):
                self._ignore(env.subject, "stall report of a pod that is not a watched member",
                             pod=r.pod)
                return
            v = self.pods.get(r.pod)
            if await self._declare(r.pod, FaultKind.hang, last_seen=v.last_seen if v else r.ts,
                                   since=r.ts,
                                   reason=f"reported by its own watchdog: {r.error}"[:2000]):
                await self._repeated(Failure(r.pod, "hang", self.generation, r.step, r.error))
        elif r.report == ReportKind.peer_error:
            await self._suspect(r, env)
        else:
            self.log.info("report", subject=env.subject, pod=r.pod, report=r.report.value,
                          error=r.error[:200])

    async def _on_corruption(self, r: Report, env: Envelope) -> None:
        """A member whose replica disagreed with the majority: its copy was rolled back, and
        the pod (suspect hardware) is to be replaced. That stays true when a plan made for
        something else (a capacity add) overtook the report, so the report's generation is
        not a reason to drop it: a pod still a member is declared (the soak, seed 7, lost one
        so: the corrupt pod was never swapped). A pod no longer a member has been replaced."""
        if r.pod in self.faulted or not self._is_member(r.pod):
            self._ignore(env.subject, "corruption report of a pod that is not a watched "
                         "member", pod=r.pod)
            return
        v = self.pods.get(r.pod)
        await self._declare(r.pod, FaultKind.corruption, last_seen=v.last_seen if v else r.ts,
                            since=r.ts, reason=r.error[:2000])

    def _reporter_watched(self, r: Report, env: Envelope) -> bool:
        if r.pod in self.faulted:
            self._ignore(env.subject, "pod already faulted", pod=r.pod)
            return False
        if r.pod not in self.pods and not self._is_member(r.pod):
            self._ignore(env.subject, "report from a pod that is not watched", pod=r.pod,
                         report=r.report.value)
            return False
        v = self.pods.get(r.pod)
        if v is not None and v.heartbeated and v.state == AgentState.done:
            self._ignore(env.subject, "exception after the pod was done: not a fault",
                         level="warning", pod=r.pod, error=r.error[:200])
            return False
        return True

    async def _on_exception(self, r: Report, env: Envelope) -> None:
        """The script's exception (the pod ends with it), judged by what it describes: its
        generation may be older than the plan's (the plan moved on while it was sent, or the
        pod never entered the first generation: set-up after ``init_process_group``). A
        repeat of another pod's stops the job; otherwise its fault is held while another
        member may still raise the same (``_release_held``)."""
        self.exits.pop(r.pod, None)  # its report decides, not its exit code
        known = r.pod in self.faulted or r.pod in self.pods or self._is_member(r.pod)
        if not known:
            self._ignore(env.subject, "report from a pod that is not watched", pod=r.pod,
                         report=r.report.value)
            return
        # a pod already declared (its exit read before its report) still counts for the verdict
        if r.pod not in self.faulted and not self._reporter_watched(r, env):
            return
        f = Failure(r.pod, "exception", r.generation, r.step, r.error)
        if await self._repeated(f):
            self.held.clear()  # the job stops: no fault, no replacement into the same bug
            return
        if r.pod in self.faulted or r.pod in self.held:
            return
        until = time.monotonic()
        if not injected(f):  # an injected one simulates the machines: never a repeat
            until += self._repeat_wait(r.step < 0)
        self.held[r.pod] = Held(r, until)
        await self._release_held(time.monotonic())

    def _repeat_wait(self, setup: bool = False) -> float:
        """How long a member at the same step may take to raise the same error and report
        it: a step (the members' median step time: ranks work in lockstep) and the time a
        message may take to arrive (the suspect timeout). In the set-up (no step committed)
        no step time tells: pods start apart and set up at their own pace, seconds apart on a
        loaded machine (CI: the second member's report came after the first's hold ended,
        and both spares were promoted into the same error), so a fault timeout more; nothing
        trains meanwhile, the others wait for the set-up anyway."""
        times = sorted(v.hb.step_time for v in self.pods.values()
                       if v.hb is not None and v.hb.step_time is not None)
        step = times[len(times) // 2] if times else 0.0
        return self.suspect_timeout + max(step, self.fault_timeout if setup else 0.0)

    def _may_repeat(self, r: Report, now: float) -> bool:
        """Could another pod still raise what ``r`` reports: one that is alive, not done,
        and has not committed past the reported step? Any watched pod, not only the plan's
        members: the plan this monitor holds may be older than the pods' (a set-up error
        right after the first plan), and a spare may run the same set-up. A member not heard
        from yet counts, within its grace: it may be in that same set-up (CI: w1's set-up
        error was declared at once while w0, still silent, was about to raise it too)."""
        for v in self.pods.values():
            if (v.pod == r.pod or v.pod in self.faulted
                    or v.pod in self.held or v.state in GONE_STATES
                    or now - v.last_hb > self._silence(v)):
                continue
            if v.step <= r.step:
                return True
        return False

    async def _release_held(self, now: float) -> None:
        for pod, h in list(self.held.items()):
            if now < h.until and self._may_repeat(h.report, now):
                continue
            del self.held[pod]
            r, v = h.report, self.pods.get(pod)
            error = (r.error.strip().splitlines() or [""])[0]
            await self._declare(pod, FaultKind.exception, last_seen=v.last_seen if v else r.ts,
                                since=r.ts, reason=f"{r.report.value}: {error}"[:2000])

    async def _suspect(self, r: Report | Heartbeat, env: Envelope) -> None:
        """A member waits in a collective: its peer_error report, or a heartbeat that
        carries ``waiting_since`` (agents report a wait once, then say so in each heartbeat,
        issue 45): the same run of a wait, the same look at the silent pods."""
        plan = self.plan
        if plan is None or r.generation != plan.generation:
            if isinstance(r, Report):  # a heartbeat of another generation is judged above
                self._ignore(env.subject, f"peer_error of generation {r.generation}, "
                             f"current {self.generation}", pod=r.pod)
            return
        now = time.monotonic()
        self.peer_errors += 1
        # Only the pods silent for suspect_timeout, the front of ``pods`` (least recently
        # heard first): a report costs the silent pods, not the members.
        suspects = []
        for v in self.pods.values():
            self.peer_error_looked += 1
            if now - v.last_hb <= self.suspect_timeout:
                break  # heard from since: so is every pod after it
            if (v.pod != r.pod and v.pod not in self.faulted and v.state not in GONE_STATES
                    and plan.rank_of(v.pod) is not None):
                suspects.append(v)
        started = False
        if plan.rank_of(r.pod) is not None and r.pod not in self.faulted:
            w = self.waiting.get(r.pod)
            # one run = one wait: a report for another step (the member committed in between,
            # however short the gap) starts a new run
            if w is None or w.generation != r.generation or w.step != r.step or \
                    now - w.last > self.fault_timeout:
                self.waiting[r.pod] = Waiting(r.generation, now, now, r.step)
                started = True
            else:
                w.last = now
        error = r.error if isinstance(r, Report) else \
            f"all-reduce waiting since {r.waiting_since:.3f} (heartbeat)"
        if started or suspects:  # a wait's repeats (every heartbeat interval) are not logged
            self.log.info("peer error reported", subject=env.subject, pod=r.pod,
                          error=error[:200], suspects=[v.pod for v in suspects[:16]])
        for v in suspects:
            await self._declare(v.pod, FaultKind.lost, last_seen=v.last_seen, since=v.last_seen,
                                reason=f"peer_error from {r.pod} and no heartbeat for "
                                       f"{now - v.last_hb:.3f}s")

    # ------------------------------------------------------------------ checks
    def _silence(self, v: PodView) -> float:
        """How long ``v`` may be silent before it is ``lost``. A pod still starting (its
        heartbeat says so: it imports and sets up, which holds the interpreter, for seconds on a
        loaded machine) and not a member yet (nothing waits for it) has the stall timeout; a
        member seeded from the plan, the grace it was given."""
        if v.heartbeated and v.state == AgentState.starting and not self._is_member(v.pod):
            return max(self.fault_timeout, self.stall_timeout)
        return self.fault_timeout + v.deadline_extra

    async def _check_loop(self) -> None:
        while True:
            await asyncio.sleep(self.check_interval)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.exception("check failed", error=str(e)[:200])

    def _grace(self, now: float, outage: float, why: str) -> None:
        """The monitor's own outage of ``outage`` seconds just ended at ``now``: that long is
        no pod's silence; the silence before and after it is (issue 45: a fresh fault timeout
        for every pod added up to a fault timeout to every detection of the round in which
        the reader fell behind). Each ``last_hb`` moves by the outage, never past ``now``, so
        ``pods`` keeps its order."""
        self.hearing.forgave(now)
        if outage <= 0:
            return
        self.log.warning("silence is the monitor's own: not counted", why=why,
                         outage_s=round(outage, 3), pods=len(self.pods))
        for v in self.pods.values():
            v.last_hb = min(now, v.last_hb + outage)

    def _deaf(self, now: float) -> bool:
        """No pod heard at all for a fault timeout: the monitor's own outage, not every pod
        lost (its server answers its PING while that server's route to the pods' server is
        stuck: seconds after a partition heals). Nothing is declared until a pod is heard."""
        was = self.hearing.state
        if not self.hearing.deaf(now):
            return False
        if was is not Ear.DEAF:
            self.log.warning("no pod heard at all: the silence is the monitor's own, not every "
                             "pod's; nothing is declared until a pod is heard",
                             silent_s=self.hearing.status(now)["quiet_s"],
                             pods=len(self.pods))
        return True

    async def _barrier(self) -> float | None:
        """When this process sent a PING that nats-server answered (None: not answered):
        a pod's silence counts only if the server answers, since while it is paused or
        restarting every heartbeat is missing and none is late. The PONG comes after every
        message the server sent before it, so by then each heartbeat published before the
        PING reached it has been read: silence is judged as of the PING's time, however far
        behind the reader is. The PONG is waited for while pods are heard (this reader is
        behind, the link is not down: issue 45, a reader more than the wait behind found the
        link "down" at every check, and no silence counted for seconds at 16,384 pods), at
        most ``LINK_WAIT`` fault timeouts; a slice with no pod heard is a link down.
        Once it answers again, the longest stretch in which no pod was heard (from the last
        one heard before the PING) is not counted: a paused server's; the silence of a pod
        that was silent before counts in full."""
        slice_s = max(0.2, min(1.0, self.fault_timeout / 3))
        sent = time.monotonic()
        pong, start, ok = self.bus.ping(), sent, False
        while True:
            done, _ = await asyncio.wait({pong}, timeout=slice_s)
            if done:
                ok = not pong.cancelled() and pong.exception() is None
                break
            now, last = time.monotonic(), self.hearing.last
            if last is None or last < start or now - sent > LINK_WAIT * self.fault_timeout:
                break
            start = now  # pods heard in this slice: the reader is behind, wait on
        if not ok:
            if self._link_down_since is None:
                self._link_down_since = time.monotonic()
                self.hearing.watch("link")
                self.log.warning("nats-server does not answer: no silence counts until it does")
            return None
        if self._link_down_since is not None:
            now = time.monotonic()
            down, self._link_down_since = now - self._link_down_since, None
            self._grace(now, self.hearing.unwatch("link", now),
                        f"nats-server did not answer for {down:.3f}s")
        return sent

    async def check(self) -> None:
        now = time.monotonic()
        if self.exits:  # (a standby keeps the crashes: _declare)
            await self._release_exits(now)
        if not self.acting:  # a standby: it watches (heartbeats, plans) but declares nothing
            return
        if self.held:
            await self._release_held(now)
        plan = self.plan
        # Only the front of ``pods`` (least recently heard first) can be overdue: no pod may
        # be silent for less than the fault timeout (``_silence``), so the first pod heard
        # within it ends the look. 20 checks a second over every pod were a core at 16,384.
        overdue = []
        for v in self.pods.values():
            self.check_looked += 1
            if now - v.last_hb <= self.fault_timeout:
                break
            if (v.pod not in self.faulted and v.pod not in self.held
                    and v.state not in GONE_STATES and now - v.last_hb > self._silence(v)):
                overdue.append(v)
        barrier = None
        if overdue and not self._deaf(now):
            barrier = await self._barrier()
        for v in overdue if barrier is not None else ():
            if v.pod in self.faulted:
                continue
            silent = barrier - v.last_hb  # (read since the PING: heard, negative)
            if silent > self._silence(v):
                what = "no heartbeat" if v.heartbeated else "never heartbeated"
                await self._declare(v.pod, FaultKind.lost, last_seen=v.last_seen,
                                    since=v.last_seen, reason=f"{what} for {silent:.3f}s")
        now = time.monotonic()
        # hang: a training member stalled while another member advanced in the window. It
        # scans every member, and stalls are timed in seconds: a few times a second is enough.
        if now - self._last_stall_check < min(0.25, self.stall_timeout / 20):
            return
        self._last_stall_check = now
        await self._check_absent(now, plan)
        self._stall_passes += 1
        every = -(-len(plan.members) // self.straggler_pass_members) if plan else 1
        if self._stall_passes % max(1, every) == 0:
            self.straggler_passes += 1
            await self._check_stragglers(now, plan)
        members = {m.pod for m in plan.members} if plan else set()
        window_start = now - self.stall_timeout
        views = [self.pods[p] for p in members if p in self.pods and p not in self.faulted]
        # one pass for who advanced (linear in the members, not quadratic: thousands of them)
        moved = [o for o in views if o.last_advance >= window_start and o.heartbeated]
        for v in views:
            if v.state != AgentState.training or v.last_advance > window_start or \
                    self._solo(v, now):
                continue
            # Only members that went past v's step, as v's own latest heartbeat (sent after
            # they did) still says: one that reached the same step a moment later (then
            # waits for v, e.g. in a rank-0 evaluation), or one whose heartbeat merely came
            # in before v's (heartbeats are up to an interval old), says nothing against v.
            advanced = [o.pod for o in moved if o is not v
                        and (o.generation, o.step) > (v.generation, v.step)
                        and v.last_hb > o.last_advance]
            if advanced:
                why = (f"step {v.step} not advanced for {now - v.last_advance:.3f}s while "
                       f"{', '.join(sorted(advanced)[:8])} advanced")
                if await self._declare(v.pod, FaultKind.hang, last_seen=v.last_seen,
                                       since=v.last_advance_wall, reason=why):
                    await self._repeated(Failure(v.pod, "hang", self.generation, v.step, why))

    async def _check_stragglers(self, now: float, plan: Plan | None) -> None:
        """A member whose own compute of a step (``Heartbeat.compute_time``, not the wait for
        the others) is judged slow (``stragglers.judge``: over ``straggler_factor`` times the
        others' median, or slowed that much more than they were against their own earlier
        pace) for most of ``straggler_window`` s is a ``straggler``, while a live spare can
        take its place (the scaler swaps them at a step boundary) or, without one, while the
        job is unsharded and it computes more than one micro-batch (the scaler shares them
        out). It stays watched: it is alive and a member."""
        if plan is None or self.straggler_factor <= 0:
            return
        for pod in self.paces.pods():  # bounded by the pods watched
            if pod not in self.pods:
                self.paces.forget(pod)
        views = [self.pods[m.pod] for m in plan.members if m.pod in self.pods]
        views = [v for v in views if v.compute_time is not None and v.pod not in self.faulted
                 and v.generation == plan.generation and v.state == AgentState.training]
        spare = any(  # a live spare (plan.spares lists only the plan's)
            v.role == Role.spare and v.rank is None and now - v.last_hb < self.fault_timeout
            for v in self.pods.values())
        # without one, the scaler shares an unsharded straggler's micro-batches out instead
        if len(views) < 2 or not (spare or plan.shard_size == 1):
            return
        gen = plan.generation
        paces = [stragglers.Pace(v.compute_time or 0.0, self.paces.base(v.pod, gen, now))
                 for v in views]
        # every member against the others at once: one sort, not one per member (judging
        # each alone was O(N² log N): seconds per check at thousands of members)
        verdicts = stragglers.judge_all(paces, self.paces.rule)
        for i, v in enumerate(views):
            if not spare and plan.shares.get(v.rank if v.rank is not None else -1, 0) <= 1:
                self.paces.unmark(v.pod)  # one micro-batch: nothing left to share out
                continue
            verdict = verdicts[i]
            if self.paces.mark(v.pod, gen, now, verdict.slow):
                self.log.info("member slower than the others", pod=v.pod,
                              compute_time=round(paces[i].compute, 4), against=verdict.why)
            if self.paces.due(v.pod, now):
                slow_for = self.paces.slow_for(v.pod, now)
                await self._declare(v.pod, FaultKind.straggler, last_seen=v.last_seen,
                                    since=time.time() - slow_for, keep=True,
                                    slowness=verdict.ratio,
                                    reason=f"computes a step in {paces[i].compute:.3f}s, "
                                           f"slow against {verdict.why}, in most of the "
                                           f"last {self.straggler_window:.1f}s")

    async def _check_absent(self, now: float, plan: Plan | None) -> None:
        """Members wait in a collective that another member, alive, does not enter: once one
        has waited the agents' collective timeout (when their own wait gives up), that
        member is hung. Waiting is known from the members' own reports: each says so every
        heartbeat interval while its all-reduce waits (a report, then ``waiting_since`` in its
        heartbeats) and once more when it times out, so a run ends ``fault_timeout`` after
        the last one."""
        if plan is None or not self.waiting:
            return
        live = {p: w for p, w in self.waiting.items()
                if w.generation == plan.generation and now - w.last <= self.fault_timeout
                and p not in self.faulted}
        if len(live) != len(self.waiting):
            self.waiting = dict(live)
        if not live:
            return
        first, w = min(live.items(), key=lambda kv: kv[1].since)
        waited = now - w.since
        if waited < self.collective_timeout:
            return
        absent = []
        for m in plan.members:
            v = self.pods.get(m.pod)
            if (v is None or m.pod in live or m.pod in self.faulted or not v.heartbeated
                    or v.state in GONE_STATES or now - v.last_hb > self.fault_timeout):
                continue  # waiting itself, handled, gone, or for the silence rules
            if self._solo(v, now):
                continue
            absent.append(v)
        if not absent:
            if self._all_waiting_logged != plan.generation:
                self._all_waiting_logged = plan.generation
                self.log.warning("every live member waits in the collective; nobody is absent",
                                 generation=plan.generation, waiting=sorted(live)[:16],
                                 waited=round(waited, 3))
            return
        for v in absent:
            why = (f"alive ({v.state.value}, generation {v.generation}, step {v.step}) but "
                   f"not in the collective that {first} has waited in for {waited:.3f}s "
                   f"({len(live)} member(s) waiting)")
            if await self._declare(v.pod, FaultKind.hang, last_seen=v.last_seen,
                                   since=time.time() - waited, reason=why):
                await self._repeated(Failure(v.pod, "hang", self.generation, v.step, why))

    def _solo(self, v: PodView, now: float) -> bool:
        """The member works alone by its own declaration (``Session.solo``): within its
        bound plus a collective timeout, or a collective timeout after it ended (to come back
        to the collective), it is not absent. Past that it is, like any other member."""
        if v.solo_until is not None:
            if time.time() < v.solo_until + self.collective_timeout:
                return True
        elif v.solo_ended is not None and now < v.solo_ended + self.collective_timeout:
            return True
        return False

    # ------------------------------------------------------------------ faults
    async def _repeated(self, f: Failure) -> bool:
        """A second pod failing as another did at the same step: the script's bug. Said
        once per job on ``job_failed`` (True when said now); the launcher stops the job (no
        more pods burnt)."""
        first = self.repeats.observe(f)
        await self._read_back()
        if first is None or self.job_failed is not None or not self.acting:
            return False
        hang = f.kind == "hang"
        kind = JobFailedKind.repeated_hang if hang else JobFailedKind.script_error
        hint = (f"step {f.step + 1} stood still on {first.pod} and again on {f.pod}: work on "
                "one member longer than the collective timeout (an evaluation, a save) "
                "belongs in `with s.solo(max_s=...)` (the DDP drop-in: "
                "`with dist.solo(max_s=...)`)" if hang else
                f"{first.pod} and {f.pod} raised the same error at step {f.step + 1}: a bug in "
                "the script, not a fault to recover from")
        msg = JobFailed(kind=kind, step=f.step, generation=self.generation,
                        pods=[first.pod, f.pod], error=f.error[-2048:], hint=hint[:2048],
                        term=self.term)
        self.job_failed = msg
        self.log.error("the failure is the script's: the job should stop", kind=kind.value,
                       step=f.step, pods=[first.pod, f.pod], error=f.error[:300])
        await self.bus.publish(self.bus.subjects.job_failed, msg,
                               msg_id=f"job-failed-{kind.value}-{f.step}")
        return True

    async def _declare(self, pod: str, kind: FaultKind, *, last_seen: float, since: float,
                       reason: str, role: Role | None = None, keep: bool = False,
                       slowness: float | None = None) -> bool:
        """Publish the fault of ``pod`` (once per pod and incident): True when it did.
        ``keep``: the pod stays watched (a straggler: alive, a member until swapped)."""
        gen = self.generation
        await self._read_back()
        if self.generation != gen and kind in JUDGED:
            # a plan read meanwhile (taking the lease): the silence or report was judged
            # against the plan before it; the checks judge again against this one
            return False
        incident = f"inc-{pod}-g{gen}"
        if incident in self.incidents or pod in self.faulted:
            return False
        if not self.acting:  # a standby declares nothing (the same incident id if it takes over)
            if kind == FaultKind.crash and not keep:  # ... but keeps an exit: said once
                self._kept_exits[pod] = {"last_seen": last_seen, "since": since,
                                         "reason": reason, "role": role}
                self._kept_exits.move_to_end(pod)
                while len(self._kept_exits) > MAX_PODS:
                    self._kept_exits.popitem(last=False)
            return False
        if self.job_failed is not None:  # the job stops: a replacement meets the same bug
            self.faulted.add(pod)
            self.pods.pop(pod, None)
            self.log.info("not declared: the job failed (the script's bug)", pod=pod,
                          kind=kind.value, reason=reason[:200])
            return False
        self.incidents.add(incident)
        if keep:
            v = self.pods.get(pod)
        else:
            self.faulted.add(pod)
            v = self.pods.pop(pod, None)
        plan = self.plan
        rank = plan.rank_of(pod) if plan else None
        if rank is not None:
            role = Role.worker
        elif role is None:
            role = v.role if v is not None else Role.spare
        if rank is None and v is not None and v.generation == gen:
            rank = v.rank
        detected = time.time()
        latency = max(0.0, detected - since)
        fault = Fault(incident=incident, pod=pod, kind=kind, detected_at=detected,
                      last_seen=max(0.0, last_seen), generation=gen, rank=rank, role=role,
                      detection_latency=latency, reason=reason[:2048],
                      slowness=None if slowness is None else min(1e6, max(1.0, slowness)),
                      term=self.term)
        attrs = {"ceaseless.job": self.bus.subjects.job, "ceaseless.incident": incident,
                 "ceaseless.generation": gen, "ceaseless.pod": pod,
                 "ceaseless.reason": f"{kind.value}: {reason}"[:512],
                 "ceaseless.fault_kind": kind.value, "ceaseless.role": role.value,
                 "ceaseless.detection_latency": latency}
        if rank is not None:
            attrs["ceaseless.rank"] = rank
        # The root of the incident's trace. It starts at the last evidence (the exit, the
        # last heartbeat or step advance, the report), so that it covers the time the
        # failure went unnoticed and the trace's total runs from the failure itself.
        start_ns = int(min(max(0.0, since), detected) * 1e9)
        with tracer.start_as_current_span("detect", context=otel_context.Context(),
                                          start_time=start_ns, attributes=attrs) as span:
            self.faults.append({"incident": incident, "pod": pod, "kind": kind.value,
                                "role": role.value, "rank": rank, "generation": gen,
                                "detection_latency": round(latency, 4), "reason": reason[:200],
                                "detected_at": detected})
            self.latencies.append(latency)
            self.log.warning("fault declared", incident=incident, pod=pod, kind=kind.value,
                             role=role.value, rank=rank, generation=gen,
                             detection_latency=round(latency, 4), reason=reason[:200])
            await self.bus.publish(self.bus.subjects.fault, fault, msg_id=incident,
                                   ctx=trace.set_span_in_context(span))
        return True

    # ------------------------------------------------------------------ status
    def _health(self, v: PodView, now: float) -> str:
        if v.state in GONE_STATES:
            return v.state.value
        silent = now - v.last_hb
        if not v.heartbeated:
            return f"never heartbeated ({silent:.1f}s)"
        if silent > self.suspect_timeout:
            return f"silent {silent:.1f}s"
        stalled = now - v.last_advance
        if v.state == AgentState.training and stalled > self.stall_timeout / 2:
            return f"step {v.step} for {stalled:.1f}s"
        return "ok"

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        plan = self.plan
        lat = sorted(self.latencies)
        health = {v.pod: self._health(v, now) for v in self.pods.values()}
        # the pods not "ok" first: at thousands of pods not every one is listed
        views = sorted(self.pods.values(), key=lambda v: (health[v.pod] == "ok", v.pod))
        waiting = sorted((p, round(now - w.since, 3)) for p, w in self.waiting.items()
                         if w.generation == self.generation
                         and now - w.last <= self.fault_timeout)
        return {
            "generation": self.generation,
            "job_failed": (self.job_failed.model_dump(mode="json")
                           if self.job_failed is not None else None),
            "pods": self.listed(((
                v.pod, {"role": v.role.value, "member": self._is_member(v.pod),
                        "gen": v.generation,
                        "generation": v.generation, "rank": v.rank, "step": v.step,
                        "age": round(now - v.last_hb, 3),
                        "since_advance": round(now - v.last_advance, 3),
                        "state": v.state.value, "heartbeated": v.heartbeated,
                        "device": v.hb.device if v.hb is not None else None,
                        "health": health[v.pod]}) for v in views), len(views)),
            "pods_total": len(views),
            # members reporting that they wait in a collective, and for how long (the
            # absent-member rule acts once one reaches collective_timeout)
            "waiting": self.listed(waiting, len(waiting)),
            "waiting_total": len(waiting),
            "faults_declared": len(self.incidents),
            "faults": list(self.faults)[-50:],
            "detection_latency": None if not lat else {
                "count": len(lat), "min": round(lat[0], 4), "max": round(lat[-1], 4),
                "median": round(lat[len(lat) // 2], 4),
                "last": round(self.latencies[-1], 4)},
            "ignored": dict(self.ignored),
            "peer_errors": {"reports": self.peer_errors, "pods_looked_at": self.peer_error_looked},
            "checks": {"pods_looked_at": self.check_looked,
                       "straggler_passes": self.straggler_passes},
            "config": {"fault_timeout": self.fault_timeout, "stall_timeout": self.stall_timeout,
                       "collective_timeout": self.collective_timeout,
                       "suspect_timeout": self.suspect_timeout,
                       "check_interval": self.check_interval,
                       "view_interval": self.view.interval if self.view else None},
            "views_published": self.view.published if self.view else 0,
            "hearing": self.hearing.status(now),
        }
