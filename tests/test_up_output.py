"""What `ceaseless up` and the CLI tell the user (issue 33), on real parts: nats-server,
`ceaseless up`, pods running a script of the user's own (tests/helpers/batch_script.py:
its own step total, batch and start step, none of them `up`'s flags).

* `ceaseless status --json` is pure JSON on stdout (logs go to stderr; the CLI's own
  disconnect is no warning);
* `up`'s header does not claim `--steps` for a script of the user's, it shows the script's
  total once known, and its summary says how many steps this run computed and where it
  resumed;
* without batch flags the plans take the script's batch and no pod warns about it; with
  flags that differ, `up`'s own output warns;
* rank 0's log ends without "Task was destroyed but it is pending!" (no asyncio task is left
  on the agent's loop at exit).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from harness import REPO, Cluster

pytestmark = [pytest.mark.timeout(120)]


def script(steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.helpers.batch_script", "--steps", str(steps), *extra]


def pod_logs(run_dir) -> dict[str, str]:
    return {p.stem: p.read_text() for p in (run_dir / "logs").glob("*.log")}


async def test_status_json_is_pure_json_and_shows_the_scripts_batch(tmp_path):
    """`ceaseless status --json | jq` works: nothing but the JSON document on stdout (the
    status client's own disconnect used to log `[warning] nats disconnected` there first).
    It also shows the scaler sizing plans with the script's batch (no flags given)."""
    run = tmp_path / "st"
    async with Cluster(run, 2, 0, 5, cmd=script(1_000_000), timeout=100) as c:
        await c.wait_rank_step(0, 3, timeout=60)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        st = None
        for _ in range(20):  # the scaler adopts the script's batch at its first step
            p = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "ops.cli", "status", "--json",
                                 "--run-dir", str(run)],
                capture_output=True, text=True, timeout=30, cwd=REPO, env=env)
            assert p.returncode == 0, p.stderr
            st = json.loads(p.stdout)  # the whole of stdout is one JSON document
            assert "nats disconnected" not in p.stdout + p.stderr, (p.stdout, p.stderr)
            if st["services"]["scaler"].get("policy", {}).get("batch_source") == "script":
                break
            await asyncio.sleep(0.5)
        assert st["script"] == {"global_batch_size": 16, "micro_batch_size": 2,
                                "total": 1_000_000, "pod": "w0"}, st["script"]
        pol = st["services"]["scaler"]["policy"]
        assert (pol["global_batch_size"], pol["micro_batch_size"], pol["batch_source"]) == \
            (16, 2, "script"), pol


async def test_up_shows_the_scripts_steps_and_batch_and_leaves_no_task_pending(tmp_path):
    """A script of the user's that resumes from its own checkpoint (start 6) and runs to
    step 40, with its own batch (16 = 2 x 8), under `up --steps 5` and no batch flags: the
    header does not say "5 steps", the script's total is shown once known, the summary
    says 34 computed, resumed from step 6; no pod warns about the batch; and no pod leaves
    an asyncio task pending at exit (rank 0's log used to end with "Task was destroyed but
    it is pending!": the last group's c10d store watcher, nats-py's consumer checks)."""
    run = tmp_path / "own"
    async with Cluster(run, 2, 1, 5, cmd=script(40, "--start", "6"), timeout=100) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
    out = (run / "up.out").read_text()
    header = out.splitlines()[0]
    assert "steps" not in header.replace("its own step count", ""), header
    assert "running `" in header and "the script's batch" in header, header
    assert "script: 40 steps, global batch 16 = 2 x 8 micro-batches (rank 0: w0)" in out, out
    assert ("all 2 members finished at step 40 (34 computed in this run, resumed from "
            "step 6) (exit 0)") in out, out
    s = c.summary()
    assert s["script"] == {"global_batch_size": 16, "micro_batch_size": 2, "total": 40,
                           "pod": "w0"}, s["script"]
    assert "finished at step 40 (34 computed" in s["reason"]
    logs = pod_logs(run)
    for pod in ("w0", "w1"):
        assert "planned for another batch" not in logs[pod], logs[pod][-2000:]
    # 6e: every pod (w0, w1 and the spare) recorded its runtime loop's pending tasks after
    # the session, after a gc.collect(): none; and no log says one was destroyed.
    pending = {p.stem: json.loads(p.read_text()) for p in (run / "pending").glob("*.json")}
    assert set(pending) == {"w0", "w1", "s0"}, pending
    assert all(v == [] for v in pending.values()), pending
    for name, text in logs.items():
        assert "Task was destroyed but it is pending" not in text, (name, text[-3000:])


async def test_up_warns_in_its_output_when_its_batch_flags_differ_from_the_scripts(tmp_path):
    """`up --global-batch-size 32 --micro-batch-size 4` for a script of batch 16 = 2 x 8:
    the plans keep the operator's batch, and `up`'s own output (not only a pod log) warns;
    a script run with its own step count still shows it."""
    run = tmp_path / "flags"
    async with Cluster(run, 2, 0, 5, cmd=script(12),
                       extra=["--global-batch-size", "32", "--micro-batch-size", "4"],
                       timeout=100) as c:
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
    out = (run / "up.out").read_text()
    assert "plans sized for global batch 32 = 4 x 8" in out.splitlines()[0], out
    assert ("WARNING: the script trains with global batch 16 = 2 x 8, but "
            "--global-batch-size 32 --micro-batch-size 4 size the plans for 32 = 4 x 8") \
        in out, out
    assert "all 2 members finished 12 steps (exit 0)" in out, out
    assert {(p.global_batch_size, p.micro_batch_size) for p in c.plans} == {(32, 4)}
    assert "planned for another batch" in pod_logs(run)["w0"]  # the pod says so too
