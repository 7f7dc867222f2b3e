"""Following the current plan: KV key ``plan`` is the truth, the ``plan`` subject a hint.
Either carries a plan whole or, for a large one, a reference to its parts
(``plumbing.plan_wire``): what is held is always the whole plan.

A plan message is adopted only when the KV bucket holds a plan of at least that generation
(the scaler writes KV first, then publishes), so a forged or replayed plan message cannot
move a follower; a plan message of an old generation is ignored. Used by the health monitor,
the state broker and the scaler (which also writes, see ``services.scaler``).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable

from nats.js.errors import KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue
from opentelemetry import context as otel_context

from schemas import PLAN_KEY, Plan
from schemas.messages import PlanRef

from plumbing.aio import cancel_all
from plumbing.bus import Bus, DropError, Envelope
from plumbing.plan_wire import PLAN_MODELS, PlanUnreadable, read_value, same

OnChange = Callable[[Plan | None, Plan], Awaitable[None] | None]


async def load_plan(kv: KeyValue, held: Plan | None = None
                    ) -> tuple[Plan | None, int | None, str]:
    """(plan, revision, problem). ``plan`` is None when the key is absent (revision None)
    or when its value does not validate or names parts that cannot be read (revision set,
    ``problem`` says why). ``held``: the plan the caller has (a reference to it, or a change
    from it, needs no parts read)."""
    try:
        entry = await kv.get(PLAN_KEY)
    except (KeyNotFoundError, NotFoundError):
        return None, None, ""
    if entry.value is None:
        return None, entry.revision, "empty plan value"
    try:
        return await read_value(kv, entry.value, held), entry.revision, ""
    except (DropError, PlanUnreadable) as e:
        return None, entry.revision, str(e)


class PlanFollower:
    """Holds the newest valid plan; calls ``on_change(old, new)`` when the generation grows."""

    def __init__(self, bus: Bus, log: Any, on_change: OnChange | None = None,
                 poll_interval: float = 1.0) -> None:
        self.bus = bus
        self.log = log
        self.on_change = on_change
        self.poll_interval = poll_interval
        self.kv: KeyValue | None = None
        self.plan: Plan | None = None
        self.revision: int | None = None
        self.problem = ""
        # trace context of the plan message of each recent generation (for child spans)
        self.contexts: dict[int, otel_context.Context] = {}
        self._lock = asyncio.Lock()
        self._sub: Any = None
        self._task: asyncio.Task | None = None

    @property
    def generation(self) -> int:
        return self.plan.generation if self.plan else 0

    async def start(self, subscribe: bool = True) -> None:
        self.kv = await self.bus.kv()
        await self.refresh()
        if subscribe:
            self._sub = await self.bus.subscribe(self.bus.subjects.plan, PLAN_MODELS,
                                                 self._on_msg)
        if self.poll_interval > 0:
            self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                self.log.warning("plan poll failed", error=str(e)[:200])

    async def refresh(self) -> bool:
        """Re-read KV; True when a newer plan was adopted."""
        assert self.kv is not None
        async with self._lock:
            plan, rev, problem = await load_plan(self.kv, self.plan)
            if problem and problem != self.problem:
                self.log.error("plan in KV does not validate; keeping the last good one",
                               subject=f"kv:{PLAN_KEY}", reason=problem, revision=rev)
            self.problem = problem
            if plan is None or (self.plan is not None and plan.generation <= self.plan.generation):
                if plan is not None and self.plan is not None and rev != self.revision \
                        and plan.generation == self.plan.generation and plan != self.plan:
                    self.log.error("KV plan changed without a new generation; ignored",
                                   subject=f"kv:{PLAN_KEY}", reason="same generation rewritten",
                                   generation=plan.generation)
                return False
            old, self.plan, self.revision = self.plan, plan, rev
        await self._changed(old, plan)
        return True

    def set_local(self, plan: Plan, revision: int,
                  ctx: otel_context.Context | None = None) -> None:
        """The writer's own committed plan (the scaler): no KV round trip."""
        self.plan, self.revision = plan, revision
        if ctx is not None:
            self._remember_ctx(plan.generation, ctx)

    def _remember_ctx(self, generation: int, ctx: otel_context.Context) -> None:
        self.contexts[generation] = ctx
        for g in sorted(self.contexts)[:-8]:
            del self.contexts[g]

    async def _changed(self, old: Plan | None, new: Plan) -> None:
        if self.on_change is None:
            return
        res = self.on_change(old, new)
        if inspect.isawaitable(res):
            await res

    async def _on_msg(self, msg: Plan | PlanRef, env: Envelope) -> None:
        cur = self.generation
        if msg.generation < cur:
            self.log.info("ignored plan message", subject=env.subject,
                          reason=f"stale generation {msg.generation} < current {cur}")
            return
        if msg.generation == cur:
            if same(msg, self.plan):
                self._remember_ctx(cur, env.ctx)
            else:
                self.log.warning("ignored plan message", subject=env.subject,
                                 reason=f"generation {cur} differs from the plan in KV")
            return
        # A newer generation: trust it only once KV has it.
        self._remember_ctx(msg.generation, env.ctx)
        await self.refresh()
        if self.plan is None or self.plan.generation < msg.generation:
            self.contexts.pop(msg.generation, None)
            self.log.warning("ignored plan message", subject=env.subject,
                             reason=f"generation {msg.generation} is not in KV "
                                    f"(KV has {self.generation})")
        elif self.plan.generation == msg.generation and not same(msg, self.plan):
            self.contexts.pop(msg.generation, None)
            self.log.warning("plan message differs from KV; using KV", subject=env.subject,
                             reason="content mismatch", generation=msg.generation)


__all__ = ["PlanFollower", "load_plan"]
