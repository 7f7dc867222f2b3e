"""A host's heartbeats in one message (issue 45): the relay's batching and a pod's route
(pure), and on a real nats-server the real health monitor reading the pods of a host through
the relay the agents elect (agent/hostbeat.py): a silent pod inside a batch is declared
once, and a lost relay costs its host's other pods no fault."""

from __future__ import annotations

import asyncio
import json

import pytest

from schemas import PLAN_KEY
from schemas.messages import (MAX_HOST_PODS, AgentState, Fault, Heartbeat, HeartbeatBatch,
                              Role)
from plumbing.bus import Bus, DropError, decode
from plumbing.hostbeat import DIRECT_AFTER, TAKE_AFTER, Batcher, Carriage, Route
from agent.config import AgentConfig
from agent.hostbeat import Beats
from bench.control_plane import batch_text
from services.health_monitor import HealthMonitor
from harness import until
from test_health_monitor import make_plan

IV = 0.05  # heartbeat interval of the pods below
FT = 1.0   # the monitor's fault timeout: a relay's loss is covered in DIRECT_AFTER intervals


def hb(pod: str, step: int = 0, **kw) -> Heartbeat:
    return Heartbeat(pod=pod, role=Role.worker, generation=1, rank=0, step=step,
                     state=AgentState.training, **kw)


# ------------------------------------------------------------------------- pure
def test_batcher_keeps_the_latest_of_each_pod_and_empties():
    b = Batcher("h0", "a0")
    assert b.take() is None
    b.add(hb("a1", 1))
    b.add(hb("a0", 1))
    b.add(hb("a1", 2))
    batch = b.take()
    assert batch is not None and (batch.host, batch.relay) == ("h0", "a0")
    assert {x.pod: x.step for x in batch.beats} == {"a1": 2, "a0": 1}
    assert b.take() is None  # each heartbeat is sent once
    # what it builds is what the wire takes
    raw = batch.model_dump_json().encode()
    assert decode(HeartbeatBatch, raw, "ceaseless.test.heartbeats.h0") == batch


def test_batcher_refuses_pods_over_its_limit():
    b = Batcher("h0", "a0", limit=2)
    assert b.add(hb("a0")) and b.add(hb("a1")) and b.add(hb("a1", 3))
    assert not b.add(hb("a2")) and b.dropped == 1
    assert {x.pod for x in b.take().beats} == {"a0", "a1"}


def test_batch_schema_refuses_bad_batches():
    HeartbeatBatch(host="h0", relay="a0", beats=[hb(f"a{i}") for i in range(MAX_HOST_PODS)])
    for bad in ({"host": "h0", "relay": "a0", "beats": [hb("a1"), hb("a1", 2)]},  # twice
                {"host": "h 0", "relay": "a0", "beats": []},                      # not an id
                {"host": "h0", "relay": "a0",
                 "beats": [hb(f"a{i}") for i in range(MAX_HOST_PODS + 1)]}):
        with pytest.raises(ValueError):
            HeartbeatBatch(**bad)
    with pytest.raises(DropError, match="invalid heartbeats"):  # logged and dropped by the bus
        decode(HeartbeatBatch, json.dumps({"schema_version": 1, "host": "h0", "relay": "a0",
                                           "beats": [{"pod": "a1"}]}).encode())


def test_bench_batch_text_is_a_heartbeat_batch():
    beats = [hb("w8", 3).model_dump_json(), hb("w9", 4).model_dump_json()]
    batch = decode(HeartbeatBatch, batch_text("h1", "w8", beats, 12.5))
    assert (batch.host, batch.relay, batch.ts) == ("h1", "w8", 12.5)
    assert [(x.pod, x.step) for x in batch.beats] == [("w8", 3), ("w9", 4)]


def test_carriage_route_follows_the_batches_that_carry_the_pod():
    c = Carriage("a1", 1.0, now=0.0)
    assert c.route(0.0) is Route.direct  # nothing carried it yet
    other = HeartbeatBatch(host="h0", relay="a0", beats=[hb("a0")])
    c.on_batch(other, 0.5)
    assert c.route(0.5) is Route.direct  # a batch without it says nothing for it
    c.on_batch(HeartbeatBatch(host="h0", relay="a0", beats=[hb("a0"), hb("a1")]), 1.0)
    assert c.route(1.0 + DIRECT_AFTER) is Route.carried
    assert c.route(1.0 + DIRECT_AFTER + 0.01) is Route.direct  # its relay went quiet


def test_carriage_elects_the_lowest_named_pod_that_hears_no_lower_relay():
    c = Carriage("a1", 1.0, now=0.0)
    assert not c.relays(TAKE_AFTER)  # a lower relay is presumed at start
    assert c.relays(TAKE_AFTER + 0.01)
    c.on_batch(HeartbeatBatch(host="h0", relay="a2", beats=[]), 4.0)
    assert c.relays(4.0)  # a higher relay does not stop it (that one stops for it)
    c.on_batch(HeartbeatBatch(host="h0", relay="a0", beats=[]), 5.0)
    assert not c.relays(5.0) and not c.relays(5.0 + TAKE_AFTER)
    assert c.relays(5.0 + TAKE_AFTER + 0.01)  # a0 lost: a1 takes over


# ------------------------------------------------------------------------- real bus
class Pod:
    """One agent's heartbeats through ``agent.hostbeat.Beats`` on its own connection."""

    def __init__(self, bus: Bus, beats: Beats, rank: int) -> None:
        self.bus, self.beats, self.rank, self.step = bus, beats, rank, 0
        self.tasks = [asyncio.create_task(beats.run()), asyncio.create_task(self._beat())]

    @classmethod
    async def start(cls, url: str, creds, pod: str, rank: int) -> "Pod":
        bus = await Bus.connect(url, "test", f"agent-{pod}", creds)
        cfg = AgentConfig(nats_url=url, job="test", pod=pod, host="h0", heartbeat_interval=IV)
        return cls(bus, await Beats.start(bus, cfg), rank)

    async def _beat(self) -> None:
        while True:
            self.step += 1
            try:
                await self.beats.send(Heartbeat(pod=self.beats.pod, role=Role.worker,
                                                generation=1, rank=self.rank, step=self.step,
                                                state=AgentState.training))
            except Exception:
                pass
            await asyncio.sleep(IV)

    async def stop(self) -> None:  # as a killed process: nothing more from it
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.bus.close()


@pytest.fixture
async def host(nats_server, bus):
    """A monitor of the plan a0..a3 (all on host h0) and the four pods heartbeating."""
    names = ["a0", "a1", "a2", "a3"]
    await (await bus.kv()).put(PLAN_KEY, make_plan(names).model_dump_json().encode())
    faults: list[Fault] = []

    async def on_fault(f, _e):
        faults.append(f)
    await bus.subscribe(bus.subjects.fault, Fault, on_fault)
    mb = await Bus.connect(nats_server.url, "test", "health_monitor", nats_server.creds)
    m = HealthMonitor(mb, fault_timeout=FT, suspect_timeout=0.1, stall_timeout=5.0,
                      check_interval=0.02)
    await m.start()
    pods = {p: await Pod.start(nats_server.url, nats_server.creds, p, i)
            for i, p in enumerate(names)}
    try:
        # a0 alone relays (every pod may for a round at start) and carries every pod: none
        # sends directly any more
        await until(lambda: all(p.beats.route is Route.carried for p in pods.values())
                    and [p for p in names if pods[p].beats.relaying] == ["a0"],
                    timeout=10, what="every pod carried by a0 alone")
        yield m, pods, faults, mb
    finally:
        for p in pods.values():
            await p.stop()
        await m.stop()
        await mb.close()


async def test_silent_pod_inside_a_batch_is_declared_once(host):
    m, pods, faults, mb = host
    batches = mb.received["heartbeats"]
    await until(lambda: mb.received["heartbeats"] > batches, what="the monitor reading batches")
    await pods["a2"].stop()
    await until(lambda: faults, timeout=FT * 5, what="a fault for the silent pod")
    await asyncio.sleep(2 * FT)  # nothing more: not a second time, not its host's other pods
    assert [(f.pod, f.kind.value) for f in faults] == [("a2", "lost")]
    assert "a2" not in m.pods and {"a0", "a1", "a3"} <= set(m.pods)


async def test_lost_relay_costs_its_host_only_its_own_fault(host):
    m, pods, faults, mb = host
    direct = mb.received["heartbeat"]
    await pods["a0"].stop()  # the relay: a whole batch stops
    # its host's other pods are heard directly (before another pod relays, and well within
    # the fault timeout) ...
    await until(lambda: mb.received["heartbeat"] > direct, timeout=5, what="direct heartbeats")
    await until(lambda: faults, timeout=FT * 5, what="a fault for the lost relay")
    # a1 (the lowest left) relays and carries a1..a3 again
    await until(lambda: [p for p in ("a1", "a2", "a3") if pods[p].beats.relaying] == ["a1"]
                and all(pods[p].beats.route is Route.carried for p in ("a1", "a2", "a3")),
                timeout=10, what="a1 relaying")
    await asyncio.sleep(2 * FT)
    assert [(f.pod, f.kind.value) for f in faults] == [("a0", "lost")]
    assert {"a1", "a2", "a3"} <= set(m.pods)


async def test_bad_batches_are_logged_and_dropped(host):
    m, pods, faults, mb = host
    # a batch on another host's subject, and one that is no batch: dropped, the rest goes on
    await mb.publish(mb.subjects.heartbeats("h9"),
                     HeartbeatBatch(host="h0", relay="a0", beats=[hb("zz")]))
    await mb.nc.publish(mb.subjects.heartbeats("h0"), b'{"schema_version": 1, "host": "h0"}')
    await until(lambda: m.ignored.get("subject names another host than 'h0'")
                and sum(n for (k, _), n in mb.dropped.items() if k == "heartbeats"),
                what="both dropped")
    await asyncio.sleep(2 * FT)
    assert "zz" not in m.pods and not faults
