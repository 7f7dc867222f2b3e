"""The heartbeat's state digest (``digest``: a strided sample of the parameters), computed
on the device and read a step later (``DigestSlot``).

A commit begins its step's digest (``digest_begin``: device work and an asynchronous
copy to pinned host memory behind a CUDA event) and reports the newest digest whose copy has
already landed, without waiting: on a GPU usually the previous step's, since the step's one
host sync (the loss read) came after that digest was queued. A digest always names its own
step (``Heartbeat.digest_step``), never the step it was reported with. Whoever needs the
digest of one exact step (a prejoin's report to the state broker) asks ``of(step)``, which
waits for it off the training thread. Two steps' digests at most are held (a few KB).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from .hostcopy import HostCopy
from .state import local


class PendingDigest:
    """A ``digest`` begun on the device: the sampled bytes of every dtype in one small
    device tensor, on its way to the host (``HostCopy``: no host sync when it is begun).
    ``ready()`` asks without waiting; ``result()`` waits for it (a host sync only if the
    device has not got there yet) and hashes the bytes."""

    def __init__(self, data: Tensor | None, parts: list[tuple[torch.dtype, int]],
                 total: int) -> None:
        self._parts, self._total = parts, total
        self._copy = HostCopy(data) if data is not None else None
        self._hex: str | None = None

    def ready(self) -> bool:
        return self._copy is None or self._copy.ready()

    def result(self) -> str:
        if self._hex is None:
            h = hashlib.blake2b(digest_size=8)
            if self._copy is not None:
                raw = self._copy.get().numpy().tobytes()
                at = 0
                for dtype, n in self._parts:
                    h.update(str(dtype).encode())
                    h.update(raw[at:at + n])
                    at += n
                h.update(self._total.to_bytes(8, "little"))
            self._hex = h.hexdigest()
        return self._hex


def digest_begin(model: torch.nn.Module | Sequence[Tensor], samples: int = 4096
                 ) -> PendingDigest:
    """``digest`` begun on the device, read later (``PendingDigest``): views and one
    ``torch.cat`` per dtype into one small byte tensor, no per-parameter host copy."""
    params = list(model.parameters()) if isinstance(model, torch.nn.Module) else list(model)
    params = [local(p) for p in params]
    total = sum(p.numel() for p in params)
    if not total:
        return PendingDigest(None, [], 0)
    pieces: dict[torch.dtype, list[Tensor]] = {}
    with torch.no_grad():
        for p in params:
            n = p.numel()
            if not n:
                continue
            k = max(1, min(n, samples * n // total))
            flat = p.detach().reshape(-1)
            pieces.setdefault(p.dtype, []).append(flat[:: max(1, n // k)][:k])
        # cat makes a fresh contiguous tensor per dtype; their bytes are then one tensor
        per = [(dtype, torch.cat(ps).view(torch.uint8)) for dtype, ps in pieces.items()]
        data = torch.cat([b for _, b in per]) if len(per) > 1 else per[0][1]
    return PendingDigest(data, [(d, b.numel()) for d, b in per], total)




class DigestSlot:
    def __init__(self, begin: Callable[[], PendingDigest | None]) -> None:
        self._begin = begin
        self._lock = threading.Lock()  # the training thread commits; a prejoin thread reads
        self._pending: list[tuple[int, PendingDigest]] = []  # oldest first, at most 2
        self._ready: tuple[int, str] | None = None

    def commit(self, step: int) -> dict[str, Any]:
        """Begin ``step``'s digest; the heartbeat fields of the newest digest already read
        (``digest``, ``digest_step``), or none known yet (``digest=""``). Never waits."""
        p = self._begin()
        with self._lock:
            pend = [x for x in self._pending if x[0] < step]
            pend = (pend + ([(step, p)] if p is not None else []))[-2:]
            for s, d in reversed(pend):  # stream order: a ready digest's elders are too
                if d.ready():
                    self._ready = (s, d.result())
                    pend = [x for x in pend if x[0] > s]
                    break
            self._pending, ready = pend, self._ready
        if ready is None:
            return {"digest": "", "digest_step": None}
        return {"digest": ready[1], "digest_step": ready[0]}

    def note(self, step: int, hexdigest: str) -> str:
        """A digest computed at once (a recovery's report): held as ``step``'s."""
        with self._lock:
            self._ready, self._pending = (step, hexdigest), []
        return hexdigest

    def of(self, step: int) -> str:
        """``step``'s digest, waiting for its copy if it is in flight; "" when it is not held
        (never another step's digest)."""
        with self._lock:
            pending, ready = dict(self._pending), self._ready
        if step in pending:
            return pending[step].result()
        return ready[1] if ready is not None and ready[0] == step else ""


def digest(model: torch.nn.Module | Sequence[Tensor], samples: int = 4096) -> str:
    """Cheap hex digest of a strided sample (about ``samples`` elements in all) of the
    parameters of ``model`` (or of a list of tensors). Equal states give equal digests; it is
    a heartbeat hint, not a proof (use ``checksum`` for that). ``digest_begin`` is the same
    value read later."""
    return digest_begin(model, samples).result()
