"""A fault that happens while part of the control plane is down is handled once it is back.

Real nats-server, real services, real gloo. The service (or nats-server) is first SIGSTOPped,
so that it is really unavailable for a known time (a frozen process answers nothing, exactly
like a dead one, and its supervisor does not restart it yet); a worker is SIGKILLed during
that outage; after the outage the frozen process is SIGKILLed, its supervisor (`ceaseless up`)
restarts it, and the restarted process must find and handle the fault from what it rebuilds
(KV plan, stream, fresh heartbeats): the spare takes the rank and the final parameters are
bitwise those of the fault-free run. Everything is cleaned up by PID.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from harness import STEPS, log_events, run_job as _run  # noqa: F401
from test_recovery_e2e import _assert_same, _kill

pytestmark = [pytest.mark.timeout(300)]
OUTAGE = 3.0  # seconds: twice the fault timeout (1.5 s), so the fault is overdue meanwhile


def _latest(c, name: str) -> int:
    return [pid for n, pid in c.pids() if n == name][-1]


def _count(c, name: str) -> int:
    return len([1 for n, _ in c.pids() if n == name])


async def _fault_during_outage(c, name: str, checks: dict) -> None:
    # Not in the first moments of the job: the scaler's once-per-term reconcile (2 fault
    # timeouts after it started, about when the first plan is out) handles a member already
    # dead by itself, which would be a plan during the monitor's outage (seen when the kill
    # landed 0.3 s after the first plan, and with pods forked from a zygote, which train
    # their step 16 before it)
    await c.wait_rank_step(1, 16)
    await c.wait_for(lambda: log_events(c.run_dir, "scaler", "lease term reconciled"), 30,
                     "the scaler's reconcile")
    pid = _latest(c, name)
    os.kill(pid, signal.SIGSTOP)  # down: answers nothing, not yet restarted
    try:
        gen = c.plans[-1].generation
        _kill(c, 1)
        t0 = time.monotonic()
        await asyncio.sleep(OUTAGE)
        checks["plans_during_outage"] = [p.generation for p in c.plans if p.generation > gen]
        checks["outage_s"] = time.monotonic() - t0
    finally:
        os.kill(pid, signal.SIGKILL)  # the supervisor restarts it
    await c.wait_for(lambda: _count(c, name) >= 2, 30, f"{name} restarted")


def _slower(tmp_path, gate=None) -> list[str]:
    """The default example, 0.02 s slower per micro-batch (same numerics): the job must still
    be training after its first 16 steps and the scaler's reconcile (~3.5 s after `up`).
    ``gate`` (a path): slower only while it exists; the test removes it once nothing is left
    to wait for, and the rest of the steps run at full speed."""
    from ops.cluster import UpOptions, _default_data, default_cmd

    cmd = [*default_cmd(UpOptions(steps=STEPS), _default_data(tmp_path / "data")),
           "--sleep", "0.02"]
    if gate is not None:
        gate.touch()
        cmd += ["--sleep-while", str(gate)]
    return cmd


@pytest.mark.parametrize("name", ["health_monitor", "state_broker", "nats-server"])
async def test_fault_while_down_is_handled_once_back(tmp_path, reference, name):
    checks: dict = {}
    gate = tmp_path / "slow"

    async def fault(c):
        await _fault_during_outage(c, name, checks)
        # restarted: the fault is handled from here (the survivor cannot step without a new
        # plan, so the job cannot end before it), no need to train slowly any more
        gate.unlink()

    s = await _run(tmp_path, f"down-{name}", 2, 1, fault, cmd=_slower(tmp_path, gate))
    _assert_same(s, reference(2))
    gens = [p.generation for p in s["plans"]]
    assert gens[-1] == 2 and gens.count(2) >= 1, gens          # one replacement, no more
    assert max(gens) == 2, gens
    assert s["plans"][-1].world_size == 2
    assert s["plans"][-1].pod_of(1) != s["plans"][0].pod_of(1)  # the spare took rank 1
    if name in ("health_monitor", "nats-server"):
        # Nobody could detect (or publish) the fault during the outage: it was handled after.
        assert checks["plans_during_outage"] == [], checks


async def test_fault_while_health_monitor_restarts(tmp_path, reference):
    """The health monitor and a worker are SIGKILLed together: the fault happens while the
    monitor is starting again (it misses the exit event); the restarted monitor still
    declares it from what it rebuilds (the plan's members, their silence)."""
    async def fault(c):
        await c.wait_rank_step(1, 4)
        os.kill(_latest(c, "health_monitor"), signal.SIGKILL)
        _kill(c, 1)
        await c.wait_for(lambda: _count(c, "health_monitor") >= 2, 30, "monitor restarted")

    s = await _run(tmp_path, "monitor-restart", 2, 1, fault)
    _assert_same(s, reference(2))
    assert [p.generation for p in s["plans"]] == [1, 2], s["plans"]
