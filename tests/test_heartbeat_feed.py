"""Heartbeat fan-in (services/common/heartbeats.py) against a real nats-server and a real
health monitor: the scaler's and the broker's heartbeats come from the monitor's view while
it runs, from the heartbeats themselves while it does not, each heartbeat once."""

from __future__ import annotations

import asyncio

import structlog

from schemas.messages import AgentState, Heartbeat, Role
from plumbing.bus import Bus
from services.common.heartbeats import HeartbeatFeed
from services.health_monitor import HealthMonitor
from harness import until

log = structlog.get_logger("test")


class Beater:
    def __init__(self, bus: Bus, pod: str, interval: float = 0.05) -> None:
        self.bus, self.pod, self.interval = bus, pod, interval
        self.generation, self.step, self.sent = 0, -1, 0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.bus.publish(self.bus.subjects.heartbeat(self.pod), Heartbeat(
                pod=self.pod, role=Role.worker, generation=self.generation, step=self.step,
                state=AgentState.training if self.generation else AgentState.waiting))
            self.sent += 1
            await asyncio.sleep(self.interval)


async def test_feed_follows_the_monitor_and_falls_back(nats_server, bus):
    url, creds = nats_server.url, nats_server.creds
    got: list[tuple[Heartbeat, str, float]] = []

    async def on_hb(hb: Heartbeat, subject: str, age: float) -> None:
        got.append((hb, subject, age))

    beats: list[tuple[str, int, int, str, float]] = []

    def on_beats(pods, gens, steps, digests, ages) -> None:
        beats.extend(zip(pods, gens, steps, digests, ages))

    feed_bus = await Bus.connect(url, "test", "consumer", creds)
    mon_bus = await Bus.connect(url, "test", "health_monitor", creds)
    feed = HeartbeatFeed(feed_bus, log, on_hb, on_beats)
    beaters = [Beater(bus, p) for p in ("w0", "w1")]
    mon = HealthMonitor(mon_bus, fault_timeout=1.5, view_interval=0.2)
    try:
        await feed.start()
        assert feed.source == "direct"  # no monitor yet: the heartbeats themselves
        await until(lambda: {h.pod for h, _, _ in got} == {"w0", "w1"}, what="direct heartbeats")
        assert {s for _, s, _ in got} == {bus.subjects.heartbeat("w0"), bus.subjects.heartbeat("w1")}

        await mon.start()
        await until(lambda: feed.source == "monitor view", what="switch to the view")
        n = len(got)
        # compact listings every interval, the full heartbeats again every few intervals
        await until(lambda: {p for p, *_ in beats} == {"w0", "w1"}, what="compact listing")
        await until(lambda: {h.pod for h, _, _ in got[n + 2:]} == {"w0", "w1"},
                    what="a complete listing")
        from_view = got[n + 2:]
        assert {s for _, s, _ in from_view} == {bus.subjects.health}
        assert all(age >= 0 for _, _, age in from_view)
        assert all(g == 0 and step == -1 and age >= 0 for _, g, step, _, age in beats)
        # each heartbeat once, in order per pod, though a view repeats the last one
        for pod in ("w0", "w1"):
            ts = [h.ts for h, _, _ in got if h.pod == pod]
            assert ts == sorted(ts) and len(ts) == len(set(ts)), pod

        # the monitor goes away: the feed reads heartbeats again, without a gap in pods
        await mon.stop()
        await until(lambda: feed.source == "direct", timeout=5, what="fall back to direct")
        n = len(got)
        await until(lambda: {h.pod for h, s, _ in got[n:] if s != bus.subjects.health}
                    == {"w0", "w1"}, what="direct heartbeats again")

        # a monitor (re)starts, with full views only every 30 s: its first full view turns
        # the feed back, and a generation change still goes out at once
        mon = mon2 = HealthMonitor(mon_bus, fault_timeout=1.5, view_interval=30.0)
        await mon2.start()
        await until(lambda: feed.source == "monitor view", what="back on the view")
        beaters[0].generation, beaters[0].step = 1, 4
        await until(lambda: any(h.pod == "w0" and h.generation == 1 for h, s, _ in got
                                if s == bus.subjects.health), timeout=10, what="urgent view")
        assert mon2.view.published >= 2 and feed.switches >= 3
    finally:
        for b in beaters:
            b.task.cancel()
        await feed.stop()
        await mon.stop()
        await feed_bus.close()
        await mon_bus.close()


async def test_view_leaves_out_pods_the_monitor_stopped_watching(nats_server, bus):
    """A pod declared faulted is not in the view any more, so the consumers do not go on
    seeing it alive through the monitor."""
    from schemas.messages import HealthView

    url, creds = nats_server.url, nats_server.creds
    mon_bus = await Bus.connect(url, "test", "health_monitor", creds)
    mon = HealthMonitor(mon_bus, fault_timeout=0.5, suspect_timeout=0.3, stall_timeout=5.0,
                        view_interval=0.1)
    listed: list[list[str]] = []

    async def on_view(v: HealthView, _env) -> None:
        if v.live:
            listed.append(sorted(v.live))
    await bus.subscribe(bus.subjects.health, HealthView, on_view)
    beaters = {p: Beater(bus, p) for p in ("w0", "w1")}
    try:
        await mon.start()
        await until(lambda: listed and listed[-1] == ["w0", "w1"], what="both in the view")
        beaters["w1"].task.cancel()
        await until(lambda: any(f["pod"] == "w1" for f in mon.faults), what="w1 lost")
        n = len(listed)
        await until(lambda: len(listed) > n + 1, what="two more compact listings")
        assert listed[-1] == ["w0"], listed[n:]
    finally:
        for b in beaters.values():
            b.task.cancel()
        await mon.stop()
        await mon_bus.close()
