"""Stragglers (issue 41): which member computes its steps so much slower that the job should
swap it out or share its work out. Pure: no clock, no I/O (times are passed in).

Each member heartbeats its own compute of a step (the median of its recent steps, from the
step's start to its gradient sync: not the wait for the others). A member is judged slow at
a check when either

* its compute is over ``factor`` times the median of the *others'* (itself left out: with two
  members the median of both is the slower one, so a straggler among two was never found), or
* its slowdown against its own steady pace (the median of its paces while it was not judged
  slow) is over ``factor`` times the others' slowdown against theirs (a member that was faster than the others and then slowed by x5
  is x5 slower than itself, maybe only x3.2 slower than them; a load that slows everyone
  slows the others as much, so it is no straggler),

and in both cases at least ``min_s`` slower (tiny steps jitter). It is declared once the slow
judgments fill ``fraction`` of the last ``window`` seconds, having been judged for a whole
window: one noisy sample no longer restarts the window.

A member's history is kept per generation (a new plan changes its share of the work) and is
bounded: at most one pace per ``window / SAMPLES_PER_WINDOW`` s over ``HORIZON`` windows and
one judgment per ``window / MARKS_PER_WINDOW`` s over one.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Sequence

FACTOR, MIN_S, WINDOW_S = 3.0, 0.05, 10.0
FRACTION = 0.7           # of the window's judgments slow: declared
HORIZON = 3              # windows of its own calm paces kept (its steady pace)
MIN_CALM = 4             # of them before it has a steady pace
SAMPLES_PER_WINDOW = 20  # own paces kept per window
MARKS_PER_WINDOW = 40    # judgments kept per window


@dataclass(frozen=True)
class Rule:
    factor: float = FACTOR
    window: float = WINDOW_S
    min_s: float = MIN_S
    fraction: float = FRACTION

    def __post_init__(self) -> None:
        if not (self.factor > 1.0 and self.window > 0 and self.min_s >= 0
                and 0 < self.fraction <= 1):
            raise ValueError(f"straggler rule: factor > 1, window > 0, min_s >= 0 and "
                             f"0 < fraction <= 1 (got {self})")


@dataclass(frozen=True)
class Pace:
    """A member at a check: its compute of a step now, and its own earlier steady pace."""
    compute: float
    base: float | None = None


@dataclass(frozen=True)
class Verdict:
    slow: bool
    ratio: float   # its compute over the others' median (>= 1: the share-out's slowness)
    why: str       # what it was judged against


def judge(me: Pace, others: Sequence[Pace], rule: Rule) -> Verdict:
    """``me`` against the other members (``others``: not itself; at least one)."""
    if not others:
        raise ValueError("a member is judged against at least one other")
    ref = median(o.compute for o in others)
    ratio = me.compute / ref if ref > 0 else (float("inf") if me.compute > 0 else 1.0)
    if me.compute > rule.factor * ref and me.compute - ref > rule.min_s:
        return Verdict(True, max(1.0, ratio), f"the others' median {ref:.3f}s")
    theirs = [o.compute / o.base for o in others if o.base]
    if me.base and theirs:
        slowdown, usual = me.compute / me.base, median(theirs)
        if slowdown > rule.factor * usual and me.compute - me.base * usual > rule.min_s:
            return Verdict(True, max(1.0, ratio),
                           f"its own earlier {me.base:.3f}s (x{slowdown:.1f}; the others "
                           f"x{usual:.1f})")
    return Verdict(False, max(1.0, ratio), f"the others' median {ref:.3f}s")


@dataclass
class _History:
    generation: int
    latest: float | None = None  # its compute now (the last heartbeat's)
    calm: deque[tuple[float, float]] = field(default_factory=deque)  # (t, compute) not slow
    marks: deque[tuple[float, bool]] = field(default_factory=deque)  # (t, slow)
    since: float | None = None  # the first judgment of the current run of them


class Tracker:
    """Every member's recent paces and judgments (bounded), and when one is due."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self._h: dict[str, _History] = {}

    def __contains__(self, pod: str) -> bool:
        return pod in self._h

    def __len__(self) -> int:
        return len(self._h)

    def pods(self) -> list[str]:
        return list(self._h)

    def forget(self, pod: str) -> None:
        self._h.pop(pod, None)

    def _history(self, pod: str, generation: int) -> _History:
        h = self._h.get(pod)
        if h is None or h.generation != generation:  # a new plan: a new share of the work
            h = self._h[pod] = _History(generation)
        return h

    def observe(self, pod: str, generation: int, compute: float) -> None:
        """A heartbeat's compute time."""
        self._history(pod, generation).latest = compute

    def base(self, pod: str, generation: int) -> float | None:
        """Its own steady pace: the median of its paces while it was not judged slow (over
        the last HORIZON windows), or None before it has MIN_CALM of them."""
        h = self._h.get(pod)
        if h is None or h.generation != generation or len(h.calm) < MIN_CALM:
            return None
        return median(c for _, c in h.calm)

    def _calm(self, h: _History, now: float) -> None:
        w = self.rule.window
        if h.latest is None:
            return
        if h.calm and now - h.calm[-1][0] < w / SAMPLES_PER_WINDOW:
            h.calm[-1] = (h.calm[-1][0], h.latest)  # one per slot: the latest
        else:
            h.calm.append((now, h.latest))
        while h.calm and (h.calm[0][0] < now - HORIZON * w
                          or len(h.calm) > HORIZON * SAMPLES_PER_WINDOW):
            h.calm.popleft()

    def mark(self, pod: str, generation: int, now: float, slow: bool) -> bool:
        """Record a judgment; True when it is the first slow one of the window."""
        h = self._history(pod, generation)
        w = self.rule.window
        if not slow:  # its steady pace: what a slowdown is measured against
            self._calm(h, now)
        if h.since is None or (h.marks and now - h.marks[-1][0] > w):
            h.marks.clear()  # not judged for a whole window: start again
            h.since = now
        first = slow and not any(s for _, s in h.marks)
        if h.marks and now - h.marks[-1][0] < w / MARKS_PER_WINDOW:
            h.marks[-1] = (h.marks[-1][0], slow)  # one per slot: the latest
        else:
            h.marks.append((now, slow))
        while h.marks and h.marks[0][0] < now - w:
            h.marks.popleft()
        return first

    def unmark(self, pod: str) -> None:
        """Not judged now (nothing it could be declared for): its judgments start again."""
        h = self._h.get(pod)
        if h is not None:
            h.marks.clear()
            h.since = None

    def due(self, pod: str, now: float) -> bool:
        """Judged for a whole window, the latest judgment slow, and slow ones fill
        ``fraction`` of the window."""
        h = self._h.get(pod)
        if h is None or h.since is None or not h.marks or not h.marks[-1][1]:
            return False
        if now - h.since < self.rule.window:
            return False
        return sum(1 for _, s in h.marks if s) >= self.rule.fraction * len(h.marks)

    def slow_for(self, pod: str, now: float) -> float:
        """Seconds since the window's first slow judgment (for the fault's reason)."""
        h = self._h.get(pod)
        first = next((t for t, s in h.marks if s), now) if h is not None else now
        return now - first
