"""The Ray driver's lease and adoption decisions (services/actuator/ray_adopt.py) and
`up --bus` (ops/external.py, the flags' rules) as pure functions; the end to end run with a
real Ray cluster is tests/test_ray_actuator.py's."""

from __future__ import annotations

import argparse
import json

import pytest

from ops.cli import external_bus_refusal
from ops.cluster import SERVICES, ServiceSupervisor, UpOptions
from ops.external import attach, node_name
from schemas.messages import Role
from services.actuator.ray_adopt import (Action, JobEnd, job_pods, on_acquire, parse_end,
                                         role_of)


def test_a_driver_taking_the_lease_adopts_a_running_job_and_starts_only_a_new_one():
    assert on_acquire([], has_plan=False, ended=False) is Action.START
    # pods running, or a plan (its pods may all have gone meanwhile): never a second set
    assert on_acquire(["w0"], has_plan=False, ended=False) is Action.ADOPT
    assert on_acquire([], has_plan=True, ended=False) is Action.ADOPT
    assert on_acquire(["w0", "s0"], has_plan=True, ended=False) is Action.ADOPT
    # the job ended under the last holder: nothing to act on, whatever is left
    assert on_acquire(["s1"], has_plan=True, ended=True) is Action.END
    assert on_acquire([], has_plan=False, ended=True) is Action.END


def test_the_jobs_pods_are_its_namespaces_named_actors_with_pod_ids():
    named = [{"name": "w0", "namespace": "ceaseless-j"}, {"name": "s3", "namespace": "ceaseless-j"},
             {"name": "w0", "namespace": "ceaseless-other"},     # another job's
             {"name": "keeper", "namespace": "ceaseless-j"},     # not a pod: left alone
             {"name": None, "namespace": "ceaseless-j"}, "junk", {}]
    assert job_pods(named, "ceaseless-j") == {"w0": Role.worker, "s3": Role.spare}
    assert job_pods([], "ceaseless-j") == {}
    assert role_of("w12") is Role.worker and role_of("s0") is Role.spare
    assert role_of("x0") is None and role_of("w") is None and role_of(7) is None


def test_the_jobs_end_round_trips_and_bad_values_are_ignored():
    end = JobEnd("actuator-n1", 0, "all 2 members finished 40 steps")
    assert parse_end(end.dumps()) == end
    for bad in (None, b"", b"not json", b"[]", json.dumps({"holder": "a"}).encode(),
                json.dumps({"holder": "a", "code": "x", "reason": ""}).encode()):
        assert parse_end(bad) is None


def test_external_bus_access(tmp_path):
    creds = tmp_path / "op.json"
    creds.write_text(json.dumps({"user": "operator", "password": "pw"}))
    acc = attach("nats://a:4222, nats://b:4222", str(creds), None)
    assert acc.bus.url == "nats://a:4222,nats://b:4222" and acc.bus.servers == []
    assert acc.bus.restart_dead() == [] and acc.creds.user == "operator"
    assert acc.pod_creds == creds.resolve()  # the pods' default: the same identity
    open_bus = attach("tls://a:4222", None, None)
    assert open_bus.creds is None and open_bus.pod_creds is None
    for url, c, p, why in [("http://a:1", None, None, "not a nats"), ("", None, None, "URL"),
                           ("nats://a:1", str(tmp_path / "missing.json"), None, "--bus-creds"),
                           ("nats://a:1", str(creds), str(tmp_path / "no.json"), "--pod-creds")]:
        with pytest.raises(ValueError, match=why):
            attach(url, c, p)
    assert node_name("n1") == "n1" and node_name(None)
    with pytest.raises(ValueError):
        node_name("a b")


def test_up_flags_with_and_without_an_external_bus():
    def why(bus_servers=1, **kw):
        return external_bus_refusal(UpOptions(**kw), argparse.Namespace(bus_servers=bus_servers))

    assert why() is None
    assert why(bus="nats://a:1", node="n1", services="external") is None
    assert "only with --bus" in why(node="n1")
    assert "only with --bus" in why(services="external")
    assert "--hosts" in why(bus="nats://a:1", hosts=3)
    assert "tls://" in why(bus="nats://a:1", tls=True)
    assert "--bus-servers" in why(bus="nats://a:1", bus_servers=3)
    assert "--standbys" in why(bus="nats://a:1", standbys=1)


def test_a_nodes_service_instances_are_named_after_it(tmp_path):
    sup = ServiceSupervisor([], tmp_path, {}, node="n-s1")
    started = []
    sup.start = started.append  # what would be run, not run
    sup.start_all()
    assert started == [f"{s}-n-s1" for s in SERVICES]


async def test_a_standby_driver_answers_nothing_and_stops_at_the_jobs_end(bus, tmp_path):
    """A real nats-server, a RayActuator that never reaches Ray: while another driver holds
    the actuator lease this one stays a standby: an actuator command gets no answer from it
    and it watches no pod; when the acting driver writes the job's end it stops (ENDED)
    with that end, without taking the lease."""
    import asyncio
    import time

    from harness import until
    from nats.errors import TimeoutError as NatsTimeout
    from schemas.messages import ActuatorAction, ActuatorCommand, ActuatorReply
    from schemas.subjects import ACTUATOR_END_KEY, lease_key
    from services.actuator.ray import RayActuator
    from services.actuator.ray_adopt import DriverLease, DriverState
    from services.common.lease import LeaseValue

    kv = await bus.kv()
    await kv.put(lease_key("actuator"), LeaseValue("actuator-n1", time.time() + 3600, 1).dumps())
    act = RayActuator(bus, [], {}, tmp_path / "logs", namespace="ceaseless-test",
                      watch_nodes=True)

    async def never() -> None:
        raise AssertionError("a standby started pods")

    ha = DriverLease(act, "actuator-n2", 0.6, never)
    ha.install()
    await act.attach()
    await ha.start()
    try:
        assert ha.state is DriverState.STANDBY and not ha.watching and not ha.acted
        assert ha.lease.holder == "actuator-n1" and act._poller is None
        with pytest.raises((NatsTimeout, asyncio.TimeoutError)):
            await bus.request(bus.subjects.actuator, ActuatorCommand(
                action=ActuatorAction.start, role=Role.spare, count=1), ActuatorReply,
                timeout=1.0)
        assert act.running() == {} and act.roles == {}
        await kv.put(ACTUATOR_END_KEY, JobEnd("actuator-n1", 0, "all 2 members finished").dumps())
        await until(lambda: ha.ended is not None, 10, "the standby seeing the job's end")
        assert ha.state is DriverState.ENDED and ha.ended.code == 0 and not ha.acted
    finally:
        await ha.finish(1, "test over")
        await act.shutdown(grace_s=1)
    # a driver that never acted writes no end of its own
    assert parse_end((await kv.get(ACTUATOR_END_KEY)).value).holder == "actuator-n1"
