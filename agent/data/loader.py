"""Elastic, step-addressed loader: position = (step, rank, world size), a pure function.

``seek`` only records the position (no replay, no rebuild, microseconds); iterating yields
this rank's micro-batches of the current step as ``(k, batch)`` and then moves on to the
next step. A background thread keeps the next ``prefetch`` micro-batches (running on into
the next step) ready. Prefetched batches are keyed by ``(step, k)`` only, because a
micro-batch's content does not depend on who computes it: after a re-plan, batches already
built for the new position are reused.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from schemas.batching import num_micro_batches

from .dataset import TokenDataset
from .format import DataError
from .order import GlobalOrder

Key = tuple[int, int]


class _Failed:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


class ElasticLoader:
    """Micro-batches of ``order`` over ``dataset`` for one rank at a time.

    ``dataset``: a :class:`TokenDataset` (fast ``batch(indices)`` path) or any map-style
    dataset (``dataset[i]`` + ``collate_fn``, default ``torch.utils.data.default_collate``).
    ``prefetch``: micro-batches kept ready ahead of the consumer (0: no thread).
    ``pin_memory``: pin batches (when CUDA is available) for ``non_blocking`` copies.
    """

    def __init__(self, dataset: Any, order: GlobalOrder, micro_batch_size: int,
                 prefetch: int = 2, *, collate_fn: Callable | None = None,
                 pin_memory: bool = False):
        self.dataset = dataset
        self.order = order
        self.micro_batch_size = int(micro_batch_size)
        self.num_micro = num_micro_batches(order.global_batch_size, self.micro_batch_size)
        if len(dataset) != order.n_samples:
            raise DataError(f"order is for {order.n_samples} samples but the dataset has {len(dataset)}")
        self.prefetch = max(0, int(prefetch))
        self._batch_fn = getattr(dataset, "batch", None)
        if not callable(self._batch_fn):
            self._batch_fn = None
        self._collate = collate_fn or torch.utils.data.default_collate
        self._pin = bool(pin_memory) and torch.cuda.is_available()
        self._step, self._rank, self._world, self._shard = 0, 0, 1, 1
        self._ks: range = order.rank_range(1, 0, self.micro_batch_size)
        self._cursor = 0
        self._gen = 0
        self._cache: dict[Key, Any] = {}
        self._inflight: set[Key] = set()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.stats = {"prefetched": 0, "foreground": 0, "waited": 0}
        if self.prefetch:
            # The thread holds only a weak reference: a loader nobody closes still goes away.
            self._thread = threading.Thread(target=_prefetch_loop, args=(weakref.ref(self), self._cond),
                                            name="ceaseless-prefetch", daemon=True)
            self._thread.start()

    @classmethod
    def from_dir(cls, data_dir: str | os.PathLike, *, global_batch_size: int,
                 micro_batch_size: int, seed: int = 0, seq_len: int | None = None,
                 prefetch: int = 2, cache_to_shm: bool = False, verify: str | bool = "auto",
                 order_cache_dir: str | os.PathLike | None = None,
                 pin_memory: bool = False) -> ElasticLoader:
        """Dataset + order + loader for a prepared directory (what a Session builds once)."""
        ds = TokenDataset(data_dir, seq_len, verify=verify, cache_to_shm=cache_to_shm)
        order = ds.global_order(global_batch_size, seed, cache_dir=order_cache_dir)
        return cls(ds, order, micro_batch_size, prefetch, pin_memory=pin_memory)

    # ---- position ---------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The step the next iteration yields."""
        return self._step

    @property
    def micro_indices(self) -> range:
        """Micro-batch indices this rank computes in every step (for the current plan)."""
        return self._ks

    def seek(self, step: int, rank: int | None = None, world_size: int | None = None,
             shard_size: int | None = None, ks: range | None = None) -> None:
        """Position at ``step`` for ``rank`` of ``world_size`` in replicas of ``shard_size``
        (defaults: unchanged), computing micro-batches ``ks`` (default: the even spread).
        O(1)."""
        if step < 0:
            raise DataError(f"step {step} is negative")
        rank = self._rank if rank is None else int(rank)
        world = self._world if world_size is None else int(world_size)
        k = self._shard if shard_size is None else int(shard_size)
        if ks is None:
            ks = self.order.rank_range(world, rank, self.micro_batch_size, k)
        if not ks:
            raise DataError(f"{self.num_micro} micro-batches cannot be spread over {world} ranks")
        with self._cond:
            self._step, self._rank, self._world, self._ks = int(step), rank, world, ks
            self._shard = k
            self._cursor = 0
            self._gen += 1
            keep = set(self._upcoming(self.prefetch + len(ks)))
            for key in [k for k in self._cache if k not in keep]:
                del self._cache[key]
            self._cond.notify_all()

    def _upcoming(self, n: int) -> list[Key]:
        """The next ``n`` (step, k) keys from the consumer's cursor on. Holds the lock."""
        out: list[Key] = []
        s, i, ks = self._step, self._cursor, self._ks
        while len(out) < n:
            if i >= len(ks):
                s, i = s + 1, 0
                continue
            out.append((s, ks[i]))
            i += 1
        return out

    # ---- iteration --------------------------------------------------------------------

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        """Yield ``(k, batch)`` for this rank's micro-batches of the current step, then
        advance to the next step. Stops early (without advancing) if ``seek`` is called
        meanwhile; breaking out early leaves the step where it is (re-iterating resumes
        with the micro-batches not yet yielded)."""
        with self._cond:
            gen, step = self._gen, self._step
        while True:
            with self._cond:
                if self._gen != gen:
                    return
                if self._cursor >= len(self._ks):
                    self._step, self._cursor = step + 1, 0
                    self._cond.notify_all()
                    return
                key = (step, self._ks[self._cursor])
            batch = self._take(key)
            with self._cond:
                if self._gen != gen:
                    return
                self._cursor += 1
                self._cond.notify_all()
            yield key[1], batch

    def next_step(self) -> list[tuple[int, Any]]:
        """All of this rank's ``(k, batch)`` for the current step; advances to the next."""
        return list(iter(self))

    def get(self, step: int, micro_index: int) -> Any:
        """Micro-batch ``micro_index`` of ``step``, built now (any rank's; no prefetch)."""
        return self._build((step, micro_index))

    def _take(self, key: Key) -> Any:
        with self._cond:
            while True:
                if key in self._cache:
                    item = self._cache.pop(key)
                    self.stats["prefetched"] += 1
                    break
                if key in self._inflight:
                    self.stats["waited"] += 1
                    self._cond.wait()
                    continue
                self._inflight.add(key)  # build it here: never queue behind the thread
                item = None
                break
        if item is None:
            try:
                item = self._build(key)
                self.stats["foreground"] += 1
            finally:
                with self._cond:
                    self._inflight.discard(key)
                    self._cond.notify_all()
        if isinstance(item, _Failed):
            raise item.exc
        return item

    def _build(self, key: Key) -> Any:
        step, k = key
        idx = self.order.indices(step, k, self.micro_batch_size)
        if self._batch_fn is not None:
            batch = self._batch_fn(idx)
        else:
            batch = self._collate([self.dataset[int(i)] for i in idx])
        if self._pin:
            batch = _pin(batch)
        return batch

    def _next_prefetch_key(self) -> Key | None:
        """Holds the lock."""
        return next((k for k in self._upcoming(self.prefetch)
                     if k not in self._cache and k not in self._inflight), None)

    # ---- spare / lifecycle ------------------------------------------------------------

    def warm(self, step: int | None = None) -> float:
        """Make the first batch after promotion cheap: fault the data into memory, load or
        compute the permutation of ``step``'s epoch (default: the current step's), and run
        the batch path once. Returns the seconds it took."""
        t0 = time.perf_counter()
        if hasattr(self.dataset, "warm"):
            self.dataset.warm()
        step = self._step if step is None else step
        self.order.warm(step)
        self._build((step, 0))
        return time.perf_counter() - t0

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cache.clear()
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def __enter__(self) -> ElasticLoader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self._closed = True
        except Exception:
            pass


def _prefetch_loop(ref: weakref.ref, cond: threading.Condition) -> None:
    while True:
        with cond:
            loader = ref()
            if loader is None or loader._closed:
                return
            key = loader._next_prefetch_key()
            if key is None:
                del loader
                cond.wait(timeout=0.5)
                continue
            loader._inflight.add(key)
        try:
            item = loader._build(key)
        except BaseException as exc:  # handed to the consumer that asks for this key
            item = _Failed(exc)
        with cond:
            loader._inflight.discard(key)
            if key in loader._upcoming(loader.prefetch + len(loader._ks)):
                loader._cache[key] = item
            cond.notify_all()
        del loader, item


def _pin(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.pin_memory()
    if isinstance(batch, tuple):
        return tuple(_pin(b) for b in batch)
    if isinstance(batch, list):
        return [_pin(b) for b in batch]
    if isinstance(batch, dict):
        return {k: _pin(v) for k, v in batch.items()}
    return batch


class BatchSource:
    """How ``Session.batches`` reads a map-style dataset. A :class:`TokenDataset`'s batches
    are a pure function of their indices: an :class:`ElasticLoader` builds them ahead in a
    thread (pinned for a CUDA model). Any other dataset's ``__getitem__`` may draw from the
    global RNGs, which the session seeds per micro-batch on the training thread: its
    batches are built there, when asked for (and pinned for a CUDA model)."""

    def __init__(self, dataset: Any, global_batch_size: int, seed: int, micro_batch_size: int,
                 pin: bool = False) -> None:
        from .order import order_for

        self.dataset, self.m = dataset, micro_batch_size
        self.order = order_for(dataset, global_batch_size, seed)
        self._pin = pin and torch.cuda.is_available()
        self.loader = ElasticLoader(dataset, self.order, micro_batch_size, prefetch=2,
                                    pin_memory=pin) if isinstance(dataset, TokenDataset) else None
        self._ahead: Iterator[tuple[int, Any]] | None = None

    def begin(self, step: int, rank: int, world_size: int, shard_size: int = 1,
              ks: range | None = None) -> None:
        """This rank's micro-batches of ``step`` (``ks``: the plan's; default: the even
        spread) come next."""
        self._ahead = None
        if ks is None:
            ks = self.order.rank_range(world_size, rank, self.m, shard_size)
        if self.loader is not None and ks:
            self.loader.seek(step, rank, world_size, shard_size, ks=ks)
            self._ahead = iter(self.loader)

    def get(self, step: int, k: int) -> Any:
        """Micro-batch ``k`` of ``step`` (in this rank's order after ``begin``)."""
        if self._ahead is not None:
            got, batch = next(self._ahead)
            if got == k:
                return batch
            self._ahead = None  # out of the loader's order: build it here
        idx = self.order.indices(step, k, self.m)
        fast = getattr(self.dataset, "batch", None)
        batch = fast(idx) if callable(fast) else \
            torch.utils.data.default_collate([self.dataset[int(i)] for i in idx])
        return _pin(batch) if self._pin else batch


open_loader = ElasticLoader.from_dir
