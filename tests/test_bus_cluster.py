"""A bus of three clustered nats-servers (issue 42): the job's stream and buckets are
replicated on all three, and a client that loses its server fails over to another with its
KV reads and writes intact. Real nats-servers (the launcher's own), real JetStream."""

import asyncio
import signal
from urllib.parse import urlparse

import pytest

from harness import until
from plumbing.bus import Bus, split_urls
from services.common.natsserver import BusServers, write_credentials
from services.common.permissions import role_permissions, write_role_credentials

JOB = "demo"
READY_S = 30.0   # a generous bound: a cluster elects its JetStream meta leader first


def test_split_urls():
    assert split_urls("nats://a:1, nats://b:2,") == ["nats://a:1", "nats://b:2"]
    assert split_urls("nats://a:1") == ["nats://a:1"]
    with pytest.raises(ValueError, match="no nats-server URL"):
        split_urls(" , ")


def test_one_server_is_the_single_server_of_old(tmp_path):
    """n=1: the plain config in the given directory, no cluster block, one URL."""
    bus = BusServers.start(tmp_path / "nats", 1, creds=write_credentials(tmp_path / "c.json"))
    try:
        conf = (tmp_path / "nats" / "nats.conf").read_text()
        assert "cluster" not in conf and "server_name" not in conf
        assert "," not in bus.url and bus.replicas == 1
    finally:
        bus.stop()


async def _replicas(js, stream: str) -> int:
    return (await js.stream_info(stream)).config.num_replicas


async def _kv_round_trip(kv, key: str, value: bytes) -> bool:
    try:
        await kv.put(key, value)
        return (await kv.get(key)).value == value
    except Exception:  # a leader election in progress: the caller retries
        return False


async def _until_async(pred, timeout: float, what: str):
    async def _loop():
        while not await pred():
            await asyncio.sleep(0.1)
    try:
        await asyncio.wait_for(_loop(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


async def _retry(call, timeout: float, what: str):
    """``await call()`` until it does not raise (bounded): a request to a JetStream group
    that is electing a leader (just created, or its leader just lost) times out meanwhile."""
    async def _loop():
        while True:
            try:
                return await call()
            except Exception:
                await asyncio.sleep(0.1)
    try:
        return await asyncio.wait_for(_loop(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
async def test_three_servers_replicate_and_a_client_fails_over(tmp_path, tls):
    files = None
    options = {}
    if tls:
        from plumbing.tlsgen import client_options, generate

        files = generate(tmp_path / "tls")
        options = client_options(files.ca)
    roles = write_role_credentials(tmp_path / "creds")
    users = [(c, role_permissions(r, JOB)) for r, (_, c) in roles.items()]
    servers = BusServers.start(tmp_path / "nats", 3, users=users, tls=files,
                               creds=roles["operator"][1])
    op = agent = None
    try:
        assert len(split_urls(servers.url)) == 3 and servers.replicas == 3
        op = await Bus.connect(servers.url, JOB, "op", roles["operator"][1], **options)
        assert op.replicas == 3
        await op.ensure_job_storage(READY_S)
        s = op.subjects
        for stream in (s.stream, f"KV_{s.kv_bucket}", f"KV_{s.store_bucket}"):
            assert await _retry(lambda: _replicas(op.js, stream), READY_S, stream) == 3, stream
        # the agent's identity: its permissions hold on every server
        agent = await Bus.connect(servers.url, JOB, "agent", roles["agent"][1], **options)
        store = await _retry(agent.store_kv, READY_S, "the store bucket")
        await _until_async(lambda: _kv_round_trip(store, "k", b"before"), READY_S,
                           "a first KV write")

        # kill the server the agent is connected to, without warning
        port = urlparse(str(agent.nc.connected_url.geturl())).port
        victim = next(srv for srv in servers.servers if srv.port == port)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(10)
        await until(lambda: agent.nc.is_connected and agent.nc.connected_url.port != port,
                    READY_S, "the agent's failover to another server")
        # a new client (the CLI: few reconnect attempts) whose first URL is the dead server
        # connects to another one
        urls = split_urls(servers.url)
        dead_first = ",".join(sorted(urls, key=lambda u: not u.endswith(f":{port}")))
        cli = await Bus.connect(dead_first, JOB, "cli", roles["operator"][1],
                                max_reconnect_attempts=2, dont_randomize=True, **options)
        try:
            assert cli.nc.connected_url.port != port
            assert cli.nc.connected_url.port in {srv.port for srv in servers.servers}
        finally:
            await cli.close()
        # the replicated bucket keeps what it had and takes new writes (once its group has
        # a leader again, if the dead server led it)
        await _until_async(lambda: _kv_round_trip(store, "k2", b"after"), READY_S,
                           "a KV write after the failover")
        assert (await _retry(lambda: store.get("k"), READY_S, "a KV read")).value == b"before"
        plan_kv = await _retry(op.kv, READY_S, "the plan bucket")
        await _until_async(lambda: _kv_round_trip(plan_kv, "probe", b"1"), READY_S,
                           "the plan bucket after the failover")
        # the server restarted in place rejoins as itself: the stream has 3 current peers
        assert servers.restart_dead() == [servers.servers.index(
            next(srv for srv in servers.servers if srv.port == port))]

        async def _all_current() -> bool:
            try:
                info = await op.js.stream_info(f"KV_{s.store_bucket}")
            except Exception:
                return False
            peers = info.cluster.replicas or []
            return len(peers) == 2 and all(p.current for p in peers)
        await _until_async(_all_current, READY_S, "the restarted server to catch up")
    finally:
        for b in (agent, op):
            if b is not None:
                await b.close()
        servers.stop()


def test_up_refuses_a_bus_of_no_server(capsys):
    from ops.cli import main

    assert main(["up", "--bus-servers", "0"]) == 2
    assert "--bus-servers must be at least 1" in capsys.readouterr().err


def test_a_bus_of_several_servers_keeps_the_fault_timeout_above_a_clients_failover(capsys):
    """A lost host sends no RST: its server's clients learn it from unanswered pings. With
    several servers they ping often enough to go elsewhere within FAILOVER_S, and `up` keeps
    the fault timeout above that (a healthy pod failing over is not lost): by default, and a
    too-short one given refused, before anything starts."""
    from ops.cli import fault_timeout_for, main
    from plumbing.bus import FAILOVER_S
    from schemas.timeouts import DEFAULTS

    assert fault_timeout_for(None, 1) == DEFAULTS["fault_timeout"]
    assert fault_timeout_for(None, 3) > FAILOVER_S
    assert fault_timeout_for(1.2, 3) == 1.2  # as given: `up` judges it
    # a peer's error suspects only a pod silent for longer than a failover and the
    # heartbeats around it, still below the fault timeout
    from ops.cluster import failover_suspect
    suspect = failover_suspect(fault_timeout_for(None, 3))
    assert FAILOVER_S + DEFAULTS["heartbeat_interval"] < suspect < fault_timeout_for(None, 3)
    assert main(["up", "--bus-servers", "3", "--fault-timeout", "1.5"]) == 2
    err = capsys.readouterr().err
    assert "too short for a bus of 3 servers" in err and f"{FAILOVER_S:g}" in err


def test_every_service_that_judges_liveness_gets_the_jobs_fault_timeout():
    """The scaler counts a spare alive (and a member silent, once a term) by the fault
    timeout: `up` gave only the monitor its own (3.5 s with 3 servers), so the scaler ran on
    the default 1.5 s and a spare that a loaded machine kept silent for 2 s was "no live
    spare" (the 300 s host chaos run shrank the job twice so). Parsed by the services' own
    argument parsers, as they start."""
    from ops.cli import fault_timeout_for
    from ops.cluster import UpOptions, service_flags
    from services.health_monitor.__main__ import parser as monitor_parser
    from services.scaler.__main__ import parser as scaler_parser

    ft = fault_timeout_for(None, 3)
    flags = service_flags(UpOptions(bus_servers=3, fault_timeout=ft))
    assert scaler_parser().parse_args(flags["scaler"]).fault_timeout == ft
    assert monitor_parser().parse_args(flags["health_monitor"]).fault_timeout == ft


async def test_a_client_of_several_servers_pings_to_find_a_lost_one(nats_server):
    from plumbing.bus import FAILOVER_CONNECT_S, FAILOVER_PING_S, FAILOVER_PINGS

    one = await Bus.connect(nats_server.url, "test", "one", nats_server.creds)
    # a second URL nobody listens on: the client still has somewhere else to go
    two = await Bus.connect(f"{nats_server.url},nats://127.0.0.1:9", "test", "two",
                            nats_server.creds)
    try:
        assert one.nc.options["ping_interval"] > FAILOVER_PING_S
        assert two.nc.options["ping_interval"] == FAILOVER_PING_S
        assert two.nc.options["max_outstanding_pings"] == FAILOVER_PINGS
        assert two.nc.options["connect_timeout"] == FAILOVER_CONNECT_S
    finally:
        await one.close()
        await two.close()


async def test_the_streams_leaders_leave_the_active_instances_server(tmp_path):
    """`up --hosts` moves every stream's and bucket's leader off the server on the active
    instances' host (ops/emulated.py lead_elsewhere): losing that host then costs the
    standbys a lease expiry, not a Raft election first (docs/cluster.md "Losing a host")."""
    from ops.emulated import active_servers, lead_elsewhere
    from ops.placement import place
    from plumbing import logs

    placement = place(["h1", "h2", "h3"], 3, ["health_monitor", "scaler", "state_broker"],
                      1, 3, 1)
    assert active_servers(placement, ["health_monitor", "scaler", "state_broker"]) == [0]
    roles = write_role_credentials(tmp_path / "creds")
    users = [(c, role_permissions(r, JOB)) for r, (_, c) in roles.items()]
    servers = BusServers.start(tmp_path / "nats", 3, users=users, creds=roles["operator"][1])
    op = None
    try:
        op = await Bus.connect(servers.url, JOB, "op", roles["operator"][1])
        await op.ensure_job_storage(READY_S)
        names = [sp.server_name for sp in servers.specs]

        async def leaders() -> dict[str, str]:
            return {si.config.name: si.cluster.leader for si in await op.js.streams_info()}
        # the server leading the job's bucket now: every leader moves off it
        target = (await _retry(leaders, READY_S, "the leaders"))[f"KV_{op.subjects.kv_bucket}"]
        got = await lead_elsewhere(op, {target}, READY_S, logs.get("test"))
        now = await leaders()
        assert got["stayed"] == [] and f"KV_{op.subjects.kv_bucket}" in got["moved"], got
        assert all(v in names and v != target for v in now.values()), now
    finally:
        if op is not None:
            await op.close()
        servers.stop()
