"""Emulated hosts (ops/hosts.py): made, reached across, cut and healed, destroyed without a
trace; the loopback fallback where namespaces cannot be made. Real namespaces and veths
(root; skipped otherwise), real sockets."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest

from ops.hosts import Hosts, Unavailable, _run, kill_all, sweep_stale

pytestmark = [pytest.mark.timeout(60)]

LISTEN = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 0)); s.listen(8); "
          "print(s.getsockname()[1], flush=True)\nwhile True: s.accept()[0].close()")


def _state() -> tuple[str, str, str]:
    return (_run(["ip", "netns", "list"]).stdout, _run(["ip", "-o", "link"]).stdout,
            _run(["ip", "-4", "route", "show", "table", "local"]).stdout)


def _reach(addr: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


@pytest.fixture
def netns_hosts():
    try:
        h = Hosts.make(2)
    except Unavailable as e:
        pytest.skip(str(e))
    if h.mode != "netns":
        h.destroy()
        pytest.skip(f"no namespaces here: {h.why}")
    try:
        yield h
    finally:
        h.destroy()


def test_hosts_are_reached_at_their_addresses_cut_and_healed(netns_hosts):
    h = netns_hosts
    h1, h2 = h.hosts
    assert h1.addr != h2.addr and h1.addr.startswith("127.") and h1.netns
    srv = subprocess.Popen(h1.argv([sys.executable, "-c", LISTEN, h1.addr]),
                           stdout=subprocess.PIPE, text=True)
    try:
        port = int(srv.stdout.readline())
        # the pid is the command's own (`ip netns exec` execs), in h1's namespace
        assert _run(["ip", "netns", "identify", str(srv.pid)]).stdout.strip() == h1.netns
        assert _reach(h1.addr, port)  # from the root namespace
        probe = [sys.executable, "-c", "import socket,sys; socket.create_connection("
                 "(sys.argv[1], int(sys.argv[2])), timeout=1)", h1.addr, str(port)]
        assert subprocess.run(h2.argv(probe), timeout=20).returncode == 0  # from h2
        h.cut("h1")
        assert h.is_cut("h1")
        assert not _reach(h1.addr, port)
        assert subprocess.run(h2.argv(probe), timeout=20,
                              capture_output=True).returncode != 0
        assert srv.poll() is None  # its process lives on
        h.heal("h1")
        assert not h.is_cut("h1")
        # a link back up answers within moments, not at once (CI: one connect right after
        # the heal failed on a loaded machine)
        deadline = time.monotonic() + 10
        while not _reach(h1.addr, port) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _reach(h1.addr, port)
        assert subprocess.run(h2.argv(probe), timeout=20).returncode == 0
    finally:
        srv.kill()
        srv.wait()


def test_destroy_leaves_nothing_even_after_a_cut():
    before = _state()
    try:
        h = Hosts.make(3)
    except Unavailable as e:
        pytest.skip(str(e))
    if h.mode != "netns":
        h.destroy()
        pytest.skip(h.why)
    h.cut("h2")
    assert _state() != before
    h.destroy()
    h.destroy()  # twice: nothing left to do, no error
    assert _state() == before


def test_a_dead_owners_namespaces_are_swept():
    try:
        Hosts.make(1).destroy()  # can namespaces be made here at all?
    except Unavailable as e:
        pytest.skip(str(e))
    dead = subprocess.Popen(["true"])
    dead.wait()
    name = f"ceaseless-{dead.pid}-a"
    if _run(["ip", "netns", "add", name], check=False).returncode != 0:
        pytest.skip("cannot add a namespace")
    assert name in sweep_stale()
    assert name not in _run(["ip", "netns", "list"]).stdout


def test_loopback_hosts_cannot_be_partitioned():
    h = Hosts.make(3, namespaces=False)
    assert h.mode == "loopback" and h.why
    assert [x.addr for x in h.hosts] == ["127.0.1.1", "127.0.1.2", "127.0.1.3"]
    assert h.hosts[0].argv(["x"]) == ["x"]
    with pytest.raises(Unavailable, match="cannot be cut"):
        h.cut("h1")
    with pytest.raises(KeyError):
        h["h9"]
    h.destroy()


def test_a_bad_host_count_is_refused():
    for n in (0, 27):
        with pytest.raises(ValueError):
            Hosts.make(n, namespaces=False)


async def test_a_bus_over_three_hosts_loses_one_and_says_who_leads(tmp_path):
    """Three nats-servers, one per host, routes between the hosts' addresses: the job's
    stream and buckets are replicated, each has a leader (JetStream's API, as `status
    --json` shows it), and with h1 lost (link cut, its server killed by pid) a client given
    every URL goes on reading and writing KV through the other two."""
    import asyncio

    from ops.emulated import bus_leaders
    from plumbing.bus import Bus
    from services.common.natsserver import BusServers, write_credentials

    try:
        h = Hosts.make(3)
    except Unavailable as e:
        pytest.skip(str(e))
    srv = None
    try:
        if h.mode != "netns":
            pytest.skip(h.why)
        creds = write_credentials(tmp_path / "c.json")
        srv = BusServers.start(tmp_path / "nats", 3, creds=creds,
                               hosts=[x.addr for x in h.hosts],
                               prefixes=[x.argv([]) for x in h.hosts])
        assert [u.rsplit(":", 1)[0].split("//")[1] for u in srv.url.split(",")] == \
            [x.addr for x in h.hosts]
        for x, s in zip(h.hosts, srv.servers):  # each server in its host's namespace
            assert _run(["ip", "netns", "identify", str(s.proc.pid)]).stdout.strip() == x.netns
        bus = await Bus.connect(srv.url, "demo", "t", creds)
        try:
            await bus.ensure_job_storage(30)

            async def retried(call, what: str):  # a loaded machine answers JetStream late
                deadline = asyncio.get_running_loop().time() + 30
                while True:
                    try:
                        return await call()
                    except Exception:
                        assert asyncio.get_running_loop().time() < deadline, what
                        await asyncio.sleep(0.2)

            leaders = await retried(lambda: bus_leaders(bus), "the leaders")
            assert leaders and all(v["leader"] in ("s1", "s2", "s3") and len(v["replicas"]) == 2
                                   for v in leaders.values()), leaders
            h.cut("h1")
            srv.down.add(0)
            assert kill_all([srv.servers[0].proc.pid]) == [srv.servers[0].proc.pid]
            assert srv.restart_dead() == []  # a lost host's server is not restarted
            kv = await retried(bus.kv, "the bucket after h1")
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                try:
                    await kv.put("k", b"v")
                    if (await kv.get("k")).value == b"v":
                        break
                except Exception:  # a leader election in progress
                    assert asyncio.get_running_loop().time() < deadline, "no KV after h1"
                    await asyncio.sleep(0.2)
            while True:  # every stream re-elected on the two left (each in its own time)
                try:
                    after = await bus_leaders(bus)
                except Exception:
                    after = {}
                if after and all(v["leader"] in ("s2", "s3") for v in after.values()):
                    break
                assert asyncio.get_running_loop().time() < deadline, after
                await asyncio.sleep(0.2)
        finally:
            await bus.close()
    finally:
        if srv is not None:
            srv.stop(timeout=2)
        h.destroy()


async def test_a_hosts_loss_kills_its_processes_and_nothing_goes_there_again(tmp_path):
    """`HostRun` (ops/emulated.py) on loopback hosts, with real processes standing for a
    server, an instance and a pod of h1 and of h2: the loss of h1 kills h1's, by pid, and
    only those; a second loss and a partition (no namespaces) are refused with why; a pod
    started later goes to h2; hosts.json says it all; h1's return makes it a host again."""
    import asyncio
    from types import SimpleNamespace

    from ops.emulated import HostRun, read_hosts
    from ops.placement import place
    from schemas.messages import Inject, InjectAction

    hosts = Hosts.make(2, namespaces=False)
    run = HostRun(hosts, place(hosts.names(), 2, ["scaler"], 1, 2, 0), tmp_path)
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = {k: subprocess.Popen(sleep, start_new_session=True)
             for k in ("s1", "s2", "scaler", "scaler-s1", "w0", "w1")}
    try:
        run.srv = SimpleNamespace(servers=[SimpleNamespace(proc=procs["s1"]),
                                           SimpleNamespace(proc=procs["s2"])],
                                  down=set(), url="nats://127.0.1.1:1,nats://127.0.1.2:2")
        run.sup = SimpleNamespace(procs={"scaler": procs["scaler"],
                                         "scaler-s1": procs["scaler-s1"]})
        run.act = SimpleNamespace(running=lambda: {p: procs[p].pid for p in ("w0", "w1")
                                                   if procs[p].poll() is None})
        assert run.where("w0") == ([], {"CEASELESS_GLOO_HOSTNAME": "127.0.1.1",
                                        "CEASELESS_HOST": "h1"}, None)
        assert run.where("w1")[1]["CEASELESS_GLOO_HOSTNAME"] == "127.0.1.2"
        assert await run.on_inject(Inject(action=InjectAction.partition, host="h1",
                                          for_s=1)) == \
            "hosts are loopback addresses here (namespaces not asked for): a host's link " \
            "cannot be cut without network namespaces (run as root)"
        assert (await run.on_inject(Inject(action=InjectAction.host_loss, host="h3"))
                ).startswith("no host 'h3'")
        assert await run.on_inject(Inject(action=InjectAction.host_loss, host="h1")) is None
        assert await run.on_inject(Inject(action=InjectAction.host_loss, host="h1")) == \
            "host h1 is lost"
        assert run.instance_down("scaler") and not run.instance_down("scaler-s1")
        await asyncio.sleep(0.5)  # the loss comes right after the answer
        for k in ("s1", "scaler", "w0"):
            assert procs[k].wait(5) == -9, k
        assert all(procs[k].poll() is None for k in ("s2", "scaler-s1", "w1"))
        assert run.srv.down == {0}
        assert run.where("s0")[1]["CEASELESS_GLOO_HOSTNAME"] == "127.0.1.2"
        run.exited("w0", -9)
        st = read_hosts(tmp_path)
        assert st["hosts"]["h1"]["state"] == "lost" and st["pods"] == {"w1": "h2", "s0": "h2"}
        assert st["servers"]["s1"] == {"host": "h1", "url": "nats://127.0.1.1:1"}
        # `inject host-return`: h1 is up again, its server and instance no longer skipped by
        # `up`'s restart loops, and the next pod goes there (the host with the fewest)
        assert await run.on_inject(Inject(action=InjectAction.host_return, host="h2")) == \
            "host h2 is up: only a lost host returns"
        assert await run.on_inject(Inject(action=InjectAction.host_return, host="h1")) is None
        assert run.srv.down == set() and not run.instance_down("scaler")
        assert run.where("s1")[1]["CEASELESS_GLOO_HOSTNAME"] == "127.0.1.1"
        assert read_hosts(tmp_path)["hosts"]["h1"]["state"] == "up"
        assert any("host h1 returned" in e for e in run.events)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        await run.close()
