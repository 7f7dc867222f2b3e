"""The global sample order: a pure function of (data, seed, step, micro-batch).

Positions are global sample slots: step ``s``, micro-batch ``k`` of ``m`` samples holds
positions ``[s*B + k*m, s*B + (k+1)*m)`` (docs/data.md, "Global order"). Position
``p`` lies in epoch ``e = p // n_usable`` at offset ``p % n_usable``, where ``n_usable`` is
``n_samples`` rounded down to a multiple of ``B``, so a step never straddles two epochs; the
sample is ``perm_e[p % n_usable]``. ``perm_e`` is a permutation of all ``n_samples`` (each
epoch drops a different ``n_samples - n_usable`` samples), obtained by sorting splitmix64
keys of (seed, epoch, i): it depends on nothing but integers (not on numpy's RNG streams),
so every machine and numpy version computes the same order. Each epoch's permutation is
computed once per node and cached as ``.npy`` (``cache_dir``), then loaded by mmap.

:func:`order_for` is the order ``agent.Session`` (and the benchmarks) use for any map-style
dataset: the dataset's own ``global_order(B, seed)`` hook if it has one (e.g. the
memory-mapped token dataset, whose permutations are cached next to the data), else a
:class:`GlobalOrder` of ``len(dataset)`` samples.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from schemas.batching import micro_batch_range, num_micro_batches

from .format import DataError, _unlink

ORDER_VERSION = 1
_M64 = (1 << 64) - 1
_C1, _C2, _C3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + _C1
        x = (x ^ (x >> np.uint64(30))) * _C2
        x = (x ^ (x >> np.uint64(27))) * _C3
        return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """``_mix`` of one value in Python integers (no numpy array: ~20x cheaper for one)."""
    x = (x + int(_C1)) & _M64
    x = ((x ^ (x >> 30)) * int(_C2)) & _M64
    x = ((x ^ (x >> 27)) * int(_C3)) & _M64
    return x ^ (x >> 31)


def _key(seed: int, stream: int) -> int:
    """The per-(seed, stream) key every element of ``hash64`` is mixed with."""
    return _mix_int(_mix_int(seed & _M64) ^ (stream & _M64))


def hash64(seed: int, stream: int, i: np.ndarray) -> np.ndarray:
    """A 64-bit hash of (seed, stream, i) for every element of the uint64 array ``i``."""
    return _mix(np.asarray(i, dtype=np.uint64) ^ np.uint64(_key(seed, stream)))


def micro_seed(seed: int, step: int, micro_index: int) -> int:
    """The seed of micro-batch ``k`` of step ``s`` (dropout, augmentation): same on any rank.
    ``hash64(seed, 0x5EED ^ (step << 20), [micro_index]) >> 1`` (fits
    torch.Generator.manual_seed), in Python integers: it is called three times a step."""
    if not 0 <= micro_index <= _M64:
        raise OverflowError(f"micro_index {micro_index} is not a uint64")
    return _mix_int(micro_index ^ _key(seed, 0x5EED ^ (step << 20))) >> 1


def epoch_permutation(n_samples: int, seed: int, epoch: int) -> np.ndarray:
    keys = hash64(seed, (epoch << 8) | 0x0E, np.arange(n_samples, dtype=np.uint64))
    perm = np.argsort(keys, kind="stable")
    return perm.astype(np.int32 if n_samples < (1 << 31) else np.int64)


class GlobalOrder:
    """Seeded, epoch-rolling order of ``n_samples`` samples for a fixed global batch.

    ``cache_dir``: where epoch permutations are cached (``None``: memory only).
    ``data_hash``: part of the cache key (the data's content hash), so that an order cached
    for one data set is never used for another.
    """

    def __init__(self, n_samples: int, global_batch_size: int, seed: int = 0,
                 cache_dir: str | os.PathLike | None = None, data_hash: str = "",
                 keep_epochs: int = 2):
        if global_batch_size <= 0:
            raise DataError(f"global_batch_size must be positive, got {global_batch_size}")
        if n_samples < global_batch_size:
            raise DataError(
                f"{n_samples} samples cannot fill one global batch of {global_batch_size}; use "
                "more data, a shorter seq_len or a smaller global batch"
            )
        self.n_samples = int(n_samples)
        self.global_batch_size = int(global_batch_size)
        self.seed = int(seed)
        self.data_hash = data_hash
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.n_usable = (self.n_samples // self.global_batch_size) * self.global_batch_size
        self.steps_per_epoch = self.n_usable // self.global_batch_size
        self._epochs: OrderedDict[int, np.ndarray] = OrderedDict()
        self._keep = max(1, keep_epochs)
        self._lock = threading.Lock()
        self._loading: dict[int, threading.Event] = {}

    # ---- positions --------------------------------------------------------------------

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int, micro_index: int, micro_batch_size: int) -> np.ndarray:
        """Sample indices of micro-batch ``micro_index`` (size ``micro_batch_size``) of ``step``."""
        M = num_micro_batches(self.global_batch_size, micro_batch_size)
        if step < 0:
            raise DataError(f"step {step} is negative")
        if not 0 <= micro_index < M:
            raise DataError(f"micro-batch {micro_index} outside 0..{M - 1}")
        pos = step * self.global_batch_size + micro_index * micro_batch_size
        epoch, off = divmod(pos, self.n_usable)
        return np.array(self.permutation(epoch)[off:off + micro_batch_size], dtype=np.int64)

    def step_indices(self, step: int) -> np.ndarray:
        """All ``B`` sample indices of ``step``, in micro-batch order."""
        return self.indices(step, 0, self.global_batch_size)

    def rank_micro_batches(self, step: int, world_size: int, rank: int,
                           micro_batch_size: int) -> list[tuple[int, np.ndarray]]:
        """``[(k, indices)]`` for the contiguous run of micro-batches ``rank`` computes."""
        ks = self.rank_range(world_size, rank, micro_batch_size)
        return [(k, self.indices(step, k, micro_batch_size)) for k in ks]

    def rank_range(self, world_size: int, rank: int, micro_batch_size: int,
                   shard_size: int = 1) -> range:
        M = num_micro_batches(self.global_batch_size, micro_batch_size)
        return micro_batch_range(M, world_size, rank, shard_size)

    # ---- permutations -----------------------------------------------------------------

    def cache_path(self, epoch: int) -> Path | None:
        if self.cache_dir is None:
            return None
        tag = (self.data_hash or "nohash")[:16]
        return self.cache_dir / f"order-v{ORDER_VERSION}-{tag}-n{self.n_samples}-s{self.seed}-e{epoch}.npy"

    def permutation(self, epoch: int) -> np.ndarray:
        """The epoch's permutation (read-only; cached in memory, on disk when configured)."""
        perm = self._epochs.get(epoch)
        if perm is not None:
            return perm
        with self._lock:
            perm = self._epochs.get(epoch)
            if perm is not None:
                return perm
            ev = self._loading.get(epoch)
            owner = ev is None
            if owner:
                ev = self._loading[epoch] = threading.Event()
        if not owner:  # another thread (the prefetcher) is computing it
            ev.wait()
            return self.permutation(epoch)
        try:
            perm = self._load_or_compute(epoch)
            with self._lock:
                self._epochs[epoch] = perm
                self._epochs.move_to_end(epoch)
                while len(self._epochs) > self._keep:
                    self._epochs.popitem(last=False)
        finally:
            with self._lock:
                self._loading.pop(epoch, None)
            ev.set()
        return perm

    def _load_or_compute(self, epoch: int) -> np.ndarray:
        path = self.cache_path(epoch)
        if path is not None and path.exists():
            try:
                perm = np.load(path, mmap_mode="r")
                if perm.shape == (self.n_samples,):
                    return perm
            except (OSError, ValueError):
                pass  # a damaged cache file is recomputed and replaced
        perm = epoch_permutation(self.n_samples, self.seed, epoch)
        perm.flags.writeable = False
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
                try:
                    with os.fdopen(fd, "wb") as f:
                        np.save(f, perm)
                    os.replace(tmp, path)
                except BaseException:
                    _unlink(tmp)
                    raise
            except OSError:
                pass  # read-only data dir: keep it in memory only
        return perm

    def warm(self, step: int = 0) -> None:
        """Load (or compute) the permutation of ``step``'s epoch."""
        self.permutation(self.epoch_of(step))

    def __repr__(self) -> str:
        return (f"GlobalOrder(n_samples={self.n_samples}, global_batch_size={self.global_batch_size}, "
                f"seed={self.seed}, steps_per_epoch={self.steps_per_epoch})")


def order_for(dataset: Any, global_batch_size: int, seed: int) -> Any:
    """The global order of a map-style ``dataset``: its own ``global_order(B, seed)`` if it
    has one, else ``GlobalOrder(len(dataset), B, seed)`` (permutations in memory only)."""
    own = getattr(dataset, "global_order", None)
    if callable(own):
        return own(global_batch_size, seed)
    return GlobalOrder(len(dataset), global_batch_size, seed)
