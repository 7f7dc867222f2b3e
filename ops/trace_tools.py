"""Read the OTLP-JSON-lines trace files of a run and analyse incidents.

``load_spans(path)`` reads every ``traces/*.jsonl`` of a run directory (or a traces directory,
or one file); ``incidents(spans)`` groups them by trace id and keeps the traces whose root is a
``detect`` (a fault) or a ``plan`` (a planned scaling change); ``phase_stats``,
``critical_path``, ``render_show`` and ``render_svg`` / ``render_png`` analyse and draw one.

The reader is lenient: a partial or garbled line (a process killed mid-write) is skipped and
counted, ids may be hex (OTLP/JSON) or base64 (plain protobuf JSON mapping).
"""

from __future__ import annotations

import base64
import json
import math
import statistics
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Sequence
from xml.sax.saxutils import escape

from plumbing import telemetry as T

# ============================================================================ reading


def _id(v: Any) -> str:
    if not v:
        return ""
    s = str(v)
    if len(s) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in s):
        return s.lower()
    try:
        return base64.b64decode(s).hex()
    except Exception:
        return s


def any_value(v: dict[str, Any] | None) -> Any:
    """An OTLP/JSON AnyValue as a Python value."""
    if not v:
        return None
    if "stringValue" in v:
        return v["stringValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "boolValue" in v:
        return bool(v["boolValue"])
    if "arrayValue" in v:
        return [any_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return kv_list(v["kvlistValue"].get("values", []))
    if "bytesValue" in v:
        return v["bytesValue"]
    return None


def kv_list(items: Iterable[dict[str, Any]] | None) -> dict[str, Any]:
    return {kv.get("key", ""): any_value(kv.get("value")) for kv in (items or [])}


_STATUS = {0: "unset", 1: "ok", 2: "error",
           "STATUS_CODE_UNSET": "unset", "STATUS_CODE_OK": "ok", "STATUS_CODE_ERROR": "error"}


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    resource: dict[str, Any] = field(default_factory=dict)
    status: str = "unset"
    status_message: str = ""
    events: list[dict[str, Any]] = field(default_factory=list)
    file: str = ""

    @property
    def duration_ms(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e6

    @property
    def service(self) -> str:
        s = self.resource.get(T.ATTR_SERVICE)
        if s:
            return str(s)
        name = str(self.resource.get("service.name") or "unknown")
        return name[len(T.SERVICE_PREFIX):] if name.startswith(T.SERVICE_PREFIX) else name

    def attr(self, key: str, default: Any = None) -> Any:
        v = self.attributes.get(key)
        if v is None:
            v = self.resource.get(key)
        return default if v is None else v

    @property
    def rank(self) -> int | None:
        r = self.attr(T.ATTR_RANK)
        try:
            return None if r is None else int(r)
        except (TypeError, ValueError):
            return None

    @property
    def pod(self) -> str | None:
        p = self.attr(T.ATTR_POD)
        return None if p is None else str(p)

    @property
    def lane_rank(self) -> int | None:
        """The rank of the process that made the span: agents (and processes whose resource
        names a rank). A control-plane span's ceaseless.rank (e.g. the failed rank on
        `detect`) is about another process and does not split its lane."""
        if (self.service == "agent" or self.resource.get(T.ATTR_RANK) is not None
                or self.name in T.AGENT_PHASES or self.name == T.SPAN_RECOVER):
            return self.rank
        return None

    @property
    def lane(self) -> str:
        """One lane per service, and per rank for ranked processes (agents)."""
        if self.lane_rank is not None:
            return f"{self.service} r{self.lane_rank}"
        if self.service == "agent" and self.pod:
            return f"agent {self.pod}"
        return self.service

    @property
    def where(self) -> str:
        return self.lane


@dataclass
class LoadStats:
    files: int = 0
    lines: int = 0
    bad_lines: int = 0
    spans: int = 0


def trace_files(path: str | Path) -> list[Path]:
    p = Path(path)
    if p.is_file():
        return [p]
    if (p / "traces").is_dir():
        p = p / "traces"
    return sorted(p.glob("*.jsonl"))


def parse_request(obj: dict[str, Any], file: str = "") -> list[Span]:
    out: list[Span] = []
    for rs in obj.get("resourceSpans", []) or []:
        res = kv_list((rs.get("resource") or {}).get("attributes"))
        for ss in rs.get("scopeSpans", []) or rs.get("instrumentationLibrarySpans", []) or []:
            for sp in ss.get("spans", []) or []:
                st = sp.get("status") or {}
                out.append(Span(
                    trace_id=_id(sp.get("traceId")),
                    span_id=_id(sp.get("spanId")),
                    parent_id=_id(sp.get("parentSpanId")),
                    name=str(sp.get("name", "")),
                    start_ns=int(sp.get("startTimeUnixNano", 0) or 0),
                    end_ns=int(sp.get("endTimeUnixNano", 0) or 0),
                    attributes=kv_list(sp.get("attributes")),
                    resource=res,
                    status=_STATUS.get(st.get("code", 0), "unset"),
                    status_message=str(st.get("message", "")),
                    events=[{"name": e.get("name", ""),
                             "time_ns": int(e.get("timeUnixNano", 0) or 0),
                             "attributes": kv_list(e.get("attributes"))}
                            for e in sp.get("events", []) or []],
                    file=file,
                ))
    return out


def load_spans(path: str | Path, stats: LoadStats | None = None) -> list[Span]:
    """Every span in the trace files under ``path``, deduplicated by (trace id, span id)."""
    stats = stats if stats is not None else LoadStats()
    seen: dict[tuple[str, str], Span] = {}
    for f in trace_files(path):
        stats.files += 1
        try:
            data = f.read_bytes()
        except OSError:
            continue
        for line in data.splitlines():
            if not line.strip():
                continue
            stats.lines += 1
            try:
                obj = json.loads(line)
                spans = parse_request(obj, f.name) if isinstance(obj, dict) else None
            except (ValueError, TypeError, AttributeError, KeyError):
                spans = None
            if spans is None:
                stats.bad_lines += 1
                continue
            for s in spans:
                if s.trace_id and s.span_id:
                    seen[(s.trace_id, s.span_id)] = s
    stats.spans = len(seen)
    return sorted(seen.values(), key=lambda s: (s.start_ns, s.end_ns))


# ============================================================================ incidents


@dataclass
class Incident:
    trace_id: str
    root: Span
    spans: list[Span]

    # ------------------------------------------------------------------ identity
    @property
    def id(self) -> str:
        inc = self.attr(T.ATTR_INCIDENT)
        if inc:
            return str(inc)
        gen = self.generation
        return f"{self.root.name}-g{gen if gen is not None else '?'}-{self.trace_id[:8]}"

    def attr(self, key: str) -> Any:
        """The root's attribute, else the first span (in time) that has it."""
        v = self.root.attributes.get(key)
        if v is not None:
            return v
        for s in self.spans:
            if s.attributes.get(key) is not None:
                return s.attributes[key]
        return None

    @property
    def kind(self) -> str:
        """The fault kind (crash/hang/exception/lost) of a `detect` root, else
        ``scale:<category>`` for a planned change (``_category``: its reason's head)."""
        a = self.root.attributes
        if self.root.name == T.SPAN_DETECT:
            kind = a.get(T.ATTR_FAULT_KIND)
            if not kind:  # ceaseless.reason is "<kind>: <why>" or just "<kind>"
                kind = str(a.get(T.ATTR_REASON) or "fault").split(":", 1)[0].strip()
            return str(kind) or "fault"
        return f"scale:{head}" if (head := _category(str(a.get(T.ATTR_REASON) or ""))) \
            else "scale"

    @property
    def reason(self) -> str:
        return str(self.root.attributes.get(T.ATTR_REASON) or "")

    @property
    def pods(self) -> list[str]:
        """The failed pod(s) of a fault; the pods a planned change names, if any."""
        pods = [s.attributes.get(T.ATTR_POD) for s in self.spans if s.name == self.root.name]
        return sorted({q.strip() for p in pods if p for q in str(p).split(",") if q.strip()})

    @property
    def generation(self) -> int | None:
        for s in self.spans:
            if s.name == T.SPAN_PLAN and s.attributes.get(T.ATTR_GENERATION) is not None:
                return int(s.attributes[T.ATTR_GENERATION])
        gens = [int(s.attributes[T.ATTR_GENERATION]) for s in self.spans
                if isinstance(s.attributes.get(T.ATTR_GENERATION), (int, float))]
        return max(gens) if gens else None

    @property
    def world_size(self) -> int | None:
        v = self.attr(T.ATTR_WORLD_SIZE)
        return int(v) if isinstance(v, (int, float)) else None

    # ------------------------------------------------------------------ timing
    @property
    def start_ns(self) -> int:
        return self.root.start_ns

    @property
    def first_steps(self) -> list[Span]:
        return [s for s in self.spans if s.name == T.SPAN_FIRST_STEP]

    @property
    def complete(self) -> bool:
        return bool(self.first_steps)

    @property
    def end_ns(self) -> int:
        fs = self.first_steps
        if fs:
            return max(s.end_ns for s in fs)
        return max(s.end_ns for s in self.spans)

    @property
    def downtime_ms(self) -> float | None:
        """Detection start to the end of the last rank's first step (None if no first step)."""
        if not self.complete:
            return None
        return (self.end_ns - self.start_ns) / 1e6

    @property
    def detection_latency_ms(self) -> float | None:
        """How long the failure went unnoticed before `detect` started, when the health
        monitor recorded it (ceaseless.detection_latency, s) and the span does not already
        cover it."""
        v = self.root.attributes.get(T.ATTR_DETECTION_LATENCY)
        if self.root.name != T.SPAN_DETECT or not isinstance(v, (int, float)) or v <= 0:
            return None
        return float(v) * 1e3

    @property
    def since_failure_ms(self) -> float | None:
        """Downtime counted from the failure: detection latency + detection -> first step."""
        if self.downtime_ms is None:
            return None
        lat = self.detection_latency_ms or 0.0
        if self.root.duration_ms >= lat:  # the detect span starts at the evidence: covered
            return self.downtime_ms
        return self.downtime_ms + lat

    @property
    def ranks(self) -> list[int]:
        return sorted({s.lane_rank for s in self.spans
                       if s.lane_rank is not None and s.name in T.AGENT_PHASES})

    def offset_ms(self, ns: int) -> float:
        return (ns - self.start_ns) / 1e6

    def children(self, span: Span) -> list[Span]:
        return [s for s in self.spans if s.parent_id == span.span_id]

    def summary(self) -> dict[str, Any]:
        return {
            "incident": self.id, "kind": self.kind, "reason": self.reason, "pods": self.pods,
            "generation": self.generation, "world_size": self.world_size,
            "trace_id": self.trace_id, "start": self.start_ns / 1e9,
            "downtime_ms": None if self.downtime_ms is None else round(self.downtime_ms, 3),
            "detection_latency_ms": (None if self.detection_latency_ms is None
                                     else round(self.detection_latency_ms, 3)),
            "since_failure_ms": (None if self.since_failure_ms is None
                                 else round(self.since_failure_ms, 3)),
            "complete": self.complete, "spans": len(self.spans), "ranks": self.ranks,
        }


def incidents(spans: Sequence[Span]) -> list[Incident]:
    """Traces whose root is a `detect` or a `plan` span, oldest first."""
    by_trace: dict[str, list[Span]] = {}
    for s in spans:
        by_trace.setdefault(s.trace_id, []).append(s)
    out = []
    for tid, group in by_trace.items():
        group.sort(key=lambda s: (s.start_ns, s.end_ns))
        ids = {s.span_id for s in group}
        roots = [s for s in group if not s.parent_id or s.parent_id not in ids]
        root = next((s for s in roots if s.name in T.ROOT_SPANS), None)
        if root is None:  # the root's process never flushed: take the earliest detect/plan
            root = next((s for s in group if s.name in T.ROOT_SPANS), None)
        if root is None:
            continue
        out.append(Incident(tid, root, group))
    out.sort(key=lambda i: (i.start_ns, i.trace_id))
    return out


class IncidentNotFound(LookupError):
    pass


def find_incident(items: Sequence[Incident], key: str) -> Incident:
    """``last``, an incident id (the latest if repeated), a list number (1-based) or a trace
    id prefix."""
    if not items:
        raise IncidentNotFound("no incidents in this run")
    if key in ("last", "latest"):
        return items[-1]
    same = [i for i in items if i.id == key]
    if same:
        return same[-1]
    if key.isdigit() and 1 <= int(key) <= len(items):
        return items[int(key) - 1]
    k = key.lower()
    pref = [i for i in items if len(k) >= 4 and i.trace_id.startswith(k)]
    if len(pref) == 1:
        return pref[0]
    if len(pref) > 1:
        raise IncidentNotFound(f"trace id prefix {key!r} is ambiguous ({len(pref)} traces)")
    raise IncidentNotFound(f"no incident {key!r} (try `ceaseless trace list`)")


# ============================================================================ analysis


def phase_order(name: str) -> tuple[int, str]:
    try:
        return (T.SPAN_ORDER.index(name), name)
    except ValueError:
        return (len(T.SPAN_ORDER), name)


@dataclass
class PhaseStat:
    name: str
    count: int
    median_ms: float
    min_ms: float
    max_ms: float
    min_where: str
    max_where: str
    where: str
    first_start_ms: float
    last_end_ms: float


def _where_summary(spans: Sequence[Span]) -> str:
    services = sorted({s.service for s in spans})
    ranks = sorted({s.lane_rank for s in spans if s.lane_rank is not None})
    parts = []
    for svc in services:
        rs = sorted({s.lane_rank for s in spans if s.service == svc and s.lane_rank is not None})
        if rs:
            parts.append(f"{svc} " + ",".join(f"r{r}" for r in rs))
        else:
            parts.append(svc)
    return "; ".join(parts) if parts else ("ranks " + ",".join(map(str, ranks)))


def phase_stats(inc: Incident) -> list[PhaseStat]:
    groups: dict[str, list[Span]] = {}
    for s in inc.spans:
        groups.setdefault(s.name, []).append(s)
    out = []
    for name in sorted(groups, key=lambda n: (phase_order(n),
                                              min(s.start_ns for s in groups[n]))):
        g = groups[name]
        lo = min(g, key=lambda s: s.duration_ms)
        hi = max(g, key=lambda s: s.duration_ms)
        out.append(PhaseStat(
            name=name, count=len(g), median_ms=statistics.median(s.duration_ms for s in g),
            min_ms=lo.duration_ms, max_ms=hi.duration_ms, min_where=lo.where,
            max_where=hi.where, where=_where_summary(g),
            first_start_ms=inc.offset_ms(min(s.start_ns for s in g)),
            last_end_ms=inc.offset_ms(max(s.end_ns for s in g))))
    return out


@dataclass
class Segment:
    """A piece of the critical path: a span (clipped to start where the previous piece ended)
    or a wait between spans (``span`` is None)."""

    start_ms: float
    end_ms: float
    span: Span | None
    notes: list[str] = field(default_factory=list)

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def label(self) -> str:
        return self.span.name if self.span else "(wait)"

    @property
    def where(self) -> str:
        return self.span.where if self.span else ""


def _ancestors(inc: Incident, span: Span) -> list[Span]:
    by_id = {s.span_id: s for s in inc.spans}
    out, cur, seen = [], span, set()
    while cur.parent_id and cur.parent_id in by_id and cur.parent_id not in seen:
        seen.add(cur.parent_id)
        cur = by_id[cur.parent_id]
        out.append(cur)
    return out


def critical_path_spans(inc: Incident) -> list[Span]:
    """The chain of spans that ends at the last first step (else the last span), walking
    back: a span's predecessor is the latest earlier span in its own lane (the phases of one
    rank run in sequence), else its nearest ancestor that ended before it (the cross-process
    cause: plan for an agent's first phase, detect for plan). Containers (`recover`, or any
    span enclosing its child) are never on the path; the root always starts it."""
    fs = inc.first_steps
    terminal = max(fs or inc.spans, key=lambda s: (s.end_ns, s.start_ns))
    chain = [terminal]
    cur = terminal
    guard = 0
    while guard < len(inc.spans) + 1:
        guard += 1
        anc = _ancestors(inc, cur)
        anc_ids = {a.span_id for a in anc}
        lane_preds = [s for s in inc.spans
                      if s.lane == cur.lane and s is not cur and s.span_id not in anc_ids
                      and s.start_ns < cur.start_ns and s.end_ns <= cur.end_ns
                      and s.name != T.SPAN_RECOVER and not _encloses(s, cur)]
        if lane_preds:
            cur = max(lane_preds, key=lambda s: (s.end_ns, s.start_ns))
            chain.append(cur)
            continue
        cause = next((a for a in anc if a.end_ns < cur.end_ns and a.name != T.SPAN_RECOVER
                      and not _encloses(a, cur)), None)
        if cause is None:
            break
        cur = cause
        chain.append(cur)
    chain.reverse()
    if chain[0] is not inc.root and inc.root.end_ns <= terminal.end_ns:
        chain.insert(0, inc.root)
    return chain


def _encloses(a: Span, b: Span) -> bool:
    return a.start_ns <= b.start_ns and a.end_ns >= b.end_ns and a is not b


def critical_path(inc: Incident) -> list[Segment]:
    """The critical path as contiguous segments from the root's start: durations add up to
    the total (detection start -> last first step end) exactly."""
    chain = critical_path_spans(inc)
    segs: list[Segment] = []
    cursor = inc.offset_ms(chain[0].start_ns)
    on_path = {s.span_id for s in chain}
    for s in chain:
        st, en = inc.offset_ms(s.start_ns), inc.offset_ms(s.end_ns)
        if st > cursor:
            segs.append(Segment(cursor, st, None))
            cursor = st
        if en > cursor:
            seg = Segment(cursor, en, s)
            # control-plane work that finished while this span ran (e.g. the transfer plan
            # a recipient's state_sync waited for)
            for o in inc.spans:
                if (o.span_id not in on_path and o.lane_rank is None and o.name in T.CONTROL_SPANS
                        and seg.start_ms < inc.offset_ms(o.end_ns) <= seg.end_ms):
                    seg.notes.append(f"{o.name} ({o.where}) ended at +{inc.offset_ms(o.end_ns):.2f}")
            segs.append(seg)
            cursor = en
    return segs


# ============================================================================ text output


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def fmt_time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]],
          align: str | None = None) -> str:
    """A plain text table; ``align`` has one of ``l``/``r`` per column."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" * len(headers)
    lines = []
    for n, r in enumerate(cells):
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(r, widths, align)]
        lines.append("  ".join(parts).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_list(items: Sequence[Incident]) -> str:
    if not items:
        return "no incidents"
    rows = []
    for n, i in enumerate(items, 1):
        rows.append([n, i.id, i.kind, ",".join(i.pods) or "-",
                     "-" if i.generation is None else i.generation, fmt_time(i.start_ns),
                     fmt_ms(i.downtime_ms) if i.complete else "incomplete", len(i.spans),
                     i.trace_id[:12]])
    return table(["#", "incident", "kind", "pods", "gen", "start", "downtime ms", "spans",
                  "trace"], rows, "rllrlrrrl")


def render_show(inc: Incident) -> str:
    out = []
    ws = inc.world_size
    head = f"incident {inc.id}  kind {inc.kind}  pods {','.join(inc.pods) or '-'}"
    head += f"  generation {inc.generation if inc.generation is not None else '-'}"
    if ws is not None:
        head += f"  world size {ws}"
    out.append(head)
    out.append(f"trace {inc.trace_id}  started {fmt_time(inc.start_ns)}  {len(inc.spans)} spans"
               f"  ranks {','.join(map(str, inc.ranks)) or '-'}")
    out.append("")
    rows = []
    for p in phase_stats(inc):
        rows.append([p.name, p.count, fmt_ms(p.median_ms), f"{fmt_ms(p.min_ms)} {p.min_where}",
                     f"{fmt_ms(p.max_ms)} {p.max_where}", f"+{fmt_ms(p.first_start_ms)}",
                     f"+{fmt_ms(p.last_end_ms)}", p.where])
    out.append(table(["phase", "n", "median ms", "min ms", "max ms", "from", "to", "where"],
                     rows, "lrrllrrl"))
    out.append("")
    segs = critical_path(inc)
    last = next((s.span for s in reversed(segs) if s.span is not None), None)
    title = "critical path"
    if last is not None and last.name == T.SPAN_FIRST_STEP:
        title += f" (ends at the last first step: {last.where}"
        title += f", pod {last.pod})" if last.pod else ")"
    out.append(title)
    rows = []
    for s in segs:
        rows.append([f"+{fmt_ms(s.start_ms)}", fmt_ms(s.duration_ms), s.label, s.where,
                     "; ".join(s.notes)])
    out.append(table(["at ms", "ms", "step", "where", "note"], rows, "rrlll"))
    in_spans = sum(s.duration_ms for s in segs if s.span is not None)
    waits = sum(s.duration_ms for s in segs if s.span is None)
    total = (segs[-1].end_ms - segs[0].start_ms) if segs else 0.0
    out.append("")
    if inc.complete:
        out.append(f"total detection -> first step: {fmt_ms(inc.downtime_ms)} ms "
                   f"(in spans {fmt_ms(in_spans)} ms + waiting {fmt_ms(waits)} ms)")
        lat = inc.detection_latency_ms
        if lat is not None and inc.since_failure_ms is not None:
            out.append(f"failure -> first step: {fmt_ms(inc.since_failure_ms)} ms (the monitor "
                       f"noticed the failure {fmt_ms(lat)} ms after its last evidence)")
    else:
        out.append(f"incomplete: no first_step yet; last span ends at +{fmt_ms(total)} ms "
                   f"(in spans {fmt_ms(in_spans)} ms + waiting {fmt_ms(waits)} ms)")
    errors = [s for s in inc.spans if s.status == "error"]
    for s in errors:
        out.append(f"error in {s.name} ({s.where}): {s.status_message or 'status error'}")
    return "\n".join(out)


def show_dict(inc: Incident) -> dict[str, Any]:
    return {
        **inc.summary(),
        "phases": [p.__dict__ for p in phase_stats(inc)],
        "critical_path": [{"step": s.label, "where": s.where, "start_ms": round(s.start_ms, 3),
                           "duration_ms": round(s.duration_ms, 3), "notes": s.notes}
                          for s in critical_path(inc)],
    }


# ============================================================================ timeline model

PHASE_COLOURS = {
    T.SPAN_DETECT: "#d62728",
    T.SPAN_PLAN: "#ff7f0e",
    T.SPAN_TRANSFER_PLAN: "#8c564b",
    T.SPAN_ABORT: "#e377c2",
    T.SPAN_FINISH_STEP: "#f7b6d2",
    T.SPAN_RENDEZVOUS: "#1f77b4",
    T.SPAN_STATE_SYNC: "#2ca02c",
    T.SPAN_DATA_RESUME: "#9467bd",
    T.SPAN_FIRST_STEP: "#17becf",
}
RECOVER_FILL = "#e8e8e8"
OTHER_COLOUR = "#bcbd22"


def colour(name: str) -> str:
    return PHASE_COLOURS.get(name, OTHER_COLOUR)


@dataclass
class Lane:
    key: str
    label: str
    service: str
    rank: int | None
    spans: list[Span]


def lanes(inc: Incident) -> list[Lane]:
    """Control-plane lanes first (in order of first activity), then one lane per rank."""
    by: dict[str, list[Span]] = {}
    for s in inc.spans:
        by.setdefault(s.lane, []).append(s)
    out = []
    for key, spans in by.items():
        s0 = spans[0]
        label = key
        pods = sorted({s.pod for s in spans if s.pod})
        if s0.lane_rank is not None and pods:
            label = f"{key} · {','.join(pods)}"
        out.append(Lane(key, label, s0.service, s0.lane_rank, spans))
    out.sort(key=lambda ln: (ln.rank is not None, ln.rank if ln.rank is not None else 0,
                             min(s.start_ns for s in ln.spans), ln.key))
    return out


def nice_step(span: float, target: int = 8) -> float:
    if span <= 0:
        return 1.0
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * mag:
            return m * mag
    return 10 * mag


def _legend_names(inc: Incident) -> list[str]:
    names = {s.name for s in inc.spans}
    return sorted(names, key=phase_order)


def render_svg(inc: Incident, width: int = 1100) -> str:
    """A dependency-free SVG timeline: one lane per service and per rank, phases coloured,
    the critical path outlined, axis in ms from the start of detection."""
    ls = lanes(inc)
    crit = {s.span_id for s in critical_path_spans(inc)}
    t_end = max(inc.offset_ms(s.end_ns) for s in inc.spans)
    t_begin = min(0.0, min(inc.offset_ms(s.start_ns) for s in inc.spans))
    label_w, pad_r = 200, 30
    lane_h, gap = 26, 6
    names = _legend_names(inc)
    legend_rows = math.ceil((len(names) + 1) / 6)
    top = 58 + legend_rows * 20
    plot_w = width - label_w - pad_r
    height = top + len(ls) * (lane_h + gap) + 50
    span_ms = max(t_end - t_begin, 1e-3)

    def x(ms: float) -> float:
        return label_w + (ms - t_begin) / span_ms * plot_w

    total = inc.downtime_ms
    title = f"{inc.id} · {inc.kind} · pods {','.join(inc.pods) or '-'} · generation " \
            f"{inc.generation if inc.generation is not None else '-'}"
    sub = (f"detection → last first step: {total:.2f} ms" if total is not None
           else "incomplete (no first_step)")
    if inc.detection_latency_ms is not None and inc.since_failure_ms is not None:
        sub += (f" · failure → first step: {inc.since_failure_ms:.1f} ms (noticed "
                f"{inc.detection_latency_ms:.1f} ms after the last evidence)")
    sub += f" · {len(inc.spans)} spans · trace {inc.trace_id[:16]}"
    o: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" '
        f'font-size="12">',
        f'<title>{escape(title)}</title>',
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="12" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="12" y="40" fill="#444">{escape(sub)}</text>',
    ]
    # legend
    o.append('<g class="legend">')
    items = [(n, colour(n) if n != T.SPAN_RECOVER else RECOVER_FILL) for n in names]
    items.append(("critical path", None))
    for k, (n, c) in enumerate(items):
        lx = 12 + (k % 6) * 175
        ly = 52 + (k // 6) * 20
        if c is None:
            o.append(f'<rect x="{lx}" y="{ly}" width="22" height="12" fill="none" '
                     f'stroke="#000" stroke-width="2"/>')
        else:
            o.append(f'<rect x="{lx}" y="{ly}" width="22" height="12" fill="{c}" '
                     f'stroke="#777" stroke-width="0.5"/>')
        o.append(f'<text x="{lx + 28}" y="{ly + 11}">{escape(n)}</text>')
    o.append('</g>')
    # grid and axis
    step = nice_step(span_ms)
    axis_y = top + len(ls) * (lane_h + gap) + 4
    o.append('<g class="axis">')
    t = math.ceil(t_begin / step) * step
    while t <= t_end + 1e-9:
        xx = x(t)
        o.append(f'<line x1="{xx:.1f}" y1="{top - 4}" x2="{xx:.1f}" y2="{axis_y}" '
                 f'stroke="#e4e4e4" stroke-width="1"/>')
        lab = f"{t:g}" if step >= 1 else f"{t:.2f}"
        o.append(f'<text x="{xx:.1f}" y="{axis_y + 16}" text-anchor="middle" '
                 f'fill="#333">{lab}</text>')
        t += step
    o.append(f'<line x1="{label_w}" y1="{axis_y}" x2="{label_w + plot_w}" y2="{axis_y}" '
             f'stroke="#333" stroke-width="1"/>')
    o.append(f'<text x="{label_w + plot_w / 2:.1f}" y="{axis_y + 36}" text-anchor="middle" '
             f'fill="#333">ms since detection started ({escape(fmt_time(inc.start_ns))})</text>')
    o.append('</g>')
    # lanes
    for n, ln in enumerate(ls):
        y = top + n * (lane_h + gap)
        attrs_ = f'class="lane" data-lane="{escape(ln.key)}" data-service="{escape(ln.service)}"'
        if ln.rank is not None:
            attrs_ += f' data-rank="{ln.rank}"'
        o.append(f'<g {attrs_}>')
        if n % 2 == 0:
            o.append(f'<rect x="0" y="{y - gap / 2}" width="{width}" height="{lane_h + gap}" '
                     f'fill="#f7f7f9"/>')
        o.append(f'<text x="{label_w - 8}" y="{y + lane_h / 2 + 4}" text-anchor="end">'
                 f'{escape(ln.label)}</text>')
        ordered = sorted(ln.spans, key=lambda s: (s.name != T.SPAN_RECOVER, s.start_ns))
        for s in ordered:
            x0, x1 = x(inc.offset_ms(s.start_ns)), x(inc.offset_ms(s.end_ns))
            w = max(x1 - x0, 2.0)
            tip = (f"{s.name} · {s.where}{' · ' + s.pod if s.pod else ''}: "
                   f"{s.duration_ms:.2f} ms (+{inc.offset_ms(s.start_ns):.2f} → "
                   f"+{inc.offset_ms(s.end_ns):.2f})")
            extra = [f"{k.split('.', 1)[-1]}={v}" for k, v in s.attributes.items()
                     if k in (T.ATTR_BYTES, T.ATTR_THROUGHPUT_MBPS, T.ATTR_RESTORE_STEP,
                              T.ATTR_REASON)]
            if extra:
                tip += " · " + ", ".join(extra)
            if s.name == T.SPAN_RECOVER:
                o.append(f'<rect class="span" data-name="{escape(s.name)}" x="{x0:.1f}" '
                         f'y="{y}" width="{w:.1f}" height="{lane_h}" fill="{RECOVER_FILL}" '
                         f'stroke="#aaa" stroke-width="0.8"><title>{escape(tip)}</title></rect>')
                continue
            stroke = ('stroke="#000" stroke-width="2"' if s.span_id in crit
                      else 'stroke="#ffffff" stroke-width="0.5"')
            o.append(f'<rect class="span" data-name="{escape(s.name)}" x="{x0:.1f}" '
                     f'y="{y + 3}" width="{w:.1f}" height="{lane_h - 6}" fill="{colour(s.name)}" '
                     f'{stroke}><title>{escape(tip)}</title></rect>')
            label = f"{s.name} {s.duration_ms:.1f}"
            if w > 7 * len(label) + 6:
                o.append(f'<text x="{x0 + w / 2:.1f}" y="{y + lane_h / 2 + 4}" '
                         f'text-anchor="middle" fill="#fff" font-size="11">{escape(label)}</text>')
            elif w > 7 * len(f"{s.duration_ms:.1f}") + 4:
                o.append(f'<text x="{x0 + w / 2:.1f}" y="{y + lane_h / 2 + 4}" '
                         f'text-anchor="middle" fill="#fff" font-size="11">'
                         f'{s.duration_ms:.1f}</text>')
            elif ln.rank is None and x0 + w + 7 * len(label) + 8 < width:
                # control-plane lanes are mostly empty: label a thin bar beside it
                o.append(f'<text x="{x0 + w + 4:.1f}" y="{y + lane_h / 2 + 4}" fill="#222" '
                         f'font-size="11">{escape(label)} ms</text>')
        o.append('</g>')
    # end marker
    if total is not None:
        xe = x(total)
        o.append(f'<line class="end" x1="{xe:.1f}" y1="{top - 6}" x2="{xe:.1f}" y2="{axis_y}" '
                 f'stroke="#000" stroke-width="1.2" stroke-dasharray="4,3"/>')
        anchor = "end" if xe > width - 160 else "start"
        dx = -4 if anchor == "end" else 4
        o.append(f'<text x="{xe + dx:.1f}" y="{top - 8}" text-anchor="{anchor}" '
                 f'font-weight="bold">first step done +{total:.1f} ms</text>')
    o.append('</svg>')
    return "\n".join(o) + "\n"


def render_png(inc: Incident, out: str | Path, dpi: int = 120) -> None:
    """The same timeline with matplotlib (the `plot` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ls = lanes(inc)
    crit = {s.span_id for s in critical_path_spans(inc)}
    fig_h = 1.6 + 0.42 * len(ls)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    for n, ln in enumerate(ls):
        y = len(ls) - 1 - n
        for s in sorted(ln.spans, key=lambda s: (s.name != T.SPAN_RECOVER, s.start_ns)):
            x0, w = inc.offset_ms(s.start_ns), max(s.duration_ms, 1e-3)
            if s.name == T.SPAN_RECOVER:
                ax.barh(y, w, left=x0, height=0.86, color=RECOVER_FILL, edgecolor="#aaa",
                        linewidth=0.6)
                continue
            on = s.span_id in crit
            ax.barh(y, w, left=x0, height=0.6, color=colour(s.name),
                    edgecolor="black" if on else "white", linewidth=1.6 if on else 0.4)
    ax.set_yticks(range(len(ls)))
    ax.set_yticklabels([ln.label for ln in reversed(ls)])
    ax.set_xlabel(f"ms since detection started ({fmt_time(inc.start_ns)})")
    ax.grid(axis="x", color="#e4e4e4")
    ax.set_axisbelow(True)
    total = inc.downtime_ms
    if total is not None:
        ax.axvline(total, color="black", linestyle="--", linewidth=1)
        ax.text(total, len(ls) - 0.4, f" first step done +{total:.1f} ms", va="bottom",
                ha="right" if total > 0.8 * ax.get_xlim()[1] else "left", fontweight="bold")
    handles = [Patch(facecolor=colour(n) if n != T.SPAN_RECOVER else RECOVER_FILL,
                     edgecolor="#777", label=n) for n in _legend_names(inc)]
    handles.append(Patch(facecolor="white", edgecolor="black", linewidth=1.6,
                         label="critical path"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18 - 0.3 / len(ls)),
              ncol=min(len(handles), 6), frameon=False, fontsize=9)
    ax.set_title(f"{inc.id} · {inc.kind} · generation {inc.generation} · "
                 + (f"{total:.2f} ms" if total is not None else "incomplete"), fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=dpi)
    plt.close(fig)


def grad_syncs(spans: Sequence[Span]) -> list[dict[str, Any]]:
    """The steps traced with CEASELESS_TRACE_STEPS=1, one row per (pod, step): the last
    backward, the all-reduce of the gradient buckets, how long they overlapped and the
    exposed wait after the backward (agent/incident.py, ``trace_grad_sync``)."""
    kids: dict[str, dict[str, Span]] = {}
    for sp in spans:
        if sp.name in ("last_backward", "allreduce"):
            kids.setdefault(sp.parent_id, {})[sp.name] = sp
    rows = []
    for sp in spans:
        if sp.name != "grad_sync" or sp.span_id not in kids:
            continue
        k = kids[sp.span_id]
        bw, ar = k.get("last_backward"), k.get("allreduce")
        if bw is None or ar is None:
            continue
        overlap = max(0, min(bw.end_ns, ar.end_ns) - max(bw.start_ns, ar.start_ns)) / 1e6
        rows.append({"pod": sp.pod, "step": sp.attr("ceaseless.step"), "rank": sp.rank,
                     "backward_ms": bw.duration_ms, "allreduce_ms": ar.duration_ms,
                     "overlap_ms": overlap, "exposed_ms": sp.attr("ceaseless.exposed_ms"),
                     "buckets": sp.attr("ceaseless.buckets"),
                     "during_backward": sp.attr("ceaseless.buckets_during_backward")})
    return sorted(rows, key=lambda r: (r["step"] or 0, str(r["pod"])))


KIND_CHARS = 40  # a planned change's kind: whole words up to this many characters


def _category(reason: str) -> str:
    """A planned change's category, its reason's head up to the first ":" or "(" (
    "preempted", "shrink 3 -> 2 replicas", "capacity add 1"), in whole words: the kind used
    to be the reason cut at 40 characters, mid-word ("...w1 leave at step 23" for 230).
    The whole reason stays in ``Incident.reason``."""
    head = reason.replace("(", ":").split(":", 1)[0].strip()
    if len(head) <= KIND_CHARS:
        return head
    cut = head[:KIND_CHARS + 1].rsplit(" ", 1)[0].rstrip(" ,;")
    return (cut if cut and cut != head[:KIND_CHARS + 1] else head[:KIND_CHARS]) + "…"
