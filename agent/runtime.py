"""The agent's background runtime: its own thread, asyncio loop and NATS connection.

It records; it does not decide. It sends heartbeats, receives plans, transfer plans and
injections, and hands them to the training thread under one private lock: an inbox of plans,
each consumed once (``take_plans``; ``Membership.newest_plan`` is the only reader), waits
(``wait``, ``wait_transfer``: the transfer plan or state lost of a generation), the step's
life as one explicit state (``vocab.StepLife``: IDLE, COMPUTING, REDUCING, moved only by
``begin_step`` / ``claim_collective`` / ``enter_collective`` / ``end_collective`` /
``end_step`` along ``vocab.STEP_MOVES``), and a typed heartbeat (``update``). It never
blocks the training thread. A plan arriving during a step is judged by
``vocab.plan_arrival`` against the step's life; the runtime applies the verdict: the abort
flag, or Membership's ``start_prejoin`` (resume in place, ``prejoin.py``). A deposed
service instance's plan or transfer (an older lease term) is ignored (``terms.py``).
"""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable

from opentelemetry import context as otel_context

from schemas.messages import (AgentState, Heartbeat, Inject, InjectAction, Plan, Report,
                              ReportKind, StateLost, Transfer, now)
from plumbing import logs
from plumbing.aio import cancel_all
from plumbing.bus import Bus, Credentials, Envelope, watch_key
from plumbing.plan_wire import PLAN_MODELS
from plumbing.terms import NewestTerm, of_plan

from .buckets import Bucket
from .catchup import CatchUp
from .config import AgentConfig
from .groups import reap
from .hostbeat import Beats
from .inject import Inbox, answer
from .vocab import Arrival, StepLife, StepPhase, StepView, Verdict, plan_arrival
from .watchdog import Watchdog

log = logs.get("agent")
DONE_KEY = "done"
CHECKPOINT_REQUEST_KEY = "checkpoint_request"


class Runtime:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self._cond = threading.Condition()
        self.abort = threading.Event()  # a newer plan than the joined generation exists
        self.injected_stall = False     # set by Injector: its stall report says "(injected)"
        self._loop: asyncio.AbstractEventLoop | None = None
        self.bus: Bus | None = None
        self._kv: Any = None
        self.kv: Bucket | None = None      # the job's KV (done, solo), once started
        self.stores: Bucket | None = None  # the store bucket: rendezvous, shadow requests
        self._thread: threading.Thread | None = None
        self._catch: CatchUp | None = None  # what a reconnect missed (agent/catchup.py)
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        # what the control plane told us (guarded by _cond)
        self._plan: Plan | None = None
        self._plan_ctx: otel_context.Context | None = None
        self._plan_at = 0.0  # wall time the current plan arrived
        self._abort_at = 0.0  # wall time the abort flag was last set (a newer plan arrived)
        self._joined_generation = 0
        # The training thread's step (vocab.StepLife: IDLE, COMPUTING, REDUCING), moved only
        # by the handshakes below. A planned plan whose boundary this pod already passed
        # aborts the step in flight (its peers entered the new plan at the boundary).
        self._life = StepLife()
        # Plans for the training thread, each consumed once (take_plans); ``_plan`` the newest
        self._inbox: deque[Arrival] = deque(maxlen=64)
        self._transfers: dict[int, tuple[Transfer, otel_context.Context]] = {}
        self._lost: dict[int, StateLost] = {}
        self._scaler, self._broker = NewestTerm("scaler", log), NewestTerm("state_broker", log)
        self._done: dict | None = None
        self.injections = Inbox(cfg)  # accepted injections until their step (own lock)
        self._prejoin: Any = None  # the next generation joined while a step is computed
        # Membership's: join ``plan`` ahead under the lock when plan_arrival says RESUME
        self.start_prejoin: Callable[[Plan, int, int, str], Any] | None = None
        self.on_preempt: Callable[[float | None], None] | None = None  # Membership's notice
        self.step_began = time.monotonic()
        self._world_size = 0  # of the joined generation
        # the training thread's signs of progress (a step boundary, a collective, a join)
        self._watchdog = Watchdog(cfg)
        self._beats: Beats | None = None  # how heartbeats go out (set once connected)
        self._checkpoint_request: str | None = None  # the last one `up` made (KV)
        # what we tell the control plane: replaced whole (frozen), sent by the heartbeat loop
        self._hb = Heartbeat(pod=cfg.pod, pid=os.getpid(), role=cfg.role, generation=0, rank=None,
                             step=-1, digest="", state=AgentState.starting)

    # ------------------------------------------------------------------ read-only faces
    @property
    def hb(self) -> Heartbeat:
        """The heartbeat as last updated (immutable)."""
        return self._hb

    @property
    def plan(self) -> Plan | None:
        with self._cond:
            return self._plan

    @property
    def plan_ctx(self) -> otel_context.Context | None:
        with self._cond:
            return self._plan_ctx

    @property
    def plan_at(self) -> float:
        with self._cond:
            return self._plan_at

    @property
    def abort_at(self) -> float:
        with self._cond:
            return self._abort_at

    @property
    def checkpoint_request(self) -> str | None:
        with self._cond:
            return self._checkpoint_request

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 15.0) -> None:
        self._thread = threading.Thread(target=self._run, name="ceaseless-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"agent could not connect to {self.cfg.nats_url} in {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"agent could not start: {self._error}") from self._error

    def stop(self, timeout: float = 5.0) -> None:
        if self._loop is None or self._stopping is None:
            return
        self._loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._main())
        except BaseException as e:  # surfaced to start(); logged otherwise
            self._error = e
            self._ready.set()
            log.exception("agent runtime stopped", error=str(e)[:200])

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        creds = Credentials.load(self.cfg.creds_path) if self.cfg.creds_path else None
        self.bus = bus = await Bus.connect(self.cfg.nats_url, self.cfg.job,
                                           f"agent-{self.cfg.pod}", creds)
        s = bus.subjects
        self._kv = await bus.kv()
        self.kv, self.stores = [Bucket(k, self._loop, self.cfg.store_timeout, bus.reconnects)
                                for k in (self._kv, await bus.store_kv())]  # watches: reopened
        self._catch = c = CatchUp(bus, self._kv, lambda: self.plan, self._adopt_plan,
                                  self._on_transfer, self._on_lost)
        await bus.subscribe(s.plan, PLAN_MODELS, c.on_plan)  # whole, or a large one's ref
        await bus.subscribe(s.transfer, Transfer, self._on_transfer)
        await bus.subscribe(s.state_lost, StateLost, self._on_lost)
        await bus.subscribe(s.inject, Inject, self._on_inject)
        await c.read_plan()
        self._beats = b = await Beats.start(bus, self.cfg)  # each alone, or by its host's relay
        tasks = [asyncio.create_task(t) for t in (self._heartbeats(c), self._watch_done(),
                                                  self._watch_checkpoint_request(),
                                                  c.follow_plan(), b.run())]
        self._ready.set()
        await self._stopping.wait()
        await cancel_all(tasks)
        try:  # the final state (done / leaving); injections whose step never came, refused
            await self._send_heartbeat()
            for d in self.injections.left(self._hb.step):
                await bus.publish(s.decision, d)
        except Exception:
            pass
        await bus.close()
        # What else runs on this loop is cancelled and awaited, as asyncio.run does (a store
        # watcher, nats-py's consumer checks): left pending, each was destroyed with the loop
        # at exit, "Task was destroyed but it is pending!" in the pod's log (issue 33).
        me = asyncio.current_task()
        await cancel_all([t for t in asyncio.all_tasks() if t is not me])

    # ------------------------------------------------------------------ inbound
    def _adopt_plan(self, plan: Plan, ctx: otel_context.Context) -> None:
        with self._cond:
            if self._plan is not None and plan.generation <= self._plan.generation \
                    or self._scaler.stale(plan.term, "plan"):
                return  # stale, replayed, or a deposed scaler's (an older term)
            self._plan, self._plan_ctx, self._plan_at = plan, ctx, time.time()
            self._inbox.append(Arrival("plan", plan=plan, ctx=ctx, at=self._plan_at))
            life = self._life

            view = StepView(joined_generation=self._joined_generation,
                            step_in_flight=life.step,
                            in_collective=life.phase is StepPhase.REDUCING,
                            aborted=self.abort.is_set(), world_size=self._world_size,
                            prejoining=self._prejoin is not None, hb=self._hb)
            verdict = plan_arrival(plan, view, self.cfg)
            if verdict is not Verdict.NOTHING and self._prejoin is not None:
                self._prejoin.drop()  # a second plan during the step: the ordinary way
                self._prejoin = None
            if verdict is Verdict.RESUME and self.start_prejoin is None:
                verdict = Verdict.ABORT  # nobody to join ahead (no Membership): the plain way
            if verdict is Verdict.RESUME:
                self._prejoin = self.start_prejoin(plan, self._hb.rank, life.step - 1,
                                                   self._hb.digest)
                log.info("fault plan while computing: finishing the step for the new "
                         "generation", generation=plan.generation, step=life.step)
            elif verdict is Verdict.ABORT:
                self._abort_at = self._plan_at
                self.abort.set()
            self._cond.notify_all()

    def claim_collective(self, generation: int) -> Any:
        """Training thread, entering its gradient all-reduce: the pending Prejoin of a newer
        generation, if any (the step goes to that group); else mark the all-reduce as
        started (under ``cond``: a plan arriving now aborts instead of resuming)."""
        with self._cond:
            p = self._prejoin
            if p is not None and p.generation > generation:
                return p
            self._move(StepPhase.REDUCING, since=time.monotonic())
            return None

    def enter_collective(self) -> None:
        """Training thread: the gradient all-reduce starts now (after a resume in place)."""
        with self._cond:
            self._move(StepPhase.REDUCING, since=time.monotonic())

    def take_prejoin(self, generation: int) -> Any:
        """The Prejoin of ``generation`` (handed over once); an older one is dropped."""
        with self._cond:
            p = self._prejoin
            if p is None or p.generation > generation:
                return None
            self._prejoin = None
        if p.generation == generation:
            return p
        p.drop()
        return None

    def interrupt(self) -> None:
        """Abort the training thread's current step (from any thread) in favour of the
        newer plan. The abort flag means "a plan newer than the joined generation exists":
        without one, there is nothing to go to, so nothing is aborted. (A prejoin whose
        verdict came after the training thread had already joined its generation by the
        ordinary path used to set a stale flag here: the member then discarded the first
        step of the generation it had just joined and waited for a plan nobody would send,
        while its peers waited for it in the all-reduce, issue 24.)"""
        with self._cond:
            newer = self._plan is not None and self._plan.generation > self._joined_generation
            if not newer:
                log.info("abort request ignored: no plan newer than the joined generation",
                         generation=self._joined_generation)
            elif not self.abort.is_set():
                self._abort_at = time.time()
                self.abort.set()
            self._cond.notify_all()

    def begin_step(self, step: int) -> None:
        """Training thread: computing ``step`` from now (a fault plan may resume it)."""
        with self._cond:
            self._move(StepPhase.COMPUTING, step=step)
            self.step_began = time.monotonic()  # the stepper's compute time starts here

    def end_step(self) -> None:
        """Training thread: the step is over (committed or discarded). From here a fault plan
        aborts instead of resuming: a discarded step has nothing left to finish."""
        with self._cond:
            self._move(StepPhase.IDLE)

    def end_collective(self) -> None:
        """Training thread: the step's gradient all-reduce is over (summed or failed). The
        step is no longer in flight either: it commits in this generation or is discarded,
        so a fault plan arriving from here aborts instead of resuming. (Taken for resumable
        here, the prejoin reported the step before, the broker restored it, and the member,
        which had committed one more, waited for a plan that never came: `bench recovery`.)"""
        with self._cond:
            self._move(StepPhase.IDLE)

    def _move(self, phase: StepPhase, step: int | None = None,
              since: float | None = None) -> None:
        """(Under the lock.) The step's life moves (``vocab.STEP_MOVES``); the step stays
        the one in flight unless a new one begins. Every move is progress (the watchdog)."""
        keep = step if step is not None else (self._life.step if phase is not StepPhase.IDLE
                                              else None)
        self._life = self._life.to(phase, keep, since)
        self._progress()

    def _progress(self) -> None:
        """(Under the lock.) The training thread moved: a stall, if any, is over."""
        self._watchdog.progress()

    def progress(self) -> None:
        """Training thread: a sign of life between boundaries (a micro-batch, a backward)."""
        with self._cond:
            self._progress()

    def note_commit(self) -> None:
        """Training thread: a step committed (the watchdog spares a generation's first)."""
        with self._cond:
            self._watchdog.committed()

    async def _on_transfer(self, t: Transfer, env: Envelope) -> None:
        with self._cond:
            if not of_plan(t, self._plan, log) or self._broker.stale(t.term, "transfer"):
                return  # the newest broker's transfer for this plan of a generation counts
            self._transfers[t.generation] = (t, env.ctx)
            for g in [g for g in self._transfers if g < t.generation - 4]:
                del self._transfers[g]
            self._cond.notify_all()

    async def _on_lost(self, m: StateLost, env: Envelope) -> None:
        with self._cond:
            if of_plan(m, self._plan, log) and not self._broker.stale(m.term, "state_lost"):
                self._lost[m.generation] = m
            self._cond.notify_all()

    async def _on_inject(self, inj: Inject, env: Envelope) -> None:
        plan = self.plan
        if inj.rank is not None and self._catch and (plan is None or plan.pod_of(inj.rank) is None):
            await self._catch.read_plan()  # the scaler writes the KV before it publishes a plan
        d = self.injections.offer(inj, self.plan, self._hb)
        if d is not None and d.accepted and inj.action == InjectAction.preempt and self.on_preempt:
            self.on_preempt(inj.deadline_s)  # a notice now, not at a step's sync
        if d is not None:
            await self.bus.publish(self.bus.subjects.decision, d)

    async def _watch_done(self) -> None:
        """Spares leave when the job finished: any member writes KV ``done`` at the end."""
        while True:
            try:
                entry = await self._kv.get(DONE_KEY)
                with self._cond:
                    self._done = json.loads(entry.value)
                    self._cond.notify_all()
                return
            except Exception:
                await asyncio.sleep(0.5)

    async def _watch_checkpoint_request(self) -> None:
        """``ceaseless up`` asks for a checkpoint (KV ``checkpoint_request``) before it stops
        the job; rank 0 writes one at its next step boundary (Session)."""
        if not os.environ.get("CEASELESS_CHECKPOINT_DIR"):
            return

        def note(value: bytes) -> None:
            with self._cond:
                self._checkpoint_request = value.decode()[:200]
                self._cond.notify_all()

        await watch_key(self._kv, CHECKPOINT_REQUEST_KEY, note, "checkpoint request")

    # ------------------------------------------------------------------ outbound
    async def _heartbeats(self, catch: CatchUp) -> None:
        while True:
            try:
                catch.after_reconnect()  # plain pushes are lost while reconnecting
                await self._send_heartbeat()
                await self._report_if_stuck()
                await self._report_if_stalled()
                reap()  # aborted generations' finished works: their buffers go back
            except Exception as e:  # reconnecting: the next beat goes through
                log.debug("heartbeat failed", error=str(e)[:200])
            await asyncio.sleep(self.cfg.heartbeat_interval)

    async def _report_if_stuck(self) -> None:
        """The all-reduce has waited long: say so (peer_error, once per wait), so the monitor
        looks for a member whose heartbeats stopped. Harmless when none has (``watchdog.py``)."""
        with self._cond:
            msg = self._watchdog.stuck(self._life.since)
        if msg is not None:
            await self.report(ReportKind.peer_error, msg)

    async def _report_if_stalled(self) -> None:
        """The stall watchdog (``watchdog.py``): a hang of user code, a deadlock."""
        with self._cond:
            got = self._watchdog.stalled(self._hb, self._life.phase is StepPhase.REDUCING)
            step = self._hb.step
        if got is not None:
            msg, idle, limit = got
            if self.injected_stall:  # a simulated machine fault, not the script's (repeats.py)
                msg += " (injected)"
            log.warning("training thread stalled: reporting this pod hung",
                        idle_s=round(idle, 3), step=step, stall_timeout=limit)
            await self.report(ReportKind.stalled, msg)

    async def _send_heartbeat(self) -> None:
        with self._cond:  # a wait says so in each heartbeat (watchdog.py)
            since = self._watchdog.waiting_since(self._life.since)
        hb = self._hb.model_copy(update={"ts": now(), "waiting_since": since})
        await self._beats.send(hb, final=self._stopping.is_set())  # type: ignore[union-attr]

    def update(self, now: bool = False, **fields: Any) -> None:
        """Set heartbeat fields (any thread); ``now`` sends one at once."""
        fields = {"digest_step": None, **fields} if "digest" in fields else fields  # step's
        with self._cond:
            if fields.get("state") == AgentState.training and self._hb.state != AgentState.training:
                self._progress()  # (re)joined: the stall watchdog counts from here
            self._hb = self._hb.model_copy(update=fields)
        if now and self._loop is not None:
            self.submit(self._send_heartbeat())

    def submit(self, coro) -> Future:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def publish(self, subject: str, msg, ctx: otel_context.Context | None = None) -> Future:
        return self.submit(self.bus.publish(subject, msg, ctx=ctx))

    async def report(self, kind: ReportKind, error: str) -> None:
        await self.bus.publish(self.bus.subjects.report(self.cfg.pod), Report(
            pod=self.cfg.pod, report=kind, generation=self._hb.generation,
            rank=self._hb.rank, step=self._hb.step, error=error[:2000]))

    def report_sync(self, kind: ReportKind, error: str, timeout: float = 2.0) -> None:
        try:
            self.submit(self.report(kind, error)).result(timeout)
        except Exception as e:
            log.warning("could not send report", error=str(e)[:200])

    # ------------------------------------------------------------------ training-thread inbox
    def notify(self) -> None:
        """Wake the training thread's wait (something it waits on may have changed)."""
        with self._cond:
            self._cond.notify_all()

    def take_plans(self) -> list[Arrival]:
        """Training thread: the plans that arrived since it last looked, oldest first; each
        is handed over once (the inbox is emptied)."""
        with self._cond:
            out = list(self._inbox)
            self._inbox.clear()
            return out

    @property
    def done(self) -> dict | None:
        """KV ``done`` (the job's last step committed), once seen."""
        with self._cond:
            return self._done

    def wait(self, ready: Callable[[], Any], timeout: float | None) -> Any:
        """Training thread: wait until ``ready()`` (called under the lock, woken by
        whatever the runtime receives) returns something; None on timeout."""
        return self._wait(ready, timeout)

    def wait_transfer(self, generation: int, timeout: float) -> Arrival | None:
        """Wait for the broker's verdict on ``generation``: "transfer" (its plan), "lost"
        (no member holds the state), or "abort" (a newer plan); None on timeout."""
        def ready() -> Arrival | None:
            if generation in self._lost:
                return Arrival("lost", lost=self._lost[generation])
            if generation in self._transfers:
                t, ctx = self._transfers[generation]
                return Arrival("transfer", transfer=t, ctx=ctx)
            return Arrival("abort") if self.abort.is_set() else None

        got = self._wait(ready, timeout)
        if got is None and self._catch is not None:  # missed? the stream keeps the last one
            self._catch.read_outcomes_from(self.submit, self.cfg.store_timeout)
            got = self._wait(ready, 0)
        return got

    def _wait(self, pred: Callable[[], Any], timeout: float | None) -> Any:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                v = pred()
                if v:
                    return v
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(0.5 if left is None else min(left, 0.5))

    def join(self, generation: int, world_size: int = 0) -> None:
        """The training thread now works in ``generation``: newer plans abort it."""
        with self._cond:
            self._joined_generation = generation
            self._world_size = world_size
            self._watchdog.joined()
            self.abort.clear()
            if self._plan is not None and self._plan.generation > generation \
                    and self._plan.apply_step is None:
                self._abort_at = self._plan_at
                self.abort.set()

    def take_injections(self, step: int) -> list[Inject]:
        return self.injections.take(step)

    def refuse_injection(self, inj: Inject, reason: str) -> None:
        self.publish(self.bus.subjects.decision, answer(inj, self.cfg.pod, reason, "", None))
