"""``HostCopy``: a small device tensor's copy to host memory, read later without a host sync.

On CUDA the copy goes to pinned memory with ``non_blocking`` on the current stream, behind an
event: starting it never waits, ``ready()`` asks the event without waiting, ``get()`` waits
only if the device has not got there yet (on whatever thread calls it). CPU tensors are
their own copy; another accelerator's is copied plainly. What the steady step reads a step
later (the heartbeat's digest) or on another thread (a spare's ``state_word``) goes through
it, so the step keeps its one host sync (issue 43).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


class HostCopy:
    def __init__(self, t: Tensor) -> None:
        self._event: Any = None
        self._dev: Tensor | None = None
        if t.is_cuda:
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            self._dev = t  # alive until the copy has read it
        elif t.device.type != "cpu":
            self._host = t.cpu()
        else:
            self._host = t

    def ready(self) -> bool:
        ev = self._event  # another thread may clear it meanwhile
        if ev is not None and ev.query():
            self._event = self._dev = None  # landed: get() need not wait
        return self._event is None

    def get(self) -> Tensor:
        """The host tensor (read it with ``numpy()``: no dispatcher, no copy)."""
        ev = self._event
        if ev is not None:
            ev.synchronize()
            self._event = self._dev = None
        return self._host
