"""OpenTelemetry setup (placeholder API; the tracing issue fleshes it out).

init(service, run_dir, job): configure a TracerProvider. With OTEL_EXPORTER_OTLP_ENDPOINT
set, export OTLP; otherwise write OTLP-JSON lines to <run_dir>/traces/<service>-<pid>.jsonl.
"""

from __future__ import annotations

from opentelemetry import trace


def init(service: str, run_dir: str | None = None, job: str = "demo") -> None:
    return None


def tracer(name: str = "ceaseless") -> trace.Tracer:
    return trace.get_tracer(name)


def shutdown() -> None:
    provider = trace.get_tracer_provider()
    fn = getattr(provider, "shutdown", None)
    if fn:
        fn()
