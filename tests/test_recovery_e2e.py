"""End to end: real nats-server, real services, real gloo process groups, real faults.

Each fault run is compared with a fault-free run of the same world size and steps: the
final parameters must be bitwise identical (sha256), no committed step may be lost.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import pytest

from harness import STEPS, Cluster, run_job as _run  # noqa: F401

FUZZ_SECONDS = float(os.environ.get("CEASELESS_FUZZ_SECONDS", "3"))
pytestmark = [pytest.mark.timeout(300)]


def _kill(c: Cluster, rank: int, sig=signal.SIGKILL) -> int:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, sig)
    return h.pid


def _divergence(summary, ref) -> str:
    """What a failed comparison needs to be read without the run's directory (CI keeps none):
    the first step whose logged loss differs, the incidents, the plans' generations."""
    losses = summary.get("losses") or {}
    first = next((k for k in sorted(losses, key=int) if ref["losses"].get(k) != losses[k]), None)
    at = (f"first step whose loss differs: {first} ({losses[first]!r} vs {ref['losses'].get(first)!r})"
          if first is not None else "every logged loss equals the reference's")
    plans = [(p.generation, p.world_size) for p in summary.get("plans", [])]
    return (f"{at}; lost_steps {summary.get('lost_steps')}, committed {summary.get('committed_step')}, "
            f"skipped {summary.get('skipped_steps')}, plans {plans}, incidents {summary.get('incidents')}, "
            f"pod exits {summary.get('pod_exits')}")


def _assert_same(summary, ref, steps=STEPS):
    assert summary["final_step"] == steps - 1
    assert summary["param_sha256"] == ref["param_sha256"], _divergence(summary, ref)
    assert summary["lost_steps"] == 0
    # Killed pods take their loss log with them; every step a survivor logged must match.
    assert summary["losses"], summary
    assert {k: ref["losses"][k] for k in summary["losses"]} == summary["losses"]


def _joined(run_dir, pod: str, generation: int) -> dict:
    """The pod's "joined generation" log record (its received / sent bytes)."""
    for line in (run_dir / "logs" / f"{pod}.log").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "joined generation" and rec.get("generation") == generation:
            return rec
    raise AssertionError(f"{pod} never joined generation {generation}")


async def _spare_holds(c: Cluster, step: int) -> None:
    await c.wait_for(lambda: any(h.role.value == "spare" and h.step >= step
                                 for h in c.hb.values()), 60, f"a spare holding step {step}")


async def test_kill_worker_with_spare(tmp_path, reference):
    async def fault(c):
        await c.wait_rank_step(1, 4)
        await _spare_holds(c, 4)  # the spare follows the job (agent/shadow.py)
        _kill(c, 1)

    s = await _run(tmp_path, "kill1", 2, 1, fault)
    _assert_same(s, reference(2))
    assert len(s["incidents"]) == 1 and s["incidents"][0]["kind"] == "crash"
    assert s["plans"][-1].world_size == 2
    # the promoted spare already held the committed state: nothing was sent to anyone
    assert _joined(tmp_path / "kill1", "s0", 2)["received"] == 0
    assert _joined(tmp_path / "kill1", "w0", 2)["sent"] == 0


async def test_survivors_finish_the_step_they_were_computing(tmp_path, reference):
    """Killed while the others compute (a slow model: 0.15 s per micro-batch), with a spare
    that holds the state: the survivors finish their micro-batches and all-reduce them with
    the spare in the new generation (agent/prejoin.py); the result is bitwise the same."""
    steps = 14
    extra = ["--", sys.executable, "-m", "examples.train_gpt", "--steps", str(steps),
             "--sleep", "0.15"]

    async def fault(c):
        await c.wait_rank_step(1, 6)
        # the spare holds the step rank 1 last committed: the survivor may resume
        await c.wait_for(lambda: any(h.role.value == "spare" and h.step >= c.member(1).step
                                     for h in c.hb.values()), 30, "the spare to catch up")
        _kill(c, 1)

    s = await _run(tmp_path, "resume", 2, 1, fault, steps=steps, extra=extra)
    ref = await _run(tmp_path, "ref-resume", 2, 0, steps=steps,
                     extra=extra[:-2])  # no sleep: the numerics do not depend on it
    _assert_same(s, ref, steps)
    log = (tmp_path / "resume" / "logs" / "w0.log").read_text()
    assert "step resumed in the new generation" in log, log[-3000:]
    assert _joined(tmp_path / "resume", "s0", 2)["received"] == 0


async def test_spare_takes_the_transfer_when_the_script_changes_state_between_steps(tmp_path):
    """An EMA updated after s.step() is state the spare cannot replay: rank 0's checksum at
    the next step differs, the spare stops following, and when promoted it receives the
    state like any replacement -- the result is still bitwise the fault-free one."""
    steps = 40
    extra = ["--", sys.executable, "-m", "examples.train_gpt", "--steps", str(steps),
             "--ema", "0.9"]
    ref = await _run(tmp_path, "ref-ema", 2, 0, steps=steps, extra=extra)
    spare_log = tmp_path / "ema" / "logs" / "s0.log"

    async def fault(c):
        await c.wait_for(lambda: spare_log.exists() and "spare stops following the job"
                         in spare_log.read_text(), 60, "the spare to notice the EMA")
        _kill(c, 1)

    s = await _run(tmp_path, "ema", 2, 1, fault, steps=steps, extra=extra)
    _assert_same(s, ref, steps)
    assert _joined(tmp_path / "ema", "s0", 2)["received"] > 0
    assert "outside s.step()" in spare_log.read_text()


async def test_kill_rank0(tmp_path, reference):
    async def fault(c):
        await c.wait_rank_step(0, 5)
        _kill(c, 0)

    s = await _run(tmp_path, "kill0", 2, 1, fault)
    _assert_same(s, reference(2))


async def test_hang_detected_fenced_replaced(tmp_path, reference):
    stopped = []

    async def fault(c):
        await c.wait_rank_step(1, 4)
        stopped.append(_kill(c, 1, signal.SIGSTOP))

    try:
        s = await _run(tmp_path, "hang", 2, 1, fault)
    finally:
        for pid in stopped:  # fenced processes are SIGKILLed by the scaler; make sure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _assert_same(s, reference(2))
    assert s["incidents"][0]["kind"] in ("lost", "hang")


async def test_two_faults_in_a_row(tmp_path, reference):
    async def fault(c):
        await c.wait_rank_step(1, 3)
        _kill(c, 1)
        await c.wait_for(lambda: len(c.plans) >= 2, 60, "second plan")
        gen = c.plans[-1].generation
        await c.wait_for(lambda: (h := c.member(0)) and h.generation == gen and h.step >= 7,
                         120, "training in the new generation")
        _kill(c, 0)

    s = await _run(tmp_path, "two", 2, 2, fault)
    _assert_same(s, reference(2))
    assert len(s["incidents"]) == 2


async def test_fault_during_recovery(tmp_path, reference):
    """The promoted spare dies while generation 2 is being entered: the survivor abandons
    its g2 rendezvous (a newer plan aborts it) and the broker waits for the survivor's
    committed state instead of declaring it lost."""
    async def fault(c):
        await c.wait_rank_step(1, 4)
        _kill(c, 1)
        # As soon as the replacement plan is out, kill the promoted spare too.
        await c.wait_for(lambda: len(c.plans) >= 2, 60, "replacement plan")
        promoted = c.plans[-1].pod_of(1)
        await c.wait_for(lambda: (h := c.hb.get(promoted)) and h.generation == c.plans[-1].generation,
                         30, "promoted spare adopting the plan")
        os.kill(c.hb[promoted].pid, signal.SIGKILL)

    s = await _run(tmp_path, "during", 2, 2, fault)
    _assert_same(s, reference(2))
    assert len(s["plans"]) >= 3


async def test_kill_without_spare_shrinks(tmp_path, reference):
    """No spare: the world shrinks 3 -> 2, the global batch stays, so the losses of the
    fault run agree with the fixed-size run up to the order of floating-point additions."""
    async def fault(c):
        await c.wait_rank_step(2, 4)
        _kill(c, 2)

    s = await _run(tmp_path, "shrink", 3, 0, fault)
    ref = reference(3)
    assert s["final_step"] == STEPS - 1 and s["lost_steps"] == 0
    assert s["plans"][-1].world_size == 2
    assert sorted(m.rank for m in s["plans"][-1].members) == [0, 1]
    assert len(s["incidents"]) == 1
    losses = s["losses"]
    assert len(losses) == STEPS, sorted(losses)
    for k, v in losses.items():
        assert abs(v - ref["losses"][k]) <= 1e-4 * abs(ref["losses"][k]), (k, v, ref["losses"][k])


async def test_control_plane_restarts_do_not_stop_training(tmp_path, reference):
    """Each service is SIGKILLed mid-training (the supervisor restarts it and it rebuilds
    its view from KV and fresh heartbeats): training never stops, no plan is published
    after the initial one, and the result is bitwise the fault-free run's."""
    def latest(c, name):
        return [pid for n, pid in c.pids() if n == name][-1]

    async def fault(c):
        for i, name in enumerate(("health_monitor", "scaler", "state_broker")):
            await c.wait_rank_step(0, 4 + 8 * i)
            os.kill(latest(c, name), signal.SIGKILL)
            await c.wait_for(lambda n=name: len([1 for m, _ in c.pids() if m == n]) >= 2, 30,
                             f"{name} restarted")
        step = c.member(0).step
        await c.wait_rank_step(0, step + 5)  # still training with the restarted services

    s = await _run(tmp_path, "cp", 2, 1, fault)
    _assert_same(s, reference(2))
    assert s["incidents"] == []
    assert [p.generation for p in s["plans"]] == [1], s["plans"]


async def test_nats_restart_does_not_stop_training(tmp_path, reference):
    """nats-server is SIGKILLed mid-training and restarted on the same port and file store:
    training keeps stepping meanwhile (gloo does not need the bus), every client reconnects,
    the plan survives, and the result is bitwise the fault-free run's."""
    async def fault(c):
        await c.wait_rank_step(0, 6)
        nats_pid = [pid for n, pid in c.pids() if n == "nats-server"][-1]
        os.kill(nats_pid, signal.SIGKILL)
        await c.wait_for(lambda: len([1 for n, _ in c.pids() if n == "nats-server"]) >= 2, 30,
                         "nats-server restarted")
        before = max((h.step for h in c.hb.values() if h.role.value == "worker"), default=-1)
        await c.wait_for(lambda: any(h.step >= before + 5 for h in c.hb.values()), 60,
                         "heartbeats after the restart showing progress")

    s = await _run(tmp_path, "natsrestart", 2, 1, fault)
    _assert_same(s, reference(2))
    assert s["incidents"] == []
    assert [p.generation for p in s["plans"]] == [1], s["plans"]


@pytest.mark.timeout(300 + 8 * FUZZ_SECONDS)
async def test_malformed_traffic_while_training(tmp_path, reference):
    """The malformed messages of the bad-input corpus (random bytes, wrong shapes, wrong
    schema versions, oversized fields, spoofed pods, stale generations) on every job subject,
    over and over for CEASELESS_FUZZ_SECONDS (default 3; docs/reliability.md reports a
    60-second run) while a real job trains: no incident, no new plan, every service alive,
    the result bitwise the fault-free run's."""
    import random
    import time

    from schemas.messages import BY_KIND
    from plumbing.bus import DropError, decode
    from test_bad_input import bad_messages

    # The job must outlast the flood (~20 steps/s unflooded here); the CI default keeps the
    # shared 80-step reference.
    steps = max(STEPS, int(FUZZ_SECONDS * 25))
    sent = {"messages": 0, "rounds": 0}

    async def fault(c):
        await c.wait_rank_step(0, 4)
        bus = c.bus
        corpus = []
        for seed in range(4):
            msgs = []
            for subject, data in bad_messages(bus, random.Random(seed)):
                model = BY_KIND.get(bus.subjects.kind_of(subject) or "")
                try:
                    if model is None or decode(model, data, subject) is None:
                        msgs.append((subject, data))
                except DropError:
                    msgs.append((subject, data))  # only what must be dropped: no real faults
            assert len(msgs) > 300
            corpus.append(msgs)
        t0 = time.monotonic()
        while time.monotonic() - t0 < FUZZ_SECONDS or not sent["rounds"]:
            h = c.member(0)
            if h is None or h.step >= steps - 20:
                break  # keep training steps after the flood to show the job is fine
            for i, (subject, data) in enumerate(corpus[sent["rounds"] % len(corpus)]):
                await bus.nc.publish(subject, data)
                if i % 25 == 0:
                    await bus.nc.flush()
                    await asyncio.sleep(0.01)
                    h = c.member(0)  # a slow round must not outlast the job (seen in CI)
                    if sent["rounds"] and (h is None or h.step >= steps - 20):
                        break
            await bus.nc.flush()
            sent["messages"] += len(corpus[sent["rounds"] % len(corpus)])
            sent["rounds"] += 1
        sent["seconds"] = round(time.monotonic() - t0, 1)
        h = await c.wait_for(lambda: c.member(0), 30, "rank 0 training after the flood")
        await c.wait_rank_step(0, h.step + 3)
        for name in ("health_monitor", "scaler", "state_broker"):
            assert len([1 for n, _ in c.pids() if n == name]) == 1, f"{name} restarted"

    s = await _run(tmp_path, "fuzz", 2, 1, fault, steps=steps)
    print(f"bad input while training: {sent['messages']} messages in {sent['rounds']} rounds "
          f"over {sent.get('seconds')} s, {steps} steps")
    _assert_same(s, reference(2, steps), steps)
    assert s["incidents"] == []
    assert [p.generation for p in s["plans"]] == [1], s["plans"]


async def test_fault_while_the_scaler_is_down(tmp_path, reference):
    """The scaler and a worker die together: the fault happens while nobody can plan. The
    restarted scaler (supervisor) reloads the plan from KV, takes the fault (the monitor's,
    or its own check of silent members) and the spare takes the rank: bitwise result."""
    async def fault(c):
        await c.wait_rank_step(1, 4)
        scaler = [pid for n, pid in c.pids() if n == "scaler"][-1]
        os.kill(scaler, signal.SIGKILL)
        _kill(c, 1)
        await c.wait_for(lambda: len([1 for n, _ in c.pids() if n == "scaler"]) >= 2, 30,
                         "scaler restarted")

    s = await _run(tmp_path, "scalerdown", 2, 1, fault)
    _assert_same(s, reference(2))
    assert [p.generation for p in s["plans"]] == [1, 2], s["plans"]
    assert s["plans"][-1].world_size == 2


async def test_kill_worker_over_tls(tmp_path, reference):
    """`ceaseless up --tls`: the bus serves TLS only (a throw-away CA per run); every service,
    agent and the harness verify it, and recovery works unchanged."""
    pytest.importorskip("cryptography")

    async def fault(c):
        assert c.bus.nc.connected_url.scheme == "tls"
        await c.wait_rank_step(1, 4)
        _kill(c, 1)

    s = await _run(tmp_path, "tls", 2, 1, fault, extra=["--tls"])
    _assert_same(s, reference(2))
    assert len(s["incidents"]) == 1


COLLECTIVE_S, STALL_S, FAULT_S = 8.0, 6.0, 1.5


async def test_member_alive_but_out_of_the_collective_is_replaced(tmp_path, reference,
                                                                   monkeypatch):
    """Issue 24's escape: w1 stays alive but out of step 30's all-reduce, waiting for a plan
    nobody would otherwise send (what the resume-in-place race did). Its peer waits and says
    so; the monitor declares w1 hung within collective timeout + fault timeout, the scaler
    fences it, the spare takes rank 1, and the result is bitwise the fault-free one."""
    ref = reference(2)  # before the hook is in the environment
    monkeypatch.setenv("CEASELESS_TEST_ABSENT", "w1:30")
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", str(COLLECTIVE_S))

    async def fault(c):
        pass  # the hook is the fault; the spares registered before this is called

    s = await _run(tmp_path, "absent", 2, 1, fault,
                   extra=["--stall-timeout", str(STALL_S), "--fault-timeout", str(FAULT_S)])
    _assert_same(s, ref)
    assert [(i["pod"], i["kind"]) for i in s["incidents"]] == [("w1", "hang")], s["incidents"]
    # detection latency runs from the first report of the peer's wait (its all-reduce
    # waited stuck_report_after, 0.5 s, before that); the rule acts at the collective timeout
    lat = s["incidents"][0]["detection_latency"]
    assert COLLECTIVE_S - 0.5 <= lat <= COLLECTIVE_S + FAULT_S, lat
    log = (tmp_path / "absent" / "logs" / "w1.log").read_text()
    assert "test hook: staying out of the collective" in log
    assert _joined(tmp_path / "absent", "s0", 2)


async def test_ranks_are_honest(tmp_path):
    """Issue 23, honest ranks: a spare that is never promoted has no rank before, at and
    after the loop (s.join() says False), so the user's `if s.rank == 0: save()` after the
    loop runs on the member of rank 0 only."""
    steps = 12
    async with Cluster(tmp_path / "ranks", 2, 1, steps,
                       cmd=[sys.executable, "-m", "tests.helpers.ranks_script", str(steps)]) as c:
        await c.wait_spares(1)
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
    d = tmp_path / "ranks" / "ranks"
    await asyncio.sleep(0)  # the spare leaves when the job is done: give it its last write
    recs = {}
    for pod in ("w0", "w1", "s0"):
        for _ in range(100):
            if (d / f"{pod}.json").exists():
                break
            await asyncio.sleep(0.1)
        recs[pod] = json.loads((d / f"{pod}.json").read_text())
    assert recs["s0"] == {"before": [None, None, False], "join": False,
                          "joined": [None, None, False], "after": [None, None, False]}
    for pod, rank in (("w0", 0), ("w1", 1)):
        assert recs[pod]["all_reduce"] == [True, 0.5]  # mean of the ranks 0 and 1
        assert recs[pod]["before"] == [None, None, False]
        assert recs[pod]["join"] is True
        assert recs[pod]["joined"] == recs[pod]["after"] == [rank, 2, True]
    assert (d / "saved").read_text() == "w0"


async def test_failure_after_the_loop_is_not_a_fault(tmp_path, monkeypatch):
    """A member whose script fails after its loop (training done) is not recovered (there is
    nothing to recover; a recovery would wait for state that is final): `up` exits 1 and
    names the pod; no incident, the other member finishes."""
    monkeypatch.setenv("RANKS_FAIL_AFTER", "w0")
    steps = 12
    async with Cluster(tmp_path / "after", 2, 0, steps,
                       cmd=[sys.executable, "-m", "tests.helpers.ranks_script", str(steps)]) as c:
        assert await c.finish() == 1, c.output()
    out = c.output()
    assert "all 2 members finished 12 steps, but w0 exited with 1 after it" in out, out
    s = c.summary()
    assert s["incidents"] == [], s["incidents"]
    assert len(c.plans) == 1, [p.generation for p in c.plans]
    log = (tmp_path / "after" / "logs" / "w0.log").read_text()
    assert "exception after training finished" in log


async def test_liveness_stress_short(tmp_path):
    """The CI-sized `bench.liveness` (issue 24): rank 0 killed while it lingers after its
    step (the spare misses its confirmation) and the survivors wait in the next all-reduce
    (it fails on the dead peer), a busy loop for load. The job must finish, bitwise equal to
    its fault-free run (`python -m bench.liveness --repeats 30` is the full stress)."""
    import argparse

    from bench import liveness

    p = argparse.ArgumentParser()
    liveness.add_arguments(p)
    # 26 steps, not the tool's 40: the kill at step 15 and the recovery take the same steps;
    # the 24 after it (~0.4 s each, rank 0 lingering) showed nothing the first 10 do not
    a = p.parse_args(["--repeats", "1", "--load", "1", "--sleep", "0.02", "--after-step", "0.05",
                      "--rank0-after-step", "0.3", "--steps", "26", "--run-timeout", "120",
                      "--run-dir", str(tmp_path)])
    res = await liveness._main(a)
    (r,) = res["runs"]
    assert not r["hang"], r
    assert r["bitwise"] and r["lost_steps"] == 0, r
