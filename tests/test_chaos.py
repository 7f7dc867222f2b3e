"""`ceaseless chaos`: the seeded schedule, and a ~90-second chaos run end to end.

The e2e run is the real thing: `ceaseless chaos` as a child process, a fault-free reference
run, then the chaos run (real nats-server, services, gloo workers and spares) under every
fault kind of the schedule; it must pass (bitwise result, zero lost steps, every fault
survived). Hard timeout; everything is cleaned up by PID (the chaos process, then every pid
its clusters recorded in pids.txt).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ops.chaos import ELASTIC_KINDS, KINDS, checkpoint_every, make_schedule, percentile
from ops.launcher import REPO, _ours, recorded

CI_SEED = 1
CI_TIMEOUT = 900  # seconds for reference + chaos on a loaded 2-core machine


def test_schedule_is_a_function_of_the_seed():
    a, b = make_schedule(7, 600), make_schedule(7, 600)
    assert a == b
    assert make_schedule(8, 600) != a
    fr = [e.at_fraction for e in a]
    assert fr == sorted(fr) and 0.0 < fr[0] and fr[-1] < 0.85
    assert len(a) == 600 // 8


def test_schedule_covers_every_kind_before_repeating():
    ev = make_schedule(3, 96)
    assert len(ev) == 12
    assert {e.kind for e in ev} == set(KINDS) and "kill_all" in KINDS
    assert not {e.kind for e in make_schedule(3, 600)} & set(ELASTIC_KINDS)
    el = make_schedule(3, 600, elastic=True)
    assert set(ELASTIC_KINDS) <= {e.kind for e in el}
    only = make_schedule(3, 100, kinds=["kill", "hang"])
    assert {e.kind for e in only} == {"kill", "hang"}
    two = make_schedule(CI_SEED, 16, kinds=["kill_all", "kill"])
    assert sorted(e.kind for e in two) == ["kill", "kill_all"]


def test_host_kinds_are_chosen_for_a_host_run_and_spread_over_it():
    """Issue 42: `--kinds host,...` expands to the host kinds this machine can run (no
    partition without namespaces), each is scheduled within the 300 s run, the events stay
    ordered and apart, and only a schedule with host kinds gets `up --hosts 3 --bus-servers
    3 --standbys 1`."""
    from ops.chaos_hosts import HOST_KINDS, UP_ARGS, expand, up_args

    asked = ["host", "kill", "kill_rank0", "hang", "kill_scaler"]
    kinds = expand(asked, None)
    assert kinds == [*HOST_KINDS, "kill", "kill_rank0", "hang", "kill_scaler"]
    assert "partition" not in expand(asked, "network namespaces need root")
    assert expand(["host", "host_loss"], None) == list(HOST_KINDS)
    ev = make_schedule(CI_SEED, 300, kinds=kinds)
    assert len(ev) == 300 // 8 and set(HOST_KINDS) <= {e.kind for e in ev}
    fr = [e.at_fraction for e in ev]
    gap = (0.80 - 0.05) / len(ev)
    assert all(b - a >= 0.3 * gap - 1e-4 for a, b in zip(fr, fr[1:])), fr
    assert up_args([e.kind for e in ev]) == UP_ARGS == ["--hosts", "3", "--bus-servers", "3",
                                                        "--standbys", "1"]
    assert up_args(["kill", "hang"]) == []


async def test_a_lost_host_is_given_back_only_once_its_loss_is_complete(monkeypatch):
    """`up` answers a host loss, then kills the host's processes; until that is done a
    return is refused, and hosts.json still says "up". The tool took that "up" for the
    return: the host stayed lost, the next host loss took the bus's quorum and the job
    could not be planned again (a 300 s host chaos run). It asks once hosts.json says lost.
    (Stubs: `up`'s answers and hosts.json.)"""
    import asyncio

    from ops import chaos_hosts as chh

    states = ["up", "up", "up", "lost"]  # hosts.json while `up` kills, then lost
    asked: list[tuple[str, str]] = []

    def state(ch, name):
        return states.pop(0) if len(states) > 1 else states[0]

    async def host_inject(ch, action, name, for_s=None, state=""):
        asked.append((action, states[0]))

    async def current(ch, name):
        return ""

    class Ch:
        async def wait(self, pred, timeout, what):
            for _ in range(100):
                if got := pred():
                    return got
                await asyncio.sleep(0)
            raise AssertionError(f"waited for {what}")

    class Out:
        detail = ""

    monkeypatch.setattr(chh, "_state", state)
    monkeypatch.setattr(chh, "_host_inject", host_inject)
    monkeypatch.setattr(chh, "_server_current", current)
    await chh._give_back(Ch(), "h3", Out())
    assert asked == [("host-return", "lost")], asked


def test_a_host_is_lost_only_where_the_other_hosts_spares_replace_its_members():
    """`pick_host`: with the default placement of 3 workers + 2 spares over 3 hosts (h1: w0;
    h2: w1, s0; h3: w2, s1) any host can go while both spares are ready; with s1 gone h3
    can (s0 is elsewhere), h2 cannot (its only spare goes with it); with none, no host with
    a member."""
    from ops.chaos_hosts import pick_host
    from ops.placement import place

    hosts = ["h1", "h2", "h3"]
    pods = place(hosts, 3, ["scaler"], 1, 3, 2).pods
    members = {"w0", "w1", "w2"}
    assert [pick_host(hosts, pods, members, {"s0", "s1"}, u) for u in (0, 0.4, 0.9)] == hosts
    assert {pick_host(hosts, pods, members, {"s0"}, u) for u in (0, 0.5, 0.99)} == {"h1", "h3"}
    assert pick_host(hosts, pods, members, {"s0"}, 0, prefer="h2") == "h1"  # h2 cannot go
    assert pick_host(hosts, pods, members, {"s0"}, 0, prefer="h3") == "h3"
    assert pick_host(hosts, pods, members, set(), 0.5) is None
    assert pick_host(["h2", "h3"], pods, members, {"s0", "s1"}, 0) == "h2"  # h1 lost: not up
    # h2 just given back holds nothing: a host with a member goes first, h2 only if none can
    moved = {**pods, "w1": "h3", "s0": "h3"}
    assert {pick_host(hosts, moved, members, {"s0", "s1"}, u) for u in (0, 0.5, 0.99)} == \
        {"h1"}
    assert pick_host(hosts, moved, members, set(), 0.5) == "h2"


def test_a_standby_instance_is_the_control_planes_not_a_pod():
    """kill_all kills pods only: `up --standbys` names its standby instances `<service>-sK`
    in pids.txt, while spares are `s0..`."""
    from ops.chaos import _service_of

    assert _service_of("scaler-s1") == "scaler" and _service_of("health_monitor-s2") == \
        "health_monitor"
    assert [_service_of(n) for n in ("s1", "w0", "nats-server", "w-s1")] == \
        ["s1", "w0", "nats-server", "w-s1"]


def test_kill_all_checkpoints_often_enough_to_recompute_a_little():
    assert checkpoint_every(144) == 10 and checkpoint_every(810) == 32


def test_nan_steps_undone_by_a_total_loss_are_not_expected_skipped():
    """Issue 41 item 10(b): a NaN step committed (skipped) after the checkpoint a later total
    loss restarted from is computed again clean; the reference must skip only what the final
    trajectory skipped, and nothing is excused that no restart undid."""
    from ops.chaos_guards import nan_outcome

    restarts = [{"from_step": 100}, {"from_step": 300}]
    # 90: before restart 0's checkpoint (kept); 120: after it (undone); 250: injected after
    # restart 0, after restart 1's checkpoint? no (250 < 300): kept; 320: undone by restart 1
    injected = [(90, 0), (120, 0), (250, 1), (320, 1), (400, 2)]
    final, failures = nan_outcome(injected, restarts, [90, 250, 400])
    assert final == [90, 250, 400] and failures == []
    # a kept step missing from the final skips is a failure, so is a skip never injected
    final, failures = nan_outcome(injected, restarts, [90, 400, 401])
    assert final == [90, 400, 401]
    assert any("250 was not skipped" in f for f in failures)
    assert any("[401]" in f for f in failures)
    # no restart: every injection must be skipped
    assert nan_outcome([(5, 0)], [], [])[1]


def test_percentile():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    v = [float(i) for i in range(1, 101)]
    assert percentile(v, 50) == 50.0 and percentile(v, 99) == 99.0
    assert percentile([1.0, 2.0, 10.0], 99) == 10.0


def _cleanup(proc: subprocess.Popen, run_dir: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    # every cluster's pids.txt: reference, chaos and the chaos run's restarts (restart-N/)
    for d in (run_dir.iterdir() if run_dir.exists() else []):
        if not d.is_dir():
            continue
        for _, pid, start in recorded(d):
            if _ours(pid, str(run_dir), start):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def _chaos(tmp_path: Path, args: list[str], timeout: float) -> tuple[int, str, Path]:
    """``ceaseless chaos ARGS`` as a child, bounded; everything cleaned up by PID."""
    run_dir = tmp_path / "chaos"
    out = tmp_path / "chaos.out"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "chaos", *args, "--run-dir", str(run_dir)],
            stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"chaos did not finish in {timeout}s:\n{out.read_text()[-4000:]}")
    finally:
        _cleanup(proc, run_dir)
    return code, out.read_text(), run_dir


@pytest.mark.timeout(CI_TIMEOUT + 60)
def test_chaos_90s_passes(tmp_path):
    # every kind but kill_all, which restarts the whole job from a checkpoint (about 25 s on
    # this machine): the next test runs it, and the suite stays within its time budget
    kinds = ",".join(k for k in KINDS if k != "kill_all")
    # --steps: the example trains about 25 steps/s here (17 in the chaos run, beside its
    # spares; not the 9 the tool sizes runs by), and the waits for replacement spares between
    # events cost steps: 810 steps ran out with 4 of 11 events still to come (seen once, on
    # Dec 5, before pods were forked from a zygote); 1150 left ~250 steps unused after the
    # last event, which the reference and the chaos run both paid for. 700 (CI, Dec 7): all
    # 11 events done by step 542, with the spares ready at each event's step (no waits), the
    # reference 44 s, the chaos run 74 s: 500 keeps the same schedule (in fractions of the
    # steps), its last event (step 387) ~70 steps before the tool's end margin (459)
    code, text, run_dir = _chaos(tmp_path, ["--duration", "90", "--seed", str(CI_SEED),
                                            "--workers", "2", "--spares", "2",
                                            "--steps", "500", "--kinds", kinds], CI_TIMEOUT)
    assert code == 0, text[-6000:]
    rep = json.loads((run_dir / "chaos.json").read_text())
    assert rep["failures"] == [], rep["failures"]
    assert rep["faults_injected"] >= 8, text[-4000:]
    assert rep["faults_survived"] == rep["faults_injected"]
    assert rep["lost_steps"] == 0
    assert rep["check"] == "bitwise parameters"
    assert rep["param_sha256"] == rep["reference_sha256"]
    worker_faults = {"kill", "hang", "stall", "kill_rank0", "during_recovery",
                     "kill_with_service"}
    assert rep["incidents"] >= sum(v[0] for k, v in rep["by_kind"].items() if k in worker_faults)
    assert rep["downtime_p50"] is not None
    assert "faults survived" in text and "downtime" in text and "lost steps" in text


KILL_ALL_TIMEOUT = 420


@pytest.mark.timeout(KILL_ALL_TIMEOUT + 60)
def test_chaos_kill_all_restarts_from_a_checkpoint(tmp_path):
    """Every pod SIGKILLed at once (and a worker kill): `up` restarts the job from its newest
    checkpoint in restart-1/, the chaos tool follows it onto the new bus, and the result is
    still bitwise the fault-free one; the steps after the checkpoint are recomputed, not
    lost."""
    code, text, run_dir = _chaos(tmp_path, [
        "--duration", "16", "--seed", str(CI_SEED), "--workers", "2", "--spares", "1",
        "--kinds", "kill_all,kill"], KILL_ALL_TIMEOUT)
    assert code == 0, text[-6000:]
    rep = json.loads((run_dir / "chaos.json").read_text())
    assert rep["failures"] == [], rep["failures"]
    assert rep["by_kind"] == {"kill": [1, 1], "kill_all": [1, 1]}, text[-4000:]
    assert rep["lost_steps"] == 0 and rep["check"] == "bitwise parameters"
    assert rep["param_sha256"] == rep["reference_sha256"]
    (r,) = rep["restarts"]
    assert r["run_dir"].endswith("restart-1") and r["from_step"] is not None
    assert rep["recomputed_steps"] >= 0
    assert "total losses" in text and "recomputed" in text


GUARDS_TIMEOUT = 420


@pytest.mark.timeout(GUARDS_TIMEOUT + 60)
def test_chaos_guards_pass(tmp_path):
    """The guards' events (`--kinds nan,slow,preempt,bitflip`, 3 workers so that a straggler
    stands out from the median): each survived through its guard, the NaN step skipped in the
    chaos run and in the reference run after it, the result bitwise the reference's. 280
    steps: the 4 events (at 9-74% of the steps) were over 100 steps before the end of 400
    (CI, Dec 7), which the chaos run and the reference both trained for nothing."""
    from ops.chaos_guards import GUARD_KINDS

    code, text, run_dir = _chaos(tmp_path, [
        "--duration", "40", "--gap", "10", "--seed", str(CI_SEED), "--workers", "3",
        "--spares", "2", "--steps", "280", "--kinds", ",".join(GUARD_KINDS)], GUARDS_TIMEOUT)
    assert code == 0, text[-6000:]
    rep = json.loads((run_dir / "chaos.json").read_text())
    assert rep["failures"] == [], rep["failures"]
    assert sorted(rep["by_kind"]) == sorted(GUARD_KINDS), text[-4000:]
    assert all(v[0] == v[1] >= 1 for v in rep["by_kind"].values()), rep["by_kind"]
    assert rep["nan_steps"] and rep["skipped_steps"] == rep["nan_steps"]
    assert rep["check"] == "bitwise parameters" and rep["param_sha256"] == rep["reference_sha256"]
    assert rep["goodput"]["effective_ratio"] is not None


def _view(hbs, plan, steps=1000):
    """A ``Chaos`` over synthetic heartbeats and plans (its views read only ``c.hb``,
    ``c.plans`` and whether ``c.proc`` still runs)."""
    from types import SimpleNamespace

    from ops.chaos import Chaos, ChaosOptions

    c = SimpleNamespace(hb={h.pod: h for h in hbs}, plans=[plan],
                        proc=SimpleNamespace(poll=lambda: None))
    return Chaos(c, ChaosOptions(), steps)


def test_a_waiting_spare_that_holds_no_step_is_ready():
    """Issue 41 item 10(a): a spare whose shadow stream ended in this generation (it lagged,
    or a rollback made it diverge) holds step -1 until the next plan; the scaler promotes it
    all the same (the state comes by transfer). The tool required step >= 0, so with no new
    plan coming it waited "not healthy with 1 spare(s) after 120s" while the job trained on."""
    from schemas.messages import AgentState, Heartbeat, Member, Plan, Role

    plan = Plan(generation=7, members=[Member(pod="w0", rank=0), Member(pod="s3", rank=1)],
                world_size=2, global_batch_size=8, micro_batch_size=4, shares={0: 1, 1: 1},
                spares=["s5"], fenced=["w1"])
    hbs = [Heartbeat(pod="w0", role=Role.worker, generation=7, rank=0, step=500,
                     state=AgentState.training),
           Heartbeat(pod="s3", role=Role.worker, generation=7, rank=1, step=500,
                     state=AgentState.training),
           Heartbeat(pod="s5", role=Role.spare, generation=7, step=-1,
                     state=AgentState.waiting),
           Heartbeat(pod="s6", role=Role.spare, generation=7, step=-1,
                     state=AgentState.starting),
           Heartbeat(pod="s7", role=Role.spare, generation=7, step=-1,
                     state=AgentState.waiting),
           Heartbeat(pod="w1", role=Role.spare, generation=6, step=480,
                     state=AgentState.waiting)]
    ch = _view(hbs, plan)
    ch.faulted.add("s7")
    assert ch.healthy()
    assert [h.pod for h in ch.spares()] == ["s5"]
    # and when it is not ready, the tool says why, member by member and spare by spare
    ch.faulted.add("s5")
    why = ch.unready(1)
    assert "ready spares 0 of 1" in why
    assert "spare s5 (g7, step -1): declared faulted" in why
    assert "spare s6 (g7, step -1): state starting" in why
    assert "spare w1 (g6, step 480): fenced in plan g7" in why
    ch.c.hb["s3"] = hbs[1].model_copy(update={"generation": 6})
    assert not ch.healthy() and "member s3 (rank 1): in generation 6" in ch.unready(1)


def test_a_job_of_one_replica_needs_a_spare_that_holds_its_state():
    """With one replica the spare is the only other holder of the state: a fault of the
    replica with spares that hold nothing is a total loss, so such spares are not ready."""
    from schemas.messages import AgentState, Heartbeat, Member, Plan, Role

    plan = Plan(generation=3, members=[Member(pod="w0", rank=0)], world_size=1,
                global_batch_size=8, micro_batch_size=8, shares={0: 1})
    hbs = [Heartbeat(pod="w0", role=Role.worker, generation=3, rank=0, step=40,
                     state=AgentState.training),
           Heartbeat(pod="s1", role=Role.spare, generation=3, step=-1,
                     state=AgentState.waiting),
           Heartbeat(pod="s2", role=Role.spare, generation=3, step=40,
                     state=AgentState.waiting)]
    ch = _view(hbs, plan)
    assert [h.pod for h in ch.spares()] == ["s2"]
    assert "spare s1 (g3, step -1): holds no step, and the job's one replica" in ch.unready(2)
