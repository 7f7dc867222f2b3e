"""The goodput ledger (issue 32): how much of a job's time trained, and where the rest went.

Built from the traces the job already writes (``run_dir/traces``), so `ceaseless status` (live)
and `summary.json` (at the end) give the same figures:

* each incident (a ``detect`` or ``plan`` trace) is cut along its critical path
  (:func:`ops.trace_tools.critical_path`, whose pieces add up to its downtime) into
  *detection* (the failure unnoticed + ``detect``), *planning* (``plan``, ``transfer_plan``),
  *rendezvous* (``abort``, ``rendezvous``), *state transfer* (``state_sync``,
  ``data_resume``), *first step* and *waiting* (gaps between spans, survivors finishing the
  step in flight);
* each rollback to the last verified copy (a ``rollback`` span) adds *recomputed* time: the
  steps computed again times the median step time the agent measured;
* the job's training window starts at its first committed step (the earliest ``train_start``
  span) and ends at its last (or now, live). Productive time is the window less the union of
  the incidents' intervals and the recomputed time; the **effective training time ratio** is
  productive / window. Start-up (launch -> first step) is shown apart, with the ratio over
  the whole wall time beside it.

An incident's first step is counted whole, as its downtime is (one step of it was training):
the ratio errs low by a step per incident. Pure functions; no I/O but ``from_run_dir``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from plumbing import telemetry as T

from . import trace_tools as tt

CATEGORIES: tuple[str, ...] = ("detection", "planning", "rendezvous", "state_transfer",
                               "first_step", "waiting", "recomputed")
_CATEGORY = {
    T.SPAN_DETECT: "detection", T.SPAN_PLAN: "planning", T.SPAN_TRANSFER_PLAN: "planning",
    T.SPAN_ABORT: "rendezvous", T.SPAN_RENDEZVOUS: "rendezvous",
    T.SPAN_STATE_SYNC: "state_transfer", T.SPAN_DATA_RESUME: "state_transfer",
    T.SPAN_FIRST_STEP: "first_step",
}


@dataclass
class Entry:
    """One incident (or rollback) of the ledger: seconds per category."""

    incident: str
    kind: str
    start: float                       # wall time (s) the time started being lost
    end: float
    complete: bool
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    def as_dict(self) -> dict[str, Any]:
        return {"incident": self.incident, "kind": self.kind, "start": round(self.start, 3),
                "complete": self.complete, "total_s": round(self.total, 4),
                **{f"{k}_s": round(v, 4) for k, v in self.seconds.items()}}


def incident_entry(inc: tt.Incident) -> Entry:
    """An incident's downtime along its critical path, by category."""
    e = Entry(incident=inc.id, kind=inc.kind, start=inc.start_ns / 1e9,
              end=inc.end_ns / 1e9, complete=inc.complete)
    for seg in tt.critical_path(inc):
        cat = _CATEGORY.get(seg.span.name, "waiting") if seg.span is not None else "waiting"
        e.seconds[cat] += max(0.0, seg.duration_ms) / 1e3
    lat = inc.detection_latency_ms
    if lat and inc.root.duration_ms < lat:  # unnoticed before `detect` started
        e.seconds["detection"] += lat / 1e3
        e.start -= lat / 1e3
    return e


def rollback_entries(spans: Sequence[tt.Span]) -> list[Entry]:
    """One entry per rollback (every member records it; one is kept per step)."""
    seen: dict[Any, Entry] = {}
    for s in spans:
        if s.name != T.SPAN_ROLLBACK:
            continue
        step = s.attr(T.ATTR_STEP)
        if step in seen:
            continue
        n = int(s.attr(T.ATTR_RECOMPUTED_STEPS, 0) or 0)
        dt = float(s.attr(T.ATTR_STEP_TIME, 0.0) or 0.0)
        e = Entry(incident=f"rollback-{step}", kind=str(s.attr(T.ATTR_REASON) or "rollback"),
                  start=s.start_ns / 1e9, end=s.start_ns / 1e9 + n * dt, complete=True)
        e.seconds["recomputed"] = n * dt
        seen[step] = e
    return list(seen.values())


def _union(intervals: list[tuple[float, float]]) -> float:
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def build(spans: Sequence[tt.Span], *, launched: float | None = None,
          end: float | None = None) -> dict[str, Any]:
    """The ledger of one job from its spans; ``end``: the last commit (default: now)."""
    starts = [s.start_ns / 1e9 for s in spans if s.name == T.SPAN_TRAIN_START]
    first = min(starts) if starts else None
    end = time.time() if end is None else end
    entries = [incident_entry(i) for i in tt.incidents(spans)]
    # a planned change before the first step (the job's own start) is start-up, not loss
    entries = [e for e in entries if first is None or e.end > first]
    entries += rollback_entries(spans)
    entries.sort(key=lambda e: e.start)
    out: dict[str, Any] = {"first_step_at": first, "end": round(end, 3),
                           "incidents": [e.as_dict() for e in entries]}
    lost = {c: round(sum(e.seconds[c] for e in entries), 4) for c in CATEGORIES}
    out["lost_s"] = lost
    if first is None or end <= first:
        out.update(window_s=None, productive_s=None, effective_ratio=None,
                   startup_s=None, ratio_since_launch=None)
        return out
    window = end - first
    stood = _union([(max(first, e.start), min(end, e.end)) for e in entries
                    if e.seconds["recomputed"] == 0 and min(end, e.end) > max(first, e.start)])
    recomputed = sum(e.seconds["recomputed"] for e in entries)
    productive = max(0.0, window - stood - recomputed)
    out.update(window_s=round(window, 3), productive_s=round(productive, 3),
               effective_ratio=round(productive / window, 4))
    if launched is not None and first > launched:
        out.update(startup_s=round(first - launched, 3),
                   ratio_since_launch=round(productive / (end - launched), 4))
    else:
        out.update(startup_s=None, ratio_since_launch=None)
    return out


def load(run_dir: str | Path) -> list[tt.Span] | None:
    """The spans of the job in ``run_dir`` (None when it has no traces yet)."""
    d = Path(run_dir) / "traces"
    return tt.load_spans(d) if d.is_dir() else None


def from_run_dir(run_dir: str | Path, *, launched: float | None = None,
                 end: float | None = None) -> dict[str, Any] | None:
    """The ledger of the job in ``run_dir`` (None when it has no traces yet)."""
    spans = load(run_dir)
    return None if spans is None else build(spans, launched=launched, end=end)


def first_committed_step(spans: Sequence[tt.Span]) -> int | None:
    """The first step any pod of the job committed (its ``train_start`` spans), including
    pods that did not finish: where the run started (0, or the step after a checkpoint it
    resumed from). None without one."""
    steps = [int(s.attr(T.ATTR_STEP)) for s in spans
             if s.name == T.SPAN_TRAIN_START and s.attr(T.ATTR_STEP) is not None]
    return min(steps) if steps else None


def render(led: dict[str, Any], last: int = 5) -> list[str]:
    """Lines for `ceaseless status` and `up`'s end."""
    if led.get("effective_ratio") is None:
        return ["goodput: no committed step yet"]
    lost = led["lost_s"]
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.2f}s" for k, v in lost.items() if v > 0)
    lines = [f"goodput: {led['effective_ratio']:.2%} of {led['window_s']:.1f}s since the first "
             f"step trained" + (f" ({led['ratio_since_launch']:.2%} counting "
                                f"{led['startup_s']:.1f}s of start-up)"
                                if led.get("ratio_since_launch") is not None else "")
             + (f"; lost: {parts}" if parts else "")]
    for e in led["incidents"][-last:]:
        cats = ", ".join(f"{k} {e[f'{k}_s']:.3f}" for k in CATEGORIES if e[f"{k}_s"] > 0)
        lines.append(f"  {e['incident']} ({e['kind']}{'' if e['complete'] else ', open'}): "
                     f"{e['total_s']:.3f}s = {cats}")
    return lines
