"""Issue 32, the non-finite guard: a step whose loss (or gradient) is not finite on any rank
is skipped on every rank alike, listed in summary.json's ``skipped_steps``, and a run with
the same injected NaN gives the same result twice (real pods under ``ceaseless up``)."""

from __future__ import annotations

import pytest

from harness import log_events, run_job

pytestmark = [pytest.mark.timeout(300)]
STEPS, AT = 30, 12


async def _nan(c):
    from schemas.messages import Inject, InjectAction

    await c.wait_rank_step(1, 2)
    await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.nan, rank=1,
                                                      at_step=AT))


async def test_an_injected_nan_step_is_skipped_on_every_rank_and_repeats(tmp_path, reference):
    a = await run_job(tmp_path, "a", 2, 0, fault=_nan, steps=STEPS)
    b = await run_job(tmp_path, "b", 2, 0, fault=_nan, steps=STEPS)
    clean = reference(2, STEPS)
    for s in (a, b):
        assert s["final_step"] == STEPS - 1 and s["skipped_steps"] == [AT], s
        assert s["incidents"] == [] and s["lost_steps"] == 0
        assert s["losses"][str(AT)] is None  # not finite: no loss to show
    assert a["param_sha256"] == b["param_sha256"]  # the same skip, the same result
    assert clean["skipped_steps"] == [] and clean["param_sha256"] != a["param_sha256"]
    warned = {r["step"]: r["ranks"] for pod in ("w0", "w1")
              for r in log_events(tmp_path / "a", pod, "non-finite loss: the step's update is "
                                  "skipped on every rank")}
    assert warned == {AT: [1]}  # every rank names rank 1, whose local loss was NaN
    # the "rollback" policy: back to the copy verified at step 9, steps 10-12 computed
    # again, step 12's data skipped again: the same result as skipping it
    r = await run_job(tmp_path, "rollback", 2, 0, fault=_nan, steps=STEPS,
                      extra=["--on-nonfinite", "rollback", "--verify-every", "5"])
    assert r["skipped_steps"] == [AT] and r["param_sha256"] == a["param_sha256"], r
    for pod in ("w0", "w1"):
        (ev,) = log_events(tmp_path / "rollback", pod, "rolled back to the last verified copy")
        assert ev["reason"] == "nonfinite" and ev["verified"] == 9 and ev["step"] == AT
    rb = [e for e in r["goodput"]["incidents"] if e["recomputed_s"] > 0]
    assert [e["kind"] for e in rb] == ["nonfinite"], r["goodput"]


async def test_preemption_notices_are_planned_departures_not_faults(tmp_path, reference):
    """SIGTERM to a worker (what Kubernetes, Slurm, a spot reclaim send), then ``inject
    preempt`` to rank 0: each leaves at a step boundary the scaler planned, a spare holding
    the state takes its rank, nothing is recomputed, no fault is declared, the leavers exit
    0, and the job ends bitwise equal to the fault-free run."""
    import os
    import signal

    from schemas.messages import Inject, InjectAction

    steps = 80
    left: list[str] = []

    async def notices(c):
        await c.wait_rank_step(1, 8)
        h = c.member(1)
        left.append(h.pod)
        os.kill(h.pid, signal.SIGTERM)
        await c.wait_for(lambda: any(p.generation == 2 and p.rank_of(left[0]) is None
                                     for p in c.plans), 60, "the planned departure")
        await c.wait_for(lambda: any(x.rank == 1 and x.generation == 2 and x.step >= 16
                                     for x in c.hb.values()), 120, "rank 1 taken over")
        h0 = await c.wait_for(lambda: c.member(0), 30, "rank 0's heartbeat")
        left.append(h0.pod)
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.preempt, rank=0,
                                                          deadline_s=60))

    ref = reference(2, steps)
    s = await run_job(tmp_path, "preempted", 2, 2, fault=notices, steps=steps)
    assert s["final_step"] == steps - 1 and s["lost_steps"] == 0, s
    assert s["incidents"] == [], s["incidents"]  # planned: no crash, no lost pod
    assert s["pod_exits"][left[0]] == 0 and s["pod_exits"][left[1]] == 0, s["pod_exits"]
    assert s["generation"] == 3 and s["world_size"] == 2
    reasons = [p.reason for p in s["plans"]]
    assert any(r.startswith(f"preempted: {left[0]}") for r in reasons), reasons
    assert any(r.startswith(f"preempted: {left[1]}") for r in reasons), reasons
    assert all(p.apply_step is not None for p in s["plans"][1:])  # step boundaries
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)


def _straggle(slow: list[str]):
    """The fault: rank 1 computes 6x slower from the step it is at when the injection
    arrives (``inject slow``; slowness does not change the trajectory, so no step is named:
    an injection whose step has passed is refused, and the harness sees a step a heartbeat
    late); its pod into ``slow``."""
    async def straggle(c):
        from schemas.messages import Inject, InjectAction

        await c.wait_rank_step(1, 5)
        slow.append(c.member(1).pod)
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.slow, rank=1,
                                                          factor=6))
    return straggle


async def test_a_straggler_is_swapped_for_a_spare_at_a_step_boundary(tmp_path, reference):
    """``inject slow --factor 6`` to rank 1 of three: the health monitor finds its own compute
    of a step (not the wait for the others) over 2.5x the members' median for 2 s, declares a
    ``straggler``; the scaler swaps it for the live spare at a step boundary (a planned plan,
    nothing recomputed); the slow pod leaves (exit 0); the job ends bitwise equal to the
    fault-free run."""
    steps = 80
    flags = ["--straggler-factor", "2.5", "--straggler-window", "2"]
    slow: list[str] = []
    straggle = _straggle(slow)

    ref = reference(3, steps)  # the straggler settings do not change the trajectory
    s = await run_job(tmp_path, "slow", 3, 1, fault=straggle, steps=steps, extra=flags)
    assert s["final_step"] == steps - 1 and s["lost_steps"] == 0, s
    assert [(i["kind"], i["pod"]) for i in s["incidents"]] == [("straggler", slow[0])], s
    assert s["pod_exits"][slow[0]] == 0, s["pod_exits"]
    swap = [p for p in s["plans"] if p.reason.startswith("straggler:")]
    assert len(swap) == 1 and swap[0].apply_step is not None and swap[0].rank_of(slow[0]) is None
    assert s["world_size"] == 3
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)


async def test_a_flipped_bit_is_found_rolled_back_and_its_pod_replaced(tmp_path, reference):
    """Silent data corruption: one bit of one of rank 1's parameters flipped (``inject
    bitflip``) at step 13 of a 3-replica job verifying every 10 steps. At step 19 the
    digests disagree, every member rolls back to the copy verified at step 9 and computes the
    steps after it again, the majority names rank 1 (a ``corruption`` incident), the spare
    takes its rank, and the job ends bitwise equal to the fault-free run."""
    from schemas.messages import Inject, InjectAction

    steps, flags = 80, ["--verify-every", "10"]
    flipped: list[str] = []

    async def flip(c):
        await c.wait_rank_step(1, 3)
        flipped.append(c.member(1).pod)
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.bitflip, rank=1,
                                                          at_step=13))

    ref = reference(3, steps)  # verification does not change the trajectory
    s = await run_job(tmp_path, "flip", 3, 1, fault=flip, steps=steps, extra=flags)
    assert s["final_step"] == steps - 1, s
    assert [(i["kind"], i["pod"]) for i in s["incidents"]] == [("corruption", flipped[0])], s
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    for pod in ("w0", "w2"):
        assert log_events(tmp_path / "flip", pod, "rolled back to the last verified copy")
    # the goodput ledger: the rollback's recomputed steps (19 -> 9) and the corruption
    # incident, each with where its time went
    g = s["goodput"]
    assert 0 < g["effective_ratio"] < 1 and g["startup_s"] > 0, g
    rb = [e for e in g["incidents"] if e["recomputed_s"] > 0]
    assert len(rb) == 1 and rb[0]["kind"] == "corruption", g
    assert [e["kind"] for e in g["incidents"] if e["recomputed_s"] == 0] == ["corruption"], g
    assert g["lost_s"]["recomputed"] == rb[0]["recomputed_s"] > 0


async def test_with_two_members_a_spare_follows_the_rollback(tmp_path, reference):
    """A flipped bit with 2 members: the digests disagree at step 19, both members roll back
    to the copy of step 9 and nobody is named (no majority of two). The spare followed rank 0
    through step 18: it must drop the discarded steps (rank 0 ends its stream with
    ROLLBACK), never report them again, follow the steps computed again, and the job ends
    bitwise equal to the fault-free run. (Before, the spare held and reported step 18
    while the members computed 10-18 again.)"""
    from schemas.messages import Inject, InjectAction

    steps, flags = 60, ["--verify-every", "10"]
    seen: list = []

    async def flip(c):
        await c.wait_rank_step(1, 3)
        seen.append(c)
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.bitflip, rank=1,
                                                          at_step=13))
        # held above 19 only after the rollback (it held 18 then): while the job runs, as
        # at its end a spare still behind is cut off and holds nothing (a loaded run: 42 of 59)
        await c.wait_for(lambda: any(h.role.value == "spare" and h.step > 19
                                     for h in c.hb.values()),
                         60, "the spare following the steps computed again")

    ref = reference(2, steps)
    s = await run_job(tmp_path, "flip2", 2, 1, fault=flip, steps=steps, extra=flags)
    assert s["final_step"] == steps - 1 and s["incidents"] == [], s
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    for pod in ("w0", "w1"):
        (ev,) = log_events(tmp_path / "flip2", pod, "rolled back to the last verified copy")
        assert ev["verified"] == 9 and ev["step"] == 19, ev
    spare = [h for h in seen[0].hb.values() if h.role.value == "spare"]
    assert len(spare) == 1, seen[0].hb
    (drop,) = log_events(tmp_path / "flip2", spare[0].pod,
                         "the job rolled back: the spare drops the discarded steps")
    assert drop["to_step"] == 9 and drop["held"] > 9, drop


async def test_a_straggler_without_a_spare_computes_fewer_micro_batches(tmp_path, reference):
    """No spare: the scaler cuts the straggler's share of the step's micro-batches by its
    slowness and gives them to the others, at a step boundary, the same members and the
    same global batch. The micro-batches are summed in another order (float64 here: the
    losses agree with the fault-free run within 1e-9), nothing is recomputed."""
    steps = 70
    flags = ["--straggler-factor", "2.5", "--straggler-window", "2", "--dtype", "float64"]
    slow: list[str] = []
    straggle = _straggle(slow)

    ref = reference(3, steps, ("--dtype", "float64"))
    s = await run_job(tmp_path, "share", 3, 0, fault=straggle, steps=steps, extra=flags)
    assert s["final_step"] == steps - 1 and s["lost_steps"] == 0, s
    assert [(i["kind"], i["pod"]) for i in s["incidents"]][:1] == [("straggler", slow[0])], s
    cut = [p for p in s["plans"] if p.reason.startswith("straggler:")]
    assert cut and cut[0].apply_step is not None, [p.reason for p in s["plans"]]
    first = s["plans"][0]
    assert [m.pod for m in cut[0].members] == [m.pod for m in first.members]
    assert cut[0].shares[1] < first.shares[1] and sum(cut[0].shares.values()) == 8
    assert s["world_size"] == 3 and s["param_sha256_consistent"]
    for k, v in ref["losses"].items():
        assert abs(s["losses"][k] - v) <= 1e-9 * abs(v), (k, s["losses"][k], v)


async def _straggler_latency(tmp_path, name: str, workers: int, steps: int) -> tuple[dict, float]:
    """``inject slow --factor 5`` to rank 1 once the job trains at its steady pace, at the
    monitor's defaults (factor 3, window 10 s): the summary and the seconds from the
    injection to the ``straggler`` fault."""
    import time

    from schemas.messages import Fault, Inject, InjectAction

    seen: list[tuple[float, Fault]] = []
    sent: list[float] = []

    async def straggle(c):
        async def on_fault(f, _e):
            seen.append((time.time(), f))
        await c.bus.subscribe(c.bus.subjects.fault, Fault, on_fault)
        await c.wait_rank_step(1, 40)  # its steady pace first
        sent.append(time.time())
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.slow, rank=1,
                                                          factor=5))
        await c.wait_for(lambda: seen, 60, "the straggler fault")

    s = await run_job(tmp_path, name, workers, 1, fault=straggle, steps=steps)
    print(f"straggler x5 among {workers}: declared {seen[0][0] - sent[0]:.2f}s after the "
          f"injection ({seen[0][1].reason})")
    return s, seen[0][0] - sent[0]


@pytest.mark.parametrize("workers", [2, 3])
async def test_a_x5_straggler_is_declared_at_the_defaults(tmp_path, workers):
    """Issue 41: with two members the median of both was the slower one (never declared),
    and among three the x5 member measured ~3.2x the median, so noise restarted the window.
    At the defaults it is declared within 15 s (most of the 10 s window plus the few steps
    its compute median takes to show it), swapped for the spare, and nobody else is."""
    # 250 steps: the x5 phase trained ~50 steps here (declared at step ~90), so the job
    # outlasts a 15 s window even on a machine twice as fast; 600 spent ~17 s on steps after
    # the swap
    steps = 250
    s, took = await _straggler_latency(tmp_path, f"x5-{workers}", workers, steps)
    assert [i["kind"] for i in s["incidents"]] == ["straggler"], s["incidents"]
    assert took <= 15.0, took
    assert s["final_step"] == steps - 1 and s["lost_steps"] == 0


async def test_a_flipped_bit_found_by_a_handoff_before_the_check_is_reported(tmp_path,
                                                                            reference):
    """A bit flipped on rank 1 at step 13, then rank 2 killed at step 16, before the next
    verification (every 10: step 19). The recovery's broker finds rank 1's digest at the
    restore step off the majority's and makes it a recipient. The corrupt replica's
    gradients of steps 13-15 were in every member's update, so the majority's state is not
    the fault-free one either: every member (the spare promoted for rank 2 too, which holds
    no verified copy: it receives it) rolls back to the copy of step 9 at its next commit,
    and rank 1 then names itself (``corruption``; it used to train on unreported, the soak's
    seed 7), so a spare takes its rank too. Bitwise equal to the fault-free run."""
    from schemas.messages import Inject, InjectAction

    steps, flags = 80, ["--verify-every", "10"]
    pods: list[str] = []

    async def flip_then_kill(c):
        await c.wait_rank_step(1, 3)
        pods.extend([c.member(1).pod, c.member(2).pod])
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.bitflip, rank=1,
                                                          at_step=13))
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.kill, rank=2,
                                                          at_step=16))

    s = await run_job(tmp_path, "handoff", 3, 2, fault=flip_then_kill, steps=steps,
                      extra=flags)
    assert s["final_step"] == steps - 1, s
    kinds = {(i["kind"], i["pod"]) for i in s["incidents"]}
    assert ("crash", pods[1]) in kinds and s["lost_steps"] == 0, s
    t = next(r for r in log_events(tmp_path / "handoff", "state_broker", "transfer plan")
             if r["generation"] == 2)
    if len({r for srcs in t["sources"].values() for r in srcs}) > 1:
        assert ("corruption", pods[0]) in kinds, s
        assert log_events(tmp_path / "handoff", pods[0],
                          "replicas disagree at the handoff: silent data corruption")
    else:  # the promoted spare had not applied the restore step yet (a loaded machine, CI):
        # one against one, nobody named (the test below makes that case on purpose)
        assert ("corruption", pods[0]) not in kinds, (s, t)
    ref = reference(3, steps)  # verification does not change the trajectory
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)


async def test_two_holders_that_disagree_at_a_handoff_both_go_back_to_the_verified_copy(
        tmp_path, reference, monkeypatch):
    """As above with a spare that does not follow the job (it holds no step when promoted):
    at the restore step rank 1's digest stands one against rank 0's. Nobody can be named,
    but both states hold the corrupt replica's gradients of steps 13-15, so every member
    goes back to the copy of step 9 all the same (CI once saw the job train on from rank
    0's state instead, its parameters no longer the fault-free run's). Bitwise equal to the
    fault-free run; only the crash is an incident."""
    from schemas.messages import Inject, InjectAction

    monkeypatch.setenv("CEASELESS_SHADOW_SPARES", "0")
    steps, pods = 80, []

    async def flip_then_kill(c):
        await c.wait_rank_step(1, 3)
        pods.extend(c.member(r).pod for r in range(3))
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.bitflip, rank=1,
                                                          at_step=13))
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.kill, rank=2,
                                                          at_step=16))

    s = await run_job(tmp_path, "tie", 3, 1, fault=flip_then_kill, steps=steps,
                      extra=["--verify-every", "10"])
    assert s["final_step"] == steps - 1 and s["lost_steps"] == 0, s
    assert [(i["kind"], i["pod"]) for i in s["incidents"]] == [("crash", pods[2])], s
    t = next(r for r in log_events(tmp_path / "tie", "state_broker", "transfer plan")
             if r["generation"] == 2)
    assert t["restore_step"] == 15 and t["steps"]["1"] == 15 and "1" in t["sources"], t
    for pod in pods[:2]:
        back = log_events(tmp_path / "tie", pod, "rolled back to the last verified copy")
        assert [(b["reason"], b["verified"]) for b in back] == [("corruption", 9)], back
    ref = reference(3, steps)
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
