"""OpenTelemetry setup for every Ceaseless process, and the names every span and metric uses.

Call ``init(service, run_dir=..., job=..., pod=..., rank=...)`` once per process (services do
it in ``services.common.service.serve``; the agent in ``Session``), then use ``tracer()`` /
``instruments()``; call ``shutdown()`` before exiting to flush.

Exporters, per signal (traces, metrics), chosen at ``init``:

* ``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` if set: a comma-separated list of
  ``otlp``, ``file`` (the Ceaseless JSON-lines file below; needs ``run_dir``), ``console``,
  ``none``;
* else ``otlp`` when ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or the signal's own
  ``OTEL_EXPORTER_OTLP_{TRACES,METRICS}_ENDPOINT``) is set, over gRPC or HTTP per
  ``OTEL_EXPORTER_OTLP_{TRACES_,METRICS_,}PROTOCOL`` (``grpc``, the default, or
  ``http/protobuf``); the SDK exporters read the rest of the ``OTEL_EXPORTER_OTLP_*`` env;
* else ``file`` when ``run_dir`` is given: ``<run_dir>/traces/<stem>.jsonl`` and
  ``<run_dir>/metrics/<stem>.jsonl`` with ``<stem>`` = ``<service>-<pid>`` (or
  ``<service>-<pod>-<pid>`` when ``pod`` is given, so that ranks sharing a process in tests
  get their own files);
* else nothing (the API's no-op tracer and meter).

File format ("OTLP-JSON lines", as the OpenTelemetry Collector's ``file`` exporter writes and
its ``otlpjsonfile`` receiver reads): one line per export batch, each line one
``ExportTraceServiceRequest`` (or ``ExportMetricsServiceRequest``) in the OTLP/JSON encoding:
the protobuf JSON mapping with lowerCamelCase field names, enums as integers, 64-bit integers
as decimal strings, and trace/span ids as lowercase hex (not base64).

``OTEL_SDK_DISABLED=true`` turns everything off; ``OTEL_TRACES_SAMPLER`` /
``OTEL_TRACES_SAMPLER_ARG``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_BSP_*`` and
``OTEL_METRIC_EXPORT_INTERVAL`` are honoured (the batch span processor's schedule delay
defaults to 200 ms here, the metric export interval to 10 s).
"""

from __future__ import annotations

import base64
import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

# ============================================================================ conventions
# One trace per incident. The health monitor's `detect` span is the root (a planned scaling
# change has the scaler's `plan` as its root); everything else descends from it through the
# W3C trace context the bus carries in NATS headers.
SPAN_DETECT = "detect"                # health_monitor: evidence -> fault published (root)
SPAN_PLAN = "plan"                    # scaler: fault/capacity/priority -> plan g+1 published
SPAN_TRANSFER_PLAN = "transfer_plan"  # state_broker: plan g+1 -> transfer published
SPAN_RECOVER = "recover"              # agent, one per rank: optional parent of the phases
SPAN_ABORT = "abort"                  # agent: abandon collectives of generation g
SPAN_RENDEZVOUS = "rendezvous"        # agent: build the process group of g+1
SPAN_STATE_SYNC = "state_sync"        # agent: wait for `transfer`, send/receive state
SPAN_DATA_RESUME = "data_resume"      # agent: loader seeks to restore_step + 1
SPAN_FIRST_STEP = "first_step"        # agent: the first step of g+1; the incident ends here
# agent, instead of abort: the step in flight was finished for g+1 (resume in place)
SPAN_FINISH_STEP = "finish_step"
# agent, outside incidents (the goodput ledger, ops/ledger.py): a pod's first committed step
# (one per pod) and a rollback to the last verified copy (the steps it computes again)
SPAN_TRAIN_START = "train_start"
SPAN_ROLLBACK = "rollback"

PHASES: tuple[str, ...] = (SPAN_ABORT, SPAN_RENDEZVOUS, SPAN_STATE_SYNC, SPAN_DATA_RESUME,
                           SPAN_FIRST_STEP)
AGENT_PHASES: tuple[str, ...] = PHASES + (SPAN_FINISH_STEP,)  # any a rank may report
CONTROL_SPANS: tuple[str, ...] = (SPAN_DETECT, SPAN_PLAN, SPAN_TRANSFER_PLAN)
ROOT_SPANS: tuple[str, ...] = (SPAN_DETECT, SPAN_PLAN)
SPAN_ORDER: tuple[str, ...] = CONTROL_SPANS + (SPAN_RECOVER,) + PHASES

# Span (and, for job/pod/rank/service, resource) attributes.
ATTR_JOB = "ceaseless.job"
ATTR_INCIDENT = "ceaseless.incident"
ATTR_GENERATION = "ceaseless.generation"      # the generation being formed (g+1)
ATTR_POD = "ceaseless.pod"                    # detect: the failed pod; agent: its own pod
ATTR_RANK = "ceaseless.rank"                  # agent: its rank in generation g+1
ATTR_WORLD_SIZE = "ceaseless.world_size"
ATTR_REASON = "ceaseless.reason"              # detect: "<kind>: <why>"; plan: why (fault/capacity/...)
ATTR_FAULT_KIND = "ceaseless.fault_kind"      # detect: crash / hang / exception / lost
ATTR_DETECTION_LATENCY = "ceaseless.detection_latency"  # detect: s from last evidence to fault
ATTR_RESTORE_STEP = "ceaseless.restore_step"
ATTR_BYTES = "ceaseless.bytes"                # state_sync: bytes received (recipient) / sent
ATTR_THROUGHPUT_MBPS = "ceaseless.throughput_mbps"
ATTR_LOST_STEPS = "ceaseless.lost_steps"
ATTR_ROLE = "ceaseless.role"                  # worker / spare / source / recipient
ATTR_SERVICE = "ceaseless.service"            # resource: short service name (agent, scaler...)
ATTR_STEP = "ceaseless.step"
ATTR_RECOMPUTED_STEPS = "ceaseless.recomputed_steps"  # rollback: steps computed again
ATTR_STEP_TIME = "ceaseless.step_time"        # rollback: the member's median step time, s

_ATTR_BY_KEY = {
    "job": ATTR_JOB, "incident": ATTR_INCIDENT, "generation": ATTR_GENERATION,
    "pod": ATTR_POD, "rank": ATTR_RANK, "world_size": ATTR_WORLD_SIZE, "reason": ATTR_REASON,
    "restore_step": ATTR_RESTORE_STEP, "bytes": ATTR_BYTES,
    "throughput_mbps": ATTR_THROUGHPUT_MBPS, "lost_steps": ATTR_LOST_STEPS, "role": ATTR_ROLE,
    "fault_kind": ATTR_FAULT_KIND, "detection_latency": ATTR_DETECTION_LATENCY,
    "step": ATTR_STEP, "recomputed_steps": ATTR_RECOMPUTED_STEPS, "step_time": ATTR_STEP_TIME,
}

# Metrics.
METRIC_RECOVERY_DOWNTIME = "ceaseless.recovery.downtime"    # histogram, s
METRIC_LOST_STEPS = "ceaseless.recovery.lost_steps"         # counter, {step}
METRIC_GOODPUT = "ceaseless.goodput"                        # gauge, 1 (fraction)
METRIC_STEPS_PER_SECOND = "ceaseless.steps_per_second"      # gauge, {step}/s
METRIC_MEMBERSHIP_SIZE = "ceaseless.membership.size"        # gauge, {rank}
DOWNTIME_BUCKETS_S: tuple[float, ...] = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                                         10.0, 30.0, 60.0, 300.0)

SERVICE_PREFIX = "ceaseless-"
DEFAULT_SCHEDULE_DELAY_MS = 200
DEFAULT_METRIC_INTERVAL_MS = 10_000


def attrs(**kw: Any) -> dict[str, Any]:
    """``attrs(incident=..., rank=2, bytes=n)`` -> ``{"ceaseless.incident": ..., ...}``.

    Short keys map to the ``ATTR_*`` names (unknown keys become ``ceaseless.<key>``); ``None``
    values are dropped and enums become their value, so the result is a valid attribute map."""
    out: dict[str, Any] = {}
    for k, v in kw.items():
        if v is None:
            continue
        if isinstance(v, Enum):
            v = v.value
        elif not isinstance(v, (str, bool, int, float)):
            v = str(v)
        out[_ATTR_BY_KEY.get(k, k if "." in k else f"ceaseless.{k}")] = v
    return out


# ============================================================================ file exporters
def _b64_to_hex(v: str) -> str:
    try:
        return base64.b64decode(v).hex()
    except Exception:
        return v


_ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def _hex_ids(obj: Any) -> Any:
    """Rewrite the protobuf JSON mapping's base64 ids to OTLP/JSON's hex, in place."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in _ID_FIELDS and isinstance(v, str):
                obj[k] = _b64_to_hex(v)
            else:
                _hex_ids(v)
    elif isinstance(obj, list):
        for v in obj:
            _hex_ids(v)
    return obj


def otlp_json(message: Any) -> dict[str, Any]:
    """An OTLP protobuf message (e.g. ExportTraceServiceRequest) as an OTLP/JSON dict."""
    from google.protobuf import json_format

    return _hex_ids(json_format.MessageToDict(message, use_integers_for_enums=True))


class JsonLinesFile:
    """Appends whole JSON lines to ``<directory>/<stem>-<pid>.jsonl``.

    The pid is read at every write, so a forked child writes its own file. One ``os.write``
    of one line on an ``O_APPEND`` descriptor: lines of concurrent writers do not interleave,
    and a process killed mid-write leaves at most one partial last line (readers skip it)."""

    def __init__(self, directory: str | os.PathLike, stem: str) -> None:
        self.directory = Path(directory)
        self.stem = stem
        self._lock = threading.Lock()
        self._fd: int | None = None
        self._pid: int | None = None

    @property
    def path(self) -> Path:
        return self.directory / f"{self.stem}-{os.getpid()}.jsonl"

    def write(self, obj: Mapping[str, Any]) -> None:
        data = (json.dumps(obj, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._fd is None or self._pid != os.getpid():
                self.directory.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                self._pid = os.getpid()
            view = memoryview(data)
            while view:
                n = os.write(self._fd, view)
                view = view[n:]

    def close(self) -> None:
        with self._lock:
            if self._fd is not None and self._pid == os.getpid():
                try:
                    os.close(self._fd)
                except OSError:
                    pass
            self._fd = None


def _file_stem(service: str, pod: str | None) -> str:
    return f"{service}-{pod}" if pod else service


class FileSpanExporter(SpanExporter):
    """SpanExporter writing one OTLP/JSON ExportTraceServiceRequest line per batch."""

    def __init__(self, directory: str | os.PathLike, stem: str) -> None:
        self.file = JsonLinesFile(directory, stem)

    def export(self, spans: Sequence[Any]) -> SpanExportResult:
        from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

        if not spans:
            return SpanExportResult.SUCCESS
        try:
            self.file.write(otlp_json(encode_spans(spans)))
        except OSError:
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        self.file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class FileMetricExporter(MetricExporter):
    """MetricExporter writing one OTLP/JSON ExportMetricsServiceRequest line per collection
    (cumulative temporality: the last line holds the totals)."""

    def __init__(self, directory: str | os.PathLike, stem: str) -> None:
        super().__init__()
        self.file = JsonLinesFile(directory, stem)

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

        try:
            self.file.write(otlp_json(encode_metrics(metrics_data)))
        except OSError:
            return MetricExportResult.FAILURE
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self.file.close()


# ============================================================================ selection
def _env(name: str, environ: Mapping[str, str]) -> str | None:
    v = environ.get(name)
    return v.strip() if v and v.strip() else None


def otlp_protocol(signal: str, environ: Mapping[str, str] | None = None) -> str:
    """``grpc`` or ``http/protobuf`` for ``signal`` in (``traces``, ``metrics``)."""
    env = os.environ if environ is None else environ
    proto = (_env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", env)
             or _env("OTEL_EXPORTER_OTLP_PROTOCOL", env) or "grpc").lower()
    if proto not in ("grpc", "http/protobuf"):
        raise ValueError(f"OTLP protocol {proto!r} is not supported here "
                         "(use grpc or http/protobuf)")
    return proto


def exporter_names(signal: str, run_dir: str | os.PathLike | None = None,
                   environ: Mapping[str, str] | None = None) -> list[str]:
    """Which exporters ``init`` uses for ``signal`` (``traces``/``metrics``): see the module doc."""
    env = os.environ if environ is None else environ
    if (_env("OTEL_SDK_DISABLED", env) or "").lower() == "true":
        return []
    explicit = _env(f"OTEL_{signal.upper()}_EXPORTER", env)
    if explicit:
        names = [n.strip().lower() for n in explicit.split(",") if n.strip()]
        if "none" in names:
            return []
        unknown = [n for n in names if n not in ("otlp", "file", "console")]
        if unknown:
            raise ValueError(f"OTEL_{signal.upper()}_EXPORTER: unknown exporter(s) {unknown}")
        if "file" in names and run_dir is None:
            names.remove("file")  # nowhere to write: leave it out rather than fail
        return list(dict.fromkeys(names))
    if _env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT", env) or \
            _env("OTEL_EXPORTER_OTLP_ENDPOINT", env):
        return ["otlp"]
    if run_dir is not None:
        return ["file"]
    return []


def _span_exporter(name: str, service: str, run_dir, pod):
    if name == "otlp":
        if otlp_protocol("traces") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter()
    if name == "file":
        return FileSpanExporter(Path(run_dir) / "traces", _file_stem(service, pod))
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    return ConsoleSpanExporter()


def _metric_exporter(name: str, service: str, run_dir, pod):
    if name == "otlp":
        if otlp_protocol("metrics") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        return OTLPMetricExporter()
    if name == "file":
        return FileMetricExporter(Path(run_dir) / "metrics", _file_stem(service, pod))
    from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

    return ConsoleMetricExporter()


def service_name(service: str) -> str:
    """``OTEL_SERVICE_NAME`` if set, else ``ceaseless-<service>``."""
    return _env("OTEL_SERVICE_NAME", os.environ) or f"{SERVICE_PREFIX}{service}"


def resource(service: str, job: str = "demo", pod: str | None = None,
             rank: int | None = None):
    from opentelemetry.sdk.resources import Resource

    a: dict[str, Any] = {
        "service.name": service_name(service),
        "service.namespace": "ceaseless",
        ATTR_SERVICE: service,
        ATTR_JOB: job,
    }
    if pod is not None:
        a[ATTR_POD] = pod
    if rank is not None:
        a[ATTR_RANK] = int(rank)
    return Resource.create(a)


def _int_env(name: str, default: int) -> int:
    try:
        return int(float(os.environ[name]))
    except (KeyError, ValueError):
        return default


def build_tracer_provider(service: str, run_dir: str | os.PathLike | None = None,
                          job: str = "demo", pod: str | None = None,
                          rank: int | None = None):
    """A configured SDK TracerProvider (not installed globally), or None when no exporter
    applies. ``init`` installs it; tests build several in one process."""
    names = exporter_names("traces", run_dir)
    if not names:
        return None
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=resource(service, job, pod, rank))  # sampler from env
    delay = _int_env("OTEL_BSP_SCHEDULE_DELAY", DEFAULT_SCHEDULE_DELAY_MS)
    exporters = [_span_exporter(name, service, run_dir, pod) for name in names]
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=delay))
    provider.ceaseless_exporters = exporters  # type: ignore[attr-defined]
    return provider


def build_meter_provider(service: str, run_dir: str | os.PathLike | None = None,
                         job: str = "demo", pod: str | None = None,
                         rank: int | None = None):
    """A configured SDK MeterProvider (not installed globally), or None."""
    names = exporter_names("metrics", run_dir)
    if not names:
        return None
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    interval = _int_env("OTEL_METRIC_EXPORT_INTERVAL", DEFAULT_METRIC_INTERVAL_MS)
    readers = [PeriodicExportingMetricReader(_metric_exporter(n, service, run_dir, pod),
                                             export_interval_millis=interval)
               for n in names]
    return MeterProvider(metric_readers=readers, resource=resource(service, job, pod, rank))


# ============================================================================ process state
_lock = threading.Lock()
_state: dict[str, Any] = {"initialised": False, "tracer_provider": None, "meter_provider": None}


def init(service: str, run_dir: str | os.PathLike | None = None, job: str = "demo",
         pod: str | None = None, rank: int | None = None) -> None:
    """Configure tracing and metrics for this process. The first call wins; later calls
    (another component in the same process) are no-ops."""
    with _lock:
        if _state["initialised"]:
            return
        _state["initialised"] = True
        tp = build_tracer_provider(service, run_dir, job, pod, rank)
        if tp is not None:
            trace.set_tracer_provider(tp)
            _state["tracer_provider"] = tp
        mp = build_meter_provider(service, run_dir, job, pod, rank)
        if mp is not None:
            otel_metrics.set_meter_provider(mp)
            _state["meter_provider"] = mp
        _state.update(service=service, run_dir=str(run_dir) if run_dir else None, job=job,
                      pod=pod, rank=rank)


def is_initialised() -> bool:
    return bool(_state["initialised"])


def trace_files() -> list[Path]:
    """The trace files this process writes (empty when not exporting to files)."""
    tp = _state.get("tracer_provider")
    return [e.file.path for e in getattr(tp, "ceaseless_exporters", ())
            if isinstance(e, FileSpanExporter)]


def tracer(name: str = "ceaseless") -> trace.Tracer:
    return trace.get_tracer(name)


def force_flush(timeout_millis: int = 5000) -> bool:
    ok = True
    for key in ("tracer_provider", "meter_provider"):
        p = _state.get(key)
        if p is not None:
            ok = bool(p.force_flush(timeout_millis)) and ok
    return ok


def shutdown() -> None:
    """Flush and stop the exporters (idempotent). Tracing stays off for this process."""
    with _lock:
        tp, mp = _state.get("tracer_provider"), _state.get("meter_provider")
        _state["tracer_provider"] = _state["meter_provider"] = None
    for p in (tp, mp):
        if p is None:
            continue
        try:
            p.force_flush(5000)
        except Exception:
            pass
        try:
            p.shutdown()
        except Exception:
            pass


@contextmanager
def span(name: str, *, context: Context | None = None, start_time: int | None = None,
         links: Sequence[Any] | None = None, **attributes: Any) -> Iterator[trace.Span]:
    """``with telemetry.span(SPAN_PLAN, context=env.ctx, generation=g, reason="fault"):``

    A current span named ``name``, child of ``context`` (e.g. the ``Envelope.ctx`` of the
    message that caused it), with ``attrs(**attributes)``. Exceptions are recorded and set the
    span's status to error."""
    with tracer().start_as_current_span(name, context=context, start_time=start_time,
                                        links=links, attributes=attrs(**attributes)) as s:
        yield s


def mark(name: str, at_s: float, **attributes: Any) -> None:
    """A zero-length root span at wall time ``at_s`` (the ledger's ``train_start`` and
    ``rollback``); never raises: a trace is an aid, not a reason to stop training."""
    try:
        ns = int(at_s * 1e9)
        s = tracer().start_span(name, context=Context(), start_time=ns,
                                attributes=attrs(**attributes))
        s.end(end_time=ns)
    except Exception:
        pass


def root_context() -> Context:
    """An empty context: pass it as ``context=`` to make a span a root (the `detect` span)."""
    return Context()


# ============================================================================ metrics
def meter(name: str = "ceaseless"):
    return otel_metrics.get_meter(name)


@dataclass(frozen=True)
class Instruments:
    """The instruments the agent (and scaler) record. Attributes: keep them low-cardinality
    (job, reason, role) - never incident ids, steps or pods' ephemeral names."""

    recovery_downtime: Any   # Histogram, s: failure detection -> first step of g+1
    lost_steps: Any          # Counter: committed steps recomputed (should be 0)
    goodput: Any             # Gauge, 1: productive training time / wall time
    steps_per_second: Any    # Gauge
    membership_size: Any     # Gauge: world size of the current generation

    def record_recovery(self, downtime_s: float, lost_steps: int = 0, **attributes: Any) -> None:
        a = attrs(**attributes)
        self.recovery_downtime.record(max(0.0, float(downtime_s)), attributes=a)
        self.lost_steps.add(max(0, int(lost_steps)), attributes=a)

    def record_goodput(self, fraction: float, **attributes: Any) -> None:
        self.goodput.set(float(fraction), attributes=attrs(**attributes))

    def record_steps_per_second(self, value: float, **attributes: Any) -> None:
        self.steps_per_second.set(float(value), attributes=attrs(**attributes))

    def record_membership(self, size: int, **attributes: Any) -> None:
        self.membership_size.set(int(size), attributes=attrs(**attributes))


_instruments: dict[int, Instruments] = {}


def instruments(m: Any = None) -> Instruments:
    """The Ceaseless instruments on ``m`` (default: the global ``meter()``), created once.
    Safe before ``init``: the API's proxy instruments forward once a provider is set."""
    m = m if m is not None else meter()
    key = id(m)
    inst = _instruments.get(key)
    if inst is None:
        inst = Instruments(
            recovery_downtime=m.create_histogram(
                METRIC_RECOVERY_DOWNTIME, unit="s",
                description="failure detection to the first completed step of the new generation",
                explicit_bucket_boundaries_advisory=list(DOWNTIME_BUCKETS_S)),
            lost_steps=m.create_counter(
                METRIC_LOST_STEPS, unit="{step}",
                description="committed steps that had to be recomputed after a recovery"),
            goodput=m.create_gauge(
                METRIC_GOODPUT, unit="1",
                description="fraction of wall time spent on steps that were committed"),
            steps_per_second=m.create_gauge(
                METRIC_STEPS_PER_SECOND, unit="{step}/s", description="training throughput"),
            membership_size=m.create_gauge(
                METRIC_MEMBERSHIP_SIZE, unit="{rank}",
                description="world size of the current generation"),
        )
        _instruments[key] = inst
    return inst
