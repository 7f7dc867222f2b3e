"""Count the host syncs a piece of training code makes on this thread (issue 43).

What would block the host until a GPU caught up: a tensor read to a Python scalar
(``aten._local_scalar_dense``: ``item()``, ``float()``, ``bool()``), a copy from a device to
the host (``aten._to_copy`` / ``copy_`` into CPU memory from another device), ``tolist()``
and ``cpu()`` (on CPU tensors these skip the dispatcher but would copy from a GPU), and
explicit waits (``torch.cuda.synchronize``, ``Event.synchronize``, ``Stream.synchronize``).
On CPU nothing really waits: what is counted is what would, the same code on a GPU. Reading
pinned host memory after a completed event (``Event.query()``) is not a sync, nor counted.
Only the calling thread counts: other threads (the runtime's, a spare's stream) wait as
they like.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten


def _never(t: Any) -> bool:
    return False


class SyncCounter(TorchDispatchMode):
    """``on_host(t)``: ``t`` lives in host memory also when the model is on a GPU (an
    optimizer's step counter; on a CUDA run every CPU tensor): reading it waits for nothing."""

    def __init__(self, on_host: Callable[[Any], bool] = _never) -> None:
        super().__init__()
        self.on_host = on_host
        self.count = 0
        self.where: list[str] = []
        self._thread = threading.get_ident()
        self._depth = 0  # inside a counted Python-level call: its own dispatches are its

    def note(self, what: str) -> None:
        if threading.get_ident() == self._thread and self._depth == 0:
            self.count += 1
            self.where.append(what)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default:
            if not self.on_host(args[0]):
                self.note("item")
        elif func is _aten._to_copy.default:
            src, dev = args[0], kwargs.get("device")
            if dev is not None and torch.device(dev).type == "cpu" and src.device.type != "cpu":
                self.note("to(cpu)")
        elif func is _aten.copy_.default:
            dst, src = args[0], args[1]
            if dst.device.type == "cpu" and src.device.type != "cpu" and not (
                    kwargs.get("non_blocking") or (len(args) > 2 and args[2])):
                self.note("copy_ to cpu")
        return func(*args, **kwargs)


@contextlib.contextmanager
def counting(on_host: Callable[[Any], bool] = _never) -> Iterator[SyncCounter]:
    """``with counting() as c: ...``; ``c.count`` host syncs on this thread."""
    c = SyncCounter(on_host)
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, label: str, tensor: bool = False) -> None:
        orig = getattr(owner, name)

        def counted(*a: Any, **k: Any) -> Any:
            if not (tensor and c.on_host(a[0])):
                c.note(label)
            c._depth += threading.get_ident() == c._thread
            try:
                return orig(*a, **k)
            finally:
                c._depth -= threading.get_ident() == c._thread

        patched.append((owner, name, orig))
        setattr(owner, name, counted)

    wrap(torch.Tensor, "tolist", "tolist", tensor=True)
    wrap(torch.Tensor, "cpu", "cpu", tensor=True)
    wrap(torch.cuda, "synchronize", "cuda.synchronize")
    wrap(torch.cuda.Event, "synchronize", "Event.synchronize")
    wrap(torch.cuda.Stream, "synchronize", "Stream.synchronize")
    try:
        with c:
            yield c
    finally:
        for owner, name, orig in reversed(patched):
            setattr(owner, name, orig)
