"""Abandoned groups are freed once they cannot block (agent/graveyard.py): across many
incidents nothing stays parked, and the gloo threads and sockets of every aborted
generation go back. Ranks are threads of this process over real gloo groups."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from agent.collectives import AbortableGroup, make_group
from agent.groups import abandoned, reap

pytestmark = [pytest.mark.timeout(240)]


def _native_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _incident(n: int) -> None:
    """One aborted generation of two ranks: rank 0 received the first piece of a transfer
    and was interrupted with more receives posted (never waited: the pipeline's next
    window) and an all-reduce its peer never joins; rank 1 has a send pending nobody
    receives. Both abandon the group, as survivors of an incident do."""
    store = dist.HashStore()
    sent = threading.Event()
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            g = AbortableGroup(make_group(dist.PrefixStore(f"i{n}", store), r, 2, 30.0, "gloo"))
            if r == 0:
                first = torch.zeros(1 << 12)
                more = [torch.zeros(1 << 12) for _ in range(3)]
                g.wait_all([g.irecv(first, 1, 16)], None, "first piece")
                for i, t in enumerate(more):
                    g.irecv(t, 1, 17 + i)
                g.allreduce_start([torch.ones(1 << 10)])
                sent.wait(30)
            else:
                g.wait_all([g.isend(torch.ones(1 << 12), 0, 16)], None, "first piece")
                g.isend(torch.ones(1 << 12), 0, 99)  # nobody receives it
                sent.set()
            g.abort()  # a newer plan
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors


def _reap_until_empty(limit_s: float = 60.0) -> None:
    """What the runtime's heartbeat does, until nothing is parked (or ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while abandoned() and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)


def test_aborted_groups_are_freed_across_many_incidents():
    _incident(-1)  # warm-up: torch's own threads, the reaper
    _reap_until_empty()
    base_threads, base_fds = _native_threads(), _fds()
    incidents = 8
    for n in range(incidents):
        _incident(n)
        assert abandoned() == 2  # both ranks parked their group, with its works
        _reap_until_empty()
        assert abandoned() == 0, f"incident {n}: {abandoned()} groups still parked"
    deadline = time.monotonic() + 30  # the reaper destroys the last groups meanwhile
    while ((_native_threads() > base_threads or _fds() > base_fds)
           and time.monotonic() < deadline):
        time.sleep(0.05)
    assert _native_threads() <= base_threads and _fds() <= base_fds, (
        f"after {incidents} incidents: {_native_threads()} threads (was {base_threads}), "
        f"{_fds()} descriptors (was {base_fds})")
