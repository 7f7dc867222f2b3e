"""Whether the bus has a JetStream quorum (ops/quorum.py): the majority rule and the lines
`up` says (pure), and the probe against real nats-servers: one that answers, one that is
gone, one that is frozen (SIGSTOP: it accepts nothing it does not read, as a cut link)."""

from __future__ import annotations

import os
import signal
import socket

import pytest

from ops.quorum import (Quorum, QuorumWatch, answers, judge, majority, probe,
                        server_names)
from services.common.natsserver import NatsServer

pytestmark = [pytest.mark.timeout(60)]


def test_a_majority_of_the_servers_is_a_quorum():
    assert [majority(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]
    with pytest.raises(ValueError):
        majority(0)
    assert judge({"s1": True, "s2": False, "s3": True}).state is Quorum.ok
    v = judge({"s1": False, "s2": False, "s3": True})
    assert v.state is Quorum.lost and v.reachable == ("s3",) and v.total == 3
    assert v.line().startswith("the bus has no JetStream quorum: 1 of 3 servers reachable "
                               "(s3), 2 needed")
    assert v.as_dict() == {"quorum": False, "reachable": ["s3"], "servers": 3, "needed": 2,
                           "line": v.line()}
    # two servers: losing either loses the quorum (docs/cluster.md: use 3)
    assert judge({"s1": True, "s2": False}).state is Quorum.lost
    assert "0 of 3 servers reachable, 2 needed" in judge(dict.fromkeys(("a", "b", "c"),
                                                                        False)).line()


def test_each_change_is_said_once():
    w = QuorumWatch()
    ok = judge({"s1": True, "s2": True, "s3": True})
    lost = judge({"s1": False, "s2": False, "s3": True})
    back = judge({"s1": False, "s2": True, "s3": True})
    assert w.observe(ok, 0.0) is None  # starting with quorum is nothing to say
    assert w.observe(ok, 1.0, js_ok=False) is None  # an election after one loss: ordinary
    assert w.observe(lost, 2.0) == lost.line()
    assert w.observe(lost, 3.0, js_ok=False) is None
    # a majority back, JetStream not answering yet: said, and still no quorum to act on
    assert w.observe(back, 14.5, js_ok=False) == (
        "the bus has a majority again: 2 of 3 servers reachable (s2, s3) after 12.5s; "
        "JetStream does not answer yet (its routes and leaders come back): still no plan")
    assert w.observe(back, 15.0, js_ok=False) is None
    assert w.observe(back, 20.5, js_ok=True) == (
        "the bus has JetStream quorum again: 2 of 3 servers reachable (s2, s3), 18.5s "
        "without, JetStream answering 6.0s after the majority")
    assert w.observe(ok, 21.0) is None  # a third server back: still quorum, nothing new
    # back with JetStream answering at once (or not asked)
    assert w.observe(lost, 30.0) == lost.line()
    assert w.observe(back, 31.0) == ("the bus has JetStream quorum again: 2 of 3 servers "
                                     "reachable (s2, s3), 1.0s without")
    first = QuorumWatch()  # a bus that starts without quorum says so at once
    assert first.observe(lost, 0.0) == lost.line()


def test_server_names_of_a_bus_url():
    assert server_names("nats://127.0.0.1:4222,tls://10.0.0.2:5222, nats://h3:1") == {
        "s1": ("127.0.0.1", 4222), "s2": ("10.0.0.2", 5222), "s3": ("h3", 1)}
    assert server_names("h1:4000") == {"s1": ("h1", 4000)}


async def test_the_probe_asks_real_servers(tmp_path):
    a = NatsServer.start(tmp_path / "a")
    b = NatsServer.start(tmp_path / "b")
    hold = socket.socket()  # bound, not listening: the port stays ours and refuses
    hold.bind(("127.0.0.1", 0))
    gone = hold.getsockname()[1]
    try:
        assert await answers("127.0.0.1", a.port)
        assert not await answers("127.0.0.1", gone)
        url = f"{a.url},{b.url},nats://127.0.0.1:{gone}"
        v = await probe(url)
        assert v.state is Quorum.ok and v.reachable == ("s1", "s2")
        assert (await probe(url, down={"s2"})).state is Quorum.lost  # a lost host's: not asked
        os.kill(b.proc.pid, signal.SIGSTOP)  # accepts (the kernel does) but says nothing
        try:
            _stopped(b.proc.pid)
            assert not await answers("127.0.0.1", b.port, timeout=0.3)
            v = await probe(url, timeout=0.3)
            assert v.state is Quorum.lost and v.reachable == ("s1",)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        assert (await probe(url)).reachable == ("s1", "s2")
    finally:
        hold.close()
        a.stop()
        b.stop()


def _stopped(pid: int, within_s: float = 10.0) -> None:
    """Until the kernel has stopped every thread of ``pid`` (a signal is delivered late
    on a loaded machine: a connection accepted meanwhile would still get its INFO)."""
    import time
    from pathlib import Path

    deadline = time.monotonic() + within_s
    tasks = Path(f"/proc/{pid}/task")
    while time.monotonic() < deadline:
        states = []
        for t in tasks.iterdir():
            try:
                states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except OSError:
                continue
        if states and all(st == "T" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} not stopped in {within_s}s")
