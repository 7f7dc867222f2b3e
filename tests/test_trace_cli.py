"""`ceaseless trace list|show|plot` on a synthesized but realistic incident: real SDK spans
(explicit timestamps) written by the file exporter of one provider per process, the trace
context handed on through the same W3C headers the bus puts in NATS messages."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from opentelemetry import propagate, trace

from ops import cli_trace
from ops import trace_tools as tt
from plumbing import telemetry as T

SVG = "{http://www.w3.org/2000/svg}"


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k, raising=False)


class World:
    """One provider (= one process and one trace file) per service and per rank."""

    def __init__(self, run_dir: Path, base_ns: int) -> None:
        self.run_dir, self.base = run_dir, base_ns
        self.providers: dict[str, object] = {}

    def tracer(self, service: str, pod: str | None = None, rank: int | None = None):
        key = f"{service}/{pod}"
        if key not in self.providers:
            self.providers[key] = T.build_tracer_provider(service, self.run_dir, job="demo",
                                                          pod=pod, rank=rank)
        return self.providers[key].get_tracer("ceaseless")

    def ns(self, ms: float) -> int:
        return self.base + round(ms * 1_000_000)

    def span(self, tracer, name, start_ms, end_ms, parent=None, headers=None, **a):
        ctx = propagate.extract(headers) if headers is not None else (
            trace.set_span_in_context(parent) if parent is not None else T.root_context())
        s = tracer.start_span(name, context=ctx, start_time=self.ns(start_ms),
                              attributes=T.attrs(job="demo", **a))
        s.end(end_time=self.ns(end_ms))
        return s

    @staticmethod
    def headers(span) -> dict[str, str]:
        h: dict[str, str] = {}
        propagate.inject(h, context=trace.set_span_in_context(span))
        return h

    def close(self) -> None:
        for p in self.providers.values():
            p.shutdown()


# rank -> (pod, abort, rendezvous, state_sync, data_resume, first_step) as (start, end) ms
FAULT_RANKS = {
    0: ("w0", (18.0, 19.0), (19.0, 44.8), (44.8, 98.0), (98.0, 98.2), (98.2, 158.0)),
    1: ("w1", (18.2, 19.2), (19.2, 44.9), (44.9, 97.0), (97.0, 97.2), (97.2, 159.0)),
    2: ("s0", (18.5, 18.6), (18.6, 45.0), (45.0, 100.0), (100.0, 100.3), (100.3, 160.0)),
}
TOTAL_MS = 160.0


def synthesize(run_dir: Path) -> dict[str, str]:
    base = (time.time_ns() // 1_000_000) * 1_000_000
    w = World(run_dir, base)
    # an earlier, planned scale-up (capacity): root `plan`, two ranks
    sc = w.span(w.tracer("scaler"), T.SPAN_PLAN, -10_000.0, -9_996.0, generation=1,
                world_size=2, reason="capacity")
    for r in (0, 1):
        at = w.tracer("agent", pod=f"w{r}", rank=r)
        rec = w.span(at, T.SPAN_RECOVER, -9_995.0, -9_900.0, headers=w.headers(sc),
                     generation=1, rank=r, pod=f"w{r}")
        t = -9_995.0
        for ph, d in zip(T.PHASES, (0.5, 20.0, 30.0, 0.5, 44.0)):
            w.span(at, ph, t, t + d, parent=rec, generation=1, rank=r, pod=f"w{r}")
            t += d
    # an unrelated trace (not an incident)
    w.span(w.tracer("scaler"), "kv_cas", -5_000.0, -4_999.0)
    # the fault: w2 (rank 2) crashed, spare s0 takes rank 2
    # as the health monitor writes it: reason "<kind>: <why>", fault_kind, the failed rank
    det = w.span(w.tracer("health_monitor"), T.SPAN_DETECT, 0.0, 12.0, incident="inc-w2-g1",
                 pod="w2", reason="crash: exited with code -9", fault_kind="crash", rank=2,
                 generation=1, detection_latency=0.25)
    plan = w.span(w.tracer("scaler"), T.SPAN_PLAN, 13.0, 17.5, headers=w.headers(det),
                  incident="inc-w2-g1", generation=2, world_size=3, reason="fault")
    w.span(w.tracer("state_broker"), T.SPAN_TRANSFER_PLAN, 45.5, 47.0,
           headers=w.headers(plan), generation=2, restore_step=41)
    for r, (pod, *phases) in FAULT_RANKS.items():
        at = w.tracer("agent", pod=pod, rank=r)
        rec = w.span(at, T.SPAN_RECOVER, phases[0][0], phases[-1][1], headers=w.headers(plan),
                     incident="inc-w2-g1", generation=2, rank=r, pod=pod, world_size=3)
        for ph, (a, b) in zip(T.PHASES, phases):
            extra = {}
            if ph == T.SPAN_STATE_SYNC:
                extra = dict(restore_step=41, bytes=120_000_000 if r == 2 else 0,
                             throughput_mbps=2181.8 if r == 2 else None)
            w.span(at, ph, a, b, parent=rec, incident="inc-w2-g1", generation=2, rank=r,
                   pod=pod, **extra)
    w.close()
    return {"trace": format(det.get_span_context().trace_id, "032x")}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("proj")
    rd = root / "runs" / "20250102-030405-demo"
    (rd).mkdir(parents=True)
    (rd / "cluster.json").write_text("{}")
    info = synthesize(rd)
    return {"root": root, "dir": rd, **info}


def cli(*argv: str) -> int:
    p = argparse.ArgumentParser(prog="ceaseless")
    sub = p.add_subparsers(dest="cmd")
    cli_trace.register(sub)
    args = p.parse_args(list(argv))
    return args.func(args)


def test_list(run, capsys):
    assert cli("trace", "list", "--run-dir", str(run["dir"])) == 0
    out = capsys.readouterr().out
    lines = [ln for ln in out.splitlines() if re.match(r"\s*\d+\s", ln)]
    assert len(lines) == 2, out                        # kv_cas trace is not an incident
    assert "scale:capacity" in lines[0] and "100.00" in lines[0]   # -10000 -> -9900 ms
    cols = lines[1].split()
    assert cols[1:5] == ["inc-w2-g1", "crash", "w2", "2"]
    assert f"{TOTAL_MS:.2f}" in cols                   # downtime: detect start -> last first step
    assert run["trace"][:12] in lines[1]
    assert "spans in 6 file(s)" in out                 # 3 control + agents w0, w1, s0


def test_list_json_and_default_run_dir(run, capsys, monkeypatch):
    monkeypatch.chdir(run["root"])                     # no --run-dir: newest runs/*/cluster.json
    assert cli("trace", "list", "--json") == 0
    items = json.loads(capsys.readouterr().out)
    assert [i["incident"] for i in items][-1] == "inc-w2-g1"
    assert items[-1]["downtime_ms"] == TOTAL_MS and items[-1]["ranks"] == [0, 1, 2]
    assert items[-1]["spans"] == 3 + 3 * (1 + len(T.PHASES))


def test_find_run_dir(tmp_path):
    runs = tmp_path / "runs"
    a, b = runs / "20250101-000000-demo", runs / "20250101-000100-demo"
    for d in (a, b):
        d.mkdir(parents=True)
    (a / "cluster.json").write_text("{}")
    assert cli_trace.find_run_dir(None, runs) == a     # b has no cluster.json
    (b / "cluster.json").write_text("{}")
    os.utime(a / "cluster.json", (1, 1))
    assert cli_trace.find_run_dir(None, runs) == b
    (runs / "latest").write_text(a.name + "\n")         # a file naming the run
    assert cli_trace.find_run_dir(None, runs) == a.resolve()
    (runs / "latest").unlink()
    (runs / "latest").symlink_to(a.name)                # a symlink
    assert cli_trace.find_run_dir(None, runs) == a.resolve()
    assert cli_trace.find_run_dir(str(b), runs) == b
    with pytest.raises(cli_trace.RunDirError):
        cli_trace.find_run_dir(str(tmp_path / "nope"), runs)
    with pytest.raises(cli_trace.RunDirError, match="ceaseless up"):
        cli_trace.find_run_dir(None, tmp_path / "empty")


def test_show_last(run, capsys):
    assert cli("trace", "show", "last", "--run-dir", str(run["dir"])) == 0
    out = capsys.readouterr().out
    print(out)
    assert "incident inc-w2-g1  kind crash  pods w2  generation 2  world size 3" in out
    rows = {ln.split()[0]: ln for ln in out.split("critical path")[0].splitlines()
            if ln.split() and ln.split()[0] in T.SPAN_ORDER}
    assert list(rows) == list(T.SPAN_ORDER)            # every phase, in protocol order
    # state_sync: r0 53.2, r1 52.1, r2 55.0 ms
    ss = rows["state_sync"].split()
    assert ss[1:4] == ["3", "53.20", "52.10"] and "agent r1" in rows["state_sync"]
    assert "55.00 agent r2" in rows["state_sync"] and "agent r0,r1,r2" in rows["state_sync"]
    assert rows["detect"].split()[1:3] == ["1", "12.00"] and "health_monitor" in rows["detect"]
    assert "state_broker" in rows["transfer_plan"]

    crit = out.split("critical path")[1]
    assert "ends at the last first step: agent r2, pod s0" in crit
    steps = [ln.split() for ln in crit.splitlines() if ln.strip().startswith("+")]
    labels = [s[2] for s in steps]
    assert labels == ["detect", "(wait)", "plan", "(wait)", "abort", "rendezvous", "state_sync",
                      "data_resume", "first_step"]
    assert all("r2" in " ".join(s) for s in steps[4:])
    assert "transfer_plan (state_broker) ended at +47.00" in crit
    total = sum(float(s[1]) for s in steps)
    assert total == pytest.approx(TOTAL_MS, abs=0.01 * len(steps))
    m = re.search(r"total detection -> first step: ([\d.]+) ms \(in spans ([\d.]+) ms \+ "
                  r"waiting ([\d.]+) ms\)", out)
    assert m and float(m[1]) == TOTAL_MS
    assert float(m[2]) + float(m[3]) == pytest.approx(TOTAL_MS, abs=0.02)
    assert float(m[3]) == pytest.approx(2.0, abs=0.01)   # 12->13 and 17.5->18.5
    # the monitor noticed the crash 250 ms after the evidence: that is downtime too
    assert "failure -> first step: 410.00 ms (the monitor noticed the failure 250.00 ms" in out


def test_show_by_id_prefix_and_json(run, capsys):
    assert cli("trace", "show", run["trace"][:10], "--run-dir", str(run["dir"]), "--json") == 0
    d = json.loads(capsys.readouterr().out)
    assert d["incident"] == "inc-w2-g1"
    assert sum(s["duration_ms"] for s in d["critical_path"]) == pytest.approx(TOTAL_MS)
    assert cli("trace", "show", "1", "--run-dir", str(run["dir"])) == 0
    assert "kind scale:capacity" in capsys.readouterr().out
    assert cli("trace", "show", "inc-nope", "--run-dir", str(run["dir"])) == 2
    assert "no incident 'inc-nope'" in capsys.readouterr().err


def test_plot_svg(run, tmp_path, capsys):
    out = tmp_path / "x.svg"
    assert cli("trace", "plot", "last", "--run-dir", str(run["dir"]), "--out", str(out)) == 0
    assert "wrote" in capsys.readouterr().out
    root = ET.parse(out).getroot()                    # well-formed XML
    assert root.tag == f"{SVG}svg"
    lanes = root.findall(f".//{SVG}g[@class='lane']")
    assert [g.get("data-lane") for g in lanes] == [
        "health_monitor", "scaler", "state_broker", "agent r0", "agent r1", "agent r2"]
    assert sorted(g.get("data-rank") for g in lanes if g.get("data-rank")) == ["0", "1", "2"]
    for g in lanes:
        if g.get("data-rank"):
            names = [r.get("data-name") for r in g.findall(f"{SVG}rect[@class='span']")]
            assert names == [T.SPAN_RECOVER, *T.PHASES]
    legend = "".join(root.find(f".//{SVG}g[@class='legend']").itertext())
    for name in T.SPAN_ORDER:
        assert name in legend
    text = "".join(root.itertext())
    assert "first step done +160.0 ms" in text and "ms since detection started" in text
    if shutil.which("rsvg-convert"):                  # a real renderer accepts it
        png = tmp_path / "x.png"
        r = subprocess.run(["rsvg-convert", "-o", str(png), str(out)], capture_output=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_png_with_matplotlib(run, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "x.png"
    assert cli("trace", "plot", "--run-dir", str(run["dir"]), "-o", str(out)) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_rejects_other_formats(run, tmp_path, capsys):
    assert cli("trace", "plot", "--run-dir", str(run["dir"]), "--out",
               str(tmp_path / "x.pdf")) == 2
    assert ".svg or .png" in capsys.readouterr().err


def test_incomplete_incident_and_missing_traces(tmp_path, capsys):
    w = World(tmp_path, time.time_ns())
    det = w.span(w.tracer("health_monitor"), T.SPAN_DETECT, 0.0, 5.0, incident="inc-w9-g3",
                 pod="w9", reason="lost")
    w.span(w.tracer("scaler"), T.SPAN_PLAN, 6.0, 8.0, headers=w.headers(det), generation=4)
    w.close()
    assert cli("trace", "list", "--run-dir", str(tmp_path)) == 0
    assert "incomplete" in capsys.readouterr().out
    assert cli("trace", "show", "--run-dir", str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "incomplete: no first_step yet; last span ends at +8.00 ms" in out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli("trace", "list", "--run-dir", str(empty)) == 2
    assert "no trace files" in capsys.readouterr().err
    assert cli("trace") == 2                          # no subcommand: help, exit 2


def test_incidents_without_root_process_file(tmp_path):
    """The health monitor died before flushing: the plan becomes the root we can see."""
    w = World(tmp_path, time.time_ns())
    hm = T.build_tracer_provider("health_monitor", None)   # no exporter: its spans vanish
    assert hm is None
    from opentelemetry.sdk.trace import TracerProvider
    det = TracerProvider().get_tracer("x").start_span(T.SPAN_DETECT)
    det.end()
    w.span(w.tracer("scaler"), T.SPAN_PLAN, 1.0, 2.0, headers=w.headers(det), generation=7,
           reason="fault")
    w.close()
    [inc] = tt.incidents(tt.load_spans(tmp_path))
    assert inc.root.name == T.SPAN_PLAN and inc.generation == 7 and inc.kind == "scale:fault"


@pytest.mark.parametrize("reason,kind", [
    ("preempted: w1 leave at step 230", "scale:preempted"),
    ("shrink 3 -> 2 replicas: w2 leave at step 230 (release 1 (priority 10))",
     "scale:shrink 3 -> 2 replicas"),
    ("replace w0 with s1, w1 with s2, w3 with s4, w5 with s6", "scale:replace w0 with s1, w1 "
     "with s2, w3 with…"),
])
def test_a_planned_changes_kind_is_its_category_in_whole_words(tmp_path, reason, kind):
    """Issue 41: the kind was the reason cut at 40 characters, mid-word ("... w1 leave at step
    23)" for 230, in summary.json's goodput and `up`'s output); the reason stays whole."""
    w = World(tmp_path, time.time_ns())
    w.span(w.tracer("scaler"), T.SPAN_PLAN, 1.0, 2.0, generation=5, reason=reason)
    w.close()
    [inc] = tt.incidents(tt.load_spans(tmp_path))
    assert inc.kind == kind and inc.reason == reason
