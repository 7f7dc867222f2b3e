"""A session closed when the interpreter exits (``agent.init``, the drop-in), not by a ``with``
block: with the script's uncaught exception when there is one, so that it is reported with
its traceback, as ``with Session`` reports it, instead of the pod's exit being taken for a
crash (issue 41: spares were promoted into the same bug until the state was lost).

The interpreter calls ``sys.excepthook`` for an uncaught exception before it runs atexit
(and so does the zygote's fork of a script, services/actuator/zygote.py): the hook prints
the traceback, then closes the session with the exception at once (its report does not wait
for the script's non-daemon threads). atexit closes it otherwise: with the exception the
interpreter left in ``sys.last_value`` when a hook the script installed later did not call
this one, else cleanly."""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Any, Callable

from plumbing import logs

log = logs.get("agent")
ExcInfo = tuple[Any, Any, Any]
NO_EXC: ExcInfo = (None, None, None)


class ExitCloser:
    """Calls ``close(exc_type, exc, tb)`` exactly once: from ``sys.excepthook`` with the
    script's uncaught exception, from ``close_now()`` (the script ended the session itself)
    or from atexit."""

    def __init__(self, close: Callable[[Any, Any, Any], None]) -> None:
        self._close = close
        self._lock = threading.Lock()  # the hook, atexit and close_now() may race
        self._closed = False
        self.failed: ExcInfo | None = None  # the script's uncaught exception
        prev = sys.excepthook

        def hook(tp: Any, v: Any, tb: Any) -> None:
            self.failed = (tp, v, tb)
            try:
                prev(tp, v, tb)  # the traceback in the pod's log first, as without Ceaseless
            finally:
                self._once(self.failed)

        sys.excepthook = hook
        atexit.register(self._at_exit)

    def close_now(self) -> None:
        self._once(self.failed or NO_EXC)

    def _at_exit(self) -> None:
        self._once(self.failed or _last_uncaught())

    def _once(self, exc: ExcInfo) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if exc[1] is not None and self.failed is None:
            self.failed = exc
        try:
            self._close(*exc)
        except Exception as e:  # at exit: log it, the process ends anyway
            log.exception("closing the session failed", error=str(e)[:200])


def _last_uncaught() -> ExcInfo:
    """The uncaught exception the interpreter printed (it sets ``sys.last_value`` before it
    calls ``sys.excepthook``), if any."""
    v = getattr(sys, "last_value", None)
    if isinstance(v, BaseException):
        return type(v), v, getattr(sys, "last_traceback", None) or v.__traceback__
    return NO_EXC
