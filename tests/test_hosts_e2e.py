"""Losing a whole host (issue 42), end to end: `ceaseless up --hosts 3 --bus-servers 3
--standbys 1`, 3 workers + 1 spare. Host h1 runs a nats-server, the active instance of
every service and rank 0 (the default placement: the worst host to lose); `ceaseless inject
host-loss --host h1` mid-run cuts its link and kills all of it at once. The job finishes
with 0 lost steps, bitwise equal to the fault-free run, one incident and one plan per
generation; `ceaseless status --json` places everything and names the streams' leaders.
Real nats-servers, services, pods and gloo across the hosts' addresses (network namespaces
as root; loopback addresses otherwise); cleaned up by PID; no namespace left behind."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import pytest

from harness import REPO, run_job
from ops.hosts import Hosts, Unavailable, _run
from test_control_plane_down import _slower
from test_recovery_e2e import _assert_same, _kill

pytestmark = [pytest.mark.timeout(300)]
SERVICES = ("health_monitor", "scaler", "state_broker")
PARTITION_S = 20


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ops.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"})


@pytest.fixture
def namespaces():
    """Skip where namespaces cannot be made; after the test, none of this run's is left."""
    try:
        Hosts.make(1).destroy()
    except Unavailable as e:
        pytest.skip(str(e))
    before = _run(["ip", "netns", "list"]).stdout
    yield
    assert _run(["ip", "netns", "list"]).stdout == before


async def test_losing_the_host_of_every_active_part(tmp_path, reference, namespaces):
    seen: dict = {}

    async def fault(c):
        await c.wait_rank_step(1, 16)
        hosts = json.loads((c.run_dir / "hosts.json").read_text())
        seen["before"] = hosts
        assert hosts["mode"] == "netns", hosts
        assert hosts["servers"]["s1"]["host"] == "h1"
        assert all(hosts["instances"][s] == "h1" for s in SERVICES), hosts
        assert c.member(0).pod and hosts["pods"][c.member(0).pod] == "h1", hosts
        gen = c.plans[-1].generation
        at = c.member(1).step
        t0 = time.time()
        r = _cli("inject", "host-loss", "--host", "h1", "--run-dir", str(c.run_dir))
        assert r.returncode == 0 and "accepted: inject host-loss: host h1 lost" in r.stdout, \
            (r.stdout, r.stderr)
        await c.wait_for(lambda: c.plans[-1].generation > gen, 60, "the plan after h1")
        # (not c.member(0): the lost w0's last heartbeat still says rank 0, generation 1)
        await c.wait_for(lambda: any(h.rank == 0 and h.generation > gen and h.step > at + 1
                                     for h in c.hb.values()), 60, "rank 0 training again")
        seen["back_s"] = time.time() - t0
        deadline = time.monotonic() + 30
        while True:  # the standbys' leases: taken by now, but a loaded machine may lag
            st = _cli("status", "--json", "--run-dir", str(c.run_dir))
            assert st.returncode == 0, st.stderr
            seen["status"] = json.loads(st.stdout)
            inst = seen["status"]["hosts"]["instances"]
            # the streams' leaders too: `status` says why it could not list them while
            # JetStream's meta leader (lost with h1) is being elected again
            if all(len([i for i, v in inst.items() if v["active"] and v["host"] != "h1" and
                        (i == n or i.startswith(n + "-s"))]) == 1 for n in SERVICES) \
                    and "error" not in seen["status"].get("streams", {}):
                break
            if time.monotonic() > deadline:
                break  # asserted below, with the status
            await asyncio.sleep(0.5)

    s = await run_job(tmp_path, "hosts", 3, 1, fault, cmd=_slower(tmp_path),
                      extra=["--hosts", "3", "--bus-servers", "3", "--standbys", "1"])
    _assert_same(s, reference(3))
    assert len(s["incidents"]) == 1, s["incidents"]
    gens = [p.generation for p in s["plans"]]
    assert all(len({p.model_dump_json() for p in s["plans"] if p.generation == g}) == 1
               for g in gens), s["plans"]  # no two plans for one generation
    assert s["plans"][-1].world_size == 3
    st = seen["status"]["hosts"]
    assert st["hosts"]["h1"]["state"] == "lost"
    assert "h1" not in st["pods"].values(), st["pods"]
    for name in SERVICES:  # the active instances now: the standbys, off h1
        active = [i for i, v in st["instances"].items() if v["active"] and
                  (i == name or i.startswith(name + "-s"))]
        assert len(active) == 1 and st["instances"][active[0]]["host"] != "h1", st
    leaders = seen["status"]["streams"]
    assert leaders and all(v["leader"] in ("s2", "s3") for v in leaders.values()), leaders
    inc = s["incidents"][0]
    det = inc.get("detection_latency")  # None: a new scaler replaced the silent w0 itself
    print(f"\nhost-loss h1: incident {inc.get('kind')} downtime {inc['downtime']:.2f}s "
          f"(detection {'-' if det is None else f'{det:.2f}s'}), rank 0 back at a step "
          f"{seen['back_s']:.2f}s after the injection")


async def test_a_partitioned_host_is_fenced_and_comes_back(tmp_path, reference, namespaces):
    """`inject partition --host h1 --for 20`: h1's link is cut with its processes alive.
    The standbys take over, rank 0 is fenced and replaced, no two plans for one generation,
    bitwise; once healed, h1's instances are standbys (the leases stay with the others) and
    its nats-server is a current replica again."""
    seen: dict = {}

    async def fault(c):
        await c.wait_rank_step(1, 16)
        gen = c.plans[-1].generation
        # 20 s, not 10: the standby monitor must first take the lease, and when the lease
        # bucket's leader was on h1's server that waits for a JetStream leader election
        # (seconds); a 10 s partition healed before anything was declared in one CI run
        # (training paused and went on: no fault, no plan)
        r = _cli("inject", "partition", "--host", "h1", "--for", str(PARTITION_S),
                 "--run-dir", str(c.run_dir))
        assert r.returncode == 0 and "accepted" in r.stdout, (r.stdout, r.stderr)
        await c.wait_for(lambda: c.plans[-1].generation > gen, 60, "the plan without h1")

        def healed() -> bool:
            return json.loads((c.run_dir / "hosts.json").read_text()
                              )["hosts"]["h1"]["state"] == "up"
        await c.wait_for(healed, 60, "h1 healed")
        healed_at = time.monotonic()
        deadline = time.monotonic() + 60
        while True:  # h1's server caught up again: a current replica of every stream
            r = _cli("status", "--json", "--run-dir", str(c.run_dir))
            try:  # (a status call may fail while the bus heals: asked again)
                st = json.loads(r.stdout)
            except ValueError:
                assert time.monotonic() < deadline, (r.stdout, r.stderr)
                await asyncio.sleep(0.5)
                continue
            reps = st.get("streams") or {}
            if reps and "error" not in reps and all(
                    any(x["server"] == "s1" and x["current"] for x in v["replicas"])
                    or v["leader"] == "s1" for v in reps.values()):
                break
            assert time.monotonic() < deadline, reps
        seen["status"] = st
        seen["current_s"] = time.monotonic() - healed_at
        slow.unlink()  # checked: the rest of the job at full speed

    # slower still and longer (same numerics): the job must outlast the partition, the heal
    # and s1's catching up (its routes wait out nats-server's 10 s write deadline first: the
    # 80-step job ended 19 s after the heal, before s1 was current, in this session's CI).
    # Slow only while `slow` exists: once s1 is current nothing is left to wait for, and the
    # rest of the 160 steps (which had to cover the worst case) run at full speed
    from ops.cluster import UpOptions, _default_data, default_cmd

    steps = 160
    slow = tmp_path / "slow"
    slow.touch()
    cmd = [*default_cmd(UpOptions(steps=steps), _default_data(tmp_path / "data")),
           "--sleep", "0.15", "--sleep-while", str(slow)]
    s = await run_job(tmp_path, "partition", 3, 1, fault, cmd=cmd, steps=steps,
                      extra=["--hosts", "3", "--bus-servers", "3", "--standbys", "1"])
    _assert_same(s, reference(3, steps), steps)
    gens = [p.generation for p in s["plans"]]
    assert all(len({p.model_dump_json() for p in s["plans"] if p.generation == g}) == 1
               for g in gens), s["plans"]
    inst = seen["status"]["hosts"]["instances"]
    for name in SERVICES:  # one instance acts per service, wherever the leases went
        acting = [i for i, v in inst.items() if v["active"] and
                  (i == name or i.startswith(name + "-s"))]
        assert len(acting) <= 1, inst
    # (h1's instances usually come back as standbys; in one loaded run two of them took
    # their leases back after the heal, which the terms make safe: not asserted)
    print(f"\nafter the heal, active: {[i for i, v in inst.items() if v['active']]}")
    print(f"\npartition h1 {PARTITION_S}s: s1 current {seen['current_s']:.1f}s after the heal; "
          f"incidents {s['incidents']}")


QUORUM_CUT_S = 15


def _partition(c, host: str, for_s: float) -> None:
    """`inject partition`, asked again when no answer came (`up`'s client may be failing
    over from the host cut just before: the injection, a plain message, is then lost); a
    refusal because the host is already cut means an earlier one got through unanswered."""
    for _ in range(4):  # a short wait: the answer takes a fraction of a second; a lost
        # injection waited out the default 10 s, and the second host was cut 11 s after the
        # first (a loaded run: "the kill came too late")
        r = _cli("inject", "partition", "--host", host, "--for", str(for_s), "--wait", "3",
                 "--run-dir", str(c.run_dir))
        if r.returncode == 0 and "accepted" in r.stdout or f"host {host} is cut" in r.stdout:
            return
        assert "no answer" in r.stderr, (r.stdout, r.stderr)
    raise AssertionError(f"inject partition {host}: no answer four times")


async def test_two_of_three_bus_hosts_lost_no_quorum_then_back(tmp_path, reference,
                                                               namespaces):
    """`--hosts 5 --bus-servers 3 --control-hosts 3 --standbys 1`: h1..h3 each run a
    nats-server and one instance of every service (h1's active, h2's standbys), the pods
    train on h4 and h5. h1 and h3 are partitioned: s2 alone, no JetStream quorum. `up` says
    so, training goes on stepping, and a member killed meanwhile is NOT replanned (the
    standbys on h2 see it but can take no lease, and nothing writes a plan) until a host
    is back; then it is recovered: one new plan, bitwise equal to the fault-free run."""
    seen: dict = {}

    def said(what: str) -> bool:
        return what in (c_dir / "up.out").read_text()

    async def fault(c):
        await c.wait_rank_step(1, 16)
        hosts = json.loads((c.run_dir / "hosts.json").read_text())
        assert [hosts["servers"][f"s{i}"]["host"] for i in (1, 2, 3)] == ["h1", "h2", "h3"]
        assert set(hosts["pods"].values()) <= {"h4", "h5"}, hosts
        gen = c.plans[-1].generation
        t_cut = time.time()
        # both at once: one after the other (~1.6 s per CLI call) left s2+s3 a majority
        # long enough for h2's standby scaler to take the lease and plan before the heal
        await asyncio.gather(*(asyncio.to_thread(_partition, c, h, QUORUM_CUT_S)
                               for h in ("h1", "h3")))
        await c.wait_for(lambda: said("the bus has no JetStream quorum: 1 of 3 servers "
                                      "reachable (s2)"), 15, "up saying why")
        at = {h.pod: h.step for h in c.hb.values() if h.role.value == "worker"}
        await c.wait_for(lambda: all(c.hb[p].step >= s + 3 for p, s in at.items()), 30,
                         "training stepping without quorum")
        _kill(c, 1)
        t_kill = time.time()
        st = _cli("status", "--json", "--run-dir", str(c.run_dir))
        assert st.returncode == 0, st.stderr
        seen["bus"] = json.loads(st.stdout)["bus"]
        await c.wait_for(lambda: said("the bus has JetStream quorum again"),
                         QUORUM_CUT_S + 40, "JetStream answering again")
        seen["js_back_s"] = time.time() - (t_cut + QUORUM_CUT_S)
        # the loss went unplanned for longer than a fault timeout and a lease TTL: with a
        # quorum a plan would have come (else the run proves nothing: too slow a machine)
        assert t_cut + QUORUM_CUT_S - t_kill > 3.5 + 2.7, "the kill came too late"
        assert all(p.generation <= gen for p in c.plans if p.ts < t_cut + QUORUM_CUT_S), \
            c.plans
        await c.wait_for(lambda: c.plans[-1].generation > gen, 60, "the plan after the heal")
        seen["plan_after_heal_s"] = c.plans[-1].ts - (t_cut + QUORUM_CUT_S)
        seen["kill_s"] = t_kill - t_cut
        seen["gen"] = gen
        slow.unlink()  # checked: the rest of the job at full speed

    c_dir = tmp_path / "quorum"
    slow = tmp_path / "slow"  # slower (same numerics) only until the checks are done
    slow.touch()
    s = await run_job(tmp_path, "quorum", 3, 1, fault,
                      cmd=[*_slower(tmp_path)[:-1], "0.08", "--sleep-while", str(slow)],
                      extra=["--hosts", "5", "--bus-servers", "3", "--control-hosts", "3",
                             "--standbys", "1"])
    _assert_same(s, reference(3))
    assert seen["bus"]["quorum"] is False and seen["bus"]["reachable"] == ["s2"], seen
    gens = [p.generation for p in s["plans"]]
    assert max(gens) == seen["gen"] + 1, s["plans"]  # the kill, recovered once
    assert all(len({p.model_dump_json() for p in s["plans"] if p.generation == g}) == 1
               for g in gens), s["plans"]
    assert s["plans"][-1].world_size == 3
    print(f"\nno quorum {QUORUM_CUT_S}s: w1 killed {seen['kill_s']:.1f}s into it; `up` saw "
          f"JetStream answer {seen['js_back_s']:.1f}s after the heal, the plan for w1 came "
          f"{seen['plan_after_heal_s']:.2f}s after the heal; incidents {s['incidents']}")
