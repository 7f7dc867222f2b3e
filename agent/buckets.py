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


class Bucket:
    def __init__(self, kv: Any, loop: asyncio.AbstractEventLoop, store_timeout: float) -> None:
        self._kv, self._loop, self._store_timeout = kv, loop, store_timeout

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
        under ``prefix``, the ones already there first; returns a function that stops."""
        task: list[asyncio.Task] = []

        async def watch() -> None:
            w = None
            try:
                w = await self._kv.watch(prefix + ">")
                async for e in w:
                    if e is None or e.operation is not None:  # initial-values marker, deletes
                        continue
                    on_put(e.key[len(prefix):], bytes(e.value or b""))
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.info("KV watch ended", prefix=prefix, error=str(e)[:200])
            finally:
                if w is not None:
                    try:
                        await w.stop()
                    except Exception:
                        pass

        self._loop.call_soon_threadsafe(lambda: task.append(asyncio.ensure_future(watch())))
        return lambda: self._loop.call_soon_threadsafe(lambda: task and task[0].cancel())

    def rendezvous(self, prefix: str, timeout: float | None = None) -> Any:
        """A c10d store (``NatsStore``) over this bucket, its keys under ``prefix``."""
        from .store import NatsStore

        return NatsStore(self._kv, self._loop, prefix=prefix,
                         timeout=timeout or self._store_timeout)
