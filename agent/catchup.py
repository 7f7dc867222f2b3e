"""What a pod missed while its NATS link was down: plans and transfer plans reach it as plain
messages, and one published while it reconnects is gone. Left at that, the pod stays in the
old generation until a timeout makes a second incident.

* The plan: KV ``plan`` is the truth (the scaler writes it before publishing), followed with
  a watch (``plumbing.bus.watch_key``: the current value first, again when the watch is
  renewed) and read again whenever the connection came back. A large plan is a reference
  (``plumbing.plan_wire``): ``resolve`` builds it from the held plan and its change, or reads
  its parts.
* The transfer plan (or state lost) of a generation: the job's JetStream stream keeps the
  last message of each subject; the pod reads it back when its connection came back and
  when it waited for one in vain (``Runtime.wait_transfer``). Only the current plan's
  generation counts, and nothing older than that plan (the stream may hold an earlier
  run's).

It runs on the runtime's event loop and hands what it found to the runtime's own handlers,
which drop what is stale or already known.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from nats.js.errors import KeyNotFoundError, NotFoundError
from opentelemetry import context as otel_context

from schemas import PLAN_KEY
from schemas.messages import Plan, PlanRef, StateLost, Transfer
from plumbing import logs
from plumbing.bus import Bus, Envelope, decode, watch_key
from plumbing.plan_wire import PLAN_MODELS, resolve

log = logs.get("agent")

READ_TRIES = 30  # after a reconnect, a second apart: a restarted server's JetStream is up
KV_GRACE_S = 0.5  # a plan seen in KV waits this long for its message (follow_plan)
Handler = Callable[[Any, Envelope], Awaitable[None]]  # the runtime's own handlers
Adopt = Callable[[Plan, otel_context.Context], None]  # the runtime's: a plan and its context


class CatchUp:
    def __init__(self, bus: Bus, kv: Any, plan: Callable[[], Plan | None],
                 adopt: Adopt, on_transfer: Handler, on_lost: Handler) -> None:
        self.bus, self.kv = bus, kv
        self._plan, self._adopt = plan, adopt
        self._on_transfer, self._on_lost = on_transfer, on_lost
        self._reconnects = self._count()
        self._task: asyncio.Task | None = None  # the catch-up after a reconnect, if running
        self._pending: set[asyncio.Task] = set()  # stored plans waiting for their message

    def _count(self) -> int:
        try:
            return int(self.bus.nc.stats.get("reconnects", 0))
        except Exception:
            return 0

    def after_reconnect(self) -> None:
        """When the connection came back since the last call: read the plan and its transfer
        plan, whatever was missed meanwhile, in a task of its own (never in the caller's
        way: the heartbeats go on while a restarted server's JetStream is not answering)."""
        n = self._count()
        if n == self._reconnects or (self._task is not None and not self._task.done()):
            return
        self._reconnects = n
        log.info("catching up on what the reconnect may have missed")
        self._task = asyncio.create_task(self._until_read())

    async def _until_read(self) -> None:
        for _ in range(READ_TRIES):  # no answer yet (JetStream starting): again
            if await self.read_plan() and await self.read_outcomes():
                return
            await asyncio.sleep(1.0)
        log.warning("could not read the plan and transfer plan after a reconnect",
                    tries=READ_TRIES)

    async def read_plan(self) -> bool:
        """The plan KV holds now, if any. False: no answer (try again)."""
        try:
            entry = await self.kv.get(PLAN_KEY)
        except (KeyNotFoundError, NotFoundError):
            return True  # no plan yet
        except Exception as e:
            log.debug("plan not read", error=str(e)[:200])
            return False
        plan = await self._stored(entry.value) if entry.value else None
        if plan is not None:
            self._adopt(plan, otel_context.Context())  # read from KV: no trace context
        return True

    async def on_plan(self, msg: Plan | PlanRef, env: Envelope) -> None:
        """A ``plan`` message: the plan it carries or names, with its trace context."""
        plan = await self.resolve(msg)
        if plan is not None:
            self._adopt(plan, env.ctx)

    async def resolve(self, msg: Plan | PlanRef) -> Plan | None:
        """The plan ``msg`` carries or names (None: not newer than the held one, or not
        readable: logged, the last good plan stays)."""
        held = self._plan()
        if isinstance(msg, PlanRef) and held is not None and msg.generation <= held.generation:
            return None  # nothing newer: no part read for it
        try:
            return await resolve(self.kv, msg, held)
        except Exception as e:  # bad input: logged and dropped
            log.warning("plan unreadable", generation=msg.generation, error=str(e)[:200])
            return None

    async def _stored(self, raw: bytes, grace: float = 0.0) -> Plan | None:
        try:
            msg = decode(PLAN_MODELS, raw, "kv.plan")
        except Exception as e:  # bad input: logged and dropped, the last good plan stays
            log.warning("stored plan unreadable", error=str(e)[:200])
            return None
        if grace:  # its message (with the incident's trace context) should come first
            await asyncio.sleep(grace)
        return await self.resolve(msg)

    async def follow_plan(self) -> None:
        """Every plan KV holds from now on (runs until cancelled), each adopted after
        ``KV_GRACE_S``: the scaler publishes a plan right after writing it, and the message
        carries the trace context the incident's spans hang from, so it should come first
        (the runtime keeps the first of a generation it sees; a large plan's parts are not
        read at all once its message brought it)."""
        async def adopt_later(raw: bytes) -> None:
            plan = await self._stored(raw, KV_GRACE_S)
            if plan is not None:
                self._adopt(plan, otel_context.Context())

        def on_value(raw: bytes) -> None:
            t = asyncio.create_task(adopt_later(raw))
            self._pending.add(t)
            t.add_done_callback(self._pending.discard)

        try:
            await watch_key(self.kv, PLAN_KEY, on_value, "plan")
        finally:
            for t in list(self._pending):
                t.cancel()

    async def read_outcomes(self) -> bool:
        """The current plan's transfer plan or state lost, if the stream holds one. False: no
        answer (try again)."""
        ok = True
        s = self.bus.subjects
        for subject, model, hand in ((s.transfer, Transfer, self._on_transfer),
                                     (s.state_lost, StateLost, self._on_lost)):
            try:
                msg = await self.bus.js.get_last_msg(s.stream, subject)
            except NotFoundError:
                continue  # none yet: nothing to catch up on
            except Exception as e:
                log.debug("stream not read", subject=subject, error=str(e)[:200])
                ok = False
                continue
            try:
                got = decode(model, msg.data, subject)
            except Exception as e:
                log.warning("stored message unreadable", subject=subject, error=str(e)[:200])
                continue
            plan = self._plan()
            if plan is not None and got.generation == plan.generation and got.ts >= plan.ts:
                await hand(got, Envelope(subject=subject, headers=dict(msg.headers or {}),
                                         raw=msg))
        return ok

    def read_outcomes_from(self, submit: Callable[[Any], Any], timeout: float) -> None:
        """``read_outcomes`` from another thread (``submit`` runs it on the loop), waited
        for up to ``timeout``."""
        try:
            submit(self.read_outcomes()).result(timeout)
        except Exception as e:
            log.warning("could not read the last transfer plan", error=str(e)[:200])
