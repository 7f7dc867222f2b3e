"""The agent's background runtime: its own thread, asyncio loop and NATS connection.

It sends heartbeats, receives plans, transfer plans and injections, and exposes them to
the training thread through a condition variable. It never blocks the training thread:
the training thread only reads fields and waits on the condition with timeouts.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from opentelemetry import context as otel_context

from schemas.messages import (AgentState, Heartbeat, Inject, InjectAction, Plan, Report,
                              ReportKind, StateLost, Transfer)
from services.common import logs
from services.common.aio import cancel_all
from services.common.bus import Bus, Credentials, Envelope, decode

from .config import AgentConfig

log = logs.get("agent")
DONE_KEY = "done"
SOLO_KEY = "solo"
CHECKPOINT_REQUEST_KEY = "checkpoint_request"


class Runtime:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.cond = threading.Condition()
        self.abort = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.bus: Bus | None = None
        self.store_kv: Any = None
        self.kv: Any = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stopping: asyncio.Event | None = None
        self._error: BaseException | None = None
        # what the control plane told us (guarded by cond)
        self.plan: Plan | None = None
        self.plan_ctx: otel_context.Context | None = None
        self.plan_at = 0.0  # wall time the current plan arrived
        self.abort_at = 0.0  # wall time the abort flag was last set (a newer plan arrived)
        self.joined_generation = 0
        # The step the training thread is computing (None between steps). A planned plan
        # whose boundary this pod has already passed aborts that step: its peers entered the
        # new plan at the boundary, so its collective would only wait for the timeout.
        self.step_in_flight: int | None = None
        self.transfers: dict[int, tuple[Transfer, otel_context.Context]] = {}
        self.lost: dict[int, StateLost] = {}
        self.done: dict | None = None
        self.injections: list[Inject] = []
        # monotonic time the training thread entered the gradient all-reduce (None: not in it)
        self.collective_since: float | None = None
        # a newer generation being joined while the current step is computed (prejoin.py)
        self.prejoin: Any = None
        self._world_size = 0  # of the joined generation
        self._stuck_reported = 0.0
        # the training thread's last sign of progress (a step boundary, a collective, a
        # join): the stall watchdog (_report_if_stalled) measures from here
        self.progress_at = time.monotonic()
        self._stall_reported = False
        self.checkpoint_request: str | None = None  # the last one `up` made (KV)
        self._committed_in_generation = False
        # rank 0: spares that asked to follow this generation (agent/shadow.py)
        self.shadow_requests: dict[str, str] = {}  # pod -> request id
        self._shadow_watch: asyncio.Task | None = None
        # what we tell it (replaced whole, read by the heartbeat loop)
        self.hb: dict[str, Any] = dict(role=cfg.role, generation=0, rank=None, step=-1,
                                       digest="", state=AgentState.starting)

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 15.0) -> None:
        self._thread = threading.Thread(target=self._run, name="ceaseless-agent", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"agent could not connect to {self.cfg.nats_url} in {timeout}s")
        if self._error is not None:
            raise RuntimeError(f"agent could not start: {self._error}") from self._error

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop is None or self._stopping is None:
            return
        self.loop.call_soon_threadsafe(self._stopping.set)
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
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
        self.kv = await bus.kv()
        self.store_kv = await bus.store_kv()
        await bus.subscribe(s.plan, Plan, self._on_plan)
        await bus.subscribe(s.transfer, Transfer, self._on_transfer)
        await bus.subscribe(s.state_lost, StateLost, self._on_lost)
        await bus.subscribe(s.inject, Inject, self._on_inject)
        await self._load_plan()
        hb_task = asyncio.create_task(self._heartbeats())
        done_task = asyncio.create_task(self._watch_done())
        ckpt_task = asyncio.create_task(self._watch_checkpoint_request())
        self._ready.set()
        await self._stopping.wait()
        await cancel_all([hb_task, done_task, ckpt_task])
        try:
            await self._send_heartbeat()  # the final state (done / leaving)
        except Exception:
            pass
        await bus.close()

    # ------------------------------------------------------------------ inbound
    async def _load_plan(self) -> None:
        try:
            entry = await self.kv.get("plan")
        except Exception:
            return  # no plan yet
        try:
            plan = decode(Plan, entry.value, self.bus.subjects.plan)
        except Exception as e:
            log.warning("stored plan unreadable", error=str(e)[:200])
            return
        self._adopt_plan(plan, otel_context.Context())

    async def _on_plan(self, plan: Plan, env: Envelope) -> None:
        self._adopt_plan(plan, env.ctx)

    def _adopt_plan(self, plan: Plan, ctx: otel_context.Context) -> None:
        with self.cond:
            if self.plan is not None and plan.generation <= self.plan.generation:
                return  # stale or replayed
            self.plan, self.plan_ctx, self.plan_at = plan, ctx, time.time()
            # A planned (elastic) plan is entered at its step boundary, not by aborting,
            # unless it arrived after this pod started a step at or past that boundary.
            step = self.step_in_flight
            late = plan.apply_step is not None and step is not None and step >= plan.apply_step
            if plan.generation > self.joined_generation and self.joined_generation > 0 \
                    and (plan.apply_step is None or late):
                if not self._resume(plan):
                    self.abort_at = self.plan_at
                    self.abort.set()
            self.cond.notify_all()

    def _resume(self, plan: Plan) -> bool:
        """(Under ``cond``.) A fault plan that keeps this pod's rank and world size arrived
        while the training thread computes a step: join the new generation in the
        background and let the step go on (``prejoin.py``). False: abort as usual."""
        hb, step = self.hb, self.step_in_flight
        rank = hb.get("rank")
        if self.prejoin is not None:  # a second plan during the step: the ordinary way
            self.prejoin.drop()
            self.prejoin = None
            return False
        if not self.cfg.resume_in_place or plan.apply_step is not None \
                or step is None or self.collective_since is not None or self.abort.is_set() \
                or rank is None or plan.rank_of(self.cfg.pod) != rank \
                or hb.get("generation") != self.joined_generation or hb.get("step") != step - 1:
            return False
        if plan.world_size != self._world_size:
            return False
        st = hb.get("step_time")
        # the replacement waits in its rendezvous while this step finishes: keep well inside
        # the collective timeout (no median yet: no resume)
        if st is None or st > self.cfg.collective_timeout / 4:
            return False
        from .prejoin import Prejoin

        self.prejoin = Prejoin(self, plan, rank, step - 1, hb.get("digest", ""))
        log.info("fault plan while computing: finishing the step for the new generation",
                 generation=plan.generation, step=step)
        return True

    def claim_collective(self, generation: int) -> Any:
        """Training thread, entering its gradient all-reduce: the pending Prejoin of a newer
        generation, if any (the step goes to that group); else mark the all-reduce as
        started (under ``cond``: a plan arriving now aborts instead of resuming)."""
        with self.cond:
            p = self.prejoin
            if p is not None and p.generation > generation:
                return p
            self.collective_since = time.monotonic()
            self._progress()
            return None

    def enter_collective(self) -> None:
        """Training thread: the gradient all-reduce starts now (after a resume in place)."""
        with self.cond:
            self.collective_since = time.monotonic()
            self._progress()

    def take_prejoin(self, generation: int) -> Any:
        """The Prejoin of ``generation`` (handed over once); an older one is dropped."""
        with self.cond:
            p = self.prejoin
            if p is None or p.generation > generation:
                return None
            self.prejoin = None
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
        with self.cond:
            newer = self.plan is not None and self.plan.generation > self.joined_generation
            if not newer:
                log.info("abort request ignored: no plan newer than the joined generation",
                         generation=self.joined_generation)
            elif not self.abort.is_set():
                self.abort_at = time.time()
                self.abort.set()
            self.cond.notify_all()

    def begin_step(self, step: int) -> None:
        """Training thread: computing ``step`` from now (a fault plan may resume it)."""
        with self.cond:
            self.step_in_flight = step
            self._progress()

    def end_step(self) -> None:
        """Training thread: the step is over (committed or discarded). From here a fault plan
        aborts instead of resuming: a discarded step has nothing left to finish."""
        with self.cond:
            self.step_in_flight = None
            self.collective_since = None
            self._progress()

    def end_collective(self) -> None:
        with self.cond:
            self.collective_since = None
            self._progress()

    def _progress(self) -> None:
        """(Under ``cond``.) The training thread moved: a stall, if any, is over."""
        self.progress_at = time.monotonic()
        self._stall_reported = False

    def progress(self) -> None:
        """Training thread: a sign of life between boundaries (a micro-batch, a backward)."""
        with self.cond:
            self._progress()

    def note_commit(self) -> None:
        """Training thread: a step committed in the joined generation (the watchdog spares a
        generation's first step: compilation, warm-up)."""
        with self.cond:
            self._committed_in_generation = True
            self._progress()

    async def _on_transfer(self, t: Transfer, env: Envelope) -> None:
        with self.cond:
            self.transfers.setdefault(t.generation, (t, env.ctx))
            for g in [g for g in self.transfers if g < t.generation - 4]:
                del self.transfers[g]
            self.cond.notify_all()

    async def _on_lost(self, m: StateLost, env: Envelope) -> None:
        with self.cond:
            self.lost[m.generation] = m
            self.cond.notify_all()

    async def _on_inject(self, inj: Inject, env: Envelope) -> None:
        if inj.action == InjectAction.resume or (
                inj.action not in (InjectAction.exception, InjectAction.stall)
                and inj.at_step is None):
            return  # the supervisor executes kill / hang / resume (signals)
        if inj.pod is not None and inj.pod != self.cfg.pod:
            return
        if inj.rank is not None and inj.rank != self.hb.get("rank"):
            return
        if not self.cfg.allow_inject:
            log.warning("injection refused: this job does not allow injection",
                        action=inj.action.value)
            return
        log.info("injection received", action=inj.action.value, at_step=inj.at_step)
        with self.cond:
            self.injections.append(inj)
            self.cond.notify_all()

    async def _watch_done(self) -> None:
        """Spares leave when the job finished: any member writes KV ``done`` at the end."""
        while True:
            try:
                entry = await self.kv.get(DONE_KEY)
                with self.cond:
                    self.done = json.loads(entry.value)
                    self.cond.notify_all()
                return
            except Exception:
                await asyncio.sleep(0.5)

    async def _watch_checkpoint_request(self) -> None:
        """``ceaseless up`` asks for a checkpoint (KV ``checkpoint_request``) before it stops
        the job; rank 0 writes one at its next step boundary (Session)."""
        if not os.environ.get("CEASELESS_CHECKPOINT_DIR"):
            return
        while True:
            try:
                w = await self.kv.watch(CHECKPOINT_REQUEST_KEY)
                async for entry in w:
                    if entry is not None and entry.value:
                        with self.cond:
                            self.checkpoint_request = entry.value.decode()[:200]
                            self.cond.notify_all()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # reconnecting: watch again
                log.debug("checkpoint request watch failed", error=str(e)[:200])
                await asyncio.sleep(1.0)

    # ------------------------------------------------------------------ outbound
    async def _heartbeats(self) -> None:
        while True:
            try:
                await self._send_heartbeat()
                await self._report_if_stuck()
                await self._report_if_stalled()
            except Exception as e:  # reconnecting: the next beat goes through
                log.debug("heartbeat failed", error=str(e)[:200])
            await asyncio.sleep(self.cfg.heartbeat_interval)

    async def _report_if_stuck(self) -> None:
        """The all-reduce has waited ``stuck_report_after``: say so (peer_error), so the
        monitor looks for a member whose heartbeats stopped. Harmless when none has."""
        since, after = self.collective_since, self.cfg.stuck_report_after
        now = time.monotonic()
        if since is None or after <= 0 or now - since < after:
            return
        if now - self._stuck_reported < self.cfg.heartbeat_interval * 0.9:
            return
        self._stuck_reported = now
        await self.report(ReportKind.peer_error,
                          f"all-reduce waiting for {now - since:.2f}s")

    async def _report_if_stalled(self) -> None:
        """The stall watchdog: a member whose training thread reached no step boundary and
        no collective for ``stall_timeout`` (and declared no ``solo``) reports itself, once
        per stall (a hang of user code, a deadlock) while its heartbeats, from this thread,
        go on. Waiting in a collective is not a stall of this member (the monitor's
        absent-member rule finds whoever it waits for)."""
        limit = self.cfg.stall_timeout or self.cfg.collective_timeout
        hb = self.hb
        if (limit <= 0 or self._stall_reported or hb.get("rank") is None
                or hb.get("state") != AgentState.training or self.collective_since is not None
                or not self._committed_in_generation):
            return
        st = hb.get("step_time")
        if st:
            limit = max(limit, 3 * st)  # a job whose steps are slow is not stalled by them
        solo = hb.get("solo_until")
        if solo is not None and time.time() < solo + self.cfg.collective_timeout:
            return  # declared work alone, as the monitor allows it
        idle = time.monotonic() - self.progress_at
        if idle < limit:
            return
        self._stall_reported = True
        log.warning("training thread stalled: reporting this pod hung", idle_s=round(idle, 3),
                    step=hb.get("step"), stall_timeout=limit)
        await self.report(ReportKind.stalled,
                          f"training thread made no progress for {idle:.1f}s (no step "
                          f"boundary, no collective; stall timeout {limit:g}s)")

    async def _send_heartbeat(self) -> None:
        hb = Heartbeat(pod=self.cfg.pod, pid=_pid(), **self.hb)
        await self.bus.publish(self.bus.subjects.heartbeat(self.cfg.pod), hb)

    def update(self, now: bool = False, **fields: Any) -> None:
        """Set heartbeat fields (training thread); ``now`` sends one at once."""
        if fields.get("state") == AgentState.training and self.hb.get("state") != AgentState.training:
            with self.cond:
                self._progress()  # (re)joined: the stall watchdog counts from here
        self.hb = {**self.hb, **fields}
        if now and self.loop is not None:
            self.submit(self._send_heartbeat())

    def submit(self, coro) -> Future:
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def publish(self, subject: str, msg, ctx: otel_context.Context | None = None) -> Future:
        return self.submit(self.bus.publish(subject, msg, ctx=ctx))

    async def report(self, kind: ReportKind, error: str) -> None:
        await self.bus.publish(self.bus.subjects.report(self.cfg.pod), Report(
            pod=self.cfg.pod, report=kind, generation=self.hb.get("generation", 0),
            rank=self.hb.get("rank"), step=self.hb.get("step", -1), error=error[:2000]))

    def report_sync(self, kind: ReportKind, error: str, timeout: float = 2.0) -> None:
        try:
            self.submit(self.report(kind, error)).result(timeout)
        except Exception as e:
            log.warning("could not send report", error=str(e)[:200])

    def put_done(self, step: int, generation: int) -> None:
        data = json.dumps({"step": step, "generation": generation, "pod": self.cfg.pod}).encode()
        try:
            self.submit(self.kv.put(DONE_KEY, data)).result(5.0)
        except Exception as e:
            log.warning("could not record job completion", error=str(e)[:200])

    # ------------------------------------------------------------------ solo work
    def put_solo(self, generation: int, until: float, ended: float | None = None) -> None:
        """Tell the peers of ``generation`` that this member works alone until ``until``
        (wall time), or that it ``ended`` then: their collective waits extend to match."""
        data = json.dumps({"pod": self.cfg.pod, "until": until, "ended": ended}).encode()
        try:
            self.submit(self.kv.put(f"{SOLO_KEY}.g{generation}", data)).result(5.0)
        except Exception as e:
            log.warning("could not record the solo", error=str(e)[:200])

    def solo_of(self, generation: int) -> dict | None:
        """The solo a member of ``generation`` declared last (None: none, or unreadable)."""
        async def get() -> dict | None:
            try:
                e = await self.kv.get(f"{SOLO_KEY}.g{generation}")
            except Exception:
                return None
            return json.loads(e.value) if e is not None and e.value else None
        try:
            return self.submit(get()).result(2.0)
        except Exception:
            return None

    # ------------------------------------------------------------------ shadow spares
    def request_shadow(self, generation: int, pod: str) -> str | None:
        """A spare asks rank 0 of ``generation`` to stream the state to it; returns the
        request id (None: the request could not be stored)."""
        rid = f"{_pid()}-{time.time_ns()}"  # unique per ask: a restarted spare asks anew
        try:
            self.submit(self.store_kv.put(f"shreq{generation}.{pod}", rid.encode())).result(5.0)
            return rid
        except Exception as e:
            log.warning("could not ask to follow the job", error=str(e)[:200])
            return None

    def shadow_request(self, generation: int, pod: str) -> str | None:
        """Rank 0: the request id ``pod`` stored for ``generation``, if any."""
        async def get() -> str | None:
            try:
                e = await self.store_kv.get(f"shreq{generation}.{pod}")
            except Exception:
                return None
            return bytes(e.value).decode() if e.value else None

        try:
            return self.submit(get()).result(2.0)
        except Exception:
            return None

    def watch_shadow_requests(self, generation: int | None) -> None:
        """Rank 0: collect the spares asking to follow ``generation`` into
        ``shadow_requests`` (None: stop)."""
        def start() -> None:
            if self._shadow_watch is not None:
                self._shadow_watch.cancel()
                self._shadow_watch = None
            with self.cond:
                self.shadow_requests = {}
            if generation is not None:
                self._shadow_watch = asyncio.ensure_future(self._watch_requests(generation))

        if self.loop is not None:
            self.loop.call_soon_threadsafe(start)

    async def _watch_requests(self, generation: int) -> None:
        prefix = f"shreq{generation}."
        w = None
        try:
            w = await self.store_kv.watch(prefix + ">")
            async for e in w:
                if e is None or e.operation is not None:  # initial-values marker, deletes
                    continue
                with self.cond:
                    self.shadow_requests = {**self.shadow_requests,
                                            e.key[len(prefix):]: bytes(e.value or b"").decode()}
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.info("watching for spares ended", error=str(e)[:200])
        finally:
            if w is not None:
                try:
                    await w.stop()
                except Exception:
                    pass

    # ------------------------------------------------------------------ training-thread waits
    def wait(self, pred: Callable[[], Any], timeout: float | None) -> Any:
        """Wait (training thread) until ``pred()`` is truthy; returns it or None on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            while True:
                v = pred()
                if v:
                    return v
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self.cond.wait(0.5 if left is None else min(left, 0.5))

    def join(self, generation: int, world_size: int = 0) -> None:
        """The training thread now works in ``generation``: newer plans abort it."""
        with self.cond:
            self.joined_generation = generation
            self._world_size = world_size
            self._committed_in_generation = False
            self._progress()
            self.abort.clear()
            if self.plan is not None and self.plan.generation > generation \
                    and self.plan.apply_step is None:
                self.abort_at = self.plan_at
                self.abort.set()

    def take_injections(self) -> list[Inject]:
        with self.cond:
            out, self.injections = self.injections, []
            return out


def _pid() -> int:
    import os

    return os.getpid()
