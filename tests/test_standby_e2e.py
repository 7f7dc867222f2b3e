"""Services with standbys (issue 42), end to end: `ceaseless up --standbys 1`, every active
service instance SIGKILLed at once mid-run, then a worker: the standbys take over (a higher
lease term each), the worker's fault is recovered, 0 lost steps, bitwise equal to the
fault-free run, one plan per generation. Real nats-server, services, gloo; cleaned up by PID."""

from __future__ import annotations

import os
import signal
import time

import pytest

from harness import log_events, run_job
from schemas.subjects import lease_key
from services.common.lease import parse_lease
from test_control_plane_down import _slower
from test_recovery_e2e import _assert_same, _kill

pytestmark = [pytest.mark.timeout(240)]
SERVICES = ("health_monitor", "scaler", "state_broker")


async def _leases(c) -> dict:
    kv = await c.bus.kv()
    return {name: parse_lease((await kv.get(lease_key(name))).value) for name in SERVICES}


async def test_every_active_service_killed_at_once_then_a_worker(tmp_path, reference):
    checks: dict = {}

    async def fault(c):
        await c.wait_rank_step(1, 16)
        # not in the first moments: the scaler's once-per-term reconcile has run
        await c.wait_for(lambda: any(log_events(c.run_dir, n, "lease term reconciled")
                                     for n in ("scaler", "scaler-s1")), 30, "the reconcile")
        before = await _leases(c)
        pids = dict(c.pids())  # the newest pid of each instance name
        for name, lease in before.items():
            os.kill(pids[lease.holder], signal.SIGKILL)
        t0 = time.monotonic()
        checks["before"] = before
        gen = c.plans[-1].generation
        _kill(c, 1)
        after: dict = {}

        async def taken() -> bool:
            after.update(await _leases(c))
            return all(after[n].term > before[n].term and after[n].expires > time.time()
                       for n in SERVICES)
        while not await taken():
            assert time.monotonic() - t0 < 30, (before, after)
        checks["takeover_s"] = time.monotonic() - t0
        checks["after"] = dict(after)
        await c.wait_for(lambda: c.plans[-1].generation > gen, 30, "the replacement plan")

    s = await run_job(tmp_path, "standby", 2, 1, fault, extra=["--standbys", "1"],
                      cmd=_slower(tmp_path))
    _assert_same(s, reference(2))
    gens = [p.generation for p in s["plans"]]
    assert len(gens) == len(set(gens)) or all(  # a plan seen twice is the same plan
        len({p.model_dump_json() for p in s["plans"] if p.generation == g}) == 1 for g in gens)
    assert s["plans"][-1].world_size == 2 and max(gens) == 2, gens
    assert all(p.term is not None for p in s["plans"])
    terms = [p.term for p in s["plans"]]
    assert terms == sorted(terms), terms
    print("takeover_s", round(checks["takeover_s"], 3), checks["after"])
