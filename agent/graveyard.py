"""Abandoned process groups: kept alive while they may block, freed once they cannot.

A group abandoned with an operation pending (a newer plan, a peer error) must not be
destroyed on the spot: ``~ProcessGroupGloo`` joins its worker threads, and one that runs a
collective on a stopped peer blocks until the operation's timeout. So such a group is parked
here with its pending works (``park``). Parked for ever, every incident would keep each
survivor's sockets and gloo threads of the aborted generation (EMFILE at scale), so
``reap`` (the runtime calls it every heartbeat) frees what no longer can block:

* a finished work goes at once (its buffers: gradient buckets, transfer pieces);
* a gloo send/receive nobody waits for never finishes on its own (gloo completes it only in
  ``wait``): the reaper waits on it briefly, which closes its pair and fails it. Nobody
  uses a parked group, so nothing is lost; a collective is left to finish or fail (its
  peers gone, or the group's own timeout);
* a group whose works have all finished is destroyed: its threads are idle, the join
  returns. NCCL groups were aborted when parked; they are freed the same way.

Destroying a group takes a while (about 0.1-0.2 s for a gloo group, measured on loopback):
it happens on one reaper thread, never on the caller's (the heartbeat loop). A parked
object also gets an extra reference, so that the interpreter's teardown never runs a
destructor that could hang the exit; freeing takes it back.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

_FORCE_WAIT = timedelta(milliseconds=1)  # a parked p2p work's last wait: fails it


@dataclass
class _Grave:
    obj: Any                                          # a group (or what may block like one)
    works: list[Any] = field(default_factory=list)    # its operations pending when parked
    gloo: bool = True                                 # gloo p2p works can be failed here
    on_free: Callable[[], None] | None = None         # after obj is gone (its store, ...)


_LOCK = threading.Lock()
_GRAVES: list[_Grave] = []
_INCREFD: set[int] = set()   # ids of objects given the extra reference
_JOBS: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
_REAPER: list[threading.Thread] = []


def park(obj: Any, works: list[Any] | tuple = (), *, gloo: bool = True,
         on_free: Callable[[], None] | None = None) -> None:
    """Keep ``obj`` (a group) and ``works`` (its pending operations) alive until ``reap``
    finds that destroying them cannot block. ``on_free`` runs once ``obj`` is gone."""
    if obj is None:
        return
    works = [w for w in works if w is not None]
    with _LOCK:
        for g in _GRAVES:
            if g.obj is obj:  # parked twice (two threads let go of it): one grave
                new = [w for w in works if all(w is not v for v in g.works)]
                g.works += new
                works = new
                break
        else:
            _GRAVES.append(_Grave(obj, works, gloo, on_free))
            _incref(obj)
        for w in works:
            _incref(w)


def abandoned() -> int:
    """How many groups are parked now (abandoned with an operation still pending, not yet
    freed). While any is stuck on a live (e.g. stopped) peer the interpreter may not exit
    cleanly: finish such a process with ``os._exit(code)`` after flushing logs."""
    with _LOCK:
        return len(_GRAVES)


def reap() -> int:
    """One pass over the parked groups (see module docstring); cheap, never blocks: what
    could take a while runs on the reaper thread. Returns how many objects (works and
    groups) this pass let go."""
    done: list[Any] = []
    force: list[Any] = []
    free: list[_Grave] = []
    with _LOCK:
        keep = []
        for g in _GRAVES:
            still = []
            for w in g.works:
                (done if _finished(w) else still).append(w)
            g.works = still
            if still:
                keep.append(g)
                if g.gloo:
                    force.extend(still)
            else:
                free.append(g)
        _GRAVES[:] = keep
    for w in done:  # finished: its destructor only frees memory
        _decref(w)
    del done
    if force or free:
        _JOBS.put(lambda: _fail(force))
        for g in free:
            _JOBS.put(lambda g=g: _destroy(g))
        _start_reaper()
    return len(free)


def _fail(works: list[Any]) -> None:
    for w in works:
        try:  # a collective: the wait times out, nothing else; a send/recv: pair closed
            w.wait(_FORCE_WAIT)
        except Exception:
            pass


def _destroy(g: _Grave) -> None:
    obj, g.obj = g.obj, None
    _decref(obj)
    del obj  # the last reference, normally: the destructor runs here, on the reaper
    if g.on_free is not None:
        try:
            g.on_free()
        except Exception:
            pass


def _start_reaper() -> None:
    with _LOCK:
        if _REAPER and _REAPER[0].is_alive():
            return
        t = threading.Thread(target=_reaper, name="ceaseless-reaper", daemon=True)
        _REAPER[:] = [t]
    t.start()


def _reaper() -> None:
    while True:
        job = _JOBS.get()
        try:
            job()
        except Exception:
            pass
        del job


def _finished(w: Any) -> bool:
    try:
        return bool(w.is_completed())
    except Exception:
        return False


def _incref(o: Any) -> None:
    try:  # survive interpreter teardown too: a destructor there would hang the exit
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(o))
        _INCREFD.add(id(o))
    except Exception:
        pass


def _decref(o: Any) -> None:
    with _LOCK:
        if id(o) not in _INCREFD:
            return
        _INCREFD.discard(id(o))
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(o))
