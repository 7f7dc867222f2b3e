"""A host's heartbeats in one message (issue 45, ``schemas.messages.HeartbeatBatch``).

One Python process reads at most ~50,000 messages a second (nats-py's parse, message object
and dispatch are most of a heartbeat's ~20 µs); 16,384 pods heartbeating 4 times a second
send 65,536. So the pods of a host (8 GPUs a node) send their heartbeats to one of them, the
host's relay, which publishes each interval one ``HeartbeatBatch`` with the latest heartbeat
of each pod it heard since the last: 8 times fewer messages for the health monitor.

The pure parts, used by the agent (``agent/hostbeat.py``) and the benchmark:

* ``Batcher``: the relay's table (latest heartbeat per pod) and the batch it takes;
* ``Carriage``: one pod's view of its host's batches, a state machine: CARRIED (a batch of
  its host carried one of its heartbeats within ``DIRECT_AFTER`` intervals) or DIRECT (it
  also sends its heartbeat on ``heartbeat.<pod>``, as a pod without a host does). A lost relay
  therefore costs its host's other pods no fault: they are heard directly within
  ``DIRECT_AFTER`` intervals (well inside the fault timeout) while the relay's own silence is
  declared, once, as any pod's. Whether the pod relays: while no batch from a relay with a
  lower name arrived within ``TAKE_AFTER`` intervals (the lowest-named live pod relays; two
  relays at once, briefly, only repeat heartbeats, which the monitor takes as any).
"""

from __future__ import annotations

from enum import Enum

from schemas.messages import MAX_HOST_PODS, Heartbeat, HeartbeatBatch

DIRECT_AFTER = 2.0  # intervals without being carried: send directly as well
TAKE_AFTER = 3.0    # intervals without a batch from a lower-named relay: relay


class Batcher:
    """The relay's side: ``add`` each heartbeat its pods send, ``take`` one batch an interval."""

    def __init__(self, host: str, relay: str, limit: int = MAX_HOST_PODS) -> None:
        self.host, self.relay, self.limit = host, relay, limit
        self._latest: dict[str, Heartbeat] = {}
        self.dropped = 0  # heartbeats refused: a pod over ``limit``

    def add(self, hb: Heartbeat) -> bool:
        """Keep ``hb`` as its pod's latest (False: refused, more than ``limit`` pods)."""
        if hb.pod not in self._latest and len(self._latest) >= self.limit:
            self.dropped += 1
            return False
        self._latest[hb.pod] = hb
        return True

    def take(self) -> HeartbeatBatch | None:
        """The batch of what arrived since the last take (None: nothing did)."""
        if not self._latest:
            return None
        beats, self._latest = list(self._latest.values()), {}
        return HeartbeatBatch(host=self.host, relay=self.relay, beats=beats)


class Route(str, Enum):
    carried = "carried"  # its host's relay carries its heartbeats
    direct = "direct"    # it sends them on heartbeat.<pod> as well


class Carriage:
    """One pod's view of its host's batches (monotonic times; ``interval``: the heartbeat
    interval). Starts DIRECT: nothing carried it yet."""

    def __init__(self, pod: str, interval: float, now: float) -> None:
        self.pod, self.interval = pod, interval
        self.carried_at: float | None = None
        self.lower_relay_at = now  # a lower relay is presumed for TAKE_AFTER at start
        self.relays_seen: set[str] = set()

    def on_batch(self, batch: HeartbeatBatch, now: float) -> None:
        if batch.relay < self.pod:
            self.lower_relay_at = now
        if any(hb.pod == self.pod for hb in batch.beats):
            self.carried_at = now

    def route(self, now: float) -> Route:
        if self.carried_at is not None and now - self.carried_at <= DIRECT_AFTER * self.interval:
            return Route.carried
        return Route.direct

    def relays(self, now: float) -> bool:
        """Should this pod relay its host's heartbeats now?"""
        return now - self.lower_relay_at > TAKE_AFTER * self.interval
