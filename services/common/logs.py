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


def configure(service: str, level: str = "info", stream: IO[str] | None = None,
              json: bool = True) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get(name: str | None = None):
    return structlog.get_logger(name)
