"""Roles on the bus are enforced by nats-server itself, not by our code."""

from __future__ import annotations

import asyncio
import stat

import nats
import pytest

from schemas.subjects import Subjects
from plumbing.bus import Bus
from services.common.natsserver import NatsServer
from services.common.permissions import ROLES, role_permissions, write_role_credentials

pytestmark = [pytest.mark.timeout(60)]
JOB = "permjob"


@pytest.fixture
def role_server(tmp_path):
    roles = write_role_credentials(tmp_path / "creds")
    srv = NatsServer.start(tmp_path / "nats", creds=roles["operator"][1],
                           users=[(c, role_permissions(r, JOB)) for r, (_, c) in roles.items()])
    try:
        yield srv, roles, tmp_path / "nats" / "nats-server.log"
    finally:
        srv.stop()


def test_credentials_are_private(tmp_path):
    roles = write_role_credentials(tmp_path / "c")
    assert set(roles) == set(ROLES)
    assert len({c.password for _, c in roles.values()}) == len(ROLES)  # one secret per role
    for path, creds in roles.values():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert creds.password not in repr(creds)  # never logged


async def test_agent_cannot_publish_plan_or_inject(role_server):
    srv, roles, server_log = role_server
    s = Subjects(JOB)
    op = await Bus.connect(srv.url, JOB, "operator", roles["operator"][1])
    scaler = await Bus.connect(srv.url, JOB, "scaler", roles["scaler"][1])
    await op.ensure_stream()
    await op.kv()
    await op.store_kv()
    skv = await scaler.kv()
    rev = await skv.put("plan", b'{"generation": 1}')
    seen: dict[str, list[bytes]] = {"plan": [], "inject": [], "heartbeat": [], "hostbeat": [],
                                    "heartbeats": []}

    async def on(msg):
        kind = msg.subject.split(".")[2]
        seen.setdefault(kind, []).append(msg.data)

    for subj in (s.plan, s.inject, s.heartbeat("*"), s.hostbeat("*", "*"), s.heartbeats("*")):
        await op.nc.subscribe(subj, cb=on)
    await op.nc.flush()

    errors: list[str] = []

    async def err_cb(e):
        errors.append(str(e))

    agent_creds = roles["agent"][1]
    nc = await nats.connect(srv.url, user=agent_creds.user, password=agent_creds.password,
                            error_cb=err_cb, allow_reconnect=False, name="rogue-agent")
    try:
        await nc.publish(s.plan, b'{"generation": 99}')
        await nc.publish(s.inject, b'{"action": "kill"}')
        await nc.publish(s.heartbeat("w0"), b"{}")  # allowed: proves the identity works
        # a pod to its host's relay, the relay (a pod) its host's batch (issue 45)
        await nc.publish(s.hostbeat("h0", "w0"), b"{}")
        await nc.publish(s.heartbeats("h0"), b"{}")
        await nc.flush()
        kv = await nc.jetstream().key_value(s.kv_bucket)
        with pytest.raises(Exception):
            await asyncio.wait_for(kv.put("plan", b'{"generation": 99}'), 2.0)
        # what the agent writes: the job done, a solo, the script's batch (status shows it)
        for key in ("done", "solo.g1", "script"):
            await asyncio.wait_for(kv.put(key, b'{"x": 1}'), 2.0)
        await asyncio.sleep(0.5)
    finally:
        await nc.close()

    assert seen["heartbeat"] == seen["hostbeat"] == seen["heartbeats"] == [b"{}"]
    assert seen["plan"] == [] and seen["inject"] == []  # nothing reached a subscriber
    entry = await skv.get("plan")
    assert entry.revision == rev and entry.value == b'{"generation": 1}'  # unchanged
    assert sum("permissions violation" in e.lower() for e in errors) >= 3, errors
    log = server_log.read_text()
    for subj in (s.plan, s.inject, f"$KV.{s.kv_bucket}.plan"):
        assert f'Publish Violation - Subject "{subj}"' in log, log[-2000:]
    await scaler.close()
    await op.close()


async def test_an_agent_reads_the_last_transfer_plan_of_the_stream(role_server):
    """What a pod missed while reconnecting is read back from the job's stream (the
    transfer plan: agent/catchup.py); reading is all it may do there."""
    from nats.js.errors import NotFoundError

    from schemas.messages import Transfer

    srv, roles, _ = role_server
    s = Subjects(JOB)
    op = await Bus.connect(srv.url, JOB, "operator", roles["operator"][1])
    broker = await Bus.connect(srv.url, JOB, "state_broker", roles["state_broker"][1])
    agent = await Bus.connect(srv.url, JOB, "agent", roles["agent"][1])
    try:
        await op.ensure_stream()
        with pytest.raises(NotFoundError):  # none yet: an answer, not a violation
            await asyncio.wait_for(agent.js.get_last_msg(s.stream, s.transfer), 5.0)
        await broker.publish(s.transfer, Transfer(generation=3, restore_step=7, sources={}))
        await broker.nc.flush()
        for _ in range(50):  # a plain publish reaches the stream a moment after the flush
            try:
                msg = await asyncio.wait_for(agent.js.get_last_msg(s.stream, s.transfer), 5.0)
                break
            except NotFoundError:
                await asyncio.sleep(0.1)
        assert Transfer.model_validate_json(msg.data).generation == 3
        with pytest.raises(Exception):  # still no publishing there
            await asyncio.wait_for(agent.js.publish(s.transfer, b"{}"), 2.0)
    finally:
        for b in (agent, broker, op):
            await b.close()


async def test_a_large_plan_is_written_by_the_scaler_and_read_by_an_agent_under_their_roles(
        role_server):
    """A plan over 64 KiB goes as KV parts (plumbing/plan_wire.py, issue 45): the scaler's
    role may write them and purge old ones, an agent's may read them and nothing more."""
    from plumbing import logs
    from plumbing.plan_wire import resolve
    from schemas import plan_part_key
    from schemas.messages import Member, Plan, PlanRef
    from services.common.plans import PlanFollower
    from services.scaler.writer import PlanWriter

    srv, roles, _ = role_server
    s = Subjects(JOB)
    op = await Bus.connect(srv.url, JOB, "operator", roles["operator"][1])
    scaler = await Bus.connect(srv.url, JOB, "scaler", roles["scaler"][1])
    agent = await Bus.connect(srv.url, JOB, "agent", roles["agent"][1])
    try:
        await op.ensure_stream()
        log = logs.get("test")
        plans = PlanFollower(scaler, log, poll_interval=0)
        await plans.start(subscribe=False)
        w = PlanWriter(scaler, plans, log)
        w.kv = plans.kv
        n = 4096
        for gen in (1, 2, 3):  # the third purges the first's parts
            p = Plan(generation=gen, members=[Member(pod=f"w{i}" if i else f"s{gen}", rank=i)
                                              for i in range(n)],
                     world_size=n, global_batch_size=n, micro_batch_size=1,
                     shares={i: 1 for i in range(n)})
            assert await w.write(p, plans.revision, [], lambda: None)
        akv = await agent.kv()
        ref = PlanRef.model_validate_json((await akv.get("plan")).value)
        assert await resolve(akv, ref, None) == p  # the agent reads the parts
        assert w._parts_left
        with pytest.raises(Exception):
            await asyncio.wait_for(akv.put(plan_part_key(ref.digest, 0), b"{}"), 2.0)
        from plumbing.plan_wire import part_keys

        keys = await part_keys(await op.kv())
        assert {k.split(".")[1] for k in keys} == {ref.digest, ref.change.base_digest}
    finally:
        for b in (agent, scaler, op):
            await b.close()


async def test_services_keep_to_their_subjects(role_server):
    srv, roles, server_log = role_server
    s = Subjects(JOB)
    op = await Bus.connect(srv.url, JOB, "operator", roles["operator"][1])
    await op.ensure_stream()
    await op.kv()
    got: list[str] = []

    async def on(msg):
        got.append(msg.subject)

    await op.nc.subscribe(s.all, cb=on)
    await op.nc.flush()
    for role, allowed, denied in (("health_monitor", s.fault, s.plan),
                                  ("state_broker", s.transfer, s.fault),
                                  ("scaler", s.plan, s.inject)):
        b = await Bus.connect(srv.url, JOB, role, roles[role][1])
        await b.ensure_stream()  # services may create the stream and buckets at start-up
        await b.nc.publish(allowed, b"{}")
        await b.nc.publish(denied, b"{}")
        await b.nc.flush()
        await b.close()
    await asyncio.sleep(0.3)
    assert sorted(got) == sorted([s.fault, s.transfer, s.plan]), got
    await op.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("allowed", [False, True])
async def test_injection_refused_unless_the_job_enables_it(bus, tmp_path, allowed):
    """`ceaseless up --no-inject`: the supervisor ignores inject kill/hang for its pods (a
    real child process survives the request); with injection enabled the same request
    kills it."""
    import sys

    from schemas.messages import Inject, InjectAction, Role
    from services.actuator.local import LocalActuator

    act = LocalActuator(bus, [sys.executable, "-c", "import time; time.sleep(60)"], {},
                        tmp_path / "logs", restart_fallback=False, allow_inject=allowed)
    await act.attach()
    (pod,) = await act.start(Role.worker, 1)
    proc = act.procs[pod]
    try:
        await bus.publish(bus.subjects.inject, Inject(action=InjectAction.kill, pod=pod))
        await bus.nc.flush()
        try:
            await asyncio.wait_for(proc.wait(), 3.0)
        except asyncio.TimeoutError:
            pass
        assert (proc.returncode is not None) == allowed, proc.returncode
    finally:
        await act.shutdown(grace_s=1.0)


async def test_only_the_state_broker_writes_the_committed_step(role_server):
    """KV ``committed`` (the job's committed high water, issue 41) is the state broker's:
    the server refuses it to the agents and to the other services."""
    from schemas.subjects import COMMITTED_KEY

    srv, roles, server_log = role_server
    s = Subjects(JOB)
    op = await Bus.connect(srv.url, JOB, "operator", roles["operator"][1])
    await op.ensure_stream()
    okv = await op.kv()
    buses = {r: await Bus.connect(srv.url, JOB, r, roles[r][1])
             for r in ("state_broker", "agent", "health_monitor", "scaler")}
    try:
        rev = await (await buses["state_broker"].kv()).put(COMMITTED_KEY, b'{"step": 5}')

        async def refused(role: str) -> bool:
            kv = await buses[role].nc.jetstream().key_value(s.kv_bucket)
            try:
                await asyncio.wait_for(kv.put(COMMITTED_KEY, b'{"step": 99}'), 2.0)
            except Exception:
                return True
            return False

        assert await asyncio.gather(*(refused(r) for r in ("agent", "health_monitor",
                                                             "scaler"))) == [True] * 3
        entry = await okv.get(COMMITTED_KEY)
        assert entry.revision == rev and entry.value == b'{"step": 5}'
        assert f'Publish Violation - Subject "$KV.{s.kv_bucket}.{COMMITTED_KEY}"' in \
            server_log.read_text()
    finally:
        for b in buses.values():
            await b.close()
        await op.close()
