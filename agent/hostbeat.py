"""How a pod's heartbeats reach the health monitor (issue 45).

Without a host (``CEASELESS_HOST`` unset): each on ``heartbeat.<pod>``, as always. With one,
through the host's relay (``plumbing/hostbeat.py``): the pod sends its heartbeat on
``hostbeat.<host>.<pod>``, watches its host's batches (``heartbeats.<host>``), and also sends
it on ``heartbeat.<pod>`` while no batch carried it within two intervals (its relay lost or
not elected yet), so a lost relay makes no other pod of its host silent. The host's
lowest-named pod that hears no batch from a lower one relays: it reads ``hostbeat.<host>.*``
and publishes each interval one ``HeartbeatBatch`` with the latest heartbeat of each pod.

Everything here runs on the runtime's event loop (one thread): no lock.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from schemas.messages import Heartbeat, HeartbeatBatch
from plumbing import logs
from plumbing.bus import Bus, Envelope
from plumbing.hostbeat import Batcher, Carriage, Route

from .config import AgentConfig

log = logs.get("agent.hostbeat")


class Beats:
    """``send`` each heartbeat; ``run`` (a task of the runtime) relays while elected."""

    def __init__(self, bus: Bus, cfg: AgentConfig) -> None:
        self.bus, self.pod, self.host = bus, cfg.pod, cfg.host
        self.interval = cfg.heartbeat_interval
        self.carriage = Carriage(cfg.pod, cfg.heartbeat_interval, time.monotonic())
        self.batcher = Batcher(cfg.host or "", cfg.pod)
        self._relay_sub: Any = None  # hostbeat.<host>.* while this pod relays
        self.relayed = 0  # batches it published

    @classmethod
    async def start(cls, bus: Bus, cfg: AgentConfig) -> "Beats":
        b = cls(bus, cfg)
        if b.host is not None:
            await bus.subscribe(bus.subjects.heartbeats(b.host), HeartbeatBatch, b._on_batch)
        return b

    @property
    def relaying(self) -> bool:
        return self._relay_sub is not None

    @property
    def route(self) -> Route:
        return Route.direct if self.host is None else self.carriage.route(time.monotonic())

    async def send(self, hb: Heartbeat, final: bool = False) -> None:
        """``final``: the pod's last (done, leaving) also goes directly: a relay stopping
        with it would never send it."""
        s = self.bus.subjects
        if self.host is not None:
            await self.bus.publish(s.hostbeat(self.host, self.pod), hb)
        if self.host is None or final or self.route is Route.direct:
            await self.bus.publish(s.heartbeat(self.pod), hb)

    async def _on_batch(self, batch: HeartbeatBatch, env: Envelope) -> None:
        self.carriage.on_batch(batch, time.monotonic())

    async def _on_hostbeat(self, hb: Heartbeat, env: Envelope) -> None:
        if env.subject.rsplit(".", 1)[-1] != hb.pod:  # as the bus checks heartbeat.<pod>
            self.bus.drop(env.subject, f"subject names another pod than {hb.pod!r}")
            return
        if not self.batcher.add(hb):
            self.bus.drop(env.subject, f"more than {self.batcher.limit} pods on host {self.host}")

    async def run(self) -> None:
        if self.host is None:
            return
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self._relay_round()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # reconnecting: the next round tries again
                log.debug("relay round failed", error=str(e)[:200])

    async def _relay_round(self) -> None:
        s = self.bus.subjects
        assert self.host is not None
        if not self.carriage.relays(time.monotonic()):
            if self._relay_sub is not None:  # a lower-named pod relays: leave it to it
                sub, self._relay_sub = self._relay_sub, None
                self.batcher.take()
                log.info("host relay handed to a lower pod", host=self.host)
                await sub.unsubscribe()
            return
        if self._relay_sub is None:
            self._relay_sub = await self.bus.subscribe(s.hostbeat(self.host, "*"), Heartbeat,
                                                       self._on_hostbeat)
            log.info("relaying the host's heartbeats", host=self.host)
            return  # the first batch after an interval of heartbeats
        batch = self.batcher.take()
        if batch is not None:
            await self.bus.publish(s.heartbeats(self.host), batch)
            self.relayed += 1
