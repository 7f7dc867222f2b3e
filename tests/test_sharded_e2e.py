"""End to end, sharded (issue 21): `ceaseless up --workers 4 --shard-size 2` trains the example
with FSDP2 inside each of 2 replicas of 2 ranks; real nats-server, services and gloo groups.

One run takes three faults in turn, each answered by a spare (`up` starts a fresh spare for
every failed pod): SIGKILL of a shard rank (rank 1: replica 0, shard 1), SIGSTOP of a rank of
the other replica, SIGKILL of rank 0. It must end bitwise equal to the fault-free run (the
digest combines every shard position's), with no committed step lost; the replacement of
(replica j, shard i) receives shard i only, from the other replica.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from harness import Cluster, log_events

pytestmark = [pytest.mark.timeout(420)]
STEPS = 60
ARGS = ["--shard-size", "2", "--global-batch-size", "32", "--micro-batch-size", "4"]


async def _job(tmp_path, name, spares, fault=None, replace=False):
    async with Cluster(tmp_path / name, 4, spares, STEPS, extra=ARGS, replace=replace) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        assert code == 0, c.output()
        s = c.summary()
        s["plans"] = c.plans
        return s


def _results(run_dir):
    return [json.loads(p.read_text()) for p in sorted((run_dir / "results").glob("*.json"))]


async def test_sharded_faults_end_bitwise_equal(tmp_path):
    ref = await _job(tmp_path, "ref", 0)
    assert ref["param_sha256"] and ref["param_sha256_consistent"], ref
    assert ref["final_step"] == STEPS - 1
    res = _results(tmp_path / "ref")
    assert sorted(tuple(r["shard"]) for r in res) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    stopped: list[int] = []

    async def fault(c):
        h = await c.wait_rank_step(1, 8)
        os.kill(h.pid, signal.SIGKILL)                 # a shard rank
        await c.wait_for(lambda: c.plans and c.plans[-1].generation >= 2, 60, "plan 2")
        await c.wait_spares(1)                         # the replacement spare
        h = await c.wait_rank_step(2, 24)
        stopped.append(h.pid)
        os.kill(h.pid, signal.SIGSTOP)                 # a hang in the other replica
        await c.wait_for(lambda: c.plans[-1].generation >= 3, 60, "plan 3")
        await c.wait_spares(1)
        h = await c.wait_rank_step(0, 40)
        os.kill(h.pid, signal.SIGKILL)                 # rank 0

    try:
        s = await _job(tmp_path, "faults", 1, fault, replace=True)
    finally:
        for pid in stopped:  # by PID: the stopped pod is fenced and killed by the scaler
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert s["final_step"] == STEPS - 1
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    assert s["lost_steps"] == 0
    assert {k: ref["losses"][k] for k in s["losses"]} == s["losses"]
    assert len(s["incidents"]) == 3, s["incidents"]
    assert all(p.shard_size == 2 and p.world_size == 4 for p in s["plans"])
    # the replacement of rank 1 got shard 1 from rank 3 (the other replica) and no one else
    plan2 = next(p for p in s["plans"] if p.generation == 2)
    new_pod = plan2.pod_of(1)
    got = log_events(tmp_path / "faults", new_pod, "joined generation")[0]
    assert got["received"] > 0
    xfer = [r for r in log_events(tmp_path / "faults", "w0", "joined generation")
            if r["generation"] == 2]
    assert xfer and xfer[0]["sent"] == 0  # rank 0 (shard 0) sends nothing for shard 1
