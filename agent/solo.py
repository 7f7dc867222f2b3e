"""Work on one member alone for longer than the collective timeout (``with s.solo():``).

The member declares a bound (heartbeat ``solo_until`` and KV ``solo.g<G>``); its peers'
collectives extend their wait while the bound holds (re-checked every collective timeout,
never past the bound), and the monitor does not call it absent until bound + collective
timeout. A block that overruns its bound is a hang like any other.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Iterator

from plumbing import logs

from .ports import KVRuntime, SoloRuntime

log = logs.get("agent")
KEY = "solo.g{generation}"  # the job KV: the solo a member of the generation declared last


def _put(rt: SoloRuntime, generation: int, until: float, ended: float | None = None) -> None:
    """Tell the peers of ``generation`` that this member works alone until ``until``
    (wall time), or that it ``ended`` then: their collective waits extend to match."""
    rt.kv.put(KEY.format(generation=generation),
              json.dumps({"pod": rt.cfg.pod, "until": until, "ended": ended}).encode())


def declared(rt: KVRuntime, generation: int) -> dict | None:
    """The solo a member of ``generation`` declared last (None: none, or unreadable)."""
    raw = rt.kv.get(KEY.format(generation=generation))
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return None


@contextlib.contextmanager
def block(rt: SoloRuntime, generation: int, step: int, limit: float) -> Iterator[None]:
    """Declare this member alone for at most ``limit`` seconds while the block runs."""
    until = time.time() + limit
    rt.progress()
    rt.update(now=True, solo_until=until)
    _put(rt, generation, until)
    log.info("working alone", generation=generation, step=step, max_s=limit)
    try:
        yield
    finally:
        rt.progress()  # back: the stall watchdog counts from here, not from before
        rt.update(now=True, solo_until=None)
        _put(rt, generation, until, ended=time.time())


def collective_args(rt: KVRuntime, generation: int, collective_timeout: float,
                    solo_max: float) -> dict[str, Any]:
    """Arguments of a member's all-reduce: its wait extends while a peer works alone, and
    the backend's own timeout outlasts the longest solo."""
    ct = collective_timeout
    noted: list[str] = []

    def extend() -> float | None:
        info = declared(rt, generation)
        if not info:
            return None
        now_w, now_m = time.time(), time.monotonic()
        bound = (info["ended"] or info["until"]) + ct
        nxt = bound if info["ended"] else min(now_w + ct, bound)
        if nxt <= now_w:
            return None
        if not noted:
            noted.append(info["pod"])
            log.info("waiting for a peer that works alone", peer=info["pod"],
                     until=round(info["until"], 3), ended=info["ended"])
        return now_m + (nxt - now_w)

    return {"extend": extend, "op_timeout_s": ct + solo_max}
