"""structlog setup: JSON lines to stderr (or a file), with the current trace/span ids."""

from __future__ import annotations

import logging
import sys
from typing import IO

import structlog


def _add_trace_ids(_logger, _name, event: dict) -> dict:
    try:
        from opentelemetry import trace

        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            event.setdefault("trace_id", format(ctx.trace_id, "032x"))
            event.setdefault("span_id", format(ctx.span_id, "016x"))
    except Exception:  # logging must never fail because tracing is unavailable
        pass
    return event


class _Stderr:
    """Whatever ``sys.stderr`` is when a line is written (pytest's capture replaces it)."""

    def write(self, s: str) -> int:
        return sys.stderr.write(s)

    def flush(self) -> None:
        sys.stderr.flush()


STDERR = _Stderr()


def configure(service: str | None, level: str = "info", stream: IO[str] | None = None,
              json: bool = True) -> None:
    """Logs go to ``stream`` (default: stderr, never stdout: a command's stdout is its
    output, e.g. ``ceaseless status --json``); ``service`` is bound to every line (None:
    not bound, the CLI's own console lines)."""
    lvl = getattr(logging, level.upper(), logging.INFO)
    tty = (stream or sys.stderr).isatty() if hasattr(stream or sys.stderr, "isatty") else False
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=tty))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            (structlog.processors.TimeStamper(fmt="iso", utc=True) if json
             else structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False)),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(stream or STDERR),
        cache_logger_on_first_use=False,
    )
    if service is not None:
        structlog.contextvars.bind_contextvars(service=service)


def get(name: str | None = None):
    return structlog.get_logger(name)
