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

from array import array
from bisect import bisect_left
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
    theirs = [o.compute / o.base for o in others if o.base]
    return _verdict(me, median(o.compute for o in others),
                    median(theirs) if me.base and theirs else None, rule)


def judge_all(paces: Sequence[Pace], rule: Rule) -> list[Verdict]:
    """``judge`` of each of ``paces`` (at least two) against all the others, the same
    verdicts in O(n log n): each one's medians are read from the sorted whole with its own
    value left out (judging each alone sorts the others once per member)."""
    if len(paces) < 2:
        raise ValueError("a member is judged against at least one other")
    computes = sorted(p.compute for p in paces)
    slowdowns = sorted(p.compute / p.base for p in paces if p.base)
    out = []
    for p in paces:
        usual = None
        if p.base and len(slowdowns) > 1:
            usual = _median_without(slowdowns, p.compute / p.base)
        out.append(_verdict(p, _median_without(computes, p.compute), usual, rule))
    return out


def _median_without(s: Sequence[float], v: float) -> float:
    """``statistics.median`` of sorted ``s`` with one occurrence of ``v`` (in it) left out."""
    k = bisect_left(s, v)
    m = len(s) - 1

    def at(j: int) -> float:
        return s[j] if j < k else s[j + 1]

    return at(m // 2) if m % 2 else (at(m // 2 - 1) + at(m // 2)) / 2


def _verdict(me: Pace, ref: float, usual: float | None, rule: Rule) -> Verdict:
    """``me`` against the others' median compute ``ref`` and, where ``me`` has a steady
    pace and some other member has one, the median of their slowdowns ``usual``."""
    ratio = me.compute / ref if ref > 0 else (float("inf") if me.compute > 0 else 1.0)
    if me.compute > rule.factor * ref and me.compute - ref > rule.min_s:
        return Verdict(True, max(1.0, ratio), f"the others' median {ref:.3f}s")
    if me.base and usual is not None:
        slowdown = me.compute / me.base
        if slowdown > rule.factor * usual and me.compute - me.base * usual > rule.min_s:
            return Verdict(True, max(1.0, ratio),
                           f"its own earlier {me.base:.3f}s (x{slowdown:.1f}; the others "
                           f"x{usual:.1f})")
    return Verdict(False, max(1.0, ratio), f"the others' median {ref:.3f}s")


class _Ring:
    """One value per time slot (``n`` slots of ``dt`` s), 0 for none: a fixed size however
    long it runs (thousands of members: a few hundred bytes each, no object per sample)."""

    def __init__(self, n: int, dt: float, typecode: str) -> None:
        self.n, self.dt = n, dt
        self.vals = array(typecode, [0]) * n
        self.last: int | None = None  # the newest slot written (absolute index)

    def slot(self, t: float) -> int:
        return int(t // self.dt)

    def put(self, t: float, v: float) -> None:
        k = self.slot(t)
        if self.last is not None:
            k = max(k, self.last)  # monotonic time; never behind the newest
            for j in range(self.last + 1, min(k, self.last + self.n) + 1):
                self.vals[j % self.n] = 0  # slots nothing was written in: empty
        self.vals[k % self.n] = v
        self.last = k

    def clear(self) -> None:
        if self.last is not None:  # (an empty ring stays empty: thousands of these a check)
            self.vals[:] = array(self.vals.typecode, [0]) * self.n
        self.last = None

    def span(self, now: float) -> range:
        """The slots of the last ``n * dt`` s up to ``now`` that were written."""
        if self.last is None:
            return range(0)
        return range(max(self.last, self.slot(now)) - self.n + 1, self.last + 1)

    def values(self, now: float) -> list[float]:
        return [v for j in self.span(now) if (v := self.vals[j % self.n])]


_FAST, _SLOW = 1, 2  # a judgment's slot (0: none)


@dataclass
class _History:
    generation: int
    calm: _Ring       # its paces while not judged slow, over HORIZON windows
    marks: _Ring      # its judgments over one window
    latest: float | None = None  # its compute now (the last heartbeat's)
    since: float | None = None   # the first judgment of the current run of them


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
            w = self.rule.window
            h = self._h[pod] = _History(
                generation, _Ring(HORIZON * SAMPLES_PER_WINDOW, w / SAMPLES_PER_WINDOW, "d"),
                _Ring(MARKS_PER_WINDOW, w / MARKS_PER_WINDOW, "b"))
        return h

    def observe(self, pod: str, generation: int, compute: float) -> None:
        """A heartbeat's compute time."""
        self._history(pod, generation).latest = compute

    def base(self, pod: str, generation: int, now: float) -> float | None:
        """Its own steady pace: the median of its paces while it was not judged slow (over
        the last HORIZON windows), or None before it has MIN_CALM of them."""
        h = self._h.get(pod)
        if h is None or h.generation != generation:
            return None
        calm = h.calm.values(now)
        return median(calm) if len(calm) >= MIN_CALM else None

    def mark(self, pod: str, generation: int, now: float, slow: bool) -> bool:
        """Record a judgment; True when it is the first slow one of the window."""
        h = self._history(pod, generation)
        if not slow and h.latest:  # its steady pace: what a slowdown is measured against
            h.calm.put(now, h.latest)
        m = h.marks
        if h.since is None or (m.last is not None and m.slot(now) - m.last > m.n):
            m.clear()  # not judged for a whole window: start again
            h.since = now
        first = slow and _SLOW not in m.values(now)
        m.put(now, _SLOW if slow else _FAST)
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
        if h is None or h.since is None or h.marks.last is None:
            return False
        m = h.marks
        if now - h.since < self.rule.window or m.vals[m.last % m.n] != _SLOW:
            return False
        marks = m.values(now)
        return sum(1 for v in marks if v == _SLOW) >= self.rule.fraction * len(marks)

    def slow_for(self, pod: str, now: float) -> float:
        """Seconds since the window's first slow judgment (for the fault's reason)."""
        h = self._h.get(pod)
        if h is None:
            return 0.0
        m = h.marks
        first = next((j for j in m.span(now) if m.vals[j % m.n] == _SLOW), None)
        return 0.0 if first is None else max(0.0, now - first * m.dt)
