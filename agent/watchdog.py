"""The training thread's signs of life, and the two verdicts drawn from them.

``stuck``: the gradient all-reduce has waited ``stuck_report_after``: the pod says so
(peer_error) once per wait, and from then on in every heartbeat (``waiting_since``), so the
monitor looks for a member whose heartbeats stopped (a report every heartbeat interval from
every waiting member was N messages more a second at N ranks, when a peer failed: issue 45).
``stalled``: a member whose training thread reached no step boundary, no collective and no
micro-batch for the stall timeout (and declared no ``solo``) reports itself hung,
once per stall, while its heartbeats (another thread) go on. Not thread-safe by itself: the
runtime calls it under its lock.
"""

from __future__ import annotations

import time
from typing import Any

from schemas.messages import AgentState, Heartbeat


class Watchdog:
    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.progress_at = time.monotonic()  # the last sign of progress
        self._stall_reported = False
        self._stuck_reported: float | None = None  # the wait (its start) last reported
        # a step committed in the joined generation: its first step (compilation, warm-up)
        # is never called a stall
        self._committed = False

    def progress(self) -> None:
        self.progress_at = time.monotonic()
        self._stall_reported = False

    def joined(self) -> None:
        self._committed = False
        self.progress()

    def committed(self) -> None:
        self._committed = True
        self.progress()

    def stuck(self, collective_since: float | None) -> str | None:
        """The peer_error to send: once per wait (``collective_since``, monotonic, names it)."""
        if (self.waiting_since(collective_since) is None
                or collective_since == self._stuck_reported):
            return None
        self._stuck_reported = collective_since
        waited = time.monotonic() - collective_since  # type: ignore[operator]
        return f"all-reduce waiting for {waited:.2f}s"

    def waiting_since(self, collective_since: float | None) -> float | None:
        """The heartbeat's ``waiting_since``: the wait's start in wall time, once it has
        lasted ``stuck_report_after``; None before, or not waiting."""
        after, now = self.cfg.stuck_report_after, time.monotonic()
        if collective_since is None or after <= 0 or now - collective_since < after:
            return None
        return time.time() - (now - collective_since)

    def stalled(self, hb: Heartbeat, in_collective: bool) -> tuple[str, float, float] | None:
        """(message, idle seconds, the limit) when this member is to report itself hung.
        Waiting in a collective is not a stall of this member (the monitor's absent-member
        rule finds whoever it waits for)."""
        limit = self.cfg.stall_timeout or self.cfg.collective_timeout
        if (limit <= 0 or self._stall_reported or hb.rank is None
                or hb.state != AgentState.training or in_collective or not self._committed):
            return None
        if hb.step_time:  # a job whose steps are slow is not stalled by them
            limit = max(limit, 3 * hb.step_time)
        if hb.solo_until is not None and time.time() < hb.solo_until + self.cfg.collective_timeout:
            return None  # declared work alone, as the monitor allows it
        idle = time.monotonic() - self.progress_at
        if idle < limit:
            return None
        self._stall_reported = True
        return (f"training thread made no progress for {idle:.1f}s (no step boundary, no "
                f"collective; stall timeout {limit:g}s)", idle, limit)
