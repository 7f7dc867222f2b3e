"""Across addresses: pods in network namespaces of their own, nothing over loopback.

Two namespaces, each joined to this (root) namespace by a veth pair carrying addresses of
127.X.0.0/16 (tests/helpers/netns.py: the root side 127.X.i.1, the namespace side
127.X.i.2, the namespaces reach each other through the root namespace). The control plane
(nats-server on 0.0.0.0, the three services, `ceaseless up`) runs here; every pod runs in a
namespace (tests/helpers/netns_pod.py) and reaches the bus at its veth's root-side address
and its peers at their namespace addresses, where it binds gloo. Inside a namespace
127.0.0.1 is its own loopback, so a pod that used loopback for the bus or advertised it to
its peers could not work at all: the job finishing proves nothing in the path assumes it.

w0 in namespace A, w1 and the spare s0 in namespace B; w1 is SIGKILLed mid-run, so every
gloo link crosses namespaces: w0-w1 (generation 1), w0 streaming to the shadow spare s0,
and w0-s0 (generation 2). The result is bitwise the fault-free run's (on loopback).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import pytest

import harness
from harness import Cluster, log_events
from helpers.netns import Netns, Unavailable

pytestmark = [pytest.mark.timeout(180)]

STEPS = harness.STEPS  # the fault-free reference is shared with test_recovery_e2e
WRAPPER = Path(__file__).parent / "helpers" / "netns_pod.py"


@pytest.fixture
def netns():
    try:
        n = Netns.create(2)
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        yield n
    finally:
        n.destroy()


def _established(n: Netns, ns) -> list[tuple[str, str, set[int]]]:
    """(local, peer, pids) of every established TCP connection inside ``ns``."""
    out = []
    for line in n.exec(ns, "ss", "-Htnp", "state", "established").splitlines():
        f = line.split()
        if len(f) >= 4:
            out.append((f[2], f[3], {int(p) for p in re.findall(r"pid=(\d+)", line)}))
    return out


_events = log_events


async def test_pods_in_namespaces_train_and_recover_across_addresses(tmp_path, netns,
                                                                      reference):
    from ops.cluster import UpOptions, _default_data, default_cmd

    a, b = netns.namespaces
    spec = {"ns": [[ns.name, ns.root_addr, ns.addr] for ns in (a, b)],
            "pods": {"w0": 0, "w1": 1, "s0": 1}}
    cmd = [sys.executable, str(WRAPPER), json.dumps(spec), "--",
           *default_cmd(UpOptions(steps=STEPS), _default_data(tmp_path / "data"))]
    run_dir = tmp_path / "netns"
    seen: dict[str, list] = {}
    async with Cluster(run_dir, 2, 1, STEPS, extra=["--bus-host", "0.0.0.0"], cmd=cmd,
                       timeout=120) as c:
        port = json.loads((run_dir / "cluster.json").read_text())["nats_url"].rsplit(":", 1)[1]
        await c.wait_rank_step(1, 4, timeout=90)
        await c.wait_for(lambda: any(h.role.value == "spare" and h.step >= 4
                                     for h in c.hb.values()), 60, "the spare following the job")
        pid = {p: c.hb[p].pid for p in ("w0", "w1", "s0")}
        # the pid the actuator started (and would SIGKILL) is the training process in its
        # namespace: `ip netns exec` execs, it does not fork
        recorded = {p[0]: p[1] for p in (line.split() for line in
                                          (run_dir / "pids.txt").read_text().splitlines())}
        own_net = os.readlink("/proc/self/ns/net")
        for p, ns in (("w0", a), ("w1", b), ("s0", b)):
            assert int(recorded[p]) == pid[p]
            argv = Path(f"/proc/{pid[p]}/cmdline").read_bytes().split(b"\0")
            assert b"examples.train_gpt" in argv and b"netns" not in argv, argv
            assert os.readlink(f"/proc/{pid[p]}/ns/net") != own_net
        seen["A1"], seen["B1"] = _established(netns, a), _established(netns, b)
        at = c.hb["w1"].step
        os.kill(pid["w1"], signal.SIGKILL)
        # s0 trained a step as rank 1 of generation 2: that generation's group is up
        await c.wait_for(lambda: (h := c.hb.get("s0")) is not None and h.rank == 1
                         and h.generation >= 2 and h.step > at + 1, 60,
                         "s0 training in generation 2 as rank 1")
        # `ss -p` can list a just-made socket before it can name its process (seen once: the
        # new w0-s0 connection with no pid): sample again, briefly, until it names w0
        for _ in range(20):
            seen["A2"], seen["B2"] = _established(netns, a), _established(netns, b)
            fresh = {(lo, pe) for lo, pe, pids in seen["A2"] if pid["w0"] in pids} - \
                {(lo, pe) for lo, pe, pids in seen["A1"]}
            if any(pe.rsplit(":", 1)[0] == b.addr for _, pe in fresh):
                break
            await asyncio.sleep(0.1)
        code = await c.finish()
        assert code == 0, c.output()
        s = c.summary()

    ref = reference(2, STEPS)
    assert s["final_step"] == STEPS - 1
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    assert s["lost_steps"] == 0
    assert {k: ref["losses"][k] for k in s["losses"]} == s["losses"]
    assert len(s["incidents"]) == 1 and s["incidents"][0]["kind"] == "crash"
    assert c.plans[-1].world_size == 2 and c.plans[-1].pod_of(1) == "s0"

    # each pod bound gloo at its namespace's address (its own log) ...
    for p, ns in (("w0", a), ("w1", b), ("s0", b)):
        assert {r.get("gloo") for r in _events(run_dir, p, "backend")} == \
            {f"hostname={ns.addr}"}, p
    # ... and the sockets were there: bus connections to the root-side addresses, gloo
    # connections between the namespaces' addresses, nothing on 127.0.0.1
    bus_a, bus_b = f"{a.root_addr}:{port}", f"{b.root_addr}:{port}"

    def links(conns, pod, peer_host):
        return [(lo, pe) for lo, pe, pids in conns
                if pid[pod] in pids and pe.rsplit(":", 1)[0] == peer_host]

    for key in seen:
        assert not [x for x in seen[key] if "127.0.0.1" in x[0] + x[1]], (key, seen[key])
    assert [pe for lo, pe, pids in seen["A1"] if pid["w0"] in pids and pe == bus_a], seen["A1"]
    for p in ("w1", "s0"):
        assert [pe for lo, pe, pids in seen["B1"] if pid[p] in pids and pe == bus_b], seen["B1"]
        assert links(seen["B1"], p, a.addr), (p, seen["B1"])  # w0-w1, w0 -> shadow s0
    assert len(links(seen["A1"], "w0", b.addr)) >= 2, seen["A1"]
    # generation 2's group w0-s0 is a new connection between the namespaces
    assert set(links(seen["A2"], "w0", b.addr)) - set(links(seen["A1"], "w0", b.addr)), seen
