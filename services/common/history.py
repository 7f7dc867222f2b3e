"""Read back what a service's lease predecessor heard (issue 42): the job stream
(``CEASELESS_<JOB>``) keeps every message but heartbeats, so an instance taking a lease
rebuilds from it what the previous holder kept in memory only (the scaler's dead pods and
dropped spares, the health monitor's declared pods, a job failure)."""

from __future__ import annotations

import asyncio
import datetime
from typing import Any, TypeVar

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from plumbing.bus import Bus, DropError, Envelope, decode
from schemas import Message

M = TypeVar("M", bound=Message)

MAX_READ = 16384      # messages read back at most (the newest ones are what counts)
FETCH_BATCH = 256
FETCH_WAIT_S = 0.5    # no message within this: the stream is read to its end


async def read_back(bus: Bus, subject: str, model: type[M], log: Any, *,
                    since: float | None = None, last_only: bool = False,
                    limit: int = MAX_READ) -> list[tuple[M, Envelope]]:
    """``subject``'s messages in the job stream, oldest first: from wall time ``since`` on
    (all of them when None), or only the last one (``last_only``). Reads what is there now,
    no more (waiting for a fetch to time out would delay the caller's decisions); at most
    ``limit``, the newest. Messages that do not validate are logged and dropped."""
    s = bus.subjects
    if last_only:
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.LAST, ack_policy=AckPolicy.NONE,
                             filter_subject=subject, inactive_threshold=30.0)
    elif since is not None:
        start = datetime.datetime.fromtimestamp(max(0.0, since), datetime.timezone.utc)
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start,
                             ack_policy=AckPolicy.NONE, filter_subject=subject,
                             inactive_threshold=30.0)
    else:
        cfg = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                             filter_subject=subject, inactive_threshold=30.0)
    sub = await bus.js.pull_subscribe(subject, stream=s.stream, config=cfg)
    out: list[tuple[M, Envelope]] = []
    try:
        left = (await sub.consumer_info()).num_pending or 0
        while left > 0:
            try:
                msgs = await sub.fetch(min(FETCH_BATCH, left), timeout=FETCH_WAIT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                break
            left -= len(msgs)
            for m in msgs:
                try:
                    obj = decode(model, m.data, m.subject)
                except DropError as e:
                    log.warning("message read back dropped", subject=m.subject,
                                reason=str(e)[:200])
                    continue
                out.append((obj, Envelope(subject=m.subject, headers=dict(m.headers or {}),
                                          raw=m)))
            if len(out) > limit:  # bounded memory: keep the newest
                del out[:len(out) - limit]
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the consumer goes away by itself (inactive_threshold)
            pass
    return out
