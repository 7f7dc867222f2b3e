"""A total loss together with the control plane (issue 41, item 3): one host that ran every
pod and the state broker (and the scaler, and every service) dies at once.

The state broker's record that the job committed a step must survive it (KV ``committed``):
the restarted broker finds that the members (fresh replacement spares) hold no state although
steps were committed, declares the state lost, and `up` restarts the job from the newest
complete checkpoint (never from step 0), and says which steps it computes again. Real
nats-server, real services, real gloo; everything cleaned up by PID.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from nats.js.errors import KeyNotFoundError

from harness import STEPS, Cluster

pytestmark = [pytest.mark.timeout(300)]

KILLS = {
    "broker": ("state_broker",),
    "broker+scaler": ("state_broker", "scaler"),
    "every_service": ("state_broker", "scaler", "health_monitor", "nats-server"),
}


async def _wait_committed(c: Cluster, step: int, timeout: float = 30) -> int:
    """Wait until the state broker's record (KV `committed`, what a restarted broker
    reads) holds ``step`` or a later one; returns it."""
    from schemas.messages import HighWater
    from schemas.subjects import COMMITTED_KEY

    kv = await c.bus.kv()
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = HighWater.model_validate_json((await kv.get(COMMITTED_KEY)).value).step
        except KeyNotFoundError:
            got = -1
        if got >= step:
            return got
        assert c.proc.poll() is None and time.monotonic() < deadline, \
            f"KV committed at {got}, not {step}:\n{c.output()}"
        await asyncio.sleep(0.05)


def _latest(c: Cluster, name: str) -> int:
    return [pid for n, pid in c.pids() if n == name][-1]


@pytest.mark.parametrize("kill", list(KILLS))
async def test_pods_and_services_killed_at_once_resume_from_the_newest_checkpoint(
        tmp_path, reference, kill):
    """2 workers + 1 spare, replacement pods on, checkpoints every 10 steps. Past the
    step-19 checkpoint every pod and the services named are SIGKILLed together. The job
    must end bitwise equal to the fault-free run, restarted once from the newest complete
    checkpoint, with the steps after it reported as recomputed."""
    from agent import checkpoint

    ref = reference(2)
    ckdir = tmp_path / "ckpt"
    async with Cluster(tmp_path / "loss", 2, 1, STEPS, replace=True, extra=[
            "--checkpoint-dir", str(ckdir), "--checkpoint-every", "10"]) as c:
        await c.wait_spares(1)
        await c.wait_rank_step(0, 25)
        await _wait_committed(c, 25)
        pids = [h.pid for h in c.hb.values()] + [_latest(c, n) for n in KILLS[kill]]
        for pid in pids:  # at once: one host's processes
            os.kill(pid, signal.SIGKILL)
        newest = checkpoint.latest(ckdir)  # nothing killed can complete one any more
        assert newest is not None
        from_step = checkpoint.manifest(newest)["step"]  # the resumed job rotates it away
        code = await c.finish()
        s = c.summary()
        out = (tmp_path / "loss" / "up.out").read_text()
    assert code == 0, out[-4000:]
    assert s["final_step"] == STEPS - 1 and s["param_sha256"] == ref["param_sha256"], out[-4000:]
    assert len(s["restarts"]) == 1, out[-4000:]
    r = s["restarts"][0]
    assert r["from_checkpoint"] == str(newest) and r["from_step"] == from_step, (r, newest)
    # what the broker recorded before the kill, or the checkpoint's own step if newer
    assert r["committed_step"] >= max(25, from_step), r
    assert r["recomputed_steps"] == r["committed_step"] - from_step == s["recomputed_steps"]
    from ops.cluster import recomputed

    _, _, said = recomputed(from_step, r["committed_step"])
    assert f"after the total loss: {said}" in out, out[-4000:]
