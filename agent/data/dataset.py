"""Memory-mapped, fixed-length token samples.

Sample ``i`` is the window ``tokens[i*L : i*L + L + 1]`` (``L = seq_len``) split into the
next-token pair ``x = window[:-1]``, ``y = window[1:]``; windows do not overlap except for
the one shared boundary token, so ``n_samples = (n_tokens - 1) // L`` and the tail that
does not fill a window is never used. Samples cross document boundaries (documents are
separated by EOS in the stream), as in GPT-style pre-training.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import time
import warnings
from pathlib import Path

import numpy as np
from numpy.lib.stride_tricks import as_strided
import torch

from .format import (
    INDEX_FILE,
    TOKENS_FILE,
    DataError,
    _unlink,
    check_size,
    check_tokens as _check_tokens,
    node_cache_dir,
    read_index,
    verify_hash,
)
from .order import GlobalOrder

_PAGE = mmap.PAGESIZE


def _map(path: Path, dtype: np.dtype) -> tuple[mmap.mmap | None, np.ndarray]:
    """A shared, read-only map of ``path`` viewed as ``dtype``."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return None, np.empty(0, dtype=dtype)
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=dtype)  # read-only view; pages shared with the page cache
    return mm, arr


class TokenDataset(torch.utils.data.Dataset):
    """Map-style dataset over a prepared data directory.

    Parameters
    ----------
    data_dir:
        a directory written by :func:`agent.data.prepare` or :func:`agent.data.generate`.
    seq_len:
        tokens per sample (``None``: the index's ``seq_len``).
    verify:
        ``"auto"`` (sha256 on the first open per node, then a marker), ``"full"``
        (always), ``"size"`` (size checks only). Size and index checks always run.
    check_tokens:
        vectorised max over all tokens at open (about 13 ms per 100M uint16 tokens in
        page cache) so a token >= vocab size is refused now, not as an embedding error.
    cache_to_shm:
        copy ``tokens.bin`` once per node to ``/dev/shm`` (keyed by content hash, atomic
        rename, one copier at a time) and map that copy, so every process on the node
        shares the same pages and no process depends on a network filesystem.
    """

    def __init__(self, data_dir: str | os.PathLike, seq_len: int | None = None, *,
                 verify: str | bool = "auto", check_tokens: bool = True,
                 cache_to_shm: bool = False, shm_dir: str | os.PathLike | None = None):
        t0 = time.perf_counter()
        self.data_dir = Path(data_dir)
        self.index = read_index(self.data_dir)
        self.seq_len = int(seq_len if seq_len is not None else self.index.seq_len)
        if self.seq_len <= 0:
            raise DataError(f"{self.data_dir}: seq_len must be positive, got {self.seq_len}")
        src = self.data_dir / TOKENS_FILE
        st = check_size(src, self.index)
        if self.seq_len + 1 > self.index.n_tokens:
            raise DataError(
                f"{src}: a sample needs seq_len + 1 = {self.seq_len + 1} tokens but the data has "
                f"only {self.index.n_tokens}"
            )
        self.verified_now = False
        self.shm_path: Path | None = None
        if cache_to_shm and (shm_dir is not None or os.path.isdir("/dev/shm")):
            path = self._shm_copy(src, st, verify, shm_dir)
        else:
            self.verified_now = verify_hash(src, self.index, st, verify)
            path = src
        self.path = path
        self._verify, self._check, self._cache, self._shm_dir = verify, check_tokens, cache_to_shm, shm_dir
        self._mm, self.tokens = _map(path, self.index.np_dtype)
        if self.tokens.size != self.index.n_tokens:  # file changed between stat and map
            raise DataError(f"{path}: holds {self.tokens.size} tokens, index says {self.index.n_tokens}")
        self.max_token = _check_tokens(path, self.tokens, self.index) if check_tokens else None
        self.n_samples = (self.index.n_tokens - 1) // self.seq_len
        self._windows = self._window_view()
        self.open_seconds = time.perf_counter() - t0

    # ---- node-local shared copy -------------------------------------------------------

    def _shm_copy(self, src: Path, st: os.stat_result, verify, shm_dir) -> Path:
        base = Path(shm_dir) if shm_dir is not None else node_cache_dir()
        if shm_dir is None and not str(base).startswith("/dev/shm"):
            base = Path("/dev/shm") / f"ceaseless-data-{os.getuid()}"
        base.mkdir(parents=True, exist_ok=True)
        dst = base / f"{self.index.sha256}.{self.index.dtype}.bin"
        if dst.exists() and dst.stat().st_size == self.index.nbytes:
            return dst  # written (and hashed) by a process of this node
        with open(base / f"{self.index.sha256}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one copier per node; the others wait
            if dst.exists() and dst.stat().st_size == self.index.nbytes:
                return dst
            tmp = base / f".{dst.name}.{os.getpid()}.tmp"
            h = hashlib.sha256()
            try:
                with open(src, "rb") as fi, open(tmp, "wb") as fo:
                    while chunk := fi.read(8 << 20):
                        h.update(chunk)
                        fo.write(chunk)
                if verify not in ("size", False, "none", None) and h.hexdigest() != self.index.sha256:
                    raise DataError(
                        f"{src}: content hash mismatch: sha256 is {h.hexdigest()[:16]}... but "
                        f"{src.parent / INDEX_FILE} says {self.index.sha256[:16]}... (corrupt or "
                        "replaced; prepare the data again)"
                    )
                if os.path.getsize(tmp) != self.index.nbytes:
                    raise DataError(f"{src}: changed while being copied to {base}")
                os.replace(tmp, dst)
                self.verified_now = True
            except BaseException:
                _unlink(tmp)
                raise
        return dst

    def _window_view(self) -> np.ndarray:
        """Read-only ``[n_samples, seq_len + 1]`` view of the map (row i = sample i's window)."""
        item = self.tokens.itemsize
        return as_strided(self.tokens, shape=(self.n_samples, self.seq_len + 1),
                          strides=(self.seq_len * item, item), writeable=False)

    # ---- access -----------------------------------------------------------------------

    def __len__(self) -> int:
        return self.n_samples

    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def content_hash(self) -> str:
        return self.index.sha256

    def window(self, i: int) -> np.ndarray:
        """Zero-copy read-only numpy view of sample ``i``'s ``seq_len + 1`` tokens."""
        if not 0 <= i < self.n_samples:
            raise IndexError(f"sample {i} outside 0..{self.n_samples - 1}")
        return self._windows[i]

    def raw(self, i: int) -> torch.Tensor:
        """Zero-copy tensor (``torch.uint16``/``uint32``) over sample ``i``'s window; read-only."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "non-writable array"
            return torch.from_numpy(self.window(i))

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.window(int(i)).astype(np.int64)
        t = torch.from_numpy(w)
        return t[:-1], t[1:]

    def batch(self, indices: np.ndarray, out: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``, two contiguous ``[n, seq_len]`` int64 tensors, for sample ``indices``.

        One gather per tensor straight from the map into int64 (the uint16 -> int64
        conversion is the only copy); ``out`` may supply (pinned) tensors to fill.
        """
        idx = np.asarray(indices, dtype=np.int64)
        if idx.ndim != 1:
            raise ValueError("indices must be one-dimensional")
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_samples):
            raise IndexError(f"sample index outside 0..{self.n_samples - 1}")
        n, L = idx.size, self.seq_len
        if out is None:
            x = torch.empty((n, L), dtype=torch.int64)
            y = torch.empty((n, L), dtype=torch.int64)
        else:
            x, y = out
        rows = self._windows[idx]  # one row gather from the map: [n, L+1] tokens
        np.copyto(x.numpy(), rows[:, :-1], casting="unsafe")  # the only conversion copy
        np.copyto(y.numpy(), rows[:, 1:], casting="unsafe")
        return x, y

    def global_order(self, global_batch_size: int, seed: int = 0,
                     cache_dir: str | os.PathLike | None = None) -> GlobalOrder:
        """The :class:`GlobalOrder` of this dataset, its permutations cached next to the data
        (or in the node cache when the data directory is read-only). ``agent.Session``
        picks this hook up through ``agent.data.order.order_for``."""
        if cache_dir is None:
            cache_dir = self.data_dir if os.access(self.data_dir, os.W_OK) else node_cache_dir() / "orders"
        return GlobalOrder(self.n_samples, global_batch_size, seed, cache_dir=cache_dir,
                           data_hash=self.content_hash)

    def warm(self, touch: bool = True) -> None:
        """Ask the kernel to read the whole file ahead and (``touch``) fault every page in."""
        if self._mm is not None:
            try:
                self._mm.madvise(mmap.MADV_WILLNEED)
            except (AttributeError, OSError):
                pass
            if touch:
                per_page = max(1, _PAGE // self.tokens.itemsize)
                int(self.tokens[::per_page].sum(dtype=np.uint64))
        self.batch(np.zeros(1, dtype=np.int64))  # first-call costs of the batch path

    # ---- pickling (DataLoader workers with spawn/forkserver) --------------------------

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_mm"] = state["tokens"] = state["_windows"] = None  # re-mapped, never pickled
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._mm, self.tokens = _map(self.path, self.index.np_dtype)
        self._windows = self._window_view()

    def close(self) -> None:
        """Drop this object's map (views handed out keep their pages alive)."""
        self.tokens = np.empty(0, dtype=self.index.np_dtype)
        # a fresh empty view: slicing the old one would keep the map alive through .base
        self._windows = np.empty((0, self.seq_len + 1), dtype=self.index.np_dtype)
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # a view handed out still uses it; it goes when that view does

    def __repr__(self) -> str:
        return (f"TokenDataset({str(self.data_dir)!r}, seq_len={self.seq_len}, n_samples={self.n_samples}, "
                f"vocab_size={self.vocab_size}, dtype={self.index.dtype})")

