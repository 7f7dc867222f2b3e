"""The agent's JetStream KV buckets, used from the training thread and helper threads.

Every call runs on the runtime's asyncio loop (the NATS connection lives there) and waits
with a bound; a failure is logged and answered with False/None, never raised into training.
``rendezvous`` gives a c10d store (``NatsStore``) over the store bucket.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from plumbing import logs

log = logs.get("agent")
WATCH_RECHECK_S = 1.0  # how often a watch looks for a reconnect (on the runtime's loop)


class Bucket:
    def __init__(self, kv: Any, loop: asyncio.AbstractEventLoop, store_timeout: float,
                 reconnects: Callable[[], int] | None = None) -> None:
        self._kv, self._loop, self._store_timeout = kv, loop, store_timeout
        # how many times the connection reconnected (``watch`` opens itself again on a change)
        self._reconnects = reconnects or (lambda: 0)

    def _run(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def put(self, key: str, value: bytes, timeout: float = 5.0) -> bool:
        try:
            self._run(self._kv.put(key, value), timeout)
            return True
        except Exception as e:
            log.warning("KV write failed", key=key, error=str(e)[:200])
            return False

    def get(self, key: str, timeout: float = 2.0) -> bytes | None:
        """The value of ``key`` (None: absent, empty, or unreadable in ``timeout``)."""
        async def get() -> bytes | None:
            try:
                e = await self._kv.get(key)
            except Exception:
                return None
            return bytes(e.value) if e is not None and e.value else None

        try:
            return self._run(get(), timeout)
        except Exception:
            return None

    def watch(self, prefix: str, on_put: Callable[[str, bytes], None]) -> Callable[[], None]:
        """Call ``on_put(key after prefix, value)`` (on the loop's thread) for every key put
        under ``prefix``, the ones already there first; returns a function that stops.

        After a reconnect the watch is opened again, in the same task once the old one has
        ended (never two at once), and the keys already there come again (the newest value
        of each): ``on_put`` must take a repeat. nats-server restarted loses the in-memory
        store bucket and ``up`` recreates it empty; a watch opened before sees nothing put
        in the new one (nats.py's ordered consumer resumes past the old stream's sequence),
        so rank 0 never heard a spare asking to follow it after the restart (issue 41).
        Entries are only ever taken by iterating the watch (no timed get that a timeout
        could cancel with an entry in hand)."""
        task: list[asyncio.Task] = []

        async def watch() -> None:
            while True:
                seen, w = self._reconnects(), None
                try:
                    w = await self._kv.watch(prefix + ">")
                    ender = asyncio.ensure_future(self._end_on_reconnect(w, seen))
                    try:
                        async for e in w:  # ends when stopped (a reconnect)
                            if e is None or e.operation is not None:  # initial marker, deletes
                                continue
                            on_put(e.key[len(prefix):], bytes(e.value or b""))
                    finally:
                        ender.cancel()
                    log.info("KV watch opened again after a reconnect", prefix=prefix)
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # e.g. the bucket not recreated yet: again shortly
                    log.info("KV watch failed; opening it again", prefix=prefix,
                             error=str(e)[:200])
                    await asyncio.sleep(WATCH_RECHECK_S)
                finally:
                    if w is not None:
                        try:
                            await w.stop()
                        except Exception:
                            pass

        self._loop.call_soon_threadsafe(lambda: task.append(asyncio.ensure_future(watch())))
        return lambda: self._loop.call_soon_threadsafe(lambda: task and task[0].cancel())

    async def _end_on_reconnect(self, w: Any, seen: int) -> None:
        """Stop the watch ``w`` (its iteration ends) once the connection reconnected."""
        while self._reconnects() == seen:
            await asyncio.sleep(WATCH_RECHECK_S)
        try:
            await w.stop()
        except Exception as e:  # the connection closing: the watch's task is cancelled too
            log.warning("KV watch not stopped after a reconnect", error=str(e)[:200])

    def rendezvous(self, prefix: str, timeout: float | None = None) -> Any:
        """A c10d store (``NatsStore``) over this bucket, its keys under ``prefix``."""
        from .store import NatsStore

        return NatsStore(self._kv, self._loop, prefix=prefix,
                         timeout=timeout or self._store_timeout)
