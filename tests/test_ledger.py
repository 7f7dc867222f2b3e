"""The goodput ledger (ops/ledger.py) on synthesized traces: an incident's downtime split along
its critical path by category, rollbacks' recomputed steps, the effective training time ratio;
`ceaseless status` shows it."""

from __future__ import annotations

import math

import pytest

from ops import ledger
from ops import trace_tools as tt
from plumbing import telemetry as T
from test_trace_cli import TOTAL_MS, World, clean_otel_env, synthesize  # noqa: F401


@pytest.fixture
def run_dir(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    synthesize(rd)  # a planned scale-up at -10 s and a crash at 0 (160 ms, 0.25 s unnoticed)
    base = (min(s.start_ns for s in tt.load_spans(rd / "traces")
                if s.name == T.SPAN_DETECT))
    w = World(rd, base)
    for pod in ("w0", "w1"):  # the pods' first commits; the later one does not move the start
        w.span(w.tracer("agent", pod=pod, rank=0), T.SPAN_TRAIN_START, -20_000.0 + (pod == "w1"),
               -20_000.0 + (pod == "w1"), step=0)
    for r in (0, 1):  # every member records the rollback; the ledger keeps one
        w.span(w.tracer("agent", pod=f"w{r}", rank=r), T.SPAN_ROLLBACK, 5_000.0, 5_000.0,
               step=39, restore_step=29, recomputed_steps=10, step_time=0.05,
               reason="corruption")
    w.close()
    return rd, base / 1e9


def test_an_incidents_downtime_is_split_by_category(run_dir):
    rd, base = run_dir
    led = ledger.from_run_dir(rd, launched=base - 25.0, end=base + 10.0)
    crash = next(e for e in led["incidents"] if e["kind"] == "crash")
    parts = sum(crash[f"{c}_s"] for c in ledger.CATEGORIES)
    assert math.isclose(crash["total_s"], parts, abs_tol=1e-3)
    # the critical path adds up to the downtime; the 0.25 s before `detect` is detection too
    assert math.isclose(crash["total_s"], TOTAL_MS / 1e3 + 0.25, abs_tol=2e-3)
    assert crash["detection_s"] >= 0.25 + 0.012 - 1e-3
    assert crash["planning_s"] >= 0.0045 - 1e-4
    assert math.isclose(crash["first_step_s"], (160.0 - 100.3) / 1e3, abs_tol=1e-3)
    assert crash["state_transfer_s"] > 0 and crash["rendezvous_s"] > 0
    assert crash["recomputed_s"] == 0


def test_the_ratio_counts_incidents_and_recomputed_steps(run_dir):
    rd, base = run_dir
    led = ledger.from_run_dir(rd, launched=base - 25.0, end=base + 10.0)
    rb = [e for e in led["incidents"] if e["recomputed_s"] > 0]
    assert len(rb) == 1 and math.isclose(rb[0]["recomputed_s"], 10 * 0.05)
    assert math.isclose(led["window_s"], 30.0, abs_tol=1e-3)
    assert math.isclose(led["startup_s"], 5.0, abs_tol=1e-3)
    lost = sum(e["total_s"] for e in led["incidents"])  # disjoint here
    assert math.isclose(led["productive_s"], 30.0 - lost, abs_tol=2e-3)
    assert math.isclose(led["effective_ratio"], (30.0 - lost) / 30.0, abs_tol=1e-3)
    assert math.isclose(led["ratio_since_launch"], (30.0 - lost) / 35.0, abs_tol=1e-3)
    assert math.isclose(led["lost_s"]["recomputed"], 0.5)
    lines = ledger.render(led)
    assert lines[0].startswith("goodput: ") and "recomputed 0.50s" in lines[0]
    assert any("crash" in x for x in lines[1:])


def test_no_first_step_yet_and_no_traces(tmp_path, run_dir):
    rd, base = run_dir
    led = ledger.from_run_dir(rd, end=base - 30.0)  # before the first commit
    assert led["effective_ratio"] is None and ledger.render(led) == [
        "goodput: no committed step yet"]
    assert ledger.from_run_dir(tmp_path / "nothing") is None


def test_a_change_before_the_first_step_is_start_up(tmp_path):
    rd = tmp_path / "run"
    rd.mkdir()
    synthesize(rd)
    base = min(s.start_ns for s in tt.load_spans(rd / "traces") if s.name == T.SPAN_DETECT)
    w = World(rd, base)
    w.span(w.tracer("agent", pod="w0", rank=0), T.SPAN_TRAIN_START, -5_000.0, -5_000.0, step=0)
    w.close()
    led = ledger.from_run_dir(rd, end=base / 1e9 + 1.0)
    assert [e["kind"] for e in led["incidents"]] == ["crash"]  # not the scale-up at -10 s


def test_the_first_committed_step_of_the_run(run_dir, tmp_path):
    rd, base = run_dir
    assert ledger.first_committed_step(ledger.load(rd)) == 0
    w = World(rd, int(base * 1e9))
    w.span(w.tracer("agent", pod="s3", rank=1), T.SPAN_TRAIN_START, 9_000.0, 9_000.0, step=57)
    w.close()
    assert ledger.first_committed_step(ledger.load(rd)) == 0  # a spare promoted later
    assert ledger.load(tmp_path / "none") is None and ledger.first_committed_step([]) is None


def test_status_shows_the_ledger(run_dir, monkeypatch):
    import argparse
    import json

    from ops import cli

    rd, base = run_dir
    (rd / "cluster.json").write_text(json.dumps({
        "nats_url": "nats://127.0.0.1:1", "job": "demo", "creds": "", "run_dir": str(rd),
        "pid": 1, "started": base - 25.0}))
    led = cli._ledger(argparse.Namespace(nats=None, run_dir=str(rd)))
    assert led["effective_ratio"] is not None and led["startup_s"] is not None
    text = cli._render_status({"job": "demo", "services": {}, "goodput": led})
    assert "goodput: " in text and "crash" in text
    assert cli._ledger(argparse.Namespace(nats="nats://127.0.0.1:1", run_dir=None)) is None
