"""A real gloo group that matches point-to-point messages as NCCL does: per peer, in the
order they were posted, tags ignored. Every send and receive goes to gloo with tag 0 (one
slot per pair), so gloo matches them by order. Gloo honours tags and would hide a receive
posted out of the sender's order; NCCL meets it with a message of another size.

Gloo itself ends the process on such a mismatch ("Received data size doesn't match"). Ranks
that are threads of one process (``thread_ranks.run_ranks``) share a ``Ledger``: the n-th
send from a to b is compared with the n-th receive posted at b from a before either reaches
gloo, and a mismatch raises ``OutOfOrder`` in the rank that posted second (the test fails,
the process lives). Between processes (``dist_worker.py``) gloo's own check is what fails."""

from __future__ import annotations

import threading
from typing import Any

from agent.groups import _GROUP_META


class OutOfOrder(RuntimeError):
    """The n-th send and the n-th receive of a pair have different sizes."""


class Ledger:
    """The sizes of the messages each pair (source, destination) posted, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._posted: dict[tuple[int, int, str], list[int]] = {}
        self.matched = 0  # pairs of (send, receive) checked

    def post(self, src: int, dst: int, kind: str, nbytes: int) -> None:
        other = "recv" if kind == "send" else "send"
        with self._lock:
            mine = self._posted.setdefault((src, dst, kind), [])
            mine.append(nbytes)
            theirs = self._posted.get((src, dst, other), [])
            n = len(mine) - 1
            if n < len(theirs):
                self.matched += 1
                if theirs[n] != nbytes:
                    raise OutOfOrder(
                        f"message {n} from rank {src} to rank {dst}: {kind} of {nbytes} bytes "
                        f"meets a {other} of {theirs[n]} bytes (NCCL matches in order)")


class InOrderGroup:
    """Wraps a ``ProcessGroupGloo`` (from ``make_group``); hand it to ``AbortableGroup``."""

    def __init__(self, pg: Any, ledger: Ledger | None = None) -> None:
        self._pg = pg
        self._ledger = ledger
        self._rank = pg.rank()
        meta = _GROUP_META.pop(id(pg), None)
        if meta is not None:  # what AbortableGroup picks up, now under this object
            _GROUP_META[id(self)] = meta

    def send(self, tensors: list, dst: int, tag: int = 0) -> Any:
        if self._ledger is not None:
            self._ledger.post(self._rank, dst, "send", _nbytes(tensors))
        return self._pg.send(tensors, dst, 0)

    def recv(self, tensors: list, src: int, tag: int = 0) -> Any:
        if self._ledger is not None:
            self._ledger.post(src, self._rank, "recv", _nbytes(tensors))
        return self._pg.recv(tensors, src, 0)

    def __getattr__(self, name: str) -> Any:  # everything else: the real group's
        return getattr(self._pg, name)


def _nbytes(tensors: list) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
