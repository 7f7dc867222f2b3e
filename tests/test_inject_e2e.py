"""Issue 41 item 4: an injection is carried out or refused with its reason, never dropped.

A drop-in job (``examples/porting/ceaseless_train.py``) sent ``kill --rank 1 --at-step N`` the
moment its first plan is published: the pods hold the plan but have not entered it yet (their
heartbeats name no rank), and the injection used to match no pod and vanish."""

from __future__ import annotations

import sys

import pytest

from harness import Cluster, log_events

pytestmark = [pytest.mark.timeout(300)]
ITERS, AT = 40, 20


async def test_an_injection_sent_at_the_first_plan_is_carried_out(tmp_path):
    from schemas.messages import Decision, Inject, InjectAction

    run = tmp_path / "job"
    cmd = [sys.executable, "examples/porting/ceaseless_train.py", "--max-iters", str(ITERS),
           "--eval-interval", "10", "--out-dir", str(run / "out")]
    answers: list[Decision] = []

    async def on_decision(d: Decision, _e) -> None:
        answers.append(d)

    async with Cluster(run, 2, 1, ITERS, cmd=cmd, replace=True) as c:
        await c.bus.subscribe(c.bus.subjects.decision, Decision, on_decision)
        await c.wait_for(lambda: c.plans, 120, "the first plan")
        inj = Inject(action=InjectAction.kill, rank=1, at_step=AT)
        await c.bus.publish(c.bus.subjects.inject, inj)
        await c.wait_for(lambda: [d for d in answers if d.request_id == inj.request_id], 60,
                         "the injection's answer")
        code = await c.finish()
        assert code == 0, c.output()
        s = c.summary()
    assert [i["kind"] for i in s["incidents"]][:1] == ["crash"], (s["incidents"], c.output())
    assert s["final_step"] == ITERS - 1 and s["lost_steps"] == 0, s
    (d,) = [d for d in answers if d.request_id == inj.request_id]
    assert d.accepted and d.pods == ["w1"] and f"at step {AT}" in d.reason, d
    assert log_events(run, "w1", "injection accepted"), "w1 was rank 1 of the first plan"
    assert "injection accepted" in (run / "up.out").read_text()  # the operator's log too
