"""Scaler: policy (pure) and the service on a real nats-server, driven by fake agents'
heartbeats and by fault messages as the health monitor would publish them."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest

from schemas import LEASE_KEY, PLAN_KEY, Plan, num_micro_batches
from schemas.messages import (ActuatorCommand, ActuatorReply, AgentState, Capacity, Decision,
                              Fault, FaultKind, Heartbeat, Priority, Role)
from plumbing.bus import Bus, decode
from schemas.policy import ScalingPolicy
from services.scaler import PolicyConfig, Scaler, Wait, initial_plan, on_fault
from harness import REPO, until

FT = 0.3  # fault_timeout in these tests


# ----------------------------------------------------------------------------- helpers


class FakeAgent:
    """The wire behaviour of an agent: heartbeats, and adopting plans (generation, rank)."""

    def __init__(self, bus: Bus, pod: str, role: Role = Role.worker, interval: float = 0.05):
        self.bus, self.pod, self.role, self.interval = bus, pod, role, interval
        self.generation, self.rank, self.step, self.state = 0, None, -1, AgentState.waiting
        self.alive = True
        self._task = None
        self._sub = None

    async def start(self):
        self._sub = await self.bus.subscribe(self.bus.subjects.plan, Plan, self._on_plan)
        self._task = asyncio.create_task(self._beat())
        return self

    async def _on_plan(self, plan: Plan, env):
        if plan.generation <= self.generation:
            return
        self.generation = plan.generation
        r = plan.rank_of(self.pod)
        if r is not None:
            self.rank, self.role, self.state = r, Role.worker, AgentState.training
        else:
            self.rank, self.state = None, AgentState.waiting
        await self.beat()

    async def beat(self):
        if self.alive:
            await self.bus.publish(self.bus.subjects.heartbeat(self.pod), Heartbeat(
                pod=self.pod, role=self.role, generation=self.generation, rank=self.rank,
                step=self.step, state=self.state))

    async def _beat(self):
        while True:
            await self.beat()
            await asyncio.sleep(self.interval)

    def kill(self):
        self.alive = False

    async def stop(self):
        self.alive = False
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._sub:
            await self._sub.unsubscribe()


@pytest.fixture
async def env(nats_server, bus):
    """Factory for services (own connection each) and fake agents; cleans up after."""
    started: list = []
    agents: list[FakeAgent] = []
    buses: list[Bus] = []

    class Env:
        srv = nats_server
        plans: list[Plan] = []
        actuator: list[ActuatorCommand] = []

        async def scaler(self, **kw) -> Scaler:
            b = await Bus.connect(nats_server.url, "test", "scaler", nats_server.creds)
            buses.append(b)
            kw.setdefault("fault_timeout", FT)
            kw.setdefault("lease_ttl", 0.6)
            kw.setdefault("tick_interval", 0.02)
            s = Scaler(b, **kw)
            await s.start()
            started.append(s)
            return s

        async def agent(self, pod, role=Role.worker) -> FakeAgent:
            a = await FakeAgent(bus, pod, role).start()
            agents.append(a)
            return a

        async def fault(self, pod, generation, kind=FaultKind.lost, incident=None):
            now = time.time()
            await bus.publish(bus.subjects.fault, Fault(
                incident=incident or f"inc-{pod}-g{generation}", pod=pod, kind=kind,
                detected_at=now, last_seen=now - FT, generation=generation))

        async def stop(self, svc):
            await svc.stop()
            started.remove(svc)

    e = Env()
    e.plans = []
    e.actuator = []
    e.stop_gate = None  # an asyncio.Event: stop requests are answered once it is set

    async def on_plan(p, _env):
        e.plans.append(p)

    async def on_actuator(raw):
        cmd = decode(ActuatorCommand, raw.data, raw.subject)
        e.actuator.append(cmd)
        if cmd.action.value == "stop" and e.stop_gate is not None:
            await e.stop_gate.wait()  # the pod's process has not exited yet
        pods = [cmd.pod] if cmd.pod else [f"new{len(e.actuator)}-{i}" for i in range(cmd.count)]
        await raw.respond(ActuatorReply(ok=True, pods=pods).model_dump_json().encode())

    await bus.subscribe(bus.subjects.plan, Plan, on_plan)
    await bus.nc.subscribe(bus.subjects.actuator, cb=on_actuator)
    try:
        yield e
    finally:
        for s in started:
            await s.stop()
        for a in agents:
            await a.stop()
        for b in buses:
            await b.close()


async def kv_plans(bus: Bus) -> list[Plan]:
    import nats.js.errors

    kv = await bus.kv()
    for attempt in range(5):
        try:
            hist = await kv.history(PLAN_KEY)
            break
        except nats.js.errors.NoKeysError:
            # nats-py's history watcher can see its end-of-data marker before the entries
            # on a loaded machine (seen once in a full run); the key exists: ask again
            if attempt == 4:
                raise
            await asyncio.sleep(0.2)
    return [Plan.model_validate_json(e.value) for e in hist if e.value]


def gens(plans):
    return [p.generation for p in plans]


def members(plan):
    return {m.rank: m.pod for m in plan.members}


# ----------------------------------------------------------------------------- policy
def test_policy_initial_and_wait():
    cfg = PolicyConfig(workers=3, min_replicas=2)
    assert isinstance(initial_plan(["w0", "w1"], [], cfg), Wait)
    p = initial_plan(["w3", "w1", "w0", "w2"], ["s0"], cfg)
    assert members(p) == {0: "w0", 1: "w1", 2: "w2"} and p.generation == 1
    assert p.spares == ["s0", "w3"] and p.reason == "initial"
    assert sum(p.shares.values()) * p.micro_batch_size == p.global_batch_size
    p2 = initial_plan(["w0", "w1"], [], cfg, timed_out=True)
    assert members(p2) == {0: "w0", 1: "w1"}
    assert isinstance(initial_plan(["w0"], [], cfg, timed_out=True), Wait)
    # capped by the number of micro-batches
    small = PolicyConfig(workers=8, global_batch_size=16, micro_batch_size=8)
    assert initial_plan([f"w{i}" for i in range(8)], [], small).world_size == 2


def test_policy_fault_replace_shrink_wait():
    cfg = PolicyConfig(workers=4, min_replicas=2)
    p = initial_plan(["w0", "w1", "w2", "w3"], [], cfg)
    assert on_fault(p, "nobody", ["s0"], cfg) is None
    r = on_fault(p, "w1", ["s1", "s0"], cfg, incident="inc-w1-g1")
    assert members(r) == {0: "w0", 1: "s0", 2: "w2", 3: "w3"}
    assert r.generation == 2 and r.spares == ["s1"] and r.fenced == ["w1"]
    assert r.incident == "inc-w1-g1" and r.reason == "replace w1 with s0"
    s = on_fault(p, "w1", [], cfg)
    assert members(s) == {0: "w0", 1: "w3", 2: "w2"} and s.world_size == 3
    assert s.reason.startswith("shrink") and s.shares == {0: 3, 1: 3, 2: 2}
    # the highest rank failing: nobody moves
    s3 = on_fault(p, "w3", [], cfg)
    assert members(s3) == {0: "w0", 1: "w1", 2: "w2"}
    # two at once, one spare: replace the lower rank, shrink the other
    t = on_fault(p, ["w2", "w0"], ["s0"], cfg)
    assert members(t) == {0: "s0", 1: "w1", 2: "w3"} and t.fenced == ["w0", "w2"]
    # below min_replicas: wait
    q = on_fault(on_fault(s, "w0", [], cfg), "w3", [], cfg)
    assert isinstance(q, Wait) and q.reason.startswith("waiting for capacity")
    # a fenced pod or a member is never a spare
    assert isinstance(on_fault(on_fault(p, "w1", [], cfg), "w0", ["w1"],
                               PolicyConfig(workers=4, min_replicas=3)), Wait)
    assert num_micro_batches(p.global_batch_size, p.micro_batch_size) == 8


# ----------------------------------------------------------------------------- service
async def test_fault_replaced_by_spare(env, bus):
    sc = await env.scaler(workers=2)
    w0, w1 = await env.agent("w0"), await env.agent("w1")
    await env.agent("s0", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    p1 = env.plans[0]
    assert p1.generation == 1 and members(p1) == {0: "w0", 1: "w1"}
    await until(lambda: "s0" in sc.alive_spares(sc.plans.plan), what="spare alive")
    w1.kill()
    await env.fault("w1", 1, FaultKind.crash)
    await until(lambda: len(env.plans) >= 2, what="plan g2")
    p2 = env.plans[1]
    assert p2.generation == 2 and members(p2) == {0: "w0", 1: "s0"}
    assert p2.fenced == ["w1"] and p2.incident == "inc-w1-g1" and p2.spares == []
    assert p2.reason == "replace w1 with s0"
    await until(lambda: env.actuator, what="fence request")
    assert env.actuator[0].action.value == "kill" and env.actuator[0].pod == "w1"
    # the same fault again, and a fault of the fenced pod: idempotent
    await env.fault("w1", 1, FaultKind.crash)
    await env.fault("w1", 2, FaultKind.lost)
    await asyncio.sleep(0.3)
    assert gens(env.plans) == [1, 2] and gens(await kv_plans(bus)) == [1, 2]
    st = sc.status()
    assert st["lease_holder"] and st["plan"]["generation"] == 2 and w0.generation == 2


async def test_no_plan_after_the_job_failed(env, bus):
    """Issue 41: once the monitor says the failure is the script's (job_failed), a fault
    (the failing pods' exits) plans no replacement: a promoted spare would raise the same
    error while the launcher stops the job."""
    from schemas.messages import JobFailed

    sc = await env.scaler(workers=2)
    w0, w1 = await env.agent("w0"), await env.agent("w1")
    await env.agent("s0", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    await until(lambda: "s0" in sc.alive_spares(sc.plans.plan), what="spare alive")
    await bus.publish(bus.subjects.job_failed, JobFailed(
        kind="script_error", step=11, generation=1, pods=["w0", "w1"],
        error="ValueError: bad batch", hint="w0 and w1 raised the same error at step 12"))
    await until(lambda: sc.job_failed is not None, what="verdict read")
    w1.kill()
    await env.fault("w1", 1, FaultKind.exception)
    await until(lambda: "job failed" in (sc.waiting or ""), what="the scaler declines")
    assert gens(env.plans) == [1] and gens(await kv_plans(bus)) == [1]


async def test_a_member_known_dead_is_faulted_again(env, bus):
    """A spare's fault that arrives while the plan promoting it is being written finds it
    a spare and only drops it from the pool (the scaler's ``dead``); the monitor declares a
    pod once. The promoted member is dead all the same: the scaler must plan around it,
    not wait for it for ever (seen in a CI run: SIGKILL of every pod at once)."""
    sc = await env.scaler(workers=2)
    w1 = await env.agent("w1")
    await env.agent("w0")
    for p in ("s0", "s1"):
        await env.agent(p, Role.spare)
    await until(lambda: env.plans, what="initial plan")
    await until(lambda: {"s0", "s1"} <= set(sc.alive_spares(sc.plans.plan)), what="spares")
    w1.kill()
    await env.fault("w1", 1, FaultKind.crash)
    await until(lambda: len(env.plans) >= 2, what="plan g2")
    promoted = members(env.plans[1])[1]
    assert promoted in ("s0", "s1")
    # what the fault of the spare, handled as a spare's, left; the monitor declared it
    # already and says nothing more (its agent here still heartbeats: only the record of
    # its fault can make the scaler act)
    await until(lambda: sc._reconciled, 10, what="the lease term's one reconciliation")
    sc.dead.add(promoted)
    sc.dropped.add(promoted)
    sc._dropped_n += 1
    sc._kick.set()
    await until(lambda: len(env.plans) >= 3, what="plan g3 around the dead member")
    assert promoted not in members(env.plans[2]).values()
    assert promoted in env.plans[2].fenced


@pytest.mark.parametrize("from_script", [True, False])
async def test_plans_after_the_script_is_known_take_its_batch(env, bus, from_script):
    """Issue 33: `ceaseless up` without batch flags runs the scaler with
    ``batch_from_script``: once rank 0 wrote KV `script`, the plans it makes take the
    script's batch (shares, replica limit); with the operator's batch they keep it."""
    from schemas.policy import SCRIPT_KEY, ScriptInfo

    sc = await env.scaler(workers=2, global_batch_size=32, micro_batch_size=4,
                          batch_from_script=from_script)
    w1 = await env.agent("w1")
    await env.agent("w0")
    await env.agent("s0", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    p1 = env.plans[0]
    assert (p1.global_batch_size, p1.micro_batch_size) == (32, 4)  # before the script runs
    await until(lambda: "s0" in sc.alive_spares(sc.plans.plan), what="spare alive")
    kv = await bus.kv()
    await kv.put(SCRIPT_KEY, ScriptInfo(global_batch_size=24, micro_batch_size=2, total=301,
                                        pod="w0").model_dump_json().encode())
    want = (24, 2) if from_script else (32, 4)
    if from_script:
        await until(lambda: (sc.cfg.global_batch_size, sc.cfg.micro_batch_size) == want,
                    what="script's batch adopted")
        assert sc.status()["policy"]["batch_source"] == "script"
        assert sc.cfg.num_micro == 12
        from ops.cli import _render_status

        text = _render_status({"job": "test", "services": {"scaler": sc.status()},
                               "plan": json.loads(p1.model_dump_json()), "script": {
                                   "global_batch_size": 24, "micro_batch_size": 2,
                                   "total": 301, "pod": "w0"}})
        assert "the next ones are sized for it" in text and "another batch" not in text, text
    else:
        await asyncio.sleep(0.3)
        assert sc.status()["policy"]["batch_source"] == "flags"
    w1.kill()
    await env.fault("w1", 1, FaultKind.crash)
    await until(lambda: len(env.plans) >= 2, what="plan g2")
    p2 = env.plans[1]
    assert members(p2) == {0: "w0", 1: "s0"}
    assert (p2.global_batch_size, p2.micro_batch_size) == want
    assert sum(p2.shares.values()) == want[0] // want[1]


def test_plan_batch_keeps_the_plans_when_the_new_one_cannot_be_spread():
    """A batch (the script's) with fewer micro-batches than the plan's ranks: a replacement
    plan keeps the plan's batch rather than fail to spread it."""
    from services.scaler.policy import plan_batch

    cfg = PolicyConfig(workers=3, global_batch_size=32, micro_batch_size=4)
    plan = initial_plan(["w0", "w1", "w2"], ["s0"], cfg)
    small = PolicyConfig(workers=3, global_batch_size=4, micro_batch_size=2)  # 2 micro-batches
    assert plan_batch(plan, small, 3) == {"global_batch_size": 32, "micro_batch_size": 4}
    assert plan_batch(plan, small, 2) == {"global_batch_size": 4, "micro_batch_size": 2}
    p2 = on_fault(plan, "w1", ["s0"], small)
    assert (p2.global_batch_size, p2.micro_batch_size, p2.world_size) == (32, 4, 3)


async def test_a_ddp_scripts_world_size_is_kept_no_shrink(env, bus):
    """Issue 31: a DDP drop-in script divides its batch by the world size once; its
    ScriptInfo says so (``fixed_world_size``), and the scaler then keeps the job at that size
    whatever its flags: a fault without a live spare waits instead of shrinking."""
    from schemas.policy import SCRIPT_KEY, ScriptInfo

    sc = await env.scaler(workers=3)  # min_replicas 1: would shrink
    agents = [await env.agent(f"w{i}") for i in range(3)]
    await until(lambda: env.plans, what="initial plan")
    kv = await bus.kv()
    await kv.put(SCRIPT_KEY, ScriptInfo(global_batch_size=24, micro_batch_size=2, pod="w0",
                                        fixed_world_size=3).model_dump_json().encode())
    await until(lambda: (sc.cfg.min_replicas, sc.cfg.max_replicas) == (3, 3),
                what="the script's world size kept")
    agents[0].kill()
    await env.fault("w0", 1)
    await asyncio.sleep(1.0)
    assert len(env.plans) == 1  # no shrink plan: it waits for a spare
    await env.agent("s9", Role.spare)
    await until(lambda: len(env.plans) >= 2, what="the replacement plan")
    p2 = env.plans[1]
    assert p2.world_size == 3 and members(p2)[0] == "s9", members(p2)


async def test_fault_without_spare_shrinks(env, bus):
    await env.scaler(workers=3)
    agents = [await env.agent(f"w{i}") for i in range(3)]
    await until(lambda: env.plans, what="initial plan")
    agents[0].kill()
    await env.fault("w0", 1)
    await until(lambda: len(env.plans) >= 2, what="shrink plan")
    p2 = env.plans[1]
    assert members(p2) == {0: "w2", 1: "w1"} and p2.world_size == 2
    assert p2.shares == {0: 4, 1: 4} and p2.reason.startswith("shrink")
    await until(lambda: agents[2].rank == 0, what="w2 adopts rank 0")


async def test_below_min_waits_then_spare(env, bus):
    sc = await env.scaler(workers=2, min_replicas=2)
    w0, w1 = await env.agent("w0"), await env.agent("w1")
    await until(lambda: env.plans, what="initial plan")
    w1.kill()
    await env.fault("w1", 1)
    await until(lambda: sc.status()["pending"], what="pending fault")
    await asyncio.sleep(0.3)
    assert gens(env.plans) == [1]
    assert sc.status()["waiting"].startswith("waiting for capacity")
    await env.agent("s9", Role.spare)
    await until(lambda: len(env.plans) >= 2, what="plan after a spare appears")
    assert members(env.plans[1]) == {0: "w0", 1: "s9"} and not sc.status()["pending"]


async def test_non_member_faults(env, bus):
    sc = await env.scaler(workers=1)
    await env.agent("w0")
    s0 = await env.agent("s0", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    await until(lambda: sc.alive_spares(sc.plans.plan) == ["s0"], what="spare alive")
    s0.kill()
    await env.fault("s0", 1)                      # a spare: dropped from the pool
    await env.fault("ghost", 1)                   # unknown: ignored
    await env.fault("w0", 7)                      # future generation: ignored
    await env.fault("w0", 0, incident="old")      # stale, and w0 heartbeats generation 1
    await until(lambda: sc.ignored.get("not a member") and sc.ignored.get("stale fault")
                and sc.ignored.get("spare dropped from the pool"), what="faults ignored")
    await asyncio.sleep(0.2)
    assert sc.alive_spares(sc.plans.plan) == [] and gens(env.plans) == [1]


async def _decisions(bus):
    got: list[Decision] = []

    async def on_decision(d, _e):
        got.append(d)
    await bus.subscribe(bus.subjects.decision, Decision, on_decision)
    return got


async def test_release_below_min_refused_with_reason(env, bus):
    await env.scaler(workers=2, min_replicas=2)
    for pod in ("w0", "w1"):
        await env.agent(pod)
    got = await _decisions(bus)
    await until(lambda: env.plans, what="initial plan")
    await bus.publish(bus.subjects.priority, Priority(release=1, request_id="p1"))
    await until(lambda: got, what="a decision")
    assert got[0].request_id == "p1" and not got[0].accepted
    assert "below min_replicas 2" in got[0].reason
    await asyncio.sleep(0.3)
    assert gens(env.plans) == [1]  # a refused request changes nothing


async def test_capacity_add_starts_spares_and_grows_at_a_step_boundary(env, bus):
    sc = await env.scaler(workers=2, max_replicas=3, policy=ScalingPolicy(
        max_replicas=3, scale_up_snooze_s=0))
    agents = [await env.agent(p) for p in ("w0", "w1")]
    got = await _decisions(bus)
    await until(lambda: env.plans, what="initial plan")
    for a in agents:
        a.step = 7
    await asyncio.sleep(0.15)
    await bus.publish(bus.subjects.capacity, Capacity(change="add", count=2, request_id="c1"))
    await until(lambda: got, what="a decision")
    assert got[0].accepted and got[0].target == 3, got[0]
    assert "capped at 3" in got[0].reason
    start = [c for c in env.actuator if c.action.value == "start"]
    assert len(start) == 1 and start[0].count == 2 and start[0].role == Role.spare
    kv = await bus.kv()
    assert json.loads((await kv.get("scale")).value)["target"] == 3
    await env.agent("n0", Role.spare)  # the started pod registers as a spare
    await env.agent("n1", Role.spare)
    await until(lambda: len(env.plans) >= 2, what="grow plan")
    g2 = env.plans[-1]
    assert g2.world_size == 3 and members(g2) == {0: "w0", 1: "w1", 2: "n0"}
    # The plan lists the spares alive when it was made: n1's first heartbeat may reach the
    # scaler just after the grow plan (it registers second). Either way it stays a spare.
    assert g2.spares in ([], ["n1"]), g2.spares
    await until(lambda: sc.status()["alive_spares"] == ["n1"], what="n1 alive as a spare")
    assert g2.apply_step is not None and g2.apply_step >= 8  # after the step in progress
    assert sum(g2.shares.values()) * g2.micro_batch_size == g2.global_batch_size
    await asyncio.sleep(0.3)
    assert len(env.plans) == 2  # at the target: no further change
    assert sc.status()["scale"]["target"] == 3
    from ops.cli import _render_status

    text = _render_status({"job": "test", "services": {"scaler": sc.status()},
                           "plan": json.loads(env.plans[-1].model_dump_json()),
                           "plan_revision": 3})
    assert "scale: 3 replica(s), target 3 (last request: capacity add 2" in text, text
    assert "policy: replicas 1..3 step 1" in text and "grow 2 -> 3" in text, text
    # the script's own batch (rank 0 writes KV `script`): shown, and a mismatch is named
    plan = json.loads(env.plans[-1].model_dump_json())
    B, m = plan["global_batch_size"], plan["micro_batch_size"]
    text = _render_status({"job": "test", "services": {}, "plan": plan, "script": {
        "global_batch_size": B, "micro_batch_size": m, "total": 61, "pod": "w0"}})
    assert f"script: global batch {B} = {m} x {B // m} micro-batches, 61 steps (pod w0)" \
        in text and "another batch" not in text, text
    text = _render_status({"job": "test", "services": {}, "plan": plan, "script": {
        "global_batch_size": 2 * B, "micro_batch_size": m, "total": 61, "pod": "w0"}})
    assert "the plan was sized for another batch" in text, text


async def test_priority_release_spares_first_then_highest_rank(env, bus):
    await env.scaler(workers=3, policy=ScalingPolicy(scale_up_snooze_s=0))
    agents = {p: await env.agent(p) for p in ("w0", "w1", "w2")}
    await env.agent("s0", Role.spare)
    got = await _decisions(bus)
    await until(lambda: env.plans, what="initial plan")
    await asyncio.sleep(0.15)
    await bus.publish(bus.subjects.priority, Priority(release=2, request_id="p2",
                                                      reason="prod job"))
    await until(lambda: got, what="accepted")
    assert got[0].accepted and not got[0].completed and got[0].target == 2, got[0]
    stops = [c for c in env.actuator if c.action.value == "stop"]
    await until(lambda: [c for c in env.actuator if c.action.value == "stop"], what="stop")
    assert [c.pod for c in env.actuator if c.action.value == "stop"] == ["s0"], stops
    await until(lambda: len(env.plans) >= 2, what="shrink plan")
    g2 = env.plans[-1]
    assert members(g2) == {0: "w0", 1: "w1"} and g2.apply_step is not None
    assert "w2" not in g2.spares  # its slot is released, it does not become a spare
    assert not any(d.completed for d in got)
    # w2 finishes the step before apply_step and leaves (its last heartbeat says done)
    agents["w2"].state = AgentState.done
    await agents["w2"].beat()
    agents["w2"].kill()
    done = await until(lambda: [d for d in got if d.completed], timeout=5, what="completed")
    assert done[0].request_id == "p2" and sorted(done[0].pods) == ["s0", "w2"]


async def test_a_release_of_an_idle_spare_completes_naming_it_after_it_exited(env, bus):
    """Issue 41: a release that frees an idle spare answered ``completed`` with no pod while
    the spare still ran. The spare counts as leaving until the actuator answers its stop
    (once the process has exited); then ``completed`` names it."""
    env.stop_gate = gate = asyncio.Event()
    sc = await env.scaler(workers=2)
    for pod in ("w0", "w1"):
        await env.agent(pod)
    spare = await env.agent("s0", Role.spare)
    got = await _decisions(bus)
    await until(lambda: env.plans and sc.alive_spares(env.plans[-1]) == ["s0"],
                what="the plan and its idle spare")
    await bus.publish(bus.subjects.priority, Priority(release=1, request_id="p1"))
    await until(lambda: [c for c in env.actuator if c.action.value == "stop"], what="stop")
    assert [d.accepted for d in got] == [True] and not got[0].completed, got
    async with sc._lock:  # a decision pass while the stop is in flight: nothing completes
        await sc._releases(sc.plans.plan, time.monotonic())
    (r,) = sc.scale.releases
    assert r.request_id == "p1" and r.leaving == ["s0"] and r.freed == [], r
    assert not [d for d in got if d.completed], got
    spare.kill()  # the process exits (its heartbeats stop); the actuator answers
    gate.set()
    done = await until(lambda: [d for d in got if d.completed], what="completed")
    assert done[0].request_id == "p1" and done[0].pods == ["s0"], done[0]
    assert sc.scale.releases == []


async def test_two_scalers_one_plan_per_generation(env, bus):
    a = await env.scaler(workers=2, scaler_id="A")
    b = await env.scaler(workers=2, scaler_id="B")
    await until(lambda: a.acting or b.acting, what="a lease holder")
    await asyncio.sleep(0.3)
    assert a.acting != b.acting
    for pod in ("w0", "w1"):
        await env.agent(pod)
    for pod in ("s0", "s1"):
        await env.agent(pod, Role.spare)
    await until(lambda: env.plans, what="initial plan")
    holder, standby = (a, b) if a.acting else (b, a)
    await until(lambda: len(standby.alive_spares(standby.plans.plan)) == 2, what="spares")
    await env.fault("w1", 1)
    await until(lambda: len(env.plans) >= 2, what="plan g2")
    # the holder stops (crash-like: its lease is released); the standby takes over
    await env.stop(holder)
    await until(lambda: standby.acting, timeout=5, what="standby takes the lease")
    await env.fault("w0", 2)
    await until(lambda: len(env.plans) >= 3, what="plan g3")
    await asyncio.sleep(0.3)
    hist = await kv_plans(bus)
    assert gens(env.plans) == [1, 2, 3] and gens(hist) == [1, 2, 3]
    assert members(hist[-1]) == {0: "s1", 1: "s0"}


async def test_concurrent_writers_cas(env, bus, monkeypatch):
    """Even with both scalers acting at once (lease bypassed) the compare-and-set lets only
    one plan per generation through; the loser reloads and agrees."""
    monkeypatch.setattr(Scaler, "acting", property(lambda self: True))
    monkeypatch.setattr(Scaler, "warm_up", 0.0)  # both decide from the start: the race
    for pod in ("w0", "w1", "w2"):
        await env.agent(pod)
    for pod in ("s0", "s1"):
        await env.agent(pod, Role.spare)
    await asyncio.sleep(0.15)
    a = await env.scaler(workers=3, scaler_id="A")
    b = await env.scaler(workers=3, scaler_id="B")
    await until(lambda: a.plans.generation == b.plans.generation == 1, what="both at g1")
    for i, pod in enumerate(("w1", "w0", "w2")):
        await env.fault(pod, i + 1)
        await until(lambda: a.plans.generation == b.plans.generation == i + 2,
                    what=f"both at g{i + 2}")
    await asyncio.sleep(0.3)
    hist = await kv_plans(bus)
    assert gens(hist) == [1, 2, 3, 4]
    by_gen: dict[int, set] = {}
    for p in env.plans:
        by_gen.setdefault(p.generation, set()).add(p.model_dump_json())
    assert sorted(by_gen) == [1, 2, 3, 4] and all(len(v) == 1 for v in by_gen.values())
    assert members(hist[-1]) == {0: "s1", 1: "s0"}  # w1->s0, w0->s1, w2 shrinks away
    assert a.cas_conflicts + b.cas_conflicts >= 1  # the race really happened


async def test_restart_keeps_plan_and_reconciles(env, bus):
    sc = await env.scaler(workers=2, scaler_id="first")
    w0 = await env.agent("w0")
    await env.agent("w1")
    await env.agent("s0", Role.spare)
    await env.agent("s1", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    await env.fault("w1", 1)
    await until(lambda: len(env.plans) >= 2, what="plan g2")
    kv = await bus.kv()
    rev = (await kv.get(PLAN_KEY)).revision
    await env.stop(sc)
    # restart with different flags: the stored plan wins, nothing is republished
    sc2 = await env.scaler(workers=4, scaler_id="second")
    await until(lambda: sc2.acting, what="new scaler holds the lease")
    await asyncio.sleep(3 * FT)  # past the reconcile grace period
    assert (await kv.get(PLAN_KEY)).revision == rev and gens(env.plans) == [1, 2]
    assert sc2.plans.generation == 2 and not sc2.pending
    # a member dies while no scaler runs: the next one handles it after the grace period
    await env.stop(sc2)
    w0.kill()
    await asyncio.sleep(FT + 0.1)
    sc3 = await env.scaler(workers=2, scaler_id="third")
    await until(lambda: len(env.plans) >= 3, timeout=5, what="reconciled plan g3")
    p3 = env.plans[2]
    assert p3.generation == 3 and members(p3) == {0: "s1", 1: "s0"}
    assert p3.incident == "inc-w0-g2" and p3.fenced == ["w1", "w0"]
    assert gens(await kv_plans(bus)) == [1, 2, 3]
    lease = json.loads((await kv.get(LEASE_KEY)).value)
    assert lease["holder"] == "third" and sc3.status()["plan"]["generation"] == 3


async def test_a_scaler_that_hears_no_pod_judges_no_member_silent(env, bus):
    """Issue 42 (two of three bus hosts lost): a standby that has heard nothing for a while
    takes the lease (after a partition JetStream answered while its server's route to the
    pods' server was still stuck). Its once-a-term reconcile faulted the live members from
    that blind view and the job shrank to one. No pod heard at all is the scaler's own
    outage: no member is silent; once pods are heard again, silence counts from then, and
    only the member that stays silent (killed meanwhile) is planned out, its rank to the
    spare. (Fails without the rule: w0 and w1 are faulted at the take.)"""
    sc1 = await env.scaler(workers=2, scaler_id="a")
    w0, w1 = await env.agent("w0"), await env.agent("w1")
    s0 = await env.agent("s0", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    sc2 = await env.scaler(workers=2, scaler_id="b")
    await until(lambda: sc2.alive_spares(sc2.plans.plan) == ["s0"] and not sc2.acting,
                what="the standby's view")
    await until(lambda: time.monotonic() - sc2.t0 > 2 * FT, what="the standby's grace past")
    for a in (w0, w1, s0):  # the standby hears none of them
        a.kill()
    await asyncio.sleep(2 * FT)
    await env.stop(sc1)
    await until(lambda: sc2.acting, what="the standby takes the lease")
    await asyncio.sleep(3 * FT)
    assert not sc2.pending and not sc2._reconciled and gens(env.plans) == [1], sc2.pending
    assert sc2.status()["hearing"]["state"] == "deaf"
    w0.alive = s0.alive = True  # heard again; w1 was killed meanwhile
    await until(lambda: len(env.plans) >= 2, timeout=10, what="w1 planned out")
    assert members(env.plans[1]) == {0: "w0", 1: "s0"} and env.plans[1].fenced == ["w1"]


async def test_only_a_scaler_taking_over_a_plan_listens_a_fault_timeout_first(env, bus):
    """The warm-up (a fault timeout of listening before faults are replayed) is for a scaler
    that takes over a running job. A new job has nothing to replay and its initial plan
    waits for the workers' heartbeats itself: it is planned at once, not a fault timeout
    later (every `ceaseless up` paid that wait before its first step)."""
    long = 60.0  # fault timeout: the warm-up would outlast every wait below
    await env.agent("w0")
    await env.agent("w1")
    sc = await env.scaler(workers=2, fault_timeout=long, scaler_id="first")
    await until(lambda: env.plans, timeout=20, what="the initial plan, with no warm-up")
    assert env.plans[0].generation == 1 and members(env.plans[0]) == {0: "w0", 1: "w1"}
    # a scaler that takes the lease over a plan still listens first (replaying nothing yet)
    await env.stop(sc)
    sc2 = await env.scaler(workers=2, fault_timeout=long, scaler_id="second")
    await until(lambda: sc2.acting, what="the new scaler holds the lease")
    assert sc2._replaying and sc2.plans.generation == 1


async def test_no_plan_until_enough_workers_then_start_timeout(env, bus):
    sc = await env.scaler(workers=3, min_replicas=2, start_timeout=1.0)
    await env.agent("w0")
    await asyncio.sleep(0.3)
    assert not env.plans and sc.status()["waiting"].startswith("waiting for workers")
    await env.agent("w1")
    await until(lambda: env.plans, timeout=3, what="plan after the start timeout")
    assert members(env.plans[0]) == {0: "w0", 1: "w1"}


async def test_deleted_plan_key_never_reuses_a_generation(env, bus):
    sc = await env.scaler(workers=1)
    w0 = await env.agent("w0")
    await env.agent("s0", Role.spare)
    await until(lambda: env.plans, what="initial plan")
    await env.stop(sc)
    kv = await bus.kv()
    await kv.delete(PLAN_KEY)
    w0.state = AgentState.waiting  # say the job's pods were started afresh
    await env.scaler(workers=1)
    await until(lambda: len(env.plans) >= 2, what="a fresh plan")
    p = env.plans[1]
    assert p.generation == 2 and p.reason.startswith("initial (plan key was deleted")


async def test_joiner_not_training_is_dropped_after_scaling_timeout(env, bus):
    """A planned grow whose joiner never trains is undone after scaling_timeout_s (the
    joiner is handled like a faulted pod: an immediate plan without it)."""
    await env.scaler(workers=2, policy=ScalingPolicy(scale_up_snooze_s=0,
                                                     scaling_timeout_s=0.5))
    for p in ("w0", "w1"):
        await env.agent(p)
    await until(lambda: env.plans, what="initial plan")
    class Stuck(FakeAgent):
        async def _on_plan(self, plan, e):  # hears plans, never enters them
            pass

    stuck = await Stuck(bus, "s0", Role.spare).start()
    await bus.publish(bus.subjects.capacity, Capacity(change="add", count=1, request_id="c"))
    await until(lambda: len(env.plans) >= 2, what="grow plan")
    assert env.plans[1].world_size == 3 and env.plans[1].apply_step is not None
    await until(lambda: len(env.plans) >= 3, timeout=5, what="joiner dropped")
    g3 = env.plans[2]
    assert g3.apply_step is None and members(g3) == {0: "w0", 1: "w1"}
    assert "s0" in g3.fenced and g3.incident == "inc-s0-g2"
    await stuck.stop()


async def test_cli_inject_prints_the_scalers_answer(env, bus, nats_server):
    """`ceaseless inject priority|capacity` publishes what the README's `nats pub` does and
    prints the scaler's answer: refused with why, or accepted."""
    await env.scaler(workers=1)
    await env.agent("w0")
    await until(lambda: env.plans, what="initial plan")
    base = [sys.executable, "-m", "ops.cli", "inject", "--nats", nats_server.url,
            "--creds", str(nats_server.creds_path), "--job", "test"]

    async def run(*argv):
        p = await asyncio.create_subprocess_exec(*base, *argv, cwd=REPO,
                                                 stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(p.communicate(), 60)
        return p.returncode, out.decode()

    code, out = await run("priority", "--release", "1", "--reason", "prod")
    assert code == 1 and "refused: release 1: only 0 idle spare(s)" in out, out
    assert "below min_replicas 1" in out
    code, out = await run("capacity", "+1")
    assert code == 0 and "accepted: capacity add 1: target 1 -> 2 replicas" in out, out


async def test_sharded_fault_drops_a_replica_and_capacity_adds_whole_replicas(env, bus):
    """shard_size 2 (issue 21): 2 replicas of 2 ranks, no spare. A fault drops the hurt
    replica whole (its survivor is released, not fenced, not a spare) and the other replica
    moves into its slots with positions kept; a capacity add counts replicas (2 pods per
    replica started) and grows by a whole replica."""
    sc = await env.scaler(workers=4, shard_size=2, max_replicas=3,
                          policy=ScalingPolicy(max_replicas=3, scale_up_snooze_s=0))
    agents = {p: await env.agent(p) for p in ("w0", "w1", "w2", "w3")}
    got = await _decisions(bus)
    await until(lambda: env.plans, what="initial plan")
    p1 = env.plans[0]
    assert p1.shard_size == 2 and p1.replicas == 2 and members(p1) == {
        0: "w0", 1: "w1", 2: "w2", 3: "w3"}
    st = sc.status()
    assert st["plan"]["shard_size"] == 2 and st["plan"]["replicas"] == 2
    assert st["policy"]["shard_size"] == 2
    agents["w1"].kill()
    await env.fault("w1", 1)
    await until(lambda: len(env.plans) >= 2, what="shrink plan")
    p2 = env.plans[1]
    assert members(p2) == {0: "w2", 1: "w3"} and p2.replicas == 1 and p2.shard_size == 2
    assert p2.fenced == ["w1"] and "w0" not in p2.spares and "w0 released" in p2.reason
    agents["w0"].state = AgentState.done  # a released member leaves (exit 0)
    await agents["w0"].beat()
    agents["w0"].kill()
    await until(lambda: agents["w2"].rank == 0 and agents["w3"].rank == 1, what="moved")
    await bus.publish(bus.subjects.capacity, Capacity(change="add", count=1, request_id="c1"))
    await until(lambda: got, what="a decision")
    assert got[0].accepted and got[0].target == 3, got[0]
    start = [c for c in env.actuator if c.action.value == "start"]
    assert len(start) == 1 and start[0].count == 2  # one replica = 2 pods
    await env.agent("n0", Role.spare)
    await asyncio.sleep(0.3)
    assert len(env.plans) == 2  # one spare is not a replica: no grow
    await env.agent("n1", Role.spare)
    await until(lambda: len(env.plans) >= 3, what="grow plan")
    g3 = env.plans[-1]
    assert members(g3) == {0: "w2", 1: "w3", 2: "n0", 3: "n1"} and g3.replicas == 2
    assert g3.apply_step is not None


def test_cli_up_refuses_bad_shard_sizes_and_status_shows_replicas(capsys):
    from ops.cli import _render_status, main as cli_main

    for argv, msg in ((["--workers", "3", "--shard-size", "2"], "not a multiple of --shard-size 2"),
                      (["--workers", "4", "--shard-size", "2", "--global-batch-size", "12",
                        "--micro-batch-size", "4"], "not a multiple of the shard size 2"),
                      (["--workers", "4", "--shard-size", "0"], "at least 1")):
        try:
            rc = cli_main(["up", *argv])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and msg in capsys.readouterr().err, argv
    cfg = PolicyConfig(workers=4, shard_size=2, global_batch_size=32, micro_batch_size=4)
    plan = json.loads(initial_plan(["a", "b", "c", "d"], [], cfg).model_dump_json())
    text = _render_status({"job": "j", "services": {}, "plan": plan, "plan_revision": 1})
    assert "world size 4 = replicas 2 x shards 2" in text, text
    assert "scale: 2 replica(s) of 2 ranks, target 2" in text, text


def test_a_preemption_is_a_planned_swap_that_fences_nobody():
    """Issue 32: a member that gave notice is planned out at a step boundary: a live spare
    into its rank (else a shrink), ``apply_step`` set, nobody fenced; not a member: None."""
    from services.scaler.policy import on_preempt

    cfg = PolicyConfig(workers=3, global_batch_size=32, micro_batch_size=4)
    plan = initial_plan(["w0", "w1", "w2"], ["s0"], cfg)
    p2 = on_preempt(plan, "w1", ["s0"], cfg, apply_step=17, incident="preempt-w1-g2")
    assert members(p2) == {0: "w0", 1: "s0", 2: "w2"} and p2.apply_step == 17
    assert "w1" not in p2.fenced and p2.reason.startswith("preempted: w1")
    shrink = on_preempt(plan, "w1", [], cfg, apply_step=17)
    assert shrink.world_size == 2 and shrink.rank_of("w1") is None and shrink.apply_step == 17
    assert on_preempt(plan, "s0", [], cfg, apply_step=17) is None  # a spare: not a member


async def test_a_straggler_without_a_spare_gets_a_smaller_share(env, bus):
    """Issue 32: no spare to swap in: the same members at a step boundary, the straggler's
    micro-batches cut by the slowness the monitor measured; a drop-in job (the script splits
    its own micro-batches) is left alone."""
    from schemas.policy import SCRIPT_KEY, ScriptInfo

    sc = await env.scaler(workers=3)
    [await env.agent(f"w{i}") for i in range(3)]
    await until(lambda: env.plans, what="initial plan")
    p1 = env.plans[0]
    assert p1.shares == {0: 3, 1: 3, 2: 2}
    now = time.time()
    await bus.publish(bus.subjects.fault, Fault(
        incident="inc-w1-g1", pod="w1", kind=FaultKind.straggler, detected_at=now,
        last_seen=now, generation=1, slowness=6.0))
    await until(lambda: len(env.plans) >= 2, what="the share-out plan")
    p2 = env.plans[1]
    assert members(p2) == members(p1) and p2.shares == {0: 4, 1: 1, 2: 3}, p2
    assert p2.apply_step is not None and p2.fenced == [] and p2.reason.startswith("straggler:")
    assert env.actuator == []  # nobody fenced, nothing started
    kv = await bus.kv()
    await kv.put(SCRIPT_KEY, ScriptInfo(global_batch_size=32, micro_batch_size=4, pod="w0",
                                        fixed_world_size=3).model_dump_json().encode())
    await until(lambda: sc.script is not None, what="the script's record")
    await bus.publish(bus.subjects.fault, Fault(
        incident="inc-w2-g2", pod="w2", kind=FaultKind.straggler, detected_at=time.time(),
        last_seen=time.time(), generation=2, slowness=6.0))
    await asyncio.sleep(1.0)
    assert len(env.plans) == 2


async def test_a_preemption_notice_outlives_a_scaler_restart(env, bus):
    """Issue 32: a notice that cannot be planned yet (no spare, no room to shrink) is kept in
    KV ``departures``; the next scaler plans it once a spare comes."""
    from schemas.messages import Report, ReportKind
    from schemas.policy import DEPARTURES_KEY, Departures

    sc = await env.scaler(workers=2, min_replicas=2)
    [await env.agent(f"w{i}") for i in range(2)]
    await until(lambda: env.plans, what="initial plan")
    # members waiting in an all-reduce report every heartbeat interval (issue 45): the
    # scaler, which wants only preemption notices, does not decode those
    for i in range(50):
        await bus.publish(bus.subjects.report(f"w{i % 2}"), Report(
            pod=f"w{i % 2}", generation=1, rank=i % 2, report=ReportKind.peer_error,
            error="all-reduce waiting for 0.50s"))
    await bus.publish(bus.subjects.report("w1"), Report(
        pod="w1", generation=1, rank=1, report=ReportKind.preempted, error="deadline 60"))
    kv = await bus.kv()

    async def stored():
        try:
            return Departures.model_validate_json((await kv.get(DEPARTURES_KEY)).value)
        except Exception:
            return None
    for _ in range(50):
        d = await stored()
        if d is not None and [x.pod for x in d.leaving] == ["w1"]:
            break
        await asyncio.sleep(0.1)
    assert d is not None and [(x.pod, x.why) for x in d.leaving] == [("w1", "preempted")], d
    assert (sc.bus.skipped["report"], sc.bus.received["report"]) == (50, 1)  # (in order)
    assert len(env.plans) == 1  # no spare, min 2: it waits
    await env.stop(sc)
    sc2 = await env.scaler(workers=2, min_replicas=2, scaler_id="second")
    await until(lambda: sc2.acting, what="new scaler holds the lease")
    await env.agent("s0", Role.spare)
    await until(lambda: len(env.plans) >= 2, what="the departure planned by the new scaler")
    p2 = env.plans[1]
    assert members(p2) == {0: "w0", 1: "s0"} and p2.reason.startswith("preempted: w1")
    assert p2.apply_step is not None and p2.fenced == []
    await until(lambda: sc2.preempting == {}, what="the notice done")


def test_what_a_fault_means():
    """services/scaler/faults.py judge (pure): the scaler applies the verdict."""
    from schemas.messages import Fault, FaultKind, Member
    from services.scaler.faults import Act, Pending, judge

    plan = Plan(generation=2, members=[Member(pod="w0", rank=0), Member(pod="w1", rank=1)],
                world_size=2, global_batch_size=16, micro_batch_size=8, shares={0: 1, 1: 1},
                spares=["s0"], fenced=["w9"], reason="test")

    def f(pod, kind=FaultKind.lost, gen=2, slowness=None):
        return Fault(incident=f"inc-{pod}", pod=pod, kind=kind, detected_at=1.0, last_seen=1.0,
                     generation=gen, slowness=slowness)

    def j(fault, plan=plan, pending=None, preempting=None, spare=False, dropin=False):
        return judge(fault, plan, pending=pending or {}, preempting=preempting or {},
                     has_spare=lambda: spare, dropin=dropin, was_spare=True, seen=None,
                     fault_timeout=1.0)
    assert j(f("w1")).act is Act.ACCEPT
    assert j(f("w1"), plan=None).act is Act.FORGET
    assert j(f("s0")).act is Act.DROP and j(f("s0")).reason == "spare dropped from the pool"
    assert j(f("w9")).reason == "already handled"
    assert j(f("w1"), pending={"w1": Pending("w1", "i", "lost", None, 0.0)}).act is Act.IGNORE
    assert j(f("w1", gen=3)).level == "warning"  # a future generation
    slow = f("w1", FaultKind.straggler, slowness=2.0)
    assert j(slow, spare=True).act is Act.SWAP
    assert j(slow).act is Act.SHARE
    assert j(slow, dropin=True).act is Act.IGNORE
    assert j(f("w1", FaultKind.straggler)).act is Act.IGNORE  # no slowness measured
    assert j(slow, spare=True, preempting={"w1": ("straggler", None)}).act is Act.SHARE
    # a stale fault (an older generation) of a member heard in the plan's generation: ignored
    # while the pod is not silent here; heard long ago it is accepted, unless the scaler hears
    # no pod at all (quiet 0: its own deafness is no pod's silence)
    from services.scaler.liveness import PodSeen

    seen = PodSeen(role=Role.worker, generation=2, state=AgentState.training, rank=1,
                   last=time.monotonic() - 10.0)

    def stale(quiet):
        return judge(f("w1", gen=1), plan, pending={}, preempting={}, has_spare=lambda: False,
                     dropin=False, was_spare=False, seen=seen, fault_timeout=1.0, quiet=quiet)
    assert stale(None).act is Act.ACCEPT and stale(5.0).act is Act.ACCEPT
    assert stale(0.0).act is Act.IGNORE and "stale fault" in stale(0.0).reason


async def test_a_view_that_stopped_coming_makes_no_pod_silent(env, bus, nats_server):
    """The CI failure of test_standby_e2e (every active service killed, then a worker): the
    scaler read its heartbeats from the monitor's view, the monitor died, and a fault it
    judged a fault timeout later found the spare "not alive" (its last heartbeat was the
    dead view's), so the job shrank instead of taking the spare: a different trajectory.
    Time the scaler did not listen (a view overdue, until it reads the heartbeats itself)
    is not a pod's silence. (Fails without it: the plan is "shrink".)"""
    from services.health_monitor import HealthMonitor

    ft = 0.8
    mon_bus = await Bus.connect(nats_server.url, "test", "health_monitor", nats_server.creds)
    # views every 1 s: the scaler goes back to the heartbeats 2.5 s after the last one
    mon = HealthMonitor(mon_bus, fault_timeout=ft, view_interval=1.0)
    try:
        await mon.start()
        sc = await env.scaler(workers=2, min_replicas=1, fault_timeout=ft)
        for pod, role in (("w0", Role.worker), ("w1", Role.worker), ("s0", Role.spare)):
            await env.agent(pod, role)
        await until(lambda: env.plans and sc.alive_spares(sc.plans.plan) == ["s0"],
                    what="the initial plan, s0 a live spare")
        await until(lambda: sc.feed.source == "monitor view", timeout=15,
                    what="the scaler on the view (a complete listing)")
        await mon.stop()  # the view stops; every pod goes on heartbeating
        stopped = time.monotonic()
        await asyncio.sleep(ft + 0.3)
        assert sc.feed.source == "monitor view"  # not reading the heartbeats yet
        assert time.monotonic() - stopped < 1.5, "the loop stalled: the test proves nothing"
        await env.fault("w1", 1)
        await until(lambda: len(env.plans) >= 2, what="the replacement plan")
        assert members(env.plans[1]) == {0: "w0", 1: "s0"}, env.plans[1].reason
    finally:
        await mon.stop()
        await mon_bus.close()
