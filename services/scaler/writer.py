"""KV ``plan``'s only writer: a plan is written by compare-and-set on the revision its
decision was based on (the first by create), traced as the incident's ``plan`` span, and
published on the ``plan`` subject only after the write succeeded. A lost race reloads the
plan (the scaler decides again)."""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from nats.js.errors import KeyWrongLastSequenceError
from opentelemetry import trace

from plumbing import telemetry
from plumbing.bus import Bus
from schemas import MAX_PAYLOAD_BYTES, PLAN_KEY
from schemas.messages import Plan
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

    async def write(self, new: Plan, revision: int | None, pend: Sequence[Pending],
                    on_written: Callable[[], None]) -> bool:
        """False: the compare-and-set lost (the plan is reloaded). ``on_written`` runs
        once it is in KV, before it is published."""
        data = new.model_dump_json().encode()
        if len(data) > MAX_PAYLOAD_BYTES:  # nats-server would refuse it: say why
            raise ValueError(f"plan generation {new.generation} of {new.world_size} members "
                             f"is {len(data)} bytes, over the {MAX_PAYLOAD_BYTES} one "
                             "message may carry (docs/benchmarks.md, Message sizes)")
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
                          spares=new.spares[:64])
            await self.bus.publish(self.bus.subjects.plan, new,
                                   msg_id=f"plan-g{new.generation}-r{rev}", ctx=ctx)
        return True

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
