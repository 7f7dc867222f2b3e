"""Telemetry: file exporter, W3C propagation across processes, exporter selection from env,
real OTLP/HTTP export to a loopback server, metrics instruments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ops import trace_tools as tt
from plumbing import telemetry as T
from plumbing.bus import Bus

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("OTEL_"):
            monkeypatch.delenv(k, raising=False)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


# A second process: init() (twice: idempotent), continue the trace from the headers the first
# process injected, exit through shutdown() (which must flush: no force_flush here).
CHILD = textwrap.dedent("""
    import json, os, sys
    from opentelemetry import propagate
    from plumbing import telemetry as T
    run_dir, headers = sys.argv[1], json.loads(sys.argv[2])
    T.init("scaler", run_dir=run_dir, job="t")
    T.init("other", run_dir=run_dir, job="t")      # no-op
    ctx = propagate.extract(headers)
    with T.span(T.SPAN_PLAN, context=ctx, generation=2, world_size=3, reason="fault") as plan:
        with T.span("kv_cas") as cas:
            pass
    print(json.dumps({"pid": os.getpid(), "plan": format(plan.get_span_context().span_id, "016x"),
                      "cas": format(cas.get_span_context().span_id, "016x"),
                      "files": [str(p) for p in T.trace_files()]}))
    T.shutdown()
    T.shutdown()                                   # idempotent
""")


def test_trace_continues_across_processes_via_w3c_headers(tmp_path):
    hm = T.build_tracer_provider("health_monitor", run_dir=tmp_path, job="t")
    tracer = hm.get_tracer("test")
    with tracer.start_as_current_span(
            T.SPAN_DETECT, context=T.root_context(),
            attributes=T.attrs(incident="inc-w1-g1", pod="w1", reason="crash", generation=1,
                               job="t")) as detect:
        headers = Bus.headers_for(msg_id="inc-w1-g1")   # what the bus puts in NATS headers
    hm.shutdown()
    assert "traceparent" in headers and headers["Nats-Msg-Id"] == "inc-w1-g1"

    r = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), json.dumps(headers)],
                       capture_output=True, text=True, timeout=60, env=_clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    child = json.loads(r.stdout.strip().splitlines()[-1])

    files = sorted(p.name for p in (tmp_path / "traces").glob("*.jsonl"))
    assert files == sorted([f"health_monitor-{os.getpid()}.jsonl",
                            f"scaler-{child['pid']}.jsonl"])
    assert [Path(f).name for f in child["files"]] == [f"scaler-{child['pid']}.jsonl"]
    # OTLP/JSON lines: hex ids, camelCase, resource attributes
    line = json.loads((tmp_path / "traces" / f"scaler-{child['pid']}.jsonl")
                      .read_text().splitlines()[0])
    span0 = line["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert len(span0["traceId"]) == 32 and int(span0["traceId"], 16)
    res = tt.kv_list(line["resourceSpans"][0]["resource"]["attributes"])
    assert res["service.name"] == "ceaseless-scaler"
    assert res[T.ATTR_JOB] == "t" and res[T.ATTR_SERVICE] == "scaler"

    stats = tt.LoadStats()
    spans = tt.load_spans(tmp_path, stats)
    assert stats.bad_lines == 0 and stats.spans == 3
    assert len({s.trace_id for s in spans}) == 1
    by = {s.name: s for s in spans}
    d = detect.get_span_context()
    assert by["detect"].trace_id == format(d.trace_id, "032x")
    assert by["detect"].parent_id == ""
    assert by["plan"].span_id == child["plan"]
    assert by["plan"].parent_id == by["detect"].span_id
    assert by["kv_cas"].parent_id == by["plan"].span_id
    assert by["plan"].service == "scaler" and by["detect"].service == "health_monitor"
    [inc] = tt.incidents(spans)
    assert inc.root is by["detect"] and inc.id == "inc-w1-g1" and inc.kind == "crash"
    assert inc.pods == ["w1"] and inc.generation == 2 and not inc.complete


def test_reader_skips_partial_last_line(tmp_path):
    p = T.build_tracer_provider("agent", run_dir=tmp_path, pod="w0", rank=0)
    with p.get_tracer("t").start_as_current_span(T.SPAN_DETECT):
        pass
    p.shutdown()
    [f] = (tmp_path / "traces").glob("agent-w0-*.jsonl")
    good = f.read_text()
    with f.open("a") as fh:
        fh.write(good[: len(good) // 2])            # killed mid-write: no newline, cut JSON
    stats = tt.LoadStats()
    spans = tt.load_spans(tmp_path, stats)
    assert [s.name for s in spans] == ["detect"] and spans[0].rank == 0
    assert stats.bad_lines == 1 and stats.lines == 2
    assert spans[0].lane == "agent r0" and spans[0].pod == "w0"


def test_exporter_selection_from_env(tmp_path, monkeypatch):
    assert T.exporter_names("traces") == []
    assert T.build_tracer_provider("scaler") is None
    assert T.build_meter_provider("scaler") is None
    assert T.exporter_names("traces", tmp_path) == ["file"]

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert T.exporter_names("traces", tmp_path) == ["otlp"]
    assert T.exporter_names("metrics", tmp_path) == ["otlp"]
    assert T.otlp_protocol("traces") == "grpc"
    p = T.build_tracer_provider("scaler", run_dir=tmp_path)
    [exp] = p.ceaseless_exporters
    assert type(exp).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    assert exp._endpoint == "127.0.0.1:9"        # constructed, nothing sent
    p.shutdown()

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    p = T.build_tracer_provider("scaler", run_dir=tmp_path)
    [exp] = p.ceaseless_exporters
    assert type(exp).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    assert exp._endpoint == "http://127.0.0.1:9/v1/traces"
    p.shutdown()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        T.build_tracer_provider("scaler")

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert T.exporter_names("traces", tmp_path) == ["otlp"]
    assert T.exporter_names("metrics", tmp_path) == ["file"]  # traces-only endpoint
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp,file")
    assert T.exporter_names("traces", tmp_path) == ["otlp", "file"]
    assert T.exporter_names("traces", None) == ["otlp"]       # no run dir: no file
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert T.exporter_names("traces", tmp_path) == []
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    with pytest.raises(ValueError, match="zipkin"):
        T.exporter_names("traces", tmp_path)
    monkeypatch.delenv("OTEL_TRACES_EXPORTER")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert T.exporter_names("traces", tmp_path) == []
    assert T.exporter_names("metrics", tmp_path) == []


def test_resource_and_service_name(monkeypatch):
    r = T.resource("agent", job="j1", pod="w3", rank=3)
    assert r.attributes["service.name"] == "ceaseless-agent"
    assert (r.attributes[T.ATTR_JOB], r.attributes[T.ATTR_POD], r.attributes[T.ATTR_RANK]) == \
        ("j1", "w3", 3)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-trainer")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=ci")
    r = T.resource("agent", job="j1")
    assert r.attributes["service.name"] == "my-trainer"
    assert r.attributes[T.ATTR_SERVICE] == "agent"
    assert r.attributes["deployment.environment"] == "ci"


def test_sampler_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    p = T.build_tracer_provider("scaler", run_dir=tmp_path)
    with p.get_tracer("t").start_as_current_span("plan") as s:
        assert not s.get_span_context().trace_flags.sampled
    p.shutdown()
    assert tt.load_spans(tmp_path) == []


def test_attrs_helper():
    from schemas.messages import FaultKind

    assert T.attrs(incident="i", rank=0, reason=FaultKind.crash, bytes=10, pod=None,
                   custom=1.5, **{"x.y": "z"}) == {
        T.ATTR_INCIDENT: "i", T.ATTR_RANK: 0, T.ATTR_REASON: "crash", T.ATTR_BYTES: 10,
        "ceaseless.custom": 1.5, "x.y": "z"}
    assert set(T.PHASES) < set(T.SPAN_ORDER) and T.PHASES[-1] == T.SPAN_FIRST_STEP


class _Recorder(BaseHTTPRequestHandler):
    got: list = []

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.got.append((self.path, self.headers.get("Content-Type"), body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def otlp_http_server():
    _Recorder.got = []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        yield srv, _Recorder.got
    finally:
        srv.shutdown()
        srv.server_close()


def test_real_otlp_http_export_to_loopback(otlp_http_server, monkeypatch, tmp_path):
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest)
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest)

    srv, got = otlp_http_server
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{srv.server_port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    tp = T.build_tracer_provider("state_broker", run_dir=tmp_path, job="j2")
    with tp.get_tracer("t").start_as_current_span(
            T.SPAN_TRANSFER_PLAN, attributes=T.attrs(generation=4, restore_step=99)):
        pass
    assert tp.force_flush(5000)
    tp.shutdown()
    mp = T.build_meter_provider("agent", run_dir=tmp_path, job="j2", pod="w0", rank=0)
    inst = T.instruments(mp.get_meter("test"))
    inst.record_recovery(0.3, lost_steps=0, reason="crash")
    inst.record_membership(4)
    assert mp.force_flush(5000)
    mp.shutdown()
    assert not (tmp_path / "traces").exists()     # OTLP wins over files

    paths = [g[0] for g in got]
    assert "/v1/traces" in paths and "/v1/metrics" in paths
    path, ctype, body = next(g for g in got if g[0] == "/v1/traces")
    assert ctype == "application/x-protobuf"
    req = ExportTraceServiceRequest.FromString(body)
    rs = req.resource_spans[0]
    res = {kv.key: kv.value.string_value for kv in rs.resource.attributes}
    assert res["service.name"] == "ceaseless-state_broker" and res[T.ATTR_JOB] == "j2"
    sp = rs.scope_spans[0].spans[0]
    assert sp.name == "transfer_plan"
    assert {kv.key: kv.value.int_value for kv in sp.attributes}[T.ATTR_RESTORE_STEP] == 99
    mreq = ExportMetricsServiceRequest.FromString(
        next(g for g in got if g[0] == "/v1/metrics")[2])
    names = {m.name for rm in mreq.resource_metrics for sm in rm.scope_metrics
             for m in sm.metrics}
    assert {T.METRIC_RECOVERY_DOWNTIME, T.METRIC_MEMBERSHIP_SIZE} <= names


def test_metrics_file_exporter(tmp_path):
    mp = T.build_meter_provider("agent", run_dir=tmp_path, job="j", pod="w1", rank=1)
    inst = T.instruments(mp.get_meter("test"))
    assert T.instruments(mp.get_meter("test")) is not None
    inst.record_recovery(0.42, lost_steps=0, reason="crash")
    inst.record_recovery(1.5, lost_steps=2, reason="hang")
    inst.record_goodput(0.97)
    inst.record_steps_per_second(12.5)
    inst.record_membership(4)
    mp.force_flush(5000)
    mp.shutdown()
    [f] = (tmp_path / "metrics").glob(f"agent-w1-{os.getpid()}.jsonl")
    last = json.loads(f.read_text().splitlines()[-1])
    metrics = {m["name"]: m for rm in last["resourceMetrics"] for sm in rm["scopeMetrics"]
               for m in sm["metrics"]}
    assert set(metrics) == {T.METRIC_RECOVERY_DOWNTIME, T.METRIC_LOST_STEPS, T.METRIC_GOODPUT,
                            T.METRIC_STEPS_PER_SECOND, T.METRIC_MEMBERSHIP_SIZE}
    h = metrics[T.METRIC_RECOVERY_DOWNTIME]
    assert h["unit"] == "s"
    pts = h["histogram"]["dataPoints"]
    assert sorted(round(p["sum"], 3) for p in pts) == [0.42, 1.5]
    assert pts[0]["explicitBounds"] == list(T.DOWNTIME_BUCKETS_S)
    lost = metrics[T.METRIC_LOST_STEPS]["sum"]["dataPoints"]
    assert sum(int(p["asInt"]) for p in lost) == 2
    assert metrics[T.METRIC_GOODPUT]["gauge"]["dataPoints"][0]["asDouble"] == 0.97
    assert int(metrics[T.METRIC_MEMBERSHIP_SIZE]["gauge"]["dataPoints"][0]["asInt"]) == 4


# The agent's own metrics and log correlation, without a cluster: a Session commits steps
# (with a stretch of lost time) and reports one recovery through a stand-in runtime.
AGENT_CHILD = textwrap.dedent("""
    import sys, time
    from types import SimpleNamespace
    from plumbing import logs, telemetry
    telemetry.init("agent", run_dir=sys.argv[1], job="j", pod="w0")
    logs.configure("agent", stream=sys.stdout)
    from agent.incident import Incident
    from agent.session import Session
    s = Session(4)
    s.cfg = SimpleNamespace(pod="w0", job="j")
    s.m = SimpleNamespace(rank=0, world_size=1, generation=2, group=None)  # a member
    s.runtime = SimpleNamespace(publish=lambda *a, **k: None, update=lambda **k: None,
                                note_commit=lambda: None,
                                bus=SimpleNamespace(subjects=SimpleNamespace(recovery="r")))
    for step in range(3):
        s._commit(step, 1.0, 0.0)
        time.sleep(0.02)
    t = time.time()
    s.timeline.incident = Incident(notice=t - 0.4, last_commit=t - 0.5, reason="test",
                            t_plan=t - 0.3, t_group=t - 0.2, t_sync=t - 0.1, t_data=t - 0.05,
                            incident="inc-w1-g1", generation=2, restore_step=2)
    s.timeline.first_commit_time -= 1.0      # a second of wall time with nothing committed
    s._commit(3, 1.0, 0.0)        # the first step of generation 2: reports the recovery
    telemetry.shutdown()
""")


def test_agent_metrics_and_log_trace_ids(tmp_path):
    r = subprocess.run([sys.executable, "-c", AGENT_CHILD, str(tmp_path)], capture_output=True,
                       text=True, timeout=60, env=_clean_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr
    [f] = (tmp_path / "metrics").glob("agent-w0-*.jsonl")
    last = json.loads(f.read_text().splitlines()[-1])
    metrics = {m["name"]: m for rm in last["resourceMetrics"] for sm in rm["scopeMetrics"]
               for m in sm["metrics"]}
    assert {T.METRIC_RECOVERY_DOWNTIME, T.METRIC_LOST_STEPS, T.METRIC_GOODPUT,
            T.METRIC_STEPS_PER_SECOND} <= set(metrics)
    [h] = metrics[T.METRIC_RECOVERY_DOWNTIME]["histogram"]["dataPoints"]
    assert int(h["count"]) == 1 and 0.45 < h["sum"] < 5
    goodput = metrics[T.METRIC_GOODPUT]["gauge"]["dataPoints"][0]["asDouble"]
    assert 0 < goodput < 0.5, goodput          # about 0.04 s useful in over a second
    sps = metrics[T.METRIC_STEPS_PER_SECOND]["gauge"]["dataPoints"][0]["asDouble"]
    assert 5 < sps < 60, sps                   # one step per ~20 ms
    # The recovery's spans, and its log line carries their trace and span ids.
    spans = {s.name: s for s in tt.load_spans(tmp_path)}
    assert {T.SPAN_RECOVER, *T.PHASES} <= set(spans)
    rec = [json.loads(line) for line in r.stdout.splitlines() if '"recovered"' in line]
    assert len(rec) == 1
    assert rec[0]["trace_id"] == spans[T.SPAN_RECOVER].trace_id
    assert rec[0]["span_id"] == spans[T.SPAN_RECOVER].span_id


def test_step_gauges_are_set_at_most_once_a_second_and_at_once_after_an_incident(monkeypatch):
    """Issue 44: the step-rate and goodput gauges are read by the exporter every few seconds;
    setting them at every commit was a fixed cost of a small step. The commit that closes an
    incident sets them at once (goodput fell)."""
    from agent.incident import Timeline
    from plumbing import telemetry

    from types import SimpleNamespace

    got: list[float] = []  # the step-rate values set (the instruments are frozen: counted)
    counting = SimpleNamespace(record_steps_per_second=lambda v, **a: got.append(v),
                               record_goodput=lambda v, **a: None)
    monkeypatch.setattr(telemetry, "instruments", lambda m=None: counting)
    tl = Timeline()
    t0 = 1000.0
    for i in range(200):  # 200 commits 10 ms apart: 2 s
        now = t0 + 0.01 * i
        tl.commit(i, 1.0, now)
        tl.record_metrics(now)
    assert 2 <= len(got) <= 3, len(got)  # 2 s of commits: about once a second
    n = len(got)
    tl.close(None, None, 0, 1, t0 + 1.995)  # an incident closed: set at this commit
    tl.commit(200, 1.0, t0 + 1.995)
    tl.record_metrics(t0 + 1.995)
    assert len(got) == n + 1
