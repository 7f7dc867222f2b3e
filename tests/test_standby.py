"""Services with standbys (issue 42) on a real nats-server: the lease (one holder, a term
that only rises, a standby that takes over when the holder's lease runs out), two health
monitors of which one declares, a scaler and an agent runtime that ignore a deposed
instance's older term, and a scaler that reads back the faults no plan handled yet."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest

from agent.config import AgentConfig
from agent.runtime import Runtime
from plumbing import logs
from plumbing.bus import Bus, Envelope
from plumbing.terms import NewestTerm
from schemas import PLAN_KEY
from schemas.messages import (ActuatorAction, ActuatorCommand, ActuatorReply, Fault, JobFailed,
                              FaultKind, Plan, Report, ReportKind, StateLost,
                              Transfer)
from services.common.lease import TICKS_PER_TTL, Lease, LeaseState, parse_lease, ttl_for
from services.health_monitor import HealthMonitor
from services.scaler.scaler import Scaler
from harness import until
from test_health_monitor import Beater, make_plan

# Not smaller: a 0.3 s fault timeout declared healthy pods when the test's event loop stalled
# under the full suite's load (two cluster tests' pods beside it on 2 cores).
FT = 0.8
TTL = 0.8
log = logs.get("test")


async def crash(svc) -> None:
    """As SIGKILL does to its lease: renewals stop, nothing is given back (the KV still
    names it until the lease expires). The loop is told to stop too and awaited: nats-py's
    request can swallow a cancel that lands as its reply does (Lease.stop), and a renewal
    in flight then took the lease back and renewed it for ever (a CI run: "the standby
    takes over" timed out)."""
    svc.lease._stopping = True
    svc.lease._task.cancel()
    await asyncio.wait({svc.lease._task}, timeout=10)
    svc.lease.state = LeaseState.STANDBY


async def test_a_lease_has_one_holder_and_a_term_that_only_rises(bus):
    a = Lease(bus, "health_monitor", "a", TTL, log)
    b = Lease(bus, "health_monitor", "b", TTL, log)
    a._kv = b._kv = await bus.kv()
    await a.tick()
    await b.tick()
    assert a.acting and not b.acting and a.term == 1 and b.holder == "a"
    await a.tick()  # a renewal keeps the term
    assert a.term == 1
    # a dies without giving the lease back: b takes it once it ran out, with a higher term
    await until(lambda: time.time() > a.expires, what="the lease to run out")
    assert not a.acting  # its own clock stops it before anybody else can take over
    await b.tick()
    assert b.acting and b.term == 2
    await a.tick()  # a comes back: a standby, it sees b's term
    assert a.state is LeaseState.STANDBY and a.term == 2 and not a.acting
    await b.release()  # a clean stop: the next taker needs no expiry, and its term is higher
    await a.tick()
    assert a.acting and a.term == 3
    stored = parse_lease((await (await bus.kv()).get("health_monitor_lease")).value)
    assert (stored.holder, stored.term) == ("a", 3)


async def test_a_standbys_check_gives_up_within_a_tick_and_the_holders_renewal_does_not(
        nats_server, bus):
    """A bucket whose stream leader's host was lost answers nothing until its Raft group
    elects another (~5 s): a check sent meanwhile is never answered. With nats-py's 5 s
    request timeout a standby's check came back 5 s later and the lease was taken 12 s after
    the host loss (docs/cluster.md "Losing a host"); a standby now gives up within a tick
    and tries again at once. The holder keeps the long timeout: a slow answer under load
    must not depose it. (A paused nats-server stands in for the leaderless bucket.)"""
    import os
    import signal

    a = Lease(bus, "scaler", "a", 6.0, log)   # ticks every 2 s; a standby's check: 2 s
    b = Lease(bus, "scaler", "b", 6.0, log)
    await a.start()
    await b.start()
    try:
        assert a.acting and b.state is LeaseState.STANDBY
        os.kill(nats_server.proc.pid, signal.SIGSTOP)
        try:
            # with 5 s timeouts no check could have failed yet; b's failed within a tick
            await until(lambda: b.outage, timeout=4.5, what="the standby's check to give up")
        finally:
            os.kill(nats_server.proc.pid, signal.SIGCONT)
        await asyncio.sleep(0.5)
        assert a.acting and a.term == 1 and not a.outage  # the holder was not deposed
    finally:
        await b.stop()
        await a.stop()


def test_a_lease_value_that_does_not_parse_counts_as_expired():
    assert parse_lease(b"{not json") == parse_lease(None) == parse_lease(b"[]")
    assert parse_lease(b'{"holder": "x", "expires": 5}').term == 0  # before terms
    assert parse_lease(b'{"holder": "x", "expires": 5, "term": -3}').term == 0


def test_the_standby_ttl_fits_the_fault_timeout():
    """Expiry (at most a TTL after the last renewal) plus one standby tick."""
    for ft in (0.5, 1.5, 10.0):
        ttl = ttl_for(ft)
        assert ttl + ttl / TICKS_PER_TTL == pytest.approx(ft)


def test_newest_term():
    t = NewestTerm("scaler")
    assert not t.stale(None) and not t.stale(2) and not t.stale(2) and t.stale(1)
    assert not t.stale(None) and not t.stale(3) and t.stale(2) and t.ignored == 2


@pytest.fixture
async def monitors(nats_server, bus):
    made: list = []
    faults: list[Fault] = []

    async def on_fault(f, _e):
        faults.append(f)
    await bus.subscribe(bus.subjects.fault, Fault, on_fault)
    await (await bus.kv()).put(PLAN_KEY, make_plan(["w0", "w1", "w2"]).model_dump_json()
                               .encode())

    async def start(instance: str) -> HealthMonitor:
        b = await Bus.connect(nats_server.url, "test", "health_monitor", nats_server.creds)
        m = HealthMonitor(b, fault_timeout=FT, suspect_timeout=0.1, stall_timeout=5.0,
                          check_interval=0.02, instance_id=instance, lease_ttl=TTL)
        await m.start()
        made.append((m, b))
        return m

    start.faults = faults
    try:
        yield start
    finally:
        for m, b in reversed(made):
            await m.stop()
            await b.close()


async def test_two_monitors_one_declares_and_the_standby_takes_over(monitors, bus):
    a, b = await monitors("mon-a"), await monitors("mon-b")
    beaters = [Beater(bus, p, rank=i) for i, p in enumerate(["w0", "w1", "w2"])]
    try:
        await until(lambda: all(len(m.pods) == 3 for m in (a, b)), what="both watch")
        assert [a.acting, b.acting].count(True) == 1
        active, standby = (a, b) if a.acting else (b, a)
        beaters[1].alive = False
        await until(lambda: monitors.faults, what="the fault of w1")
        await asyncio.sleep(3 * FT)  # (the standby, had it declared, would have by now)
        assert [(f.pod, f.term) for f in monitors.faults] == [("w1", active.lease.term)]
        assert "w1" not in standby.faulted  # a standby declares nothing
        await crash(active)
        await until(lambda: standby.acting, timeout=10, what="the standby takes over")
        assert standby.lease.term > active.lease.term
        beaters[2].alive = False
        await until(lambda: any(f.pod == "w2" for f in monitors.faults), what="w2's fault")
        f2 = [f for f in monitors.faults if f.pod == "w2"]
        assert len(f2) == 1 and f2[0].term == standby.lease.term
    finally:
        for bt in beaters:
            await bt.stop()


async def test_the_scaler_ignores_a_deposed_monitors_fault_and_replays_unplanned_ones(
        nats_server, bus):
    """A fault of an older monitor term than one already seen is ignored; a scaler taking
    the lease reads back the faults declared since the current plan (the previous holder
    knew them, the new one never heard them)."""
    plan = make_plan(["w0", "w1", "w2"], spares=["s0"])
    await (await bus.kv()).put(PLAN_KEY, plan.model_dump_json().encode())
    now = time.time()

    def fault(pod, term):
        return Fault(incident=f"inc-{pod}-g1", pod=pod, kind=FaultKind.lost, detected_at=now,
                     last_seen=now, generation=1, term=term)
    await bus.publish(bus.subjects.fault, fault("w1", 2), msg_id="inc-w1-g1")
    b = await Bus.connect(nats_server.url, "test", "scaler", nats_server.creds)
    sc = Scaler(b, workers=3, fault_timeout=FT, lease_ttl=TTL, tick_interval=0.02,
                scaler_id="sc", start_timeout=60.0)
    async def no_decisions(kicked=True):  # what it knows is looked at; no plan is made
        return None
    sc._decide = no_decisions
    try:
        await sc.start()
        # w1's fault was published before this scaler existed: read back from the stream
        await until(lambda: "w1" in sc.pending, what="the replayed fault")
        assert sc.replayed == 1
        env = Envelope(subject=bus.subjects.fault, headers={}, raw=None)
        await sc._on_fault(fault("w2", 1), env)  # a deposed monitor's (term 1 < 2)
        assert "w2" not in sc.pending and sc.monitor_term.ignored == 1
        await sc._on_fault(fault("w0", 3), env)
        assert "w0" in sc.pending
    finally:
        await sc.stop()
        await b.close()


async def test_a_new_scaler_rebuilds_dead_pods_dropped_spares_and_the_jobs_failure(
        nats_server, bus):
    """What the previous scaler knew from faults older than the current plan, read back
    from the job stream when the lease is taken: a spare dropped from the pool is never
    promoted (it may heartbeat on until killed), a spare whose fault raced the plan that
    promoted it is faulted (the monitor declares a pod once: the job would wait for it for
    ever), and a script's failure stops all plans."""
    from schemas.messages import AgentState, JobFailed, JobFailedKind, Role

    now = time.time()

    def spare_fault(pod):
        return Fault(incident=f"inc-{pod}-g1", pod=pod, kind=FaultKind.lost, detected_at=now,
                     last_seen=now, generation=1, role=Role.spare, term=1)
    for pod in ("s0", "s1"):
        await bus.publish(bus.subjects.fault, spare_fault(pod), msg_id=f"inc-{pod}-g1")
    await bus.publish(bus.subjects.job_failed, JobFailed(
        kind=JobFailedKind.script_error, step=3, generation=1, pods=["w1", "w2"], error="boom",
        hint="a bug", term=1))
    # generation 2 promoted s0 in place of w1 (its writer had not heard s0's fault yet)
    plan = make_plan(["w0", "s0"], generation=2, fenced=["w1"])
    await (await bus.kv()).put(PLAN_KEY, plan.model_dump_json().encode())
    s1 = Beater(bus, "s1", role=Role.spare, generation=2, state=AgentState.waiting,
                advance=False)
    b = await Bus.connect(nats_server.url, "test", "scaler", nats_server.creds)
    sc = Scaler(b, workers=2, fault_timeout=FT, lease_ttl=TTL, tick_interval=0.02,
                scaler_id="sc", start_timeout=60.0)

    async def no_decisions(kicked=True):  # what it knows is looked at; no plan is made
        return None
    sc._decide = no_decisions
    try:
        await sc.start()
        await until(lambda: not sc._replaying and sc.holder, what="the read-back")
        assert {"s0", "s1"} <= set(sc.dead) and {"s0", "s1"} <= set(sc.dropped)
        assert sc.job_failed is not None and sc.job_failed.step == 3
        await asyncio.sleep(3 * s1.interval)  # s1 heartbeats on: still no spare
        assert sc.alive_spares(sc.plans.plan) == []
        sc._dead_members(sc.plans.plan, time.monotonic())
        assert "s0" in sc.pending and "w0" not in sc.pending
    finally:
        await s1.stop()
        await sc.stop()
        await b.close()


def test_what_a_new_scaler_makes_of_the_streams_faults():
    """replay.classify (pure): recent faults are replayed; of older ones a non-member's
    drops the pod, a fenced member's marks it dead, a member's the scaler of that time
    judged stale stays ignored, and neither a straggler nor a later generation's (another
    run's, on a kept bus) counts."""
    from schemas.messages import Role
    from services.scaler.replay import classify

    plan = make_plan(["w0", "w1", "s0"], generation=3, fenced=["w2"])

    def fault(pod, gen, *, rank=None, kind=FaultKind.lost, at=plan.ts - 60):
        return (Fault(incident=f"inc-{pod}-g{gen}", pod=pod, kind=kind, detected_at=at,
                      last_seen=at, generation=gen, rank=rank,
                      role=Role.worker if rank is not None else Role.spare), None)
    got = classify(plan, [fault("s0", 2), fault("s1", 1), fault("w2", 2, rank=2),
                          fault("w1", 2, rank=1), fault("w0", 2, rank=0,
                                                        kind=FaultKind.straggler),
                          fault("s7", 9), fault("w0", 3, rank=0, at=plan.ts + 1)])
    assert got.dropped == ["s0", "s1"] and got.dead == ["w2"]
    assert [f.pod for f, _ in got.unplanned] == ["w0"]


async def test_a_new_monitor_does_not_declare_a_pod_again(monitors, bus):
    """The standby never noted the pods the active one declared; taking over, it reads them
    back from the job stream: a pod is declared once."""
    a, b = await monitors("mon-a"), await monitors("mon-b")
    beaters = [Beater(bus, p, rank=i) for i, p in enumerate(["w0", "w1", "w2"])]
    try:
        await until(lambda: all(len(m.pods) == 3 for m in (a, b)), what="both watch")
        active, standby = (a, b) if a.acting else (b, a)
        beaters[1].alive = False
        await until(lambda: monitors.faults, what="the fault of w1")
        await crash(active)
        read = getattr(standby, "_inherited", None)  # (None: a monitor that reads nothing)
        await until(lambda: standby.acting and (read is None or read.is_set()), timeout=10,
                    what="the standby takes over")
        assert "w1" in standby.faulted
        await asyncio.sleep(3 * FT)  # (it would have declared w1 again by now)
        assert [f.pod for f in monitors.faults] == ["w1"]
    finally:
        for bt in beaters:
            await bt.stop()


async def test_a_standby_declares_the_exit_it_heard_when_it_takes_over(monitors, bus):
    """A host loss takes the active monitor and a member at once: the member's exit (which
    `up` publishes: it sees its children die) reaches only the standby, which declared
    nothing as one and then found the member by its silence, a fault timeout after taking
    the lease. It keeps the exit and declares it on taking over: a crash, once."""
    from schemas.messages import Lifecycle

    a, b = await monitors("mon-a"), await monitors("mon-b")
    beaters = [Beater(bus, p, rank=i) for i, p in enumerate(["w0", "w1", "w2"])]
    try:
        await until(lambda: all(len(m.pods) == 3 for m in (a, b)), what="both watch")
        active, standby = (a, b) if a.acting else (b, a)
        await crash(active)
        beaters[2].alive = False
        await bus.publish(bus.subjects.lifecycle("w2"), Lifecycle(
            pod="w2", event="exited", exit_code=-9, ts=time.time()))
        await bus.round_trip(5.0)
        assert not standby.acting  # (it takes the lease only when the old one runs out)
        await until(lambda: any(f.pod == "w2" for f in monitors.faults), timeout=10,
                    what="w2's fault")
        await asyncio.sleep(3 * FT)  # (a second declaration would have come by now)
        f2 = [f for f in monitors.faults if f.pod == "w2"]
        assert [(f.kind, f.term) for f in f2] == [(FaultKind.crash, standby.lease.term)], f2
        assert "code -9" in f2[0].reason
    finally:
        for bt in beaters:
            await bt.stop()


@contextlib.asynccontextmanager
async def two_scalers(nats_server):
    """Scalers "one" and "two", started in that order (one acts), stopped after."""
    made = []
    try:
        for name in ("one", "two"):
            b = await Bus.connect(nats_server.url, "test", "scaler", nats_server.creds)
            made.append((Scaler(b, workers=2, fault_timeout=FT, lease_ttl=TTL,
                                scaler_id=name), b))
        for s, _b in made:
            await s.start()
        yield made[0][0], made[1][0]
    finally:
        for s, b in made:
            await s.stop()
            await b.close()


async def test_two_scalers_one_acts_and_plans_carry_the_term(nats_server, bus):
    async with two_scalers(nats_server) as (s1, s2):
        assert s1.acting and not s2.acting
        assert s1.status()["lease"]["state"] == "active"
        assert s2.status()["lease"]["state"] == "standby"
        await crash(s1)
        await until(lambda: s2.acting, timeout=10, what="the standby scaler takes over")
        assert s2.term == s1.lease.term + 1 and s1.term is None
        # its actuator commands carry its term; the deposed one sends none
        got: list = []

        async def actuator(cmd, env):
            got.append(cmd)
            await bus.nc.publish(env.raw.reply, ActuatorReply(ok=True, pods=["s9"])
                                 .model_dump_json().encode())
        await bus.subscribe(bus.subjects.actuator, ActuatorCommand, actuator)
        start = ActuatorCommand(action=ActuatorAction.start)
        assert await s2._actuate(start) == (["s9"], "")
        assert await s1._actuate(start) == ([], "not the lease holder")
        assert [c.term for c in got] == [s2.term]


async def test_a_scaler_that_missed_plans_reads_the_plan_before_it_replays(nats_server, bus):
    """As the monitor above: a scaler cut off while a plan was made replays the faults
    since the plan it holds; taking the lease, it reads the current plan first (else it
    replays a fault that plan already handled, against the plan before it)."""
    await (await bus.kv()).put(PLAN_KEY, make_plan(["w0", "w1"]).model_dump_json().encode())
    async with two_scalers(nats_server) as (s1, s2):
        assert s1.acting and not s2.acting and s2.plans.generation == 1
        s2.plans._task.cancel()  # cut off: no poll, no plan message
        await s2.plans._sub.unsubscribe()
        s2.plans._sub = None
        await (await bus.kv()).put(PLAN_KEY, make_plan(["s0", "w1"], generation=2,
                                                       fenced=["w0"]).model_dump_json().encode())
        await crash(s1)
        await until(lambda: s2.acting and not s2._replaying, timeout=10,
                    what="the standby scaler takes over")
        assert s2.plans.generation == 2


async def test_the_agent_runtime_takes_the_newest_brokers_transfer(nats_server):
    rt = Runtime(AgentConfig(nats_url=nats_server.url, job="test", pod="w0",
                             creds_path=str(nats_server.creds_path)))
    env = Envelope(subject="t", headers={}, raw=None)

    def transfer(term, restore_step):
        return Transfer(generation=2, restore_step=restore_step, sources={1: [0]}, term=term)
    await rt._on_transfer(transfer(3, 10), env)
    await rt._on_transfer(transfer(2, 99), env)  # a deposed broker's: ignored
    assert rt.wait_transfer(2, 0.1).transfer.restore_step == 10
    await rt._on_transfer(transfer(4, 11), env)  # a newer broker's replaces it
    assert rt.wait_transfer(2, 0.1).transfer.restore_step == 11
    await rt._on_lost(StateLost(generation=3, reason="x", term=1), env)
    assert rt.wait_transfer(3, 0.05) is None
    await rt._on_transfer(transfer(None, 12), env)  # an older broker's (no term): taken
    assert rt.wait_transfer(2, 0.1).transfer.restore_step == 12
    # a verdict carries the plan it was decided for: one for another plan of the agent's
    # generation (a stale broker instance's, an earlier run's) is ignored, whatever its term
    rt._plan = make_plan(["w0", "w1"], generation=2)
    other = transfer(9, 13).model_copy(update={"plan_ts": rt._plan.ts - 5})
    await rt._on_transfer(other, env)
    await rt._on_lost(StateLost(generation=2, reason="x", term=9, plan_ts=other.plan_ts), env)
    got = rt.wait_transfer(2, 0.1)
    assert got.kind == "transfer" and got.transfer.restore_step == 12
    mine = transfer(5, 14).model_copy(update={"plan_ts": rt._plan.ts})
    await rt._on_transfer(mine, env)  # (the term 9 above was not noted as the newest)
    assert rt.wait_transfer(2, 0.1).transfer.restore_step == 14


def test_up_names_each_instance_and_keeps_the_first_as_before():
    from ops.cluster import ServiceSupervisor

    assert ServiceSupervisor.instances(0) == [
        ("health_monitor", "health_monitor"), ("scaler", "scaler"),
        ("state_broker", "state_broker")]
    assert ("scaler", "scaler-s2") in ServiceSupervisor.instances(2)
    assert len(ServiceSupervisor.instances(2)) == 9


async def test_status_says_which_instance_is_active(bus):
    from ops.cli import _leases, _render_status

    lease = Lease(bus, "scaler", "scaler-s1", TTL, log)
    await lease.start()
    try:
        leases = await _leases(bus)
    finally:
        await lease.stop()
    assert leases["scaler"]["active"] == "scaler-s1" and leases["scaler"]["term"] == 1
    assert leases["health_monitor"] is None  # none ran: no lease
    st = {"job": "test", "services": {"scaler": {"uptime_s": 1, "dropped": {}},
                                      "health_monitor": {"uptime_s": 1, "dropped": {}}},
          "leases": leases}
    text = _render_status(st)
    assert "service scaler: up 1s, dropped 0; active: scaler-s1 (term 1)" in text
    assert "service health_monitor: up 1s, dropped 0; no active instance" in text
    assert "actuator" not in leases and "actuator" not in text  # no Ray driver: no lease
    driver = Lease(bus, "actuator", "actuator-n2", TTL, log)  # `up --actuator ray --bus`
    await driver.start()
    try:
        leases = await _leases(bus)
    finally:
        await driver.stop()
    assert leases["actuator"]["active"] == "actuator-n2"
    assert "actuator: active: actuator-n2 (term 1)" in _render_status({**st, "leases": leases})


async def test_two_brokers_one_publishes_and_the_standby_publishes_what_it_decided(
        nats_server, bus):
    """The standby broker decides each generation too but publishes nothing; taking over
    it publishes the current generation's transfer (with its higher term) unless the stream
    holds it."""
    from schemas.messages import AgentState, Heartbeat, Role
    from services.state_broker import StateBroker

    out: list = []

    async def on_out(m, _e):
        out.append(m)
    await bus.subscribe(bus.subjects.transfer, Transfer, on_out)
    made = []
    for name in ("br-a", "br-b"):
        b = await Bus.connect(nats_server.url, "test", "state_broker", nats_server.creds)
        br = StateBroker(b, instance_id=name, lease_ttl=TTL)
        await br.start()
        made.append((br, b))
    (a, _), (b_, _) = made
    try:
        assert [a.acting, b_.acting] == [True, False]

        async def generation(g):
            plan = make_plan(["w0", "w1"]).model_copy(update={"generation": g})
            await (await bus.kv()).put(PLAN_KEY, plan.model_dump_json().encode())
            await bus.publish(bus.subjects.plan, plan)
            for i, pod in enumerate(("w0", "w1")):
                await bus.publish(bus.subjects.heartbeat(pod), Heartbeat(
                    pod=pod, role=Role.worker, generation=g, step=5, digest="aa", rank=i,
                    state=AgentState.recovering))
        await generation(1)
        await until(lambda: out, what="the generation-1 transfer")
        await until(lambda: b_.handled_generation == 1, what="the standby decided it too")
        assert [(t.generation, t.term) for t in out] == [(1, a.lease.term)]
        await crash(a)
        await generation(2)  # while nobody acts: the standby decides, holds it back
        await until(lambda: any(t.generation == 2 for t in out), timeout=10,
                    what="the new broker's transfer of generation 2")
        assert [(t.generation, t.term) for t in out] == [(1, 1), (2, 2)]
        stored = (await (await bus.kv()).get(PLAN_KEY)).value
        assert out[-1].plan_ts == Plan.model_validate_json(stored).ts  # the plan's identity
        assert b_.acting and b_.lease.term == 2
    finally:
        for br, b in made:
            await br.stop()
            await b.close()


async def test_read_back_without_a_meta_leader_gets_the_messages_one_by_one(bus, monkeypatch):
    """What a new lease holder reads back (services/common/history.py): every fault of the
    subject, oldest first, bounded to the newest; the last only; a malformed one dropped.
    Through a consumer, which JetStream's meta leader creates; after a host loss that took
    the meta leader a consumer waited 4-9 s for its election, and the monitor's declaration
    and the scaler's plan with it: a consumer not created within a second gives way to
    message gets, which the stream's leader answers (the same messages). (A consumer that
    is never created stands in for the missing meta leader.)"""
    import nats.js.client

    from services.common import history
    from services.common.history import read_back

    s = bus.subjects
    for i in range(5):
        await bus.publish(s.fault, Fault(incident=f"inc-p{i}-g1", pod=f"p{i}",
                                         kind=FaultKind.lost, detected_at=time.time(),
                                         last_seen=time.time(), generation=1))
    await bus.js.publish(s.fault, b"{not json")  # logged and dropped
    await bus.nc.flush()
    by_consumer = await read_back(bus, s.fault, Fault, log)
    assert [f.pod for f, _ in by_consumer] == [f"p{i}" for i in range(5)]

    async def no_meta_leader(*a, **kw):
        await asyncio.sleep(3600)
    monkeypatch.setattr(nats.js.client.JetStreamContext, "pull_subscribe", no_meta_leader)
    monkeypatch.setattr(history, "CREATE_S", 0.2)
    t0 = time.monotonic()
    by_gets = await read_back(bus, s.fault, Fault, log)
    assert [f for f, _ in by_gets] == [f for f, _ in by_consumer]
    assert [f.pod for f, _ in await read_back(bus, s.fault, Fault, log, limit=2)] == ["p3", "p4"]
    assert await read_back(bus, s.job_failed, JobFailed, log, last_only=True) == []
    assert time.monotonic() - t0 < 60  # not the hour a consumer would have waited


async def test_a_monitor_that_missed_plans_reads_the_plan_before_it_declares(monitors, bus):
    """A partitioned host's monitor heard no plan while it was cut off; after the heal it may
    take the lease (the standby's renewal failed while JetStream elected its leaders again)
    with the plan of before, and its peers' stale reports of that generation then made it
    declare healthy members (a clean-clone CI run: w1 and w2 declared `lost` in generation
    1 after generation 2 was made, the job shrank to one member). Taking the lease, it reads
    the plan first: its declarations are judged against the current generation."""
    a, b = await monitors("mon-a"), await monitors("mon-b")
    beaters = [Beater(bus, p, rank=i) for i, p in enumerate(["w0", "w1", "w2"])]
    try:
        await until(lambda: all(len(m.pods) == 3 for m in (a, b)), what="both watch")
        active, stale = (a, b) if a.acting else (b, a)
        # the stale one hears no plan from now on (its link was cut): no poll, no message
        stale.plans._task.cancel()
        await stale.plans._sub.unsubscribe()
        stale.plans._sub = None
        await (await bus.kv()).put(PLAN_KEY, make_plan(["s0", "w1", "w2"], generation=2,
                                                       fenced=["w0"]).model_dump_json().encode())
        await until(lambda: active.generation == 2, what="the active one follows")
        assert stale.generation == 1
        real = stale.plans.refresh

        async def slow_refresh():  # (the bus slow after the heal: declarations meanwhile)
            await asyncio.sleep(0.5)
            return await real()
        stale.plans.refresh = slow_refresh
        beaters[2].alive = False  # silent: w1's report suspects it, the checks find it
        await crash(active)
        await until(lambda: stale.acting, timeout=10, what="the stale one takes over")
        # w1's report of the old generation, while the plan is being read
        await bus.publish(bus.subjects.report("w1"), Report(
            pod="w1", report=ReportKind.peer_error, generation=1, rank=1, step=3,
            error="all-reduce waiting"))
        await until(lambda: stale._inherited.is_set(), timeout=10, what="the plan read")
        assert stale.generation == 2  # read before anything is declared
        await asyncio.sleep(2 * FT)
        assert not [f for f in monitors.faults if f.generation < 2], monitors.faults
    finally:
        for bt in beaters:
            await bt.stop()
