"""Ranks as threads of this process over a real gloo group (an in-memory store): for unit
tests of one part (tests/test_grad_sync.py, tests/test_transfer.py). ``in_order``: the group
matches sends and receives per peer in order, tags ignored, as NCCL does
(``helpers/in_order.py``)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch.distributed as dist

from agent.collectives import AbortableGroup, make_group
from helpers.in_order import InOrderGroup, Ledger


def run_ranks(fn: Callable[[int, AbortableGroup], Any], world: int = 2,
              in_order: bool = False) -> list:
    """``fn(rank, group)`` in ``world`` threads; their results in rank order. Raises the
    first error of any rank."""
    store = dist.HashStore()
    ledger = Ledger()
    out: list = [None] * world
    errors: list = []

    def run(r: int) -> None:
        try:
            pg = make_group(dist.PrefixStore("t", store), r, world, 30.0, "gloo")
            g = AbortableGroup(InOrderGroup(pg, ledger) if in_order else pg)
            out[r] = fn(r, g)
            g.close()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return out
