"""`ceaseless up --bus-servers 3` (issue 42): one of the bus's nats-servers is SIGKILLed
mid-run; every client (agents, services, `up`, this harness) fails over to another server, the
replicated stream and buckets keep serving, `up` restarts the dead server in place, and the
job finishes with 0 lost steps, bitwise equal to the fault-free run. Real nats-servers,
services and gloo; cleaned up by PID."""

from __future__ import annotations

import json
import os
import signal

import pytest

from harness import run_job
from plumbing.bus import split_urls
from test_control_plane_down import _count, _slower
from test_recovery_e2e import _assert_same

pytestmark = [pytest.mark.timeout(300)]


async def test_a_lost_nats_server_costs_no_step(tmp_path, reference):
    seen: dict = {}

    async def fault(c):
        # the CLI's run file names every server
        seen["urls"] = split_urls(json.loads((c.run_dir / "cluster.json").read_text())["nats_url"])
        step = (await c.wait_rank_step(0, 16)).step
        # the server this harness is connected to (as the CLI would be), so that a failover
        # surely happens: its pid from its run dir (s1..s3 hold the servers' own logs)
        port = c.bus.nc.connected_url.port
        k = [u.rsplit(":", 1)[1] for u in seen["urls"]].index(str(port))
        victim = [pid for n, pid in c.pids() if n == "nats-server"][k]
        os.kill(victim, signal.SIGKILL)
        await c.wait_for(lambda: c.bus.nc.is_connected and c.bus.nc.connected_url.port != port,
                         30, "the harness's failover")
        await c.wait_rank_step(0, step + 8)  # heartbeats flow on through another server
        await c.wait_for(lambda: _count(c, "nats-server") > 3, 30, "the server restarted")

    s = await run_job(tmp_path, "bus3", 2, 0, fault, cmd=_slower(tmp_path),
                      extra=["--bus-servers", "3"])
    assert len(seen["urls"]) == 3, seen
    _assert_same(s, reference(2))
    assert s["incidents"] == [], s["incidents"]            # a bus server is no pod: no fault
    assert [p.generation for p in s["plans"]] == [1], s["plans"]
