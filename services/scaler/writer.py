"""KV ``plan``'s only writer: a plan is written by compare-and-set on the revision its
decision was based on (the first by create), traced as the incident's ``plan`` span, and
published on the ``plan`` subject only after the write succeeded. A lost race reloads the
plan (the scaler decides again). A plan too large to send whole has its parts stored first
and a reference written and published instead (``plumbing.plan_wire``); the parts of plans
older than the one replaced are removed after."""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry import trace

from plumbing import telemetry
from plumbing.bus import Bus
from plumbing.plan_wire import digest_of, for_wire, put_parts, sweep_parts
from schemas import PLAN_KEY
from schemas.messages import Plan, PlanRef
from services.common.plans import PlanFollower

from .faults import Pending

tracer = trace.get_tracer("ceaseless")


class PlanWriter:
    def __init__(self, bus: Bus, plans: PlanFollower, log: Any) -> None:
        self.bus = bus
        self.plans = plans
        self.log = log
        self.kv: Any = None  # the job's bucket, set when the scaler starts
        self.written = 0
        self.cas_conflicts = 0
        # parts of large plans may be stored (unknown at start: a predecessor's): swept after
        # each plan until none are left
        self._parts_left = True

    async def write(self, new: Plan, revision: int | None, pend: Sequence[Pending],
                    on_written: Callable[[], None]) -> bool:
        """False: the compare-and-set lost (the plan is reloaded). ``on_written`` runs
        once it is in KV, before it is published."""
        base = self.plans.plan  # the plan ``revision`` holds: a change is against it
        wire, parts = for_wire(new, base)
        data = wire.model_dump_json().encode()
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
            try:
                if isinstance(wire, PlanRef):  # the parts first: the reference names them
                    self._parts_left = True
                    await put_parts(self.kv, wire, parts)
                    span.set_attribute("ceaseless.plan_parts", len(parts))
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
                return False
            ctx = trace.set_span_in_context(span)
            self.plans.set_local(new, rev, ctx)
            self.written += 1
            try:  # the scaler is the single writer of membership: it owns the gauge
                telemetry.instruments().record_membership(new.world_size)
            except Exception:
                pass
            on_written()
            self.log.info("plan committed", generation=new.generation, revision=rev,
                          world_size=new.world_size, reason=new.reason, incident=new.incident,
                          members={m.rank: m.pod for m in new.members[:64]},  # a line, not MBs
                          spares=new.spares[:64], parts=len(parts))  # 0: sent whole
            await self.bus.publish(self.bus.subjects.plan, wire,
                                   msg_id=f"plan-g{new.generation}-r{rev}", ctx=ctx)
        if isinstance(wire, PlanRef) or self._parts_left:
            await self._sweep(new, base)
        return True

    async def _sweep(self, new: Plan, base: Plan | None) -> None:
        """Remove the parts of plans before ``base`` (a reader may still read ``base``'s):
        bounded by two plans, whatever a restarted scaler's predecessor left."""
        keep = {digest_of(p) for p in (new, base) if p is not None}
        try:
            left = await sweep_parts(self.kv, self.bus.js, self.bus.subjects.kv_bucket, keep)
        except Exception as e:  # left for the next plan's sweep
            self.log.warning("old plan parts not removed", error=str(e)[:200])
            return
        self._parts_left = bool(left)

    async def last_generation(self) -> int:
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
