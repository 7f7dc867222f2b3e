"""A real local cluster, one injected crash, and the trace it leaves in the run dir.

One trace per incident: the health monitor's ``detect`` is the root; the scaler's ``plan``,
the state broker's ``transfer_plan`` and every member's ``recover`` and phases join it
through the trace context in NATS headers. The phases on the critical path must add up to
the downtime the tools report (detection start -> the last rank's first step).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from harness import REPO, Cluster
from ops import trace_tools as tt
from plumbing import telemetry as tm

pytestmark = [pytest.mark.timeout(240)]

STEPS = 60


def _ceaseless_all(*calls: tuple[list[str], object]) -> list[str]:
    """Run ``ceaseless ARGS`` in CWD for each (ARGS, CWD) concurrently; their stdout."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "ops.cli", *args], cwd=cwd, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for args, cwd in calls]
    outs = []
    for p, (args, _) in zip(procs, calls):
        out, err = p.communicate(timeout=90)
        assert p.returncode == 0, (args, out, err)
        outs.append(out)
    return outs


def _metric_names(run_dir) -> dict[str, set[str]]:
    """{file stem without the pid: metric names in its last line}."""
    out: dict[str, set[str]] = {}
    for f in (run_dir / "metrics").glob("*.jsonl"):
        lines = f.read_text().splitlines()
        if not lines:
            continue
        last = json.loads(lines[-1])
        out.setdefault(f.stem.rsplit("-", 1)[0], set()).update(
            m["name"] for rm in last["resourceMetrics"] for sm in rm["scopeMetrics"]
            for m in sm["metrics"])
    return out


async def test_one_crash_one_trace(tmp_path):
    run_dir = tmp_path / "run"
    async with Cluster(run_dir, workers=2, spares=1, steps=STEPS) as c:
        await c.wait_spares(1)
        h = await c.wait_rank_step(1, 4)
        assert h.pid
        killed = h.pod
        os.kill(h.pid, signal.SIGKILL)
        code = await c.finish()
        assert code == 0, c.output()
        plans = list(c.plans)
    summary = c.summary()
    assert len(summary["incidents"]) == 1, summary
    incident = summary["incidents"][0]["incident"]
    assert incident == f"inc-{killed}-g1", summary
    final = plans[-1]
    members = {m.rank: m.pod for m in final.members}
    promoted = members[1]
    assert promoted != killed

    stats = tt.LoadStats()
    spans = tt.load_spans(run_dir, stats)
    assert stats.files >= 5, stats   # 3 services + the 2 members of the new generation
    mine = [s for s in spans if s.attr(tm.ATTR_INCIDENT) == incident]
    assert mine, f"no span names {incident}; {len(spans)} spans loaded"
    # Exactly one trace for the incident, and every span in that trace belongs to it.
    trace_ids = {s.trace_id for s in mine}
    assert len(trace_ids) == 1, {s.name: s.trace_id for s in mine}
    (trace_id,) = trace_ids
    tr = [s for s in spans if s.trace_id == trace_id]
    assert {s.attr(tm.ATTR_INCIDENT) for s in tr} == {incident}

    # Who contributed.
    by = {(s.service, s.name, s.pod if s.service == "agent" else None) for s in tr}
    assert ("health_monitor", tm.SPAN_DETECT, None) in by, by
    assert ("scaler", tm.SPAN_PLAN, None) in by, by
    assert ("state_broker", tm.SPAN_TRANSFER_PLAN, None) in by, by
    for rank, pod in members.items():
        for phase in (tm.SPAN_RECOVER,) + tm.PHASES:
            if phase == tm.SPAN_ABORT:
                # a spare had nothing to abort; a survivor aborted its step or, when it was
                # still computing it and the spare held the state, finished it (prejoin.py)
                ended = {p for p in (tm.SPAN_ABORT, tm.SPAN_FINISH_STEP) if ("agent", p, pod) in by}
                assert len(ended) == (0 if pod == promoted else 1), (pod, ended)
                continue
            assert ("agent", phase, pod) in by, (rank, pod, phase, sorted(map(str, by)))
    agent_spans = [s for s in tr if s.service == "agent"]
    per_rank = [(s.pod, s.name) for s in agent_spans]
    assert len(per_rank) == len(set(per_rank)), sorted(per_rank)   # one attempt each
    assert {s.pod for s in agent_spans} == set(members.values())
    assert {s.attr(tm.ATTR_RANK) for s in agent_spans} == set(members)

    # Parenting: one root (detect), every other span's parent is in the trace, and the
    # causal chain is detect -> plan -> {transfer_plan, recover -> phases}.
    ids = {s.span_id: s for s in tr}
    roots = [s for s in tr if not s.parent_id]
    assert [r.name for r in roots] == [tm.SPAN_DETECT], [(r.name, r.service) for r in roots]
    for s in tr:
        if s.parent_id:
            assert s.parent_id in ids, (s.name, s.service, s.pod)
    parent = lambda s: ids[s.parent_id].name  # noqa: E731
    for s in tr:
        if s.name == tm.SPAN_PLAN:
            assert parent(s) == tm.SPAN_DETECT
        elif s.name in (tm.SPAN_TRANSFER_PLAN, tm.SPAN_RECOVER):
            assert parent(s) == tm.SPAN_PLAN, (s.name, parent(s))
        elif s.name in tm.AGENT_PHASES:
            assert parent(s) == tm.SPAN_RECOVER, (s.name, parent(s))

    # Attributes the issue asks for.
    detect = roots[0]
    assert detect.attr(tm.ATTR_POD) == killed and detect.attr(tm.ATTR_FAULT_KIND) == "crash"
    assert detect.attr(tm.ATTR_RANK) == 1 and detect.attr(tm.ATTR_GENERATION) == 1
    # detect starts at the last evidence of the failure (here: the exit the actuator
    # reported), not when the fault was declared: it covers the detection latency.
    latency_ms = detect.attr(tm.ATTR_DETECTION_LATENCY) * 1e3
    assert latency_ms - 0.01 <= detect.duration_ms <= latency_ms + 100, (
        detect.duration_ms, latency_ms)
    for s in agent_spans:
        assert s.attr(tm.ATTR_GENERATION) == final.generation
        assert s.attr(tm.ATTR_WORLD_SIZE) == 2
        assert s.attr(tm.ATTR_LOST_STEPS) == 0
        assert s.attr(tm.ATTR_RESTORE_STEP) is not None and s.attr(tm.ATTR_RESTORE_STEP) >= 4
    sync = [s for s in agent_spans if s.name == tm.SPAN_STATE_SYNC]
    recv = [s for s in sync if s.pod == promoted]
    # the promoted spare received the state, or already held it (a shadow spare): 0 bytes
    assert recv and recv[0].attr(tm.ATTR_BYTES) is not None and recv[0].attr(tm.ATTR_BYTES) >= 0
    if recv[0].attr(tm.ATTR_BYTES) > 0:
        assert recv[0].attr(tm.ATTR_THROUGHPUT_MBPS) is not None

    # The tools see exactly this incident, complete.
    items = [i for i in tt.incidents(spans) if i.id == incident]
    assert len(items) == 1
    inc = items[0]
    assert inc.complete and inc.kind == "crash"
    downtime = inc.downtime_ms
    assert downtime is not None and downtime > 0
    # The downtime the tools report: detection start (last evidence) -> last first step.
    last_first = max(s.end_ns for s in tr if s.name == tm.SPAN_FIRST_STEP)
    assert abs(downtime - (last_first - detect.start_ns) / 1e6) < 1e-3
    # Phase durations on the critical path add up to it within 10%.
    path = tt.critical_path(inc)
    names = [seg.label for seg in path]
    last_lane = path[-1].span.pod
    expect = [tm.SPAN_DETECT, tm.SPAN_PLAN] + [p for p in tm.AGENT_PHASES
                                               if ("agent", p, last_lane) in by]
    expect = sorted(expect, key=lambda p: 2.5 if p == tm.SPAN_FINISH_STEP
                    else [tm.SPAN_DETECT, tm.SPAN_PLAN, *tm.PHASES].index(p))
    assert [n for n in names if n != "(wait)"] == expect, names
    in_spans = sum(seg.duration_ms for seg in path if seg.span is not None)
    # (a few ms of scheduling between spans are gaps too: 59 ms downtimes were seen with
    # 7.8 ms of them on a loaded CI machine)
    assert abs(in_spans - downtime) <= max(0.10 * downtime, 15.0), (in_spans, downtime, names)
    # summary.json counts the same way (from the fault's evidence to the last Recovery).
    down_s = summary["incidents"][0]["downtime"]
    assert down_s is not None
    assert abs(down_s * 1e3 - downtime) <= 1.0, (down_s, downtime)
    assert inc.since_failure_ms == pytest.approx(downtime)

    # Metrics (the file exporter's last line of each file holds the totals) and logs.
    names = _metric_names(run_dir)
    assert tm.METRIC_MEMBERSHIP_SIZE in names["scaler"], names
    survivor = members[0]
    for metric in (tm.METRIC_RECOVERY_DOWNTIME, tm.METRIC_LOST_STEPS, tm.METRIC_GOODPUT,
                   tm.METRIC_STEPS_PER_SECOND):
        assert metric in names[f"agent-{survivor}"], names
    logged = [json.loads(line) for f in (run_dir / "logs").glob("*.log")
              for line in f.read_text().splitlines() if line.startswith("{")]
    correlated = {e["event"] for e in logged if e.get("trace_id") == trace_id}
    assert {"fault declared", "plan committed", "recovered"} <= correlated, correlated

    # The CLI, as an operator runs it (two processes at once: each imports the CLI).
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "latest").symlink_to(run_dir)   # what `trace list` reads by default
    show, listing = _ceaseless_all(
        (["trace", "show", "last", "--run-dir", str(run_dir)], REPO),
        (["trace", "list"], tmp_path))
    assert incident in show, show
    for phase in (tm.SPAN_DETECT, tm.SPAN_PLAN, tm.SPAN_TRANSFER_PLAN) + tm.PHASES:
        if phase != tm.SPAN_ABORT:
            assert phase in show, show
    assert tm.SPAN_ABORT in show or tm.SPAN_FINISH_STEP in show, show
    assert "critical path" in show and "total detection -> first step" in show, show
    assert f"{downtime:.2f}" in show, show
    row = next(line for line in listing.splitlines() if incident in line)
    assert "crash" in row and killed in row and f"{downtime:.2f}" in row, listing
    # The timeline (SVG needs nothing beyond the standard library).
    svg = tt.render_svg(inc)
    assert svg.lstrip().startswith("<") and "first_step" in svg
