"""Bus calls made again while the bus says it did not take them (the store's rendezvous)."""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable, TypeVar

from nats.errors import ConnectionReconnectingError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

T = TypeVar("T")

# Answers that say the write reached no stream (JetStream still recovering after a server
# restart, a cluster electing the bucket's leader, the client reconnecting): nothing was
# stored, so the call is made again, even a compare-and-set. A timeout is not among them: its
# write may have landed. Seen: two ranks rendezvousing just after a nats-server restart both
# raised NoStreamResponseError from `set`, which read as a bug in the script (the soak).
TRANSIENT = (NoStreamResponseError, ServiceUnavailableError, NoRespondersError,
             ConnectionReconnectingError)
# Calls safe to repeat whatever happened to the first (opening a watch, a read, a put of the
# same value): one that timed out (the bucket's stream electing a leader after its server's
# host was lost, seen in test_hosts_e2e) is made again too.
REOPEN = TRANSIENT + (NatsTimeout, asyncio.TimeoutError)
RETRY_FOR_S = 30.0   # at most this long (or the store's timeout, if shorter) per call
_BACKOFF = (0.05, 1.0)


async def again(call: Callable[[], Awaitable[T]], what: str, within_s: float | None,
                errors: tuple[type[BaseException], ...] = TRANSIENT,
                fail: type[Exception] = RuntimeError) -> T:
    """``await call()``, made again while it fails with one of ``errors``, backing off, for
    at most ``within_s`` (``RETRY_FOR_S`` if None); then ``fail`` naming the last error."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(RETRY_FOR_S, within_s if within_s is not None else RETRY_FOR_S)
    pause = _BACKOFF[0]
    while True:
        try:
            return await call()
        except errors as e:
            if loop.time() + pause > deadline:
                raise fail(f"{what}: the bus did not take it within the retry time "
                       f"({type(e).__name__}: {e})") from e
            await asyncio.sleep(pause)
            pause = min(pause * 2, _BACKOFF[1])
