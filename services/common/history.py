"""Read back what a service's lease predecessor heard (issue 42): the job stream
(``CEASELESS_<JOB>``) keeps every message but heartbeats, so an instance taking a lease
rebuilds from it what the previous holder kept in memory only (the scaler's dead pods and
dropped spares, the health monitor's declared pods, a job failure)."""

from __future__ import annotations

import asyncio
import datetime
from collections import deque
from typing import Any, TypeVar

from nats.errors import TimeoutError as NatsTimeoutError
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from plumbing.bus import Bus, DropError, Envelope, decode
from schemas import Message

M = TypeVar("M", bound=Message)

MAX_READ = 16384      # messages read back at most (the newest ones are what counts)
FETCH_BATCH = 256
FETCH_WAIT_S = 0.5    # no message within this: the stream is read to its end
CREATE_S = 1.0        # a consumer not created within this: JetStream's meta leader is away


async def read_back(bus: Bus, subject: str, model: type[M], log: Any, *,
                    since: float | None = None, last_only: bool = False,
                    limit: int = MAX_READ) -> list[tuple[M, Envelope]]:
    """``subject``'s messages in the job stream, oldest first: from wall time ``since`` on
    (all of them when None), or only the last one (``last_only``). Reads what is there now,
    no more (waiting for a fetch to time out would delay the caller's decisions); at most
    ``limit``, the newest. Messages that do not validate are logged and dropped."""
    # A consumer reads many messages a request, but JetStream's meta leader creates it; a
    # message get is answered by the stream's leader, one message a request. An instance
    # takes its lease and reads back right after a host loss, and where that host held the
    # meta leader a consumer waited 4-9 s for its election (the declaration and the plan
    # with it): a consumer not created within CREATE_S gives way to message gets (4,096
    # faults: ~0.7 s by consumer, ~2.4 s by gets; python -m bench.readback).
    stream = bus.subjects.stream
    since_dt = (datetime.datetime.fromtimestamp(max(0.0, since), datetime.timezone.utc)
                if since is not None else None)
    out: deque = deque(maxlen=max(1, limit))  # bounded memory: the newest ``limit``

    def take(m: Any) -> None:
        try:
            obj = decode(model, m.data or b"", m.subject or subject)
        except DropError as e:
            log.warning("message read back dropped", subject=m.subject, reason=str(e)[:200])
            return
        out.append((obj, Envelope(subject=m.subject or subject,
                                  headers=dict(m.headers or {}), raw=m)))

    if last_only:
        try:
            take(await bus.js.get_msg(stream, subject=subject))
        except NotFoundError:
            pass
    elif not await _by_consumer(bus, subject, since_dt, take):
        seq = 1
        while True:
            try:
                raw = await bus.js.get_msg(stream, seq=seq, subject=subject, next=True)
            except NotFoundError:  # no message of the subject from ``seq`` on
                break
            seq = (raw.seq or seq) + 1
            if since_dt is None or raw.time is None or raw.time >= since_dt:
                take(raw)
    return list(out)


async def _by_consumer(bus: Bus, subject: str, since: datetime.datetime | None,
                       take: Any) -> bool:
    """Every message of ``subject`` (from ``since``) through an ephemeral consumer, to
    ``take``; False (nothing taken) when the consumer was not created within CREATE_S."""
    policy = dict(deliver_policy=DeliverPolicy.ALL) if since is None else dict(
        deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=since)
    cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, filter_subject=subject,
                         inactive_threshold=30.0, **policy)
    try:
        sub = await asyncio.wait_for(
            bus.js.pull_subscribe(subject, stream=bus.subjects.stream, config=cfg), CREATE_S)
        left = (await asyncio.wait_for(sub.consumer_info(), CREATE_S)).num_pending or 0
    except Exception:  # no meta leader (yet)
        return False
    try:
        while left > 0:
            try:
                msgs = await sub.fetch(min(FETCH_BATCH, left), timeout=FETCH_WAIT_S)
            except (NatsTimeoutError, asyncio.TimeoutError):
                break
            left -= len(msgs)
            for m in msgs:
                take(m)
    finally:
        try:
            await sub.unsubscribe()
        except Exception:  # the consumer goes away by itself (inactive_threshold)
            pass
    return True
