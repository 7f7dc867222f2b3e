"""The agent's membership state machine in one process, against a real nats-server.

No training processes and no services: the test plays the control plane (it publishes plans
and transfer plans on the bus, writes KV ``done``) and drives one pod's ``Membership`` (a
real ``Runtime`` with its NATS connection, a real gloo group of one) through its phases,
as torchft's ``manager_test.py`` does for its manager. ``plan_arrival`` (what a plan arriving
during a step means) is checked as the pure function it is.
"""

from __future__ import annotations

import asyncio
import time
import threading

import pytest
import torch

from agent.config import AgentConfig
from agent.incident import Timeline
from agent.membership import Membership
from agent.vocab import Phase, StepView, Verdict, plan_arrival
from agent.runtime import Runtime
from agent.train_state import TrainState
from schemas.messages import AgentState, Heartbeat, Member, Plan, Role, Transfer

pytestmark = pytest.mark.timeout(90)


def plan(g: int, members: list[str], spares: tuple[str, ...] = (), apply_step: int | None = None,
         **kw) -> Plan:
    n = len(members)
    return Plan(generation=g, members=[Member(pod=p, rank=r) for r, p in enumerate(members)],
                world_size=n, global_batch_size=4 * n, micro_batch_size=4,
                shares={r: 1 for r in range(n)}, spares=list(spares), apply_step=apply_step,
                **kw)


def pod(nats_server, name: str = "p0", url: str | None = None) -> tuple[Runtime, Membership]:
    cfg = AgentConfig(nats_url=url or nats_server.url, job="test", pod=name,
                      creds_path=str(nats_server.creds_path), collective_timeout=10.0,
                      store_timeout=10.0, recovery_timeout=10.0, shadow_spares=False,
                      exit_on_release=False)
    state = TrainState()
    state.register(model=torch.nn.Linear(3, 2))
    rt = Runtime(cfg)
    rt.start()
    return rt, Membership(cfg, rt, state, Timeline())


async def in_thread(fn, *a):
    return await asyncio.wait_for(asyncio.to_thread(fn, *a), 30)


async def in_daemon(fn, timeout: float = 30.0):
    """``fn()`` on a daemon thread: one that never returns (a wait for a plan that never
    comes) fails the test after ``timeout`` and does not hold the interpreter's exit."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def run() -> None:
        try:
            r = fn()
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(r))
        except BaseException as e:  # noqa: BLE001
            try:
                # bound now: ``e`` is unset once this except block ends, and the callback
                # runs later (a NameError there left the future pending: a false timeout)
                loop.call_soon_threadsafe(lambda e=e: fut.done() or fut.set_exception(e))
            except RuntimeError:  # the loop is gone: the test failed already
                pass

    threading.Thread(target=run, daemon=True).start()
    return await asyncio.wait_for(fut, timeout)


async def until(pred, what: str, timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


async def test_join_discard_recover_and_finish_as_a_spare(bus, nats_server):
    rt, m = pod(nats_server)
    s = bus.subjects
    try:
        assert m.phase is Phase.OUTSIDE and m.rank is None
        joining = asyncio.ensure_future(in_thread(m.recover))
        await bus.publish(s.plan, plan(1, ["p0"]))
        # the broker's part: the pod reports generation 1, then gets its transfer plan
        await until(lambda: rt.hb.generation == 1 and rt.hb.state == AgentState.recovering,
                    "the pod to report generation 1")
        await bus.publish(s.transfer, Transfer(generation=1, restore_step=-1, sources={}))
        assert await joining is True
        assert (m.phase, m.rank, m.world_size, m.generation) == (Phase.MEMBER, 0, 1, 1)
        assert m.group is not None and rt.hb.state == AgentState.training

        # a step is thrown away (a peer error): the pod recovers into the next plan
        m.discard("test: a peer failed")
        assert m.phase is Phase.INTERRUPTED and m.timeline.incident is not None
        again = asyncio.ensure_future(in_thread(m.after_discard))
        await bus.publish(s.plan, plan(2, ["p0"]))
        await until(lambda: rt.hb.generation == 2, "the pod to report generation 2")
        await bus.publish(s.transfer, Transfer(generation=2, restore_step=-1, sources={}))
        assert await again is True
        assert (m.phase, m.generation) == (Phase.MEMBER, 2)

        # a planned plan that makes this pod a spare, entered at the step boundary
        p3 = plan(3, ["p1"], spares=("p0",), apply_step=0)
        await bus.publish(s.plan, p3)
        await until(lambda: m.planned_transition(0) is not None, "the planned plan")
        assert m.planned_transition(0).generation == 3
        leaving = asyncio.ensure_future(in_thread(m.transition, p3))
        await until(lambda: m.phase is Phase.SPARE, "the spare phase")
        assert m.rank is None and rt.hb.role == Role.spare
        kv = await bus.kv()
        await kv.put("done", b'{"step": 5, "generation": 3, "pod": "p1"}')
        assert await leaving is False
        assert m.phase is Phase.FINISHED
        await in_thread(m.leave)
        assert rt.hb.state == AgentState.done
    finally:
        m.close_group()
        rt.stop()


async def test_plans_by_reference_are_joined_like_whole_ones(bus, nats_server, monkeypatch):
    """Issue 45: a plan too large to send whole reaches the pod as a ``PlanRef``: the first
    read from its KV parts, the next built from the held plan by the change it carries
    (its parts never written here: the change alone must do)."""
    from plumbing.plan_wire import INLINE_ENV, for_wire, put_parts
    from schemas import PLAN_KEY

    monkeypatch.setenv(INLINE_ENV, "0")  # the scaler's setting: every plan by reference
    rt, m = pod(nats_server)
    s, kv = bus.subjects, await bus.kv()
    try:
        p1 = plan(1, ["p0"], spares=("p9",))
        ref1, parts = for_wire(p1, None)
        await put_parts(kv, ref1, parts)
        await kv.put(PLAN_KEY, ref1.model_dump_json().encode())
        joining = asyncio.ensure_future(in_thread(m.recover))
        await bus.publish(s.plan, ref1)
        await until(lambda: rt.hb.generation == 1, "the pod to report generation 1")
        await bus.publish(s.transfer, Transfer(generation=1, restore_step=-1, sources={}))
        assert await joining is True and m.plan == p1
        m.discard("test: a peer failed")
        again = asyncio.ensure_future(in_thread(m.after_discard))
        p2 = plan(2, ["p0"], fenced=("p9",))
        ref2, _ = for_wire(p2, p1)
        assert ref2.change is not None
        await bus.publish(s.plan, ref2)
        await until(lambda: rt.hb.generation == 2, "the pod to report generation 2")
        await bus.publish(s.transfer, Transfer(generation=2, restore_step=-1, sources={}))
        assert await again is True
        assert (m.phase, m.generation) == (Phase.MEMBER, 2) and m.plan == p2
    finally:
        m.close_group()
        rt.stop()


async def test_a_plan_and_its_transfer_missed_while_reconnecting_are_caught_up(bus, nats_server):
    """Plans and transfers reach a pod as plain NATS messages: one published while its link
    to the server is down is gone. The pod follows KV ``plan`` (the scaler writes it before
    publishing) and reads the last transfer back from the job's stream, so it enters the
    new generation once its link is back, instead of staying in the old one until a
    timeout makes a second incident."""
    from helpers.cut import Cut

    s = bus.subjects
    kv = await bus.kv()

    async def publish_plan(p: Plan) -> None:  # as the scaler does: KV first, then the subject
        await kv.put("plan", p.model_dump_json().encode())
        await bus.publish(s.plan, p)

    with Cut(nats_server.url) as link:
        rt, m = pod(nats_server, url=link.url)

        def fallback(why: str) -> None:  # the pod would leave the process: fail the test
            raise AssertionError(f"the pod gave up: {why}")

        m.fallback = fallback
        try:
            joining = asyncio.ensure_future(in_daemon(m.recover))
            await publish_plan(plan(1, ["p0"]))
            await until(lambda: rt.hb.generation == 1, "generation 1")
            await bus.publish(s.transfer, Transfer(generation=1, restore_step=-1, sources={}))
            assert await joining is True

            m.discard("test: a peer failed")
            link.cut()
            await until(lambda: not rt.bus.nc.is_connected, "the pod to lose its link")
            await publish_plan(plan(2, ["p0"]))
            await bus.publish(s.transfer, Transfer(generation=2, restore_step=-1, sources={}))
            again = asyncio.ensure_future(in_daemon(m.after_discard))
            link.restore()
            assert await again is True
            assert (m.phase, m.generation) == (Phase.MEMBER, 2)
            assert link.accepted >= 2  # it did reconnect (the same server, a new link)

            # the link breaks again once the pod built generation 3's group and waits for
            # the transfer plan: it misses only that, published meanwhile
            m.discard("test: another peer failed")
            again = asyncio.ensure_future(in_daemon(m.after_discard))
            await publish_plan(plan(3, ["p0"]))
            await until(lambda: rt.hb.generation == 3 and m.group is not None,
                        "generation 3's group")
            link.cut()
            await until(lambda: not rt.bus.nc.is_connected, "the pod to lose its link")
            await bus.publish(s.transfer, Transfer(generation=3, restore_step=-1, sources={}))
            link.restore()
            assert await again is True
            assert (m.phase, m.generation) == (Phase.MEMBER, 3)
        finally:
            m.close_group()
            rt.stop()


async def test_a_plan_without_this_member_releases_it(bus, nats_server):
    rt, m = pod(nats_server)
    s = bus.subjects
    try:
        joining = asyncio.ensure_future(in_thread(m.recover))
        await bus.publish(s.plan, plan(1, ["p0"]))
        await until(lambda: rt.hb.generation == 1, "generation 1")
        await bus.publish(s.transfer, Transfer(generation=1, restore_step=-1, sources={}))
        assert await joining is True
        m.discard("test: the group broke")
        again = asyncio.ensure_future(in_thread(m.after_discard))
        await bus.publish(s.plan, plan(2, ["p1"]))  # neither member nor spare, not fenced
        assert await again is False
        assert m.phase is Phase.RELEASED and m.rank is None
    finally:
        m.close_group()
        rt.stop()


async def test_a_spare_the_job_fenced_leaves_and_a_new_pod_of_that_name_does_not(bus,
                                                                                 nats_server):
    """A spare declared lost while its host was cut off comes back: the plan after its loss
    fences it (services/scaler/policy.py gone_spares) and it leaves, to be replaced, also
    when it never saw the plan that named it (cut off, it sees only the newest plan after
    the heal: the host chaos run's spare followed the job for ever, fenced). A pod is not
    told to leave by a fence older than itself (another run's plans, a reused pod id)."""
    s = bus.subjects
    for named, missed in ((True, False), (False, True), (False, False)):
        rt, m = pod(nats_server)
        left: list[str] = []

        class Left(Exception):
            pass

        def leave(why: str) -> None:  # the real one exits the process (the fallback code)
            left.append(why)
            raise Left(why)

        m.fallback = leave
        try:
            waiting = asyncio.ensure_future(in_daemon(m.recover))
            async def adopted(p: Plan) -> None:  # published again until the pod has it
                for _ in range(10):
                    await bus.publish(s.plan, p)
                    try:
                        return await until(lambda: rt.hb.generation >= p.generation or left,
                                           f"plan {p.generation}", timeout=3.0)
                    except (AssertionError, TimeoutError):
                        continue

            # newer than any plan the module's earlier tests left in KV
            g = 50 if named else 60 if missed else 70
            if named:
                await adopted(plan(g, ["p1"], spares=("p0",)))
                assert rt.hb.generation == g
            # the fence of a run before this pod started, or made while it lived
            await adopted(plan(g + 1, ["p1"], fenced=("p0",),
                               **({} if named or missed else {"ts": time.time() - 3600})))
            if named or missed:
                with pytest.raises(Left):
                    await waiting
                assert left and "fenced" in left[0]
            else:
                assert rt.hb.generation == g + 1 and not left and m.phase is Phase.SPARE
                waiting.cancel()
        finally:
            m.close_group()
            rt.stop()


def test_moves_outside_the_table_are_refused(nats_server):
    rt, m = pod(nats_server)
    try:
        with pytest.raises(RuntimeError, match="not a valid move"):
            m._to(Phase.MEMBER)  # outside -> member skips recovering
        m.phase = Phase.FINISHED
        with pytest.raises(RuntimeError, match="not a valid move"):
            m._to(Phase.RECOVERING)
    finally:
        rt.stop()


def _view(**kw) -> StepView:
    hb = Heartbeat(pod="p0", role=Role.worker, generation=kw.pop("hb_generation", 1), rank=0,
                   step=kw.pop("hb_step", 4), step_time=kw.pop("step_time", 0.1))
    base = dict(joined_generation=1, step_in_flight=5, in_collective=False, aborted=False,
                world_size=2, prejoining=False, hb=hb)
    return StepView(**{**base, **kw})


def test_plan_arrival():
    cfg = AgentConfig(nats_url="nats://127.0.0.1:1", pod="p0")
    fault = plan(2, ["p0", "p9"])          # keeps p0's rank and the world size
    assert plan_arrival(fault, _view(), cfg) is Verdict.RESUME
    assert plan_arrival(fault, _view(in_collective=True), cfg) is Verdict.ABORT
    assert plan_arrival(fault, _view(prejoining=True), cfg) is Verdict.ABORT
    assert plan_arrival(fault, _view(step_time=None), cfg) is Verdict.ABORT   # no median yet
    assert plan_arrival(fault, _view(step_time=10.0), cfg) is Verdict.ABORT   # steps too long
    assert plan_arrival(fault, _view(step_in_flight=None), cfg) is Verdict.ABORT
    assert plan_arrival(plan(2, ["p9", "p0"]), _view(), cfg) is Verdict.ABORT  # rank moved
    assert plan_arrival(plan(2, ["p0", "p9", "p8"]), _view(), cfg) is Verdict.ABORT
    assert plan_arrival(plan(1, ["p0", "p9"]), _view(), cfg) is Verdict.NOTHING  # not newer
    assert plan_arrival(fault, _view(joined_generation=0), cfg) is Verdict.NOTHING
    # planned: at the boundary, unless this pod already started a step at or past it
    assert plan_arrival(plan(2, ["p0"], apply_step=6), _view(), cfg) is Verdict.NOTHING
    assert plan_arrival(plan(2, ["p0"], apply_step=5), _view(), cfg) is Verdict.ABORT
    assert plan_arrival(plan(2, ["p0"], apply_step=3), _view(step_in_flight=None),
                        cfg) is Verdict.NOTHING
    off = AgentConfig(nats_url="nats://127.0.0.1:1", pod="p0", resume_in_place=False)
    assert plan_arrival(fault, _view(), off) is Verdict.ABORT


async def test_a_fault_plan_after_the_steps_all_reduce_aborts_and_does_not_resume(bus, nats_server):
    """The step's all-reduce is over but its commit not yet reported (the heartbeat still
    holds the step before): a fault plan keeping this rank must abort, not resume in place
    (the prejoin would report the step before, the broker restore it, and this member, one
    step ahead, would fail to resume and wait for a plan nobody sends; `bench recovery`
    found it)."""
    rt, m = pod(nats_server)
    try:
        rt.join(1, 2)
        rt.update(generation=1, rank=0, role=Role.worker, step=4, step_time=0.1,
                  state=AgentState.training)
        rt.begin_step(5)
        assert rt.claim_collective(1) is None  # the all-reduce of step 5 starts ...
        rt.end_collective()                    # ... and is over: step 5 commits next
        await bus.publish(bus.subjects.plan, plan(2, ["p0", "p9"]))
        await until(lambda: rt.plan is not None and rt.plan.generation == 2, "the plan")
        assert rt.abort.is_set()
        assert rt.take_prejoin(2) is None
        # the same plan while the step is still being computed is resumed in place
        rt2, _ = pod(nats_server, "p1")
        try:
            rt2.join(1, 2)
            rt2.update(generation=1, rank=0, role=Role.worker, step=4, step_time=0.1,
                       state=AgentState.training)
            rt2.begin_step(5)
            await bus.publish(bus.subjects.plan, plan(3, ["p1", "p9"]))
            await until(lambda: rt2.plan is not None and rt2.plan.generation == 3, "the plan")
            assert not rt2.abort.is_set()
            pre = rt2.take_prejoin(3)
            assert pre is not None
            pre.drop()
        finally:
            rt2.stop()
    finally:
        rt.stop()


def test_the_step_life_moves_only_along_its_table():
    """Runtime's record of the training thread's step (vocab.StepLife): the moves the
    handshakes make are allowed, the step in flight is kept while it is reduced, and a
    move the table does not have (a new step begun inside an all-reduce) is refused."""
    from agent.vocab import StepLife, StepPhase

    life = StepLife().to(StepPhase.COMPUTING, 7)
    life = life.to(StepPhase.REDUCING, life.step, 1.0)
    assert (life.phase, life.step, life.since) == (StepPhase.REDUCING, 7, 1.0)
    with pytest.raises(RuntimeError, match="reducing -> computing"):
        life.to(StepPhase.COMPUTING, 8)
    assert life.to(StepPhase.IDLE) == StepLife()
    cfg = AgentConfig(nats_url="nats://127.0.0.1:1", pod="p0")
    rt = Runtime(cfg)   # not started: the handshakes are plain calls under its lock
    rt.begin_step(3)
    assert rt.claim_collective(1) is None and rt._life.phase is StepPhase.REDUCING
    rt.end_collective()
    assert rt._life == StepLife()
    rt.end_collective()  # a script's metric all-reduce between steps: IDLE stays IDLE


def test_a_plan_reaches_the_training_thread_once():
    """The runtime's inbox: each plan is taken once (Runtime.take_plans); Membership keeps
    the newest it took, whatever order they came in, and a stale or replayed plan is not
    delivered again."""
    from opentelemetry import context as otel_context

    cfg = AgentConfig(nats_url="nats://127.0.0.1:1", pod="p0")
    rt = Runtime(cfg)
    m = Membership(cfg, rt, TrainState(), Timeline())
    ctx = otel_context.Context()
    rt._adopt_plan(plan(1, ["p0"]), ctx)
    rt._adopt_plan(plan(2, ["p0", "p1"]), ctx)
    rt._adopt_plan(plan(2, ["p0", "p1"]), ctx)  # replayed: not delivered again
    rt._adopt_plan(plan(1, ["p0"]), ctx)        # stale
    assert m.newest_plan().plan.generation == 2
    assert rt.take_plans() == []
    assert m.newest_plan().plan.generation == 2 and m.newest_plan().at > 0
    rt._adopt_plan(plan(4, ["p0"], apply_step=9), ctx)
    assert m.planned_transition(8) is None and m.planned_transition(9).generation == 4
