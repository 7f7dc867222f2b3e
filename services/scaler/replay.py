"""What a scaler taking the lease must not lose (issue 42): the faults declared since the
current plan that no plan has handled yet. They lived in the previous scaler's memory only,
and the health monitor declares a pod once; the job stream (``CEASELESS_<JOB>``) keeps every
``fault`` message, so the new holder reads them back from the plan's time on."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.errors import TimeoutError as NatsTimeoutError

from plumbing.bus import Bus, DropError, Envelope, decode
from schemas.messages import Fault, Plan

MAX_REPLAY = 4096     # faults read back at most (a plan's worth; the rest were planned)
FETCH_BATCH = 256
FETCH_WAIT_S = 0.5    # no message within this: the stream is read to its end
SLACK_S = 1.0         # clock slack between the plan's writer and the stream's timestamps


async def unplanned_faults(bus: Bus, plan: Plan, log: Any) -> list[tuple[Fault, Envelope]]:
    """The stream's ``fault`` messages from ``plan.ts`` on, of ``plan``'s generation or a
    later one, oldest first (at most ``MAX_REPLAY``). Bad messages are logged and dropped."""
    s = bus.subjects
    since = datetime.datetime.fromtimestamp(max(0.0, plan.ts - SLACK_S), datetime.timezone.utc)
    cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since,
                         ack_policy=AckPolicy.NONE, filter_subject=s.fault,
                         inactive_threshold=30.0)
    sub = await bus.js.pull_subscribe(s.fault, stream=s.stream, config=cfg)
    out: list[tuple[Fault, Envelope]] = []
    try:
        # what is there now, no more: waiting for a fetch to time out would delay the plan
        left = min(MAX_REPLAY, (await sub.consumer_info()).num_pending or 0)
        while left > 0:
            try:
                msgs = await sub.fetch(min(FETCH_BATCH, left), timeout=FETCH_WAIT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                break
            left -= len(msgs)
            for m in msgs:
                try:
                    f = decode(Fault, m.data, m.subject)
                except DropError as e:
                    log.warning("replayed fault dropped", reason=str(e)[:200])
                    continue
                if f.generation >= plan.generation:
                    out.append((f, Envelope(subject=m.subject, headers=dict(m.headers or {}),
                                            raw=m)))
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the consumer goes away by itself (inactive_threshold)
            pass
    return out[:MAX_REPLAY]
