"""Health monitor: heartbeats, lifecycle events and agent reports -> one fault per incident."""

from .monitor import HealthMonitor

__all__ = ["HealthMonitor"]
