"""A c10d store on NATS JetStream KV: the rendezvous of every process group generation.

``NatsStore`` is a ``torch.distributed.Store`` (a Python subclass, which ``ProcessGroupGloo``
and ``ProcessGroupNCCL`` accept) whose keys live in a JetStream KeyValue bucket under a
per-generation prefix, so no rank has to host a TCPStore and a new generation never collides
with an old one::

    store = NatsStore(kv, loop, prefix="g7.", timeout=30.0)
    pg = agent.collectives.make_group(store, rank, world_size)

* ``kv`` is a ``nats.js.kv.KeyValue`` bound to ``loop``, an asyncio loop running in **another**
  thread (the agent's runtime thread). Every method blocks the calling thread on
  ``asyncio.run_coroutine_threadsafe(...).result()``; calling one from the loop's own thread
  would deadlock and raises ``RuntimeError`` instead.
* Keys are stored as ``prefix + base64url(key)``: c10d/gloo keys (``"0/1"``, ...) hold
  characters a KV key refuses. ``prefix`` must be a valid KV key prefix ending in ``"."``
  (e.g. ``"g7."``), so that one watcher on ``prefix + ">"`` sees every key of the store.
* ``get``/``wait`` on a missing key do not poll: one KV ``get`` (authoritative), and on a miss
  they wait on a single per-store watcher (started on first need) that delivers every
  put under the prefix as it happens.
* Counters (``add``) are ASCII decimal values updated by compare-and-set on the KV revision.
* Timeouts raise ``StoreTimeout`` (a ``torch.distributed.DistStoreError``) naming the keys.

What gloo needs (measured, torch 2.13): per rank one ``set`` of its address key, then for
every rank ``wait([key], timeout)`` and ``get(key)``: 2W+1 calls per rank at world size W.
The extended API (``multi_get``...) is not used by gloo with a Python store.

``StoreLoop`` is a convenience for tests and standalone use: a background thread with its own
asyncio loop and NATS connection (``Bus``), handing out ``NatsStore`` objects.
"""

from __future__ import annotations

import asyncio
import base64
import re
import threading
from datetime import timedelta
from typing import Any, Coroutine, TypeVar

import torch.distributed as dist
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from .transient import REOPEN, again

T = TypeVar("T")

_PREFIX_RE = re.compile(r"^([-/_=a-zA-Z0-9]+\.)*$")  # tokens of KV key chars, each ending "."
_KV_PUT = None  # nats-py marks puts with operation None, deletes with "DEL"/"PURGE"


class StoreTimeout(dist.DistStoreError):
    """A store wait ran past its timeout."""


class StoreError(dist.DistStoreError):
    """The store could not complete an operation (connection lost, bad value)."""




def encode_key(key: str | bytes) -> str:
    """base64url of the key (``=`` for the empty key): only characters KV keys accept."""
    raw = key.encode() if isinstance(key, str) else bytes(key)
    return base64.urlsafe_b64encode(raw).decode("ascii") if raw else "="


def decode_key(encoded: str) -> str:
    return "" if encoded == "=" else base64.urlsafe_b64decode(encoded.encode()).decode()


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    return bytes(value)  # bytearray, memoryview, list[int] from C++


def _seconds(timeout: timedelta | float | None, default: float) -> float | None:
    """c10d convention: a zero timeout means no timeout (wait forever) -> None."""
    if timeout is None:
        s = default
    elif isinstance(timeout, timedelta):
        s = timeout.total_seconds()
    else:
        s = float(timeout)
    return None if s <= 0 else s


class NatsStore(dist.Store):
    """c10d store backed by a JetStream KV bucket (see module docstring).

    Args:
        kv: the KeyValue of the store bucket (``await bus.store_kv()``), bound to ``loop``.
        loop: the running asyncio loop that owns ``kv`` (in another thread).
        prefix: key prefix of this store, e.g. ``"g7."`` (one per process group generation).
        timeout: default timeout in seconds of ``get``/``wait`` (``set_timeout`` changes it).
    """

    def __init__(self, kv: KeyValue, loop: asyncio.AbstractEventLoop, prefix: str,
                 timeout: float = 30.0) -> None:
        super().__init__()
        if not _PREFIX_RE.match(prefix) or ".." in prefix:
            raise ValueError(f"invalid store prefix {prefix!r}: KV key characters "
                             "[-/_=a-zA-Z0-9] in dot-separated tokens, ending with '.'")
        self._kv = kv
        self._loop = loop
        self.prefix = prefix
        self.set_timeout(timedelta(seconds=timeout))
        # watcher state: touched only on the loop thread
        self._watch_task: asyncio.Task | None = None
        self._watch_ready: asyncio.Future | None = None
        self._watcher: Any = None
        self._seen: dict[str, tuple[int, bool, bytes]] = {}  # kv key -> (rev, is_put, value)
        self._waiters: dict[str, list[tuple[int, asyncio.Future]]] = {}
        self._closed = False
        self.calls = 0  # store calls served (for telemetry / tests)

    # ------------------------------------------------------------------ plumbing
    def _k(self, key: str | bytes) -> str:
        return self.prefix + encode_key(key)

    def _timeout_s(self) -> float | None:
        return _seconds(self.timeout, 0)

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        if self._closed:
            coro.close()
            raise StoreError(f"store {self.prefix!r} is closed")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError("NatsStore methods block: call them from a thread other than "
                               "the one running its asyncio loop")
        self.calls += 1
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # the coroutine enforces `timeout` itself; the margin covers a stalled loop
            return fut.result(None if timeout is None else timeout + 10.0)
        except TimeoutError:
            if fut.done():
                raise
            fut.cancel()
            raise StoreTimeout(f"store {self.prefix!r}: the NATS loop did not answer "
                               f"within {timeout}s (+10s)") from None

    # ------------------------------------------------------------------ watcher (loop thread)
    async def _ensure_watcher(self) -> None:
        if self._watch_task is None or self._watch_task.done():
            self._watch_ready = self._loop.create_future()
            self._watch_task = asyncio.ensure_future(self._watch_loop())
        await asyncio.shield(self._watch_ready)

    async def _watch_loop(self) -> None:
        ready = self._watch_ready
        try:
            self._watcher = w = await again(
                lambda: self._kv.watch(self.prefix + ">"), f"store {self.prefix!r} watch",
                self._timeout_s(), REOPEN, fail=StoreError)
            if ready is not None and not ready.done():
                ready.set_result(None)
            async for entry in w:
                if entry is None:  # "initial values delivered" marker
                    continue
                self._observe(entry.key, entry.revision, entry.operation is _KV_PUT,
                              entry.value or b"")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # connection lost etc.: fail the waiters, restart on demand
            err = StoreError(f"store {self.prefix!r} watcher failed: {e!r}")
            if ready is not None and not ready.done():
                ready.set_exception(err)
            for waiters in self._waiters.values():
                for _, fut in waiters:
                    if not fut.done():
                        fut.set_exception(err)
        finally:
            if ready is not None and not ready.done():
                ready.set_exception(StoreError(f"store {self.prefix!r} watcher stopped"))

    def _observe(self, k: str, rev: int, is_put: bool, value: bytes) -> None:
        cur = self._seen.get(k)
        if cur is not None and cur[0] >= rev:
            return
        self._seen[k] = (rev, is_put, value)
        if not is_put:
            return
        waiters = self._waiters.get(k)
        if not waiters:
            return
        keep = []
        for min_rev, fut in waiters:
            if fut.done():
                continue
            if rev > min_rev:
                fut.set_result(value)
            else:
                keep.append((min_rev, fut))
        if keep:
            self._waiters[k] = keep
        else:
            self._waiters.pop(k, None)

    async def _await_put(self, k: str, min_rev: int, timeout: float | None) -> bytes:
        """The value of the first put of ``k`` with a revision above ``min_rev``."""
        await self._ensure_watcher()
        cur = self._seen.get(k)
        if cur is not None and cur[1] and cur[0] > min_rev:
            return cur[2]
        fut: asyncio.Future = self._loop.create_future()
        self._waiters.setdefault(k, []).append((min_rev, fut))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            if not fut.done():
                fut.cancel()
            lst = self._waiters.get(k)
            if lst is not None:
                lst[:] = [(r, f) for r, f in lst if f is not fut]
                if not lst:
                    self._waiters.pop(k, None)

    # ------------------------------------------------------------------ coroutines
    async def _get_now(self, k: str) -> tuple[bytes | None, int]:
        """(value, 0) if present, else (None, revision of the delete marker or 0)."""
        try:
            e = await again(lambda: self._kv.get(k), f"store get {k!r}", self._timeout_s(),
                            REOPEN, fail=StoreError)  # a read: safe to make again
            return (e.value or b""), e.revision
        except KeyNotFoundError as err:
            entry = getattr(err, "entry", None)
            return None, (entry.revision if entry is not None else 0)

    async def _get(self, k: str, timeout: float | None) -> bytes:
        value, rev = await self._get_now(k)
        if value is not None:
            return value
        try:
            return await self._await_put(k, rev, timeout)
        except asyncio.TimeoutError:
            raise StoreTimeout(f"store {self.prefix!r}: timed out after {timeout}s waiting "
                               f"for key {decode_key(k[len(self.prefix):])!r}") from None

    async def _wait(self, keys: list[str], timeout: float | None) -> None:
        async def one(k: str) -> None:
            cur = self._seen.get(k)
            if cur is not None and cur[1]:
                return  # already seen by the watcher
            await self._get(k, None)

        tasks = [asyncio.ensure_future(one(k)) for k in keys]
        try:
            done, pending = await asyncio.wait(tasks, timeout=timeout)
        finally:
            for t in tasks:
                if not t.done():
                    t.cancel()
        for t in done:
            if t.exception() is not None:
                raise t.exception()
        if pending:
            missing = [decode_key(k[len(self.prefix):]) for k, t in zip(keys, tasks)
                       if t in pending]
            raise StoreTimeout(f"store {self.prefix!r}: timed out after {timeout:.1f}s "
                               f"waiting for keys {missing}")

    async def _cas_loop(self, k: str, fn) -> bytes:
        """Read-modify-write by compare-and-set: ``fn(old or None) -> (new or None, result)``."""
        while True:
            old, rev = await self._get_now(k)
            new, result = fn(old)
            if new is None:
                return result
            try:
                if old is None:
                    await again(lambda: self._kv.create(k, new), f"store create {k!r}",
                                self._timeout_s(), fail=StoreError)
                else:
                    await again(lambda: self._kv.update(k, new, last=rev),
                                f"store update {k!r}", self._timeout_s(), fail=StoreError)
                return result
            except KeyWrongLastSequenceError:
                continue  # lost a race: read again

    async def _num_keys(self) -> int:
        w = await self._kv.watch(self.prefix + ">", ignore_deletes=True, meta_only=True)
        n = 0
        try:
            async for e in w:
                if e is None:
                    break
                n += 1
        finally:
            await w.stop()
        return n

    # ------------------------------------------------------------------ c10d API
    def set(self, key: str, value: str | bytes) -> None:
        """Set ``key`` to ``value`` (overwrites)."""
        k, v, t = self._k(key), _as_bytes(value), self._timeout_s()
        # a put is idempotent: one that timed out (its stream electing a leader) is made again
        self._run(again(lambda: self._kv.put(k, v), f"store set {key!r}", t, REOPEN,
                        fail=StoreError), t)

    def get(self, key: str) -> bytes:
        """The value of ``key``, blocking until it exists (store timeout -> StoreTimeout)."""
        timeout = self._timeout_s()
        return self._run(self._get(self._k(key), timeout), timeout)

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer counter ``key`` (created at 0); new value."""
        delta = int(value)

        def fn(old: bytes | None):
            try:
                cur = int(old) if old is not None else 0
            except ValueError:
                raise StoreError(f"store {self.prefix!r}: key {key!r} holds a non-integer "
                                 f"value {old[:40]!r}") from None
            return str(cur + delta).encode(), cur + delta

        return self._run(self._cas_loop(self._k(key), fn), self._timeout_s())

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        """TCPStore semantics: set ``desired`` if the current value is ``expected`` (a missing
        key matches an empty ``expected``); return the value after the call (for a missing key
        and a non-empty ``expected``: ``expected``)."""
        exp, des = _as_bytes(expected_value), _as_bytes(desired_value)

        def fn(old: bytes | None):
            if old is None:
                return (des, des) if exp == b"" else (None, exp)
            return (des, des) if old == exp else (None, old)

        return self._run(self._cas_loop(self._k(key), fn), self._timeout_s())

    def check(self, keys: list[str]) -> bool:
        """True when every key exists (does not block)."""
        async def all_there() -> bool:
            got = await asyncio.gather(*(self._get_now(self._k(k)) for k in keys))
            return all(v is not None for v, _ in got)

        return self._run(all_there(), self._timeout_s())

    def wait(self, keys: list[str], timeout: timedelta | float | None = None) -> None:
        """Block until every key exists; ``timeout`` (default: the store's) -> StoreTimeout."""
        t = _seconds(timeout, self.timeout.total_seconds())
        self._run(self._wait([self._k(k) for k in keys], t), t)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; False when it did not exist."""
        async def delete() -> bool:
            k = self._k(key)
            value, _ = await self._get_now(k)
            if value is None:
                return False
            await self._kv.delete(k)
            return True

        return self._run(delete(), self._timeout_s())

    def num_keys(self) -> int:
        """Number of keys under this store's prefix (one watch over the prefix: not hot)."""
        return self._run(self._num_keys(), self._timeout_s())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        timeout = self._timeout_s()

        async def many() -> list[bytes]:
            return list(await asyncio.gather(*(self._get(self._k(k), timeout) for k in keys)))

        return self._run(many(), timeout)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        async def many() -> None:
            await asyncio.gather(*(self._kv.put(self._k(k), _as_bytes(v))
                                   for k, v in zip(keys, values)))

        self._run(many(), self._timeout_s())

    def append(self, key: str, value: str | bytes) -> None:
        tail = _as_bytes(value)
        self._run(self._cas_loop(self._k(key), lambda old: ((old or b"") + tail, None)),
                  self._timeout_s())

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the watcher (non-blocking; safe from any thread, idempotent)."""
        if self._closed:
            return
        self._closed = True

        def stop() -> None:
            task, self._watch_task = self._watch_task, None
            w, self._watcher = self._watcher, None
            if w is not None:
                asyncio.ensure_future(_quiet(w.stop()))
            if task is not None:
                task.cancel()
            for waiters in self._waiters.values():
                for _, fut in waiters:
                    if not fut.done():
                        fut.set_exception(StoreError(f"store {self.prefix!r} closed"))
            self._waiters.clear()

        try:
            self._loop.call_soon_threadsafe(stop)
        except RuntimeError:  # loop already closed
            pass

    def __repr__(self) -> str:
        return f"NatsStore(prefix={self.prefix!r}, timeout={self.timeout})"


async def _quiet(coro: Coroutine[Any, Any, Any]) -> None:
    try:
        await coro
    except Exception:
        pass


class StoreLoop:
    """A background thread running an asyncio loop with its own NATS connection.

    For tests and standalone use (the agent uses its runtime's loop and KV instead)::

        with StoreLoop(url, job="demo", creds=creds) as sl:
            store = sl.store("g1.")
            pg = make_group(store, rank, world_size)
    """

    def __init__(self, url: str, job: str = "demo", creds: Any = None,
                 name: str = "ceaseless-store", kv_ttl: float = 3600.0,
                 connect_timeout: float = 15.0) -> None:
        from plumbing.bus import Bus  # the shared bus layer (reconnect, creds)

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self.bus = self.call(Bus.connect(url, job, name, creds), connect_timeout)
        self.kv: KeyValue = self.call(self.bus.store_kv(ttl=kv_ttl), connect_timeout)
        self._stores: list[NatsStore] = []

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = 30.0) -> T:
        """Run a coroutine on the loop and return its result (blocking this thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def store(self, prefix: str, timeout: float = 30.0) -> NatsStore:
        s = NatsStore(self.kv, self.loop, prefix, timeout)
        self._stores.append(s)
        return s

    def close(self, timeout: float = 5.0) -> None:
        if not self.loop.is_running():
            return
        for s in self._stores:
            s.close()
        try:
            self.call(self.bus.close(), timeout)
        except Exception:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def __enter__(self) -> "StoreLoop":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
