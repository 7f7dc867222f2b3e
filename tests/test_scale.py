"""Issue 45: jobs of tens of thousands of members. The wire's bounds admit them, the
benchmarks refuse a size they cannot run (non-zero, with the reason), and the messages that
grow with the job are measured. Pure: no cluster."""

from __future__ import annotations

import pytest

from bench import control_plane, message_sizes
from bench.common import main
from schemas.messages import (MAX_MEMBERS, MAX_PODS, AgentState, HealthView, Heartbeat, Role)
from schemas.policy import ScalingPolicy


def test_no_cap_below_65536_replicas():
    assert MAX_MEMBERS >= 65536
    assert ScalingPolicy(min_replicas=1, max_replicas=65536).max_replicas == 65536
    p = message_sizes.plan(16384)  # validates: ranks, shares, spares
    assert p.world_size == 16384 and p.rank_of("w16383") == 16383
    with pytest.raises(ValueError):
        ScalingPolicy(max_replicas=MAX_MEMBERS + 1)
    # a capacity add of more than 1,024 pods: the scaler's start command and its reply
    from schemas.messages import ActuatorCommand, ActuatorReply, Capacity

    assert Capacity(change="add", count=4096).count == 4096
    assert ActuatorCommand(action="start", count=4096).count == 4096
    assert len(ActuatorReply(ok=True, pods=[f"s{i}" for i in range(4096)]).pods) == 4096


def test_a_complete_health_view_lists_every_pod_a_service_may_track():
    """The complete listing is split into messages of MAX_VIEW_PODS; its ``chunks`` bound
    was 64 (32,768 pods): a larger job's listing did not validate."""
    from services.common.heartbeats import ViewPublisher

    n = 64 * 512 + 1  # one more than the old bound allowed
    hbs = [(Heartbeat(pod="w1", role=Role.worker, generation=1, rank=1,
                      state=AgentState.training), 0.0)] * n  # (the builder does not dedupe)
    vp = ViewPublisher(None, None, lambda pods: hbs)  # type: ignore[arg-type]
    views = vp.full_views(hbs, True, 0.0)
    assert sum(len(v.pods) for v in views) == n and views[-1].chunks == len(views) == 65
    assert HealthView.model_fields["chunks"].metadata[-1].le * 512 >= MAX_PODS


def test_control_plane_bench_refuses_a_size_it_cannot_run(capsys):
    """It printed the policy's validation error and exited 0 with empty results."""
    rc = main("bench.control_plane", ["--agents", f"1024,{MAX_MEMBERS + 1}"])
    err = capsys.readouterr().err
    assert rc != 0
    assert f"{MAX_MEMBERS + 1} agents: the scaler's policy refuses it" in err
    assert main("bench.control_plane", ["--agents", "many"]) != 0
    assert "give sizes as integers" in capsys.readouterr().err


def test_control_plane_bench_names_the_sizes_that_did_not_run():
    res = {"runs": [{"agents": 1024, "detect_p50_s": 1.5},
                    {"agents": 16384, "failed": "scaler did not come up: ..."}]}
    assert control_plane.failures(res) == ["16384 agents: scaler did not come up: ..."]
    assert control_plane.failures({"runs": [{"agents": 1024}]}) == []


def test_message_sizes_measures_what_grows_with_the_job():
    r = message_sizes.measure(512)
    assert r["plan_bytes"] > 512 * 10 and r["transfer_bytes"] > 512 * 4
    assert r["view_full_msgs"] == 1 and r["view_compact_msgs"] == 1
    assert set(r["status_bytes"]) == {"health_monitor", "scaler", "state_broker"}
    assert all(b > 0 for b in r["status_bytes"].values())


async def test_a_status_lists_the_first_pods_not_ok_first():
    """A status reply is one message: the monitor's listing of every pod was 3.7 MB at
    16,384 pods (over nats-server's max_payload: `ceaseless status` got nothing)."""
    from ops.cli import _render_status
    from services.common.service import STATUS_ITEMS
    from services.health_monitor import HealthMonitor

    n = STATUS_ITEMS + 500
    p = message_sizes.plan(n)
    mon = HealthMonitor(None, view_interval=None, suspect_timeout=50.0,  # type: ignore[arg-type]
                        fault_timeout=60.0, stall_timeout=120.0, collective_timeout=120.0)
    mon.plans.plan = p
    for hb in message_sizes.heartbeats(p):
        await mon._on_heartbeat(hb, message_sizes._Env())
    mon.pods[f"w{n - 1}"].last_hb -= 100.0  # silent: listed although last by name
    st = mon.status()
    assert len(st["pods"]) == STATUS_ITEMS and st["pods_total"] == n
    assert next(iter(st["pods"])) == f"w{n - 1}" and st["pods"][f"w{n - 1}"]["member"]
    text = _render_status({"job": "test", "services": {"health_monitor": st}})
    assert "... and 500 more pods not listed" in text
