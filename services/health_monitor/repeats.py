"""Repeated failures: the same failure at the same step on a second pod is the script's
(issue 33), not the machines'. A pure, bounded record the health monitor feeds with every
exception and hang it declares; ``observe`` says when one repeats an earlier one.

* exception: the same error (its first line, addresses and ids masked) raised at the same
  place (the innermost ``File "...", line N`` of its traceback) with the same committed
  step, by another pod, in any generation (every rank raising at once is the common case);
* hang: another pod hung holding the same committed step, in a later generation (the job
  recovered and its replacement hung at the same point: an evaluation longer than the
  collective timeout without ``s.solo``).

Injected faults (``InjectedFault``, an injected stall) simulate the machines: never counted.
Crashes by signal and lost heartbeats are the machines' too: never fed in.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

Kind = Literal["exception", "hang"]
_ADDR = re.compile(r"0x[0-9a-fA-F]+|\b[0-9a-f]{12,}\b")
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
INJECTED_MARK = "(injected)"  # the agent's stall report of an injected stall ends with it


@dataclass(frozen=True)
class Failure:
    pod: str
    kind: Kind
    generation: int
    step: int       # the pod's last committed step when it failed
    error: str      # the exception with its traceback, or what hung


def signature(f: Failure) -> tuple[str, int, str]:
    """What two failures must share to be one bug."""
    if f.kind == "hang":
        return ("hang", f.step, "")
    lines = f.error.strip().splitlines()
    first = _ADDR.sub("#", lines[0]) if lines else ""
    frames = _FRAME.findall(f.error)
    where = f"{frames[-1][0]}:{frames[-1][1]}" if frames else ""
    return ("exception", f.step, f"{first}|{where}")


def injected(f: Failure) -> bool:
    return f.error.startswith("InjectedFault") or f.error.rstrip().endswith(INJECTED_MARK)


class RepeatDetector:
    """The first failure of each signature (bounded: the oldest are forgotten)."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._first: OrderedDict[tuple[str, int, str], Failure] = OrderedDict()
        self._max = max_entries

    def observe(self, f: Failure) -> Failure | None:
        """Record ``f``; the earlier failure it repeats (another pod), or None."""
        if injected(f):
            return None
        key = signature(f)
        first = self._first.get(key)
        if first is None:
            self._first[key] = f
            if len(self._first) > self._max:
                self._first.popitem(last=False)
            return None
        if first.pod == f.pod:
            return None
        if f.kind == "hang" and f.generation <= first.generation:
            return None  # the same incident seen twice, not a replacement hanging again
        return first
