"""State broker: the pure transfer decision, and the service on a real nats-server (members
heartbeat the new generation with their committed step and digest, as agents do). Also the
whole control plane in one trace: detect -> plan -> transfer_plan."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry import trace

from schemas import PLAN_KEY, Plan
from schemas.messages import (AgentState, Heartbeat, Lifecycle, Member, Role, StateLost,
                              Transfer)
from plumbing.bus import Bus
from services.health_monitor import HealthMonitor
from services.scaler import Scaler
from services.state_broker import StateBroker, decide_transfer
from services.state_broker.broker import Committed
from harness import until




def make_plan(pods, generation=1, incident=None):
    n = len(pods)
    return Plan(generation=generation, members=[Member(pod=p, rank=i) for i, p in enumerate(pods)],
                world_size=n, global_batch_size=8 * n, micro_batch_size=8,
                shares={i: 1 for i in range(n)}, reason="test", incident=incident)


# ----------------------------------------------------------------------------- pure
def test_decide_mixed_steps_and_digest_majority():
    plan = make_plan(["a", "b", "c", "d", "e", "f"], generation=3)
    reported = {0: (10, "aa"), 1: (10, "aa"), 2: (10, "bb"), 3: (9, "cc"), 4: (-1, ""),
                5: (10, "aa")}
    t = decide_transfer(plan, reported, high_water=10, incident="inc-x-g2")
    assert isinstance(t, Transfer)
    assert t.restore_step == 10 and t.digest == "aa" and t.incident == "inc-x-g2"
    # rank 2 is at the top step with a minority digest: it receives too
    assert t.sources == {2: [0, 1, 5], 3: [1, 5, 0], 4: [5, 0, 1]}
    assert t.steps == {0: 10, 1: 10, 2: 10, 3: 9, 4: -1, 5: 10}
    # a tie of digests: the lowest rank's digest wins
    t2 = decide_transfer(make_plan(["a", "b", "c"]), {0: (4, "bb"), 1: (4, "aa"), 2: (3, "")}, 4)
    assert t2.digest == "bb" and t2.sources == {1: [0], 2: [0]}


def test_decide_generation_one_and_state_lost():
    plan = make_plan(["a", "b", "c"])
    t = decide_transfer(plan, {0: (-1, ""), 1: (-1, ""), 2: (-1, "")}, high_water=-1)
    assert t.restore_step == -1 and t.sources == {1: [0], 2: [0]}
    lost = decide_transfer(make_plan(["x", "y"], generation=4),
                           {0: (-1, ""), 1: (-1, "")}, high_water=12)
    assert isinstance(lost, StateLost) and lost.best_step == -1 and "12" in lost.reason
    assert decide_transfer(plan, {}, -1) is None
    # everyone already at the top with one digest: nobody receives
    same = decide_transfer(plan, {0: (5, "aa"), 1: (5, "aa"), 2: (5, "aa")}, 5)
    assert same.sources == {} and same.restore_step == 5


# ----------------------------------------------------------------------------- service
@pytest.fixture
async def env(nats_server, bus):
    items: list = []
    out: list = []

    async def on_out(m, _e):
        out.append(m)
    await bus.subscribe(bus.subjects.transfer, Transfer, on_out)
    await bus.subscribe(bus.subjects.state_lost, StateLost, on_out)

    class Env:
        async def broker(self, **kw) -> StateBroker:
            b = await Bus.connect(nats_server.url, "test", "state_broker", nats_server.creds)
            s = StateBroker(b, **kw)
            await s.start()
            items.append((s, b))
            return s

        async def plan(self, plan: Plan):
            kv = await bus.kv()
            await kv.put(PLAN_KEY, plan.model_dump_json().encode())
            await bus.publish(bus.subjects.plan, plan)

        async def hb(self, pod, generation, step=-1, digest="", rank=None, role=Role.worker):
            await bus.publish(bus.subjects.heartbeat(pod), Heartbeat(
                pod=pod, role=role, generation=generation, step=step, digest=digest, rank=rank,
                state=AgentState.recovering))

        async def close(self):
            for s, b in items:
                await s.stop()
                await b.close()
            items.clear()

    e = Env()
    e.out = out
    try:
        yield e
    finally:
        await e.close()


async def test_transfer_restore_step_and_sources(env, bus):
    br = await env.broker()
    await env.plan(make_plan(["w0", "w1"]))
    await env.hb("w0", 1)
    await env.hb("w1", 1)
    await until(lambda: env.out, what="generation-1 transfer")
    t1 = env.out[0]
    assert (t1.generation, t1.restore_step, t1.sources) == (1, -1, {1: [0]})
    # training happened; then w1 died and s0 replaced it; members heartbeat generation 2
    await env.hb("w0", 1, step=7, digest="ab")
    await env.hb("w1", 1, step=7, digest="ab")
    await env.plan(make_plan(["w0", "s0", "w2"], generation=2, incident="inc-w1-g1"))
    await env.hb("w0", 2, step=7, digest="ab")
    await asyncio.sleep(0.1)
    assert len(env.out) == 1  # still waiting for s0 and w2
    await env.hb("s0", 2, step=-1)
    await env.hb("w2", 2, step=6, digest="cd")
    await until(lambda: len(env.out) == 2, what="generation-2 transfer")
    t2 = env.out[1]
    assert (t2.generation, t2.restore_step, t2.digest, t2.incident) == (2, 7, "ab", "inc-w1-g1")
    assert t2.sources == {1: [0], 2: [0]} and t2.steps == {0: 7, 1: -1, 2: 6}
    st = br.status()
    assert st["last_transfer"]["restore_step"] == 7 and st["high_water"] == 7
    assert st["pods"]["w0"]["step"] == 7


async def test_wait_timeout_uses_who_reported(env, bus):
    await env.broker(member_wait=0.4, live_s=0.6)
    await env.plan(make_plan(["w0", "w1", "w2"], generation=5))
    await env.hb("w0", 5, step=3, digest="aa")
    await env.hb("w1", 4, step=9, digest="bb")  # an old generation does not count...
    t0 = time.monotonic()
    await until(lambda: env.out, timeout=5, what="transfer after the wait")
    # ...but while its heartbeats were fresh (live_s) the broker waited for its step 9
    assert time.monotonic() - t0 >= 0.5
    t = env.out[0]
    assert t.restore_step == 3 and t.sources == {1: [0], 2: [0]} and t.steps == {0: 3}


async def test_waits_for_a_live_member_holding_the_state(env, bus):
    """Fault during recovery: plan g3 = [w0, s1] while w0 is still stuck building g2's group
    (heartbeating g2 with its committed step). The new member s1 reports step -1 at once;
    deciding at member_wait would declare the state lost. The broker waits for w0 instead."""
    await env.broker(member_wait=0.3, state_wait=10.0, live_s=1.0)
    await env.plan(make_plan(["w0", "s0"], generation=2))
    await env.hb("w0", 2, step=6, digest="aa")
    await env.hb("s0", 2, step=-1)
    await until(lambda: env.out, what="g2 transfer")
    await env.plan(make_plan(["w0", "s1"], generation=3))
    await env.hb("s1", 3, step=-1)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.2:  # w0 stuck in g2, its heartbeat thread alive
        await env.hb("w0", 2, step=6, digest="aa")
        await asyncio.sleep(0.1)
    assert len(env.out) == 1, env.out[1:]
    await env.hb("w0", 3, step=6, digest="aa")
    await until(lambda: len(env.out) == 2, what="g3 transfer")
    t = env.out[1]
    assert isinstance(t, Transfer) and t.restore_step == 6 and t.sources == {1: [0]}


async def test_a_generation_nobody_reported_in_the_member_wait_still_gets_its_transfer(env, bus):
    """Generation 1 on a loaded machine (issue 42's chaos run): the members reported the plan
    only after the member wait, when their model was built. The broker gave the generation
    up with no reporter and never published its transfer: every member waited for it in
    vain, left after its recovery timeout and the job shrank. With nobody reported there
    is nothing to decide: it waits on, and the late members get their transfer."""
    await env.broker(member_wait=0.2, state_wait=0.4, live_s=0.5)
    await env.plan(make_plan(["w0", "w1"]))
    await asyncio.sleep(0.8)  # past both waits, nobody heard
    await env.hb("w0", 1)
    await env.hb("w1", 1)
    await until(lambda: env.out, timeout=10, what="the late generation's transfer")
    t = env.out[0]
    assert isinstance(t, Transfer) and (t.generation, t.sources) == (1, {1: [0]})


async def test_members_alive_are_waited_for_past_the_member_wait(env, bus):
    """Members that heartbeat (alive: still building their model, or stuck a moment in an
    older generation) but have not reported the generation by the member wait are waited
    for (up to ``state_wait``): without them the group cannot form anyway, and deciding
    without rank 0 in generation 1 made rank 1 the source of every rank's start."""
    await env.broker(member_wait=0.2, state_wait=10.0, live_s=0.5)
    await env.plan(make_plan(["w0", "w1", "w2"]))
    await env.hb("w1", 1)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # w0 and w2 alive, not in the generation yet
        await env.hb("w0", 0)
        await env.hb("w2", 0)
        await asyncio.sleep(0.1)
    assert env.out == []
    await env.hb("w0", 1)
    await env.hb("w2", 1)
    await until(lambda: env.out, timeout=10, what="the generation's transfer")
    t = env.out[0]
    assert t.sources == {1: [0], 2: [0]} and t.steps == {0: -1, 1: -1, 2: -1}


def test_broker_refuses_inconsistent_waits():
    with pytest.raises(ValueError, match="state_wait"):
        StateBroker(None, member_wait=5.0, state_wait=1.0)  # type: ignore[arg-type]


async def test_state_lost(env, bus):
    await env.broker()
    await env.plan(make_plan(["w0", "w1"]))
    await env.hb("w0", 1)
    await env.hb("w1", 1)
    await until(lambda: env.out, what="g1 transfer")
    await env.hb("w0", 1, step=4, digest="aa")
    await env.hb("w1", 1, step=4, digest="aa")
    await asyncio.sleep(0.1)
    await env.plan(make_plan(["s0", "s1"], generation=2))
    await env.hb("s0", 2)
    await env.hb("s1", 2)
    await until(lambda: len(env.out) == 2, what="state_lost")
    lost = env.out[1]
    assert isinstance(lost, StateLost) and lost.generation == 2 and "step 4" in lost.reason


async def test_one_transfer_per_generation_across_restart(env, bus):
    await env.broker()
    await env.plan(make_plan(["w0", "w1"], generation=3))
    await env.hb("w0", 3, step=2, digest="aa")
    await env.hb("w1", 3, step=1, digest="bb")
    await until(lambda: env.out, what="transfer")
    for _ in range(3):  # heartbeats go on; the plan message is repeated
        await env.hb("w0", 3, step=2, digest="aa")
        await bus.publish(bus.subjects.plan, make_plan(["w0", "w1"], generation=3))
    await env.close()
    br = await env.broker()  # restart: the stream already holds generation 3's transfer
    await asyncio.sleep(0.4)
    assert len(env.out) == 1 and br.handled_generation == 3


# ----------------------------------------------------------------------------- KV committed
async def _stored(bus) -> int:
    """The high-water mark KV ``committed`` holds (-1: none)."""
    from nats.js.errors import KeyNotFoundError

    from schemas.messages import HighWater
    from schemas.subjects import COMMITTED_KEY

    try:
        entry = await (await bus.kv()).get(COMMITTED_KEY)
    except KeyNotFoundError:
        return -1
    return HighWater.model_validate_json(entry.value).step


async def _until_stored(bus, step: int) -> None:
    got = [-1]

    async def poll():
        while got[0] < step:
            got[0] = await _stored(bus)
            await asyncio.sleep(0.02)
    try:
        await asyncio.wait_for(poll(), 10)
    except asyncio.TimeoutError:
        raise AssertionError(f"KV committed holds {got[0]}, never {step}") from None


async def test_a_restarted_broker_knows_the_committed_step(env, bus):
    """Issue 41: every member and the broker die at once. The broker started in its place
    reads the committed mark from KV, so replacements that hold nothing are a total loss
    (state_lost), not a fresh start from step -1 (which trained the job again from 0)."""
    await env.broker()
    await env.plan(make_plan(["w0", "w1"]))
    await env.hb("w0", 1)
    await env.hb("w1", 1)
    await until(lambda: env.out, what="g1 transfer")
    await env.hb("w0", 1, step=6, digest="aa", rank=0)
    await env.hb("w1", 1, step=6, digest="aa", rank=1)
    await _until_stored(bus, 6)  # written while it runs: a SIGKILL later loses nothing
    await env.close()
    br = await env.broker()
    assert br.high_water == 6
    await env.plan(make_plan(["s0", "s1"], generation=2, incident="inc-w0-g1"))
    await env.hb("s0", 2)
    await env.hb("s1", 2)
    await until(lambda: len(env.out) == 2, what="the restarted broker's verdict")
    lost = env.out[1]
    assert isinstance(lost, StateLost) and lost.generation == 2 and "step 6" in lost.reason


async def test_the_stored_mark_only_rises_and_a_bad_one_is_replaced(nats_server, bus):
    """Two brokers beside each other (a restart overlapping the old one): a write from a
    stale view does not lower the mark; the writer takes the higher one and goes on. A value
    that does not validate is logged, ignored and overwritten by the next mark."""
    from plumbing import logs
    from schemas.subjects import COMMITTED_KEY
    from services.state_broker.high_water import HighWaterRecord

    kv = await bus.kv()
    await kv.put(COMMITTED_KEY, b"not a mark")
    a, b = HighWaterRecord(bus, logs.get("a")), HighWaterRecord(bus, logs.get("b"))
    await a.start()
    await b.start()
    try:
        assert a.step == b.step == -1  # the bad value counts for nothing
        a.note(10, 3, "w0")
        await _until_stored(bus, 10)
        b.note(7, 2, "w1")  # b's revision is stale: its compare-and-set fails, it re-reads
        await until(lambda: b.stored == 10, what="b taking the stored mark")
        assert b.step == 10 and await _stored(bus) == 10
        b.note(12, 4, "w1")
        await _until_stored(bus, 12)
        a.note(11, 4, "w0")
        await until(lambda: a.stored == 12, what="a taking the stored mark")
        assert await _stored(bus) == 12 and a.step == 12
    finally:
        await a.stop()
        await b.stop()


# ----------------------------------------------------------------------------- one trace
def _collector():
    from opentelemetry.sdk.trace import SpanProcessor

    class Collect(SpanProcessor):
        def __init__(self):
            self.spans = []

        def on_end(self, span):
            self.spans.append(span)

    return Collect()


def _sdk_provider():
    from opentelemetry.sdk.trace import TracerProvider

    prov = trace.get_tracer_provider()
    if not isinstance(prov, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        prov = trace.get_tracer_provider()
    return prov if isinstance(prov, TracerProvider) else None


async def test_control_plane_pipeline_one_trace(nats_server, bus):
    """crash -> fault (detect) -> plan g2 with the spare (plan) -> transfer (transfer_plan),
    all spans in one trace, each the parent of the next."""
    prov = _sdk_provider()
    if prov is None:
        pytest.skip("a non-SDK tracer provider is installed")
    col = _collector()
    prov.add_span_processor(col)
    buses = [await Bus.connect(nats_server.url, "test", n, nats_server.creds)
             for n in ("health_monitor", "scaler", "state_broker")]
    svcs = [HealthMonitor(buses[0], fault_timeout=0.3, suspect_timeout=0.1,
                          check_interval=0.02),
            Scaler(buses[1], workers=2, fault_timeout=0.3, lease_ttl=0.6, tick_interval=0.02),
            StateBroker(buses[2])]
    transfers: list[Transfer] = []

    async def on_transfer(t, _e):
        transfers.append(t)
    await bus.subscribe(bus.subjects.transfer, Transfer, on_transfer)
    state = {"w0": [0, None, 5], "w1": [0, None, 5], "s0": [0, None, -1]}  # gen, rank, step

    async def on_plan(p, _e):
        for pod, st in state.items():
            st[0], st[1] = p.generation, p.rank_of(pod)
            await beat(pod)

    async def beat(pod):
        g, r, s = state[pod]
        await bus.publish(bus.subjects.heartbeat(pod), Heartbeat(
            pod=pod, role=Role.spare if pod == "s0" and r is None else Role.worker,
            generation=g, rank=r, step=s, digest="ab" if s >= 0 else "",
            state=AgentState.waiting if r is None else AgentState.training))

    await bus.subscribe(bus.subjects.plan, Plan, on_plan)
    alive = {"w0", "w1", "s0"}

    async def beats():
        while True:
            for pod in list(alive):
                await beat(pod)
            await asyncio.sleep(0.05)
    task = asyncio.create_task(beats())
    try:
        for s in svcs:
            await s.start()
        await until(lambda: len(transfers) == 1, what="generation-1 transfer")
        alive.discard("w1")
        await bus.publish(bus.subjects.lifecycle("w1"), Lifecycle(pod="w1", event="exited",
                                                                  exit_code=137))
        await until(lambda: len(transfers) == 2, what="generation-2 transfer")
        t = transfers[1]
        assert t.generation == 2 and t.incident == "inc-w1-g1" and t.restore_step == 5
        assert t.sources == {1: [0]}
        await asyncio.sleep(0.1)
        named = {s.name: s for s in col.spans
                 if s.attributes.get("ceaseless.incident") == "inc-w1-g1"}
        assert {"detect", "plan", "transfer_plan"} <= set(named)
        d, p, x = named["detect"], named["plan"], named["transfer_plan"]
        assert d.context.trace_id == p.context.trace_id == x.context.trace_id
        assert p.parent.span_id == d.context.span_id and x.parent.span_id == p.context.span_id
        assert x.attributes["ceaseless.restore_step"] == 5
        assert d.attributes["ceaseless.pod"] == "w1"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for s in svcs:
            await s.stop()
        for b in buses:
            await b.close()


def test_transfer_stays_small_with_thousands_of_ranks():
    """Every recipient stripes over at most MAX_SOURCES sources, rotated so that all sources
    serve: the message grows with the recipients, not recipients x sources (a 2,048 -> 4,096
    scale-up named 8M source entries, over NATS' 1 MB payload limit)."""
    from schemas import MAX_PAYLOAD_BYTES
    from services.state_broker.broker import MAX_SOURCES

    n = 4096
    plan = Plan(generation=2, members=[Member(pod=f"p{r}", rank=r) for r in range(n)],
                world_size=n, global_batch_size=n, micro_batch_size=1,
                shares={r: 1 for r in range(n)})
    reported = {r: (9, "aa") for r in range(0, n, 2)} | {r: (-1, "") for r in range(1, n, 2)}
    t = decide_transfer(plan, reported, high_water=9)
    assert t.restore_step == 9 and len(t.sources) == n // 2
    assert all(len(v) == MAX_SOURCES and len(set(v)) == MAX_SOURCES for v in t.sources.values())
    assert {s for v in t.sources.values() for s in v} == set(range(0, n, 2))  # all serve
    assert len(t.model_dump_json()) < MAX_PAYLOAD_BYTES // 4


def test_decide_generation_one_from_the_scripts_own_checkpoint():
    """s.steps(total, start=k): members report step k-1 in generation 1. Rank 0's state is
    the job's (as at step -1), even against a majority that loaded something else; members
    holding the same step and digest receive nothing. Later generations vote as before."""
    plan = make_plan(["a", "b", "c"])
    t = decide_transfer(plan, {0: (9, "aa"), 1: (9, "bb"), 2: (9, "bb")}, high_water=-1)
    assert (t.restore_step, t.digest, t.sources) == (9, "aa", {1: [0], 2: [0]})
    t = decide_transfer(plan, {0: (9, "aa"), 1: (9, "aa"), 2: (-1, "")}, high_water=-1)
    assert (t.restore_step, t.sources) == (9, {2: [0, 1]})
    later = decide_transfer(make_plan(["a", "b", "c"], generation=2),
                            {0: (9, "aa"), 1: (9, "bb"), 2: (9, "bb")}, high_water=9)
    assert later.digest == "bb" and later.sources == {0: [1, 2]}


# ----------------------------------------------------------------------------- sharded (issue 21)
def sharded_plan(n, k, generation=2):
    return Plan(generation=generation, members=[Member(pod=f"p{r}", rank=r) for r in range(n)],
                world_size=n, global_batch_size=n, micro_batch_size=1,
                shares={r: 1 for r in range(n)}, shard_size=k)


def test_sharded_recipient_gets_only_same_position_sources():
    """2x2: rank 1 (shard 1) was replaced by a spare (step -1). It receives from rank 3, the
    other holder of shard 1, never from the shard-0 ranks; nobody else receives."""
    plan = sharded_plan(4, 2)
    t = decide_transfer(plan, {0: (7, "a0"), 1: (-1, ""), 2: (7, "a0"), 3: (7, "a1")}, 7)
    assert isinstance(t, Transfer)
    assert t.restore_step == 7 and t.sources == {1: [3]} and t.digest == "a0"
    # 3 replicas of 2, two new members (ranks 0 and 5): each from its own position, striped
    plan = sharded_plan(6, 2)
    t = decide_transfer(plan, {0: (-1, ""), 1: (7, "b"), 2: (7, "a"), 3: (7, "b"),
                               4: (7, "a"), 5: (-1, "")}, 7)
    assert t.sources == {0: [2, 4], 5: [1, 3]}
    # a minority digest at a position receives from that position's majority
    t = decide_transfer(plan, {0: (7, "a"), 1: (7, "b"), 2: (7, "a"), 3: (7, "x"),
                               4: (7, "a"), 5: (7, "b")}, 7)
    assert t.sources == {3: [1, 5]} and t.digest == "a"


def test_sharded_state_lost_when_a_whole_position_is_behind():
    plan = sharded_plan(4, 2, generation=5)
    lost = decide_transfer(plan, {0: (9, "a"), 1: (8, "b"), 2: (9, "a"), 3: (-1, "")}, 9)
    assert isinstance(lost, StateLost)
    assert "no replica holds shard 1 at step 9" in lost.reason and lost.best_step == 9
    # a position nobody reported
    lost = decide_transfer(plan, {0: (9, "a"), 2: (9, "a")}, 9)
    assert isinstance(lost, StateLost) and "shard 1" in lost.reason
    # all at -1 after something was committed: lost, as unsharded
    lost = decide_transfer(plan, {r: (-1, "") for r in range(4)}, 3)
    assert isinstance(lost, StateLost) and lost.best_step == -1


def test_sharded_position_one_step_behind_finishes_its_pending_step():
    """A fault during a step's last collective (the world's loss sum): shard 1 committed step
    9, shard 0's member did not, but holds step 9's gradients summed (pending). It finishes
    the step at the handoff and is shard 0's source; without it pending the state is lost."""
    plan = sharded_plan(4, 2, generation=4)
    reported = {0: (8, "a"), 1: (9, "b"), 2: (-1, ""), 3: (-1, "")}
    t = decide_transfer(plan, reported, 9, pending={0: 9})
    assert isinstance(t, Transfer)
    assert t.restore_step == 9 and t.sources == {2: [0], 3: [1]} and t.steps[0] == 8
    assert t.digest == ""  # shard 0's digest at step 9 is not known before it is finished
    # a pending step that is not the restore step, or a member not one step behind: lost
    for pend, rep in (({0: 10}, reported), ({0: 9}, {**reported, 0: (7, "a")})):
        lost = decide_transfer(plan, rep, 9, pending=pend)
        assert isinstance(lost, StateLost) and "shard 0 at step 9" in lost.reason
    assert isinstance(decide_transfer(plan, reported, 9), StateLost)
    # a position that has a holder: the pending member receives, as any member behind
    t = decide_transfer(plan, {0: (8, "a"), 1: (9, "b"), 2: (9, "a9"), 3: (9, "b")}, 9,
                        pending={0: 9})
    assert t.restore_step == 9 and t.sources == {0: [2]} and t.digest == "a9"
    # nobody committed step 9: everyone is at 8 and computes it again (pending is moot)
    t = decide_transfer(plan, {0: (8, "a"), 1: (8, "b")}, 8, pending={0: 9, 1: 9})
    assert t.restore_step == 8 and t.sources == {2: [0], 3: [1]}


def test_sharded_generation_one():
    plan = sharded_plan(6, 3, generation=1)
    t = decide_transfer(plan, {r: (-1, "") for r in range(6)}, -1)
    assert t.restore_step == -1 and t.sources == {3: [0], 4: [1], 5: [2]}
    # the scripts restored a checkpoint: replica 0's shards are the job's
    t = decide_transfer(plan, {0: (4, "a"), 1: (4, "b"), 2: (4, "c"), 3: (4, "a"),
                               4: (4, "z"), 5: (-1, "")}, -1)
    assert t.restore_step == 4 and t.digest == "a" and t.sources == {4: [1], 5: [2]}
    # shards of different checkpoints: lost
    lost = decide_transfer(plan, {0: (4, "a"), 1: (3, "b"), 2: (4, "c")}, -1)
    assert isinstance(lost, StateLost) and "one checkpoint" in lost.reason
    # unsharded plans are untouched by the sharded path
    assert decide_transfer(make_plan(["a", "b"]), {0: (-1, ""), 1: (-1, "")}, -1).sources \
        == {1: [0]}


def test_the_broker_waits_for_live_missing_members_sharded_or_not():
    """2x2, restore step 9: rank 1 reported 8, rank 3 (the other holder of shard 1) has not
    reported the generation yet but is alive at step 9: it is waited for (deciding without
    it would declare shard 1 lost). Any live member is (sharded or not); a silent one, or
    one never heard of, is not."""
    class NoBus:
        subjects = None

    b = StateBroker(NoBus())
    now = time.time()
    plan = Plan(generation=3, members=[Member(pod=f"p{r}", rank=r) for r in range(4)],
                world_size=4, global_batch_size=4, micro_batch_size=1,
                shares={r: 1 for r in range(4)}, shard_size=2)
    b.pods["p3"] = Committed(generation=2, step=9, digest="d", rank=3, ts=now)
    b.pods["p2"] = Committed(generation=3, step=9, digest="a", rank=2, ts=now)  # reported
    b.pods["p1"] = Committed(generation=2, step=8, digest="b", rank=1, ts=now - 10 * b.live_s)
    assert b._alive_missing(plan) == ["p3"]
    assert b._alive_missing(plan.model_copy(update={"shard_size": 1})) == ["p3"]
