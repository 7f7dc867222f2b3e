"""Healing (issue 20): replacement pods keep a job at its size through faults."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from harness import STEPS, Cluster
from services.actuator.replace import ReplacementBudget, is_failure

pytestmark = [pytest.mark.timeout(300)]


def test_the_budget_refuses_a_crash_loop_and_recovers():
    b = ReplacementBudget(limit=2, window_s=10.0)
    assert b.take(0.0) is None and b.refused(0.5) is None and b.take(1.0) is None
    assert "not starting more" in b.refused(1.5)  # no pod started on request either
    refused = b.take(2.0)
    assert refused is not None and "crash loop" in refused and "limit 2" in refused
    # a failure that was not replaced counts too (issue 33): [1, 2, 9.9, 10] in the window
    assert b.take(9.9) is not None and b.take(10.0) is not None
    assert b.refused(19.5) is not None   # 9.9 and 10.0 still within the last 10 s
    assert b.refused(20.0) is None and b.take(20.0) is None  # they left the window
    with pytest.raises(ValueError):
        ReplacementBudget(limit=1, window_s=0)


def test_what_gets_replaced():
    assert is_failure(-9, False) and is_failure(1, False) and is_failure(75, False)
    assert not is_failure(0, False)      # done, or released by a planned shrink
    assert not is_failure(-9, True)      # `up` is shutting the job down


async def test_a_kill_and_a_hang_with_one_spare_keep_the_job_at_full_size(tmp_path):
    """3 workers + 1 spare, replacement pods on: SIGKILL of w1 (the spare takes rank 1 and a
    replacement spare starts), then SIGSTOP of w2 once the replacement follows the job (it
    takes rank 2). The world size never drops and the result is bitwise the fault-free run."""
    steps = 60
    async with Cluster(tmp_path / "ref", 3, 0, steps, extra=["--", *_example(steps)]) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        ref = c.summary()
    # slower steps (same numerics): the replacement must start and follow before the end;
    # slower only while `slow` exists (removed once both faults are handled and replaced)
    slow = tmp_path / "slow"
    slow.touch()
    async with Cluster(tmp_path / "heal", 3, 1, steps, replace=True, extra=[
            "--fault-timeout", "1.5", "--",
            *_example(steps, "--sleep", "0.1", "--sleep-while", str(slow))]) as c:
        await c.wait_spares(1)
        await c.wait_rank_step(1, 8)
        t_kill = time.monotonic()
        os.kill(c.member(1).pid, signal.SIGKILL)
        # the replacement: a new spare that holds the job's state (it follows rank 0)
        first_spare = {p for p, h in c.hb.items() if h.role.value == "spare"}
        await c.wait_for(lambda: any(h.role.value == "spare" and p not in first_spare
                                     and h.step >= 0 for p, h in c.hb.items()),
                         90, "a replacement spare following the job")
        t_ready = time.monotonic() - t_kill
        h = c.member(2)
        gen = c.plans[-1].generation
        os.kill(h.pid, signal.SIGSTOP)
        up_out = tmp_path / "heal" / "up.out"
        await c.wait_for(lambda: c.plans[-1].generation > gen and up_out.read_text().count(
            "replacement started as a spare") >= 2, 90, "w2 replaced, and a spare started")
        slow.unlink()  # nothing left to wait for: the rest of the steps at full speed
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert s["final_step"] == steps - 1 and s["lost_steps"] == 0
    assert s["param_sha256"] == ref["param_sha256"]
    kinds = sorted(i["kind"] for i in s["incidents"])
    assert len(kinds) == 2 and "crash" in kinds, s["incidents"]
    assert all(p.world_size == 3 for p in c.plans), [p.world_size for p in c.plans]
    out = (tmp_path / "heal" / "up.out").read_text()
    assert out.count("replacement started as a spare") >= 2, out[-3000:]
    print(f"replacement spare following the job {t_ready:.2f}s after the kill")


async def test_without_a_spare_the_job_grows_back_to_its_size(tmp_path):
    """3 workers, no spare: SIGKILL of w1 shrinks the job to 2; the replacement pod joins
    and the scaler grows the job back to 3 at a step boundary (after its snooze)."""
    async with Cluster(tmp_path / "grow", 3, 0, 120, replace=True,
                       extra=["--scale-up-snooze", "2", "--dtype", "float64"]) as c:
        await c.wait_rank_step(1, 10)
        t_kill = time.monotonic()
        os.kill(c.member(1).pid, signal.SIGKILL)
        await c.wait_for(lambda: c.plans and c.plans[-1].world_size == 2, 60, "the shrink")
        await c.wait_for(lambda: c.plans[-1].world_size == 3, 90, "back at 3 replicas")
        back = time.monotonic() - t_kill
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert s["final_step"] == 119 and s["lost_steps"] == 0 and s["param_sha256_consistent"]
    assert back < 30, back
    print(f"back at full size {back:.2f}s after the kill")


def _example(steps: int, *args: str) -> list[str]:
    return [sys.executable, "-m", "examples.train_gpt", "--steps", str(steps), *args]


HANG_TIMEOUTS = ["--stall-timeout", "2.5", "--fault-timeout", "1.5"]


async def test_a_training_thread_hang_is_found_by_its_own_watchdog(tmp_path, monkeypatch):
    """A member whose training thread hangs in user code while its heartbeats go on: its
    own stall watchdog reports it within the stall timeout (+1 s; before its peer's
    collective times out, 3 s), the spare takes its rank, and the result is bitwise the
    fault-free run. (Rank 1: a hung rank 0 never confirms its last step to the spare, which
    then takes the state from the other members; with no other member that is the
    last-resort checkpoint's case.)"""
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", "3")
    steps = 24
    async with Cluster(tmp_path / "ref", 2, 0, steps,
                       extra=[*HANG_TIMEOUTS, "--", *_example(steps)]) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        ref = c.summary()
    async with Cluster(tmp_path / "hang", 2, 1, steps, extra=[
            *HANG_TIMEOUTS, "--", *_example(steps, "--hang-at-step", "10", "--hang-rank", "1",
                                            "--sleep", "0.02")]) as c:
        await c.wait_spares(1)
        h = await c.wait_rank_step(1, 10)
        t_hang = time.monotonic()
        assert h.step == 10  # it hangs after committing step 10
        await c.wait_for(lambda: len(c.plans) >= 2, 30, "the plan that replaces rank 0")
        took = time.monotonic() - t_hang
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert [(i["pod"], i["kind"]) for i in s["incidents"]] == [("w1", "hang")], s["incidents"]
    assert "own watchdog" in (tmp_path / "hang" / "up.out").read_text()
    assert took <= 2.5 + 1.0, took
    assert s["final_step"] == steps - 1 and s["param_sha256"] == ref["param_sha256"]


async def test_rank0_work_within_the_stall_timeout_is_no_alarm(tmp_path, monkeypatch):
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", "3")
    steps = 12
    async with Cluster(tmp_path / "slow", 2, 0, steps, extra=[
            *HANG_TIMEOUTS, "--", *_example(steps, "--rank0-after-step", "1.5",
                                            "--rank0-every", "4")]) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert s["incidents"] == [] and s["final_step"] == steps - 1


async def test_every_pod_killed_at_once_resumes_from_the_last_checkpoint(tmp_path, reference):
    """Last resort: checkpoints every 10 steps; SIGKILL of every pod at once (no holder of
    the state survives: the job ends, state lost). A new `ceaseless up --resume` starts from
    the newest complete checkpoint, recomputes the steps after it, and ends bitwise equal to
    the fault-free run."""
    ref = reference(2)
    ckdir = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "10"]
    async with Cluster(tmp_path / "lost", 2, 0, STEPS, extra=[*flags, "--auto-resume", "0"]) as c:
        await c.wait_rank_step(0, 25)
        for h in list(c.hb.values()):
            os.kill(h.pid, signal.SIGKILL)
        code = await c.finish()
    assert code in (1, 2), c.output()  # every pod gone / training state lost
    from agent import checkpoint

    last = checkpoint.latest(ckdir)
    assert last is not None and last.name in ("step-00000019", "step-00000029"), last
    async with Cluster(tmp_path / "resumed", 2, 0, STEPS,
                       extra=[*flags, "--resume", str(ckdir)]) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert s["final_step"] == STEPS - 1
    assert s["param_sha256"] == ref["param_sha256"]
    log = (tmp_path / "resumed" / "logs" / "w0.log").read_text()
    assert "resumed from a checkpoint" in log
    assert checkpoint.latest(ckdir).name == f"step-{STEPS - 1:08d}"  # the final one


async def test_a_total_loss_restarts_from_the_checkpoint_by_itself(tmp_path, reference):
    """The same total loss with replacement pods on and nothing done by hand: the broker
    finds no holder (the replacements hold nothing), `up` restarts the job from the newest
    checkpoint in restart-1/, and the run ends bitwise equal to the fault-free one."""
    ref = reference(2)
    ckdir = tmp_path / "ckpt"
    async with Cluster(tmp_path / "auto", 2, 0, STEPS, replace=True, extra=[
            "--checkpoint-dir", str(ckdir), "--checkpoint-every", "10"]) as c:
        await c.wait_rank_step(0, 25)
        for h in list(c.hb.values()):
            os.kill(h.pid, signal.SIGKILL)
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert s["final_step"] == STEPS - 1 and s["param_sha256"] == ref["param_sha256"]
    assert len(s["restarts"]) == 1 and "step-000000" in s["restarts"][0]["from_checkpoint"]
    out = (tmp_path / "auto" / "up.out").read_text()
    assert "restarting from" in out


async def test_stopping_the_job_writes_a_final_checkpoint_to_resume_from(tmp_path):
    """SIGTERM to `ceaseless up` (a user's Ctrl-C, a scheduler's stop): rank 0 writes a
    checkpoint at its next step boundary before the pods are stopped (none would be due for
    1000 steps); `--resume` from it ends bitwise equal to the uninterrupted run."""
    steps = 40
    async with Cluster(tmp_path / "ref", 2, 0, steps, extra=["--", *_example(steps)]) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        ref = c.summary()
    ckdir = tmp_path / "ckpt"
    flags = ["--checkpoint-dir", str(ckdir), "--checkpoint-every", "1000"]
    async with Cluster(tmp_path / "stopped", 2, 0, steps, extra=[
            *flags, "--", *_example(steps, "--sleep", "0.05")]) as c:
        await c.wait_rank_step(0, 10)
        c.proc.send_signal(signal.SIGTERM)
        assert await c.finish() == 130, c.output()
    out = (tmp_path / "stopped" / "up.out").read_text()
    assert "final checkpoint" in out, out[-2000:]
    from agent import checkpoint

    last = checkpoint.latest(ckdir)
    assert last is not None and 10 <= int(last.name.split("-")[1]) < steps - 1, last
    async with Cluster(tmp_path / "resumed", 2, 0, steps, extra=[
            *flags, "--resume", str(ckdir), "--", *_example(steps)]) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    assert s["final_step"] == steps - 1 and s["param_sha256"] == ref["param_sha256"]


def _default_example(tmp_path, *args: str) -> list[str]:
    """The command `up` runs by default (what the session's `reference` runs), plus args."""
    from ops.cluster import UpOptions, _default_data, default_cmd

    return [*default_cmd(UpOptions(steps=STEPS), _default_data(tmp_path / "data")), *args]


async def test_a_spare_started_after_an_auto_resume_takes_the_state_from_its_peers(
        tmp_path, reference):
    """Issue 33 (5): after a total loss the job resumes in restart-1/ from checkpoint C and
    goes on checkpointing (keep 1), which deletes C. A worker is killed: the spare takes its
    rank and the replacement spare `up` starts must take the job's state from its peers
    (it never loads C, which is gone): it follows the job, is promoted when rank 1 is killed
    again, and the job ends bitwise equal to the fault-free run."""
    import re

    from agent import checkpoint

    ref = reference(2)
    ckdir = tmp_path / "ckpt"
    cmd = _default_example(tmp_path, "--sleep", "0.04")  # same numerics, slower steps
    async with Cluster(tmp_path / "auto", 2, 1, STEPS, replace=True, extra=[
            "--checkpoint-dir", str(ckdir), "--checkpoint-every", "5",
            "--checkpoint-keep", "1", "--", *cmd]) as c:
        await c.wait_spares(1)
        await c.wait_rank_step(0, 6)
        for h in list(c.hb.values()):
            os.kill(h.pid, signal.SIGKILL)
        await c.wait_for(lambda: c.job_dir() != c.run_dir, 60, "the restart")
        await c.reattach()
        out = lambda: (c.run_dir / "up.out").read_text()  # noqa: E731
        found = Path(re.search(r"restarting from (\S+)", out()).group(1))
        logs = c.job_dir() / "logs"

        checked = [0.0]

        def no_crash_loop() -> bool:
            if time.monotonic() - checked[0] < 0.5:
                return True
            checked[0] = time.monotonic()
            for p in logs.glob("*.log"):
                text = p.read_text(errors="replace")
                assert "no complete checkpoint" not in text, \
                    f"{p.name} loaded the checkpoint the job resumed from:\n{text[-2000:]}"
            return True

        def kill_rank(rank: int) -> None:  # the newest generation's member of that rank
            h = max((h for h in c.hb.values() if h.rank == rank
                     and h.state.value == "training"), key=lambda h: h.generation)
            os.kill(h.pid, signal.SIGKILL)

        await c.wait_spares(1)
        # the resumed job's own checkpoints rotated the one it started from away
        await c.wait_for(lambda: not (found / "manifest.json").exists(), 60,
                         f"{found.name} rotated away")
        first = set(c.hb)
        kill_rank(1)
        new = await c.wait_for(
            lambda: no_crash_loop() and next((p for p, h in c.hb.items() if p not in first
                                              and h.role.value == "spare" and h.step >= 0),
                                             None),
            60, "a replacement spare following the job")
        kill_rank(1)  # the promoted spare: now the replacement's turn
        await c.wait_for(lambda: no_crash_loop() and c.hb[new].rank is not None, 60,
                         f"{new} promoted")
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
        checked[0] = 0.0
        no_crash_loop()
    assert s["final_step"] == STEPS - 1 and s["param_sha256"] == ref["param_sha256"]
    assert len(s["restarts"]) == 1 and s["restarts"][0]["from_checkpoint"] == str(found)


async def test_a_command_that_fails_at_start_stops_up_at_once_with_its_error(tmp_path):
    """Issue 33 (3): every pod fails before it ever heartbeats (an import error in the
    script). `up` (replacement pods on, its default) prints the end of the pods' logs
    itself and stops within seconds with a non-zero exit, instead of waiting out the
    start timeout (120 s here) or replacing them in a loop."""
    t0 = time.monotonic()
    async with Cluster(tmp_path / "bad", 2, 1, 10, replace=True,
                       cmd=[sys.executable, "-c", "import nonexistent_mod"]) as c:
        code = await c.finish(60)
    took = time.monotonic() - t0
    out = (tmp_path / "bad" / "up.out").read_text()
    assert code == 1, out[-3000:]
    assert "ModuleNotFoundError: No module named 'nonexistent_mod'" in out, out[-3000:]
    assert "failed before it started training" in out and "every pod failed" in out, out[-3000:]
    assert "  | Traceback" in out  # the log's tail, as the pod wrote it
    assert "restarting from" not in out  # no auto-resume of a command that cannot start
    assert took < 30, (took, out[-3000:])
    s = json.loads((tmp_path / "bad" / "summary.json").read_text())
    assert "every pod failed before it started training" in s["reason"]


async def test_every_failed_pod_counts_against_the_crash_loop_budget(tmp_path):
    """Issue 33 (5): pods asked for on the bus (as a keeper of the spare pool does) that
    fail at start, not replaced (--no-replace), count against the crash-loop budget: once
    2 failed (--max-replacements 2), the actuator refuses to start more, saying why. Each
    is reported by `up` with its error (it failed before it ever heartbeated), and the
    job, which never needed them, trains on and finishes."""
    from schemas.messages import ActuatorAction, ActuatorCommand, ActuatorReply, Role

    script = ("import os, runpy, sys\n"
              "if os.environ['CEASELESS_ROLE'] == 'spare':\n"
              "    sys.exit('spares fail at start on purpose')\n"
              "sys.argv = ['train_gpt', *sys.argv[1:]]\n"
              "runpy.run_module('examples.train_gpt', run_name='__main__')\n")
    cmd = [sys.executable, "-c", script, "--steps", "40", "--sleep", "0.02"]
    async with Cluster(tmp_path / "loop", 1, 0, 40, extra=["--max-replacements", "2"],
                       cmd=cmd) as c:
        await c.wait_rank_step(0, 1)

        async def ask() -> ActuatorReply:
            return await c.bus.request(c.bus.subjects.actuator, ActuatorCommand(
                action=ActuatorAction.start, role=Role.spare, count=1,
                reason="test: keep the spare pool full"), ActuatorReply, timeout=10)

        started = []
        for _ in range(2):
            r = await ask()
            assert r.ok, r
            started += r.pods
            await c.wait_for(lambda: all(p in _exits(c) for p in started), 30,
                             f"{started} failed")
        r = await ask()
        assert not r.ok and "crash loop" in r.error and "limit 2" in r.error, r
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
    out = (tmp_path / "loop" / "up.out").read_text()
    for pod in started:
        assert f"pod {pod} failed before it started training (exit 1)" in out, out[-3000:]
    assert "spares fail at start on purpose" in out
    assert c.summary()["final_step"] == 39


def _exits(c: Cluster) -> dict[str, int]:
    """The pods `up`'s actuator saw exit, from its log lines in up.out."""
    import re

    out = {}
    for line in (c.run_dir / "up.out").read_text().splitlines():
        if "pod exited" in line or "failed before it started training" in line:
            code, pod = re.search(r"exit_code=(-?\d+)", line), re.search(r"pod=(\w+)", line)
            if code and pod:
                out[pod.group(1)] = int(code.group(1))
    return out


async def test_a_command_that_cannot_run_at_all_is_a_failed_start_too(tmp_path):
    """Issue 33 (3): a wrong `python` (no such program): the pod cannot even be started. It
    is reported like a pod that failed at start (exit 127, the error in its log and in
    `up`'s output), and `up` stops at once, cleaning up its bus and services."""
    t0 = time.monotonic()
    async with Cluster(tmp_path / "nopy", 2, 1, 10, replace=True,
                       cmd=[str(tmp_path / "no-such-python"), "-c", "pass"]) as c:
        code = await c.finish(60)
        pids = c.pids()
    took = time.monotonic() - t0
    out = (tmp_path / "nopy" / "up.out").read_text()
    assert code == 1, out[-3000:]
    assert "FileNotFoundError" in out and "no-such-python" in out, out[-3000:]
    assert "every pod failed before it started training" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]  # `up` itself did not crash
    assert took < 30, (took, out[-3000:])
    from harness import _ours

    alive = [(n, p) for n, p in pids if _ours(p, str(tmp_path / "nopy"))]
    assert not alive, alive  # nats-server and the services stopped with `up`
