"""Abortable collectives on real gloo process groups (one process per rank, NATS store)."""

from __future__ import annotations

import signal
import time

import pytest

from helpers.procs import Group, nats_cfg

pytestmark = [pytest.mark.timeout(180)]


def test_bucketed_collectives_and_p2p(nats_server):
    """All-reduce over mixed dtypes/shapes (non-contiguous, empty, scalar) in small
    buckets, broadcast, send/recv, and gradients with an unused parameter."""
    with Group("collect", 3, nats_cfg(nats_server)) as g:
        res = g.expect_all("result", timeout=90)
        g.expect_all("done", timeout=30)
    for r in res:
        assert r["allreduce"] and r["broadcast"] and r["p2p"], r
    assert len({r["grad_digest"] for r in res}) == 1  # every rank holds the same gradients
    assert all(r["extra_grad_nonzero"] for r in res)  # rank 0's grad reached the others


def test_killed_peer_raises_peer_error(nats_server):
    """A SIGKILLed peer makes the pending all-reduce fail fast, and the group stays broken."""
    with Group("kill", 3, dict(nats_cfg(nats_server), victim=2)) as g:
        g[2].expect("ready", timeout=90)
        pend = g.expect_all("pending", timeout=30, ranks=[0, 1])
        time.sleep(0.3)
        t_kill = time.time()
        g[2].signal(signal.SIGKILL)
        res = g.expect_all("peer_error", timeout=30, ranks=[0, 1])
        g.expect_all("done", timeout=30, ranks=[0, 1])
    for p, r in zip(pend, res):
        assert r["state"] == "broken" and r["after"] == "PeerError", r
        assert r["t"] - t_kill < 10, r  # failed on the reset, not on the 20 s op timeout
        assert r["t"] >= p["t"]


def test_stopped_peer_abort_and_regroup(nats_server):
    """A SIGSTOPped peer: abort unblocks the wait within a few slices; the survivors
    build the next generation's group while the old one is still stuck, and exit."""
    with Group("stop", 3, dict(nats_cfg(nats_server), victim=2, abort_after=0.5,
                                hard_exit=True)) as g:
        g[2].expect("stopping", timeout=90)
        res = g.expect_all("result", timeout=60, ranks=[0, 1])
        g.expect_all("exiting", timeout=30, ranks=[0, 1])
        for r in (0, 1):
            assert g[r].wait(30) == 0
    for r in res:
        assert r["value_ok"], r
        assert r["old_state"] in ("aborted", "closed"), r
        assert r["abandoned"] >= 1, r
        assert r["latency"] < 1.0, r  # slice is 0.05 s; generous for a loaded 2-core machine
        print(f"\nabort latency {r['latency'] * 1e3:.1f} ms, new group {r['create_ms']:.1f} ms")


def test_p2p_waits_longer_than_a_slice(nats_server):
    """A receive that waits longer than the slice still succeeds (a timed-out gloo p2p wait
    would close the pair), and an abort still abandons a receive that never completes."""
    with Group("p2p", 2, dict(nats_cfg(nats_server), mb=16, delay=0.5)) as g:
        res = g.expect_all("result", timeout=90)
        g.expect_all("done", timeout=30)
    for r in res:
        assert r["late_ok"], r
        assert r["late_s"] >= 0.4, r  # the wait really did outlast several 0.05 s slices
    assert res[1]["aborted_after"] is not None and res[1]["aborted_after"] < 1.0, res[1]


def test_the_nccl_environment_replaces_values_that_would_kill_survivors():
    """Issue 30: a cluster's TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear down on error), a
    rethrow of CUDA errors or NVLS would end survivors or block the abort: replaced, each with
    one line naming it; the defaults leave a user's own choice alone."""
    from agent.groups import nccl_env_defaults

    env = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    lines = nccl_env_defaults(env)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert env["TORCH_NCCL_RETHROW_CUDA_ERRORS"] == "0" and env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert len(lines) == 1 and lines[0].startswith("TORCH_NCCL_ASYNC_ERROR_HANDLING=1 replaced")
    env = {"NCCL_NVLS_ENABLE": "1", "CEASELESS_NCCL_NVLS": "1"}
    assert nccl_env_defaults(env) == [] and env["NCCL_NVLS_ENABLE"] == "1"
    assert nccl_env_defaults({"NCCL_NVLS_ENABLE": "1"})[0].startswith("NCCL_NVLS_ENABLE=1")
