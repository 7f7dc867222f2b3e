"""Issue 41 item 4: every injection is carried out or refused with its reason, never dropped.

The pod's side (``agent/inject.py``: ``Inbox``, ``Injector``) and the supervisor's
(``services/actuator/inject.py``), against a real nats-server where a bus is needed."""

from __future__ import annotations

import asyncio
import sys

import pytest

from agent.config import AgentConfig
from agent.inject import Inbox, InjectedFault, Injector
from agent.runtime import Runtime
from schemas.messages import (AgentState, Decision, Heartbeat, Inject, InjectAction, Member,
                              Plan, Role)

from harness import until


def _cfg(pod: str = "w1", **kw) -> AgentConfig:
    kw.setdefault("allow_inject", True)
    return AgentConfig(nats_url="nats://unused:4222", job="test", pod=pod, **kw)


def _plan(members: list[str], g: int = 1) -> Plan:
    n = len(members)
    return Plan(generation=g, members=[Member(pod=p, rank=r) for r, p in enumerate(members)],
                world_size=n, global_batch_size=4 * n, micro_batch_size=4,
                shares={r: 1 for r in range(n)})


def _hb(pod: str = "w1", rank: int | None = None, step: int = -1) -> Heartbeat:
    return Heartbeat(pod=pod, pid=1, role=Role.worker, generation=0 if rank is None else 1,
                     rank=rank, step=step, digest="", state=AgentState.starting)


def test_a_pod_of_the_plan_takes_its_injection_before_it_entered_the_plan():
    """The drop-in's case: the first plan is out, the pods have not entered it (their
    heartbeats name no rank); an injection by rank used to match nobody and vanish."""
    inbox = Inbox(_cfg("w1"))
    inj = Inject(action=InjectAction.kill, rank=1, at_step=60)
    d = inbox.offer(inj, _plan(["w0", "w1"]), _hb("w1"))
    assert d is not None and d.accepted and d.request_id == inj.request_id, d
    assert d.pods == ["w1"] and "rank 1" in d.reason and "step 60" in d.reason, d.reason
    assert Inbox(_cfg("w0")).offer(inj, _plan(["w0", "w1"]), _hb("w0")) is None  # not w0's
    assert inbox.take(59) == [] and inbox.take(60) == [inj] and inbox.take(61) == []


@pytest.mark.parametrize("inj,hb,cfg,why", [
    (Inject(action=InjectAction.nan, rank=1, at_step=5), _hb(rank=1, step=9), {},
     "step 5 already passed"),
    (Inject(action=InjectAction.nan, rank=1, at_step=5), _hb(rank=1, step=5), {},
     "step 5 already passed"),
    (Inject(action=InjectAction.exception, pod="w1"), _hb(), {"allow_inject": False},
     "does not allow injection"),
    (Inject(action=InjectAction.preempt, pod="w1"), _hb(), {}, "not a training member yet"),
])
def test_what_a_pod_cannot_run_is_refused_with_the_reason(inj, hb, cfg, why):
    inbox = Inbox(_cfg("w1", **cfg))
    d = inbox.offer(inj, _plan(["w0", "w1"]), hb)
    assert d is not None and not d.accepted and why in d.reason, d
    assert inbox.take(10**6) == []  # nothing kept


def test_what_the_supervisor_signals_is_not_the_pods():
    inbox = Inbox(_cfg("w1"))
    for a in (InjectAction.kill, InjectAction.hang, InjectAction.resume):
        assert inbox.offer(Inject(action=a, pod="w1"), _plan(["w0", "w1"]), _hb()) is None
    # resume at a step is still a signal; kill at a step is the pod's own
    assert inbox.offer(Inject(action=InjectAction.resume, pod="w1", at_step=3), None, _hb()) is None
    assert inbox.offer(Inject(action=InjectAction.kill, pod="w1", at_step=3), None, _hb()).accepted


def test_an_injection_whose_step_never_comes_is_refused_at_the_end():
    inbox = Inbox(_cfg("w1"))
    inj = Inject(action=InjectAction.nan, pod="w1", at_step=500)
    assert inbox.offer(inj, None, _hb()).accepted
    (d,) = inbox.left(119)
    assert not d.accepted and d.request_id == inj.request_id and "ended at step 119" in d.reason
    assert inbox.left(119) == []


class _Rt:
    """What ``Injector.before_sync`` uses of the runtime: an inbox and the refusal."""

    def __init__(self, inbox: Inbox) -> None:
        self.inbox, self.refused, self.injected_stall = inbox, [], False

    def take_injections(self, step: int) -> list[Inject]:
        return self.inbox.take(step)

    def refuse_injection(self, inj: Inject, reason: str) -> None:
        self.refused.append((inj, reason))


def test_an_injection_taken_after_its_step_is_refused_not_run_late():
    """A spare that joins after the step, or a step whose sync passed while the injection
    was on its way: refused (a NaN one step late would be a fault at another step)."""
    inbox = Inbox(_cfg("w1"))
    late = Inject(action=InjectAction.nan, pod="w1", at_step=7)
    now = Inject(action=InjectAction.nan, pod="w1", at_step=9)
    assert inbox.offer(late, None, _hb()).accepted and inbox.offer(now, None, _hb()).accepted
    rt, inj = _Rt(inbox), Injector(None)
    inj.before_sync(rt, 9)
    assert [(i.at_step, "passed" in why) for i, why in rt.refused] == [(7, True)]
    assert inj.take_nan()  # step 9's runs


def test_two_injections_at_one_step_the_one_that_ends_it_runs_last_a_second_is_refused():
    inbox = Inbox(_cfg("w1"))
    boom, kill, nan = (Inject(action=a, pod="w1", at_step=4) for a in (
        InjectAction.exception, InjectAction.kill, InjectAction.nan))
    for i in (boom, kill, nan):
        assert inbox.offer(i, None, _hb()).accepted
    rt, inj = _Rt(inbox), Injector(None)
    with pytest.raises(InjectedFault):
        inj.before_sync(rt, 4)
    assert inj.take_nan()  # ran before the exception ended the step
    assert [(i.action, "exception came first" in why) for i, why in rt.refused] == [
        (InjectAction.kill, True)]


async def _decisions(bus) -> asyncio.Queue:
    q: asyncio.Queue = asyncio.Queue()

    async def on(d: Decision, _e) -> None:
        q.put_nowait(d)
    await bus.subscribe(bus.subjects.decision, Decision, on)
    return q


async def test_the_runtime_answers_an_injection_by_the_rank_of_a_plan_it_has_not_entered(
        nats_server, bus):
    """A real runtime: the plan published, the injection by rank right after, the pod's
    heartbeat still without a rank. The pod answers accepted and runs it at its step."""
    rt = Runtime(AgentConfig(nats_url=nats_server.url, job="test", pod="w1",
                             creds_path=str(nats_server.creds_path), allow_inject=True))
    await asyncio.to_thread(rt.start)
    try:
        q = await _decisions(bus)
        plan = _plan(["w0", "w1"])
        kv = await bus.kv()
        await kv.put("plan", plan.model_dump_json().encode())  # the scaler's order: KV first
        await bus.publish(bus.subjects.plan, plan)
        inj = Inject(action=InjectAction.exception, rank=1, at_step=3)
        await bus.publish(bus.subjects.inject, inj)
        d = await asyncio.wait_for(q.get(), 10)
        assert d.accepted and d.request_id == inj.request_id and d.pods == ["w1"], d
        assert rt.hb.rank is None  # it had not entered the plan
        assert rt.take_injections(2) == [] and rt.take_injections(3) == [inj]
        late = Inject(action=InjectAction.nan, rank=1, at_step=1)
        rt.update(step=2)
        await bus.publish(bus.subjects.inject, late)
        d = await asyncio.wait_for(q.get(), 10)
        assert not d.accepted and "step 1 already passed" in d.reason, d
    finally:
        await asyncio.to_thread(rt.stop)


async def test_the_supervisor_answers_what_it_signals_and_what_no_pod_can(bus, tmp_path):
    """kill by rank: SIGKILL, answered accepted; a rank nobody holds and a pod that is not
    running: refused with the reason (no pod would answer them); a pod's own refusal is in
    `up`'s log. Real child processes, a real bus."""
    from services.actuator.local import LocalActuator

    act = LocalActuator(bus, [sys.executable, "-c", "import time; time.sleep(60)"], {},
                        tmp_path / "logs", restart_fallback=False, allow_inject=True,
                        replace=False)
    await act.attach()
    q = await _decisions(bus)
    try:
        pods = await act.start(Role.worker, 2)
        ghost = Inject(action=InjectAction.kill, rank=1)
        await bus.publish(bus.subjects.inject, ghost)  # no plan yet
        d = await asyncio.wait_for(q.get(), 10)
        assert not d.accepted and d.request_id == ghost.request_id, d
        assert "no member holds rank 1 yet" in d.reason, d.reason
        plan = _plan(pods)
        await (await bus.kv()).put("plan", plan.model_dump_json().encode())
        await bus.publish(bus.subjects.plan, plan)
        kill = Inject(action=InjectAction.kill, rank=1)
        await bus.publish(bus.subjects.inject, kill)
        d = await asyncio.wait_for(q.get(), 10)
        assert d.accepted and d.pods == [pods[1]] and "SIGKILL" in d.reason, d
        proc = act.procs.get(pods[1])
        if proc is not None:
            await asyncio.wait_for(proc.wait(), 10)
        await until(lambda: pods[1] not in act.running(), 10, "the killed pod gone")
        for inj, why in (
                (Inject(action=InjectAction.kill, rank=5), "no member holds rank 5 in plan g1"),
                (Inject(action=InjectAction.hang, pod=pods[1]), f"{pods[1]} is not running"),
                # a host's injection where `up` runs no emulated hosts (issue 42)
                (Inject(action=InjectAction.host_loss, host="h1"),
                 "this job runs no emulated hosts (`ceaseless up --hosts H`)")):
            await bus.publish(bus.subjects.inject, inj)
            d = await asyncio.wait_for(q.get(), 10)
            assert not d.accepted and d.request_id == inj.request_id and why in d.reason, d
        # where `up` runs emulated hosts, each host injection its handler accepts is answered
        # with what was done (a host-return's answer failed to format: no answer at all)
        ran: list[Inject] = []

        async def on_host(inj: Inject) -> None:
            ran.append(inj)

        act.on_host_inject = on_host
        for inj, what in ((Inject(action=InjectAction.host_loss, host="h1"), "host h1 lost"),
                          (Inject(action=InjectAction.host_return, host="h1"),
                           "host h1 returned"),
                          (Inject(action=InjectAction.partition, host="h2", for_s=10),
                           "host h2 cut off for 10s")):
            await bus.publish(bus.subjects.inject, inj)
            d = await asyncio.wait_for(q.get(), 10)
            assert d.accepted and d.request_id == inj.request_id and what in d.reason, d
        assert [i.action for i in ran] == [InjectAction.host_loss, InjectAction.host_return,
                                           InjectAction.partition]
        # one its pod runs: passed on; the pod's refusal (here published by hand) is in
        # `up`'s log, the actuator's
        nan = Inject(action=InjectAction.nan, pod=pods[0], at_step=3)
        await bus.publish(bus.subjects.inject, nan)
        await until(lambda: nan.request_id in act.injections._passed, 10, "passed to the pod")
        import structlog

        # captured at the logger, not on stdout: where lines go depends on which test of
        # this worker configured the logs first
        with structlog.testing.capture_logs() as cap:
            await bus.publish(bus.subjects.decision, Decision(
                request_id=nan.request_id, accepted=False, reason="inject nan: step 3 passed"))
            await asyncio.wait_for(q.get(), 10)
            await until(lambda: any(e.get("event") == "injection refused"
                                    and "step 3 passed" in str(e.get("reason")) for e in cap),
                        10, "the refusal logged")
    finally:
        await act.shutdown(grace_s=1.0)


async def test_an_injection_by_rank_before_the_plan_message_reads_the_stored_plan(
        nats_server, bus):
    """The plan is in KV but its message has not reached the pod yet (here: never sent):
    an injection by rank reads the stored plan at once and is answered."""
    rt = Runtime(AgentConfig(nats_url=nats_server.url, job="test", pod="w1",
                             creds_path=str(nats_server.creds_path), allow_inject=True))
    await asyncio.to_thread(rt.start)
    try:
        q = await _decisions(bus)
        await (await bus.kv()).put("plan", _plan(["w0", "w1"]).model_dump_json().encode())
        inj = Inject(action=InjectAction.exception, rank=1, at_step=3)
        await bus.publish(bus.subjects.inject, inj)
        d = await asyncio.wait_for(q.get(), 10)
        assert d.accepted and d.request_id == inj.request_id and d.pods == ["w1"], d
    finally:
        await asyncio.to_thread(rt.stop)


def test_a_hosts_injection_names_a_host_and_nothing_else():
    """Inject's host field (issue 42): host-loss / partition / host-return name a host (a
    partition its duration too) and no pod or rank; no other action names a host."""
    from pydantic import ValidationError

    Inject(action=InjectAction.host_loss, host="h2")
    Inject(action=InjectAction.partition, host="h1", for_s=10)
    assert not Inject(action=InjectAction.partition, host="h1", for_s=10).by_pod
    assert not Inject(action=InjectAction.host_return, host="h1").by_pod
    for bad in ({"action": "host-loss"}, {"action": "host-loss", "host": "h1", "rank": 0},
                {"action": "host-loss", "host": "h1", "for_s": 3},
                {"action": "host-return"}, {"action": "host-return", "host": "h1", "for_s": 3},
                {"action": "partition", "host": "h1"},
                {"action": "kill", "rank": 0, "host": "h1"},
                {"action": "host-loss", "host": "node1"}):
        with pytest.raises(ValidationError):
            Inject(**bad)
