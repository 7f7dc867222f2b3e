import asyncio
import json

import pytest

from schemas import Heartbeat, Plan
from schemas.messages import Member, Role
from plumbing.bus import DropError, decode
from harness import until


def test_decode_reasons():
    ok = Heartbeat(pod="p1", role=Role.worker, generation=0)
    assert decode(Heartbeat, ok.model_dump_json().encode(), "ceaseless.j.heartbeat.p1") == ok
    cases = {
        b"\xff\xfe": "not JSON",
        b"[1,2]": "JSON list",
        b'{"schema_version": 2, "pod": "p1"}': "schema_version",
        b'{"schema_version": 1, "pod": "p1", "role": "worker", "generation": 0, "x": 1}': "invalid",
        b"x" * (2 * 1024 * 1024): "oversized",
    }
    for data, reason in cases.items():
        with pytest.raises(DropError, match=reason):
            decode(Heartbeat, data, "ceaseless.j.heartbeat.p1")
    with pytest.raises(DropError, match="subject names pod"):
        decode(Heartbeat, ok.model_dump_json().encode(), "ceaseless.j.heartbeat.other")
    # Valid but for a missing schema_version (the model's default would fill it in): the fast
    # path must not accept it.
    bare = json.loads(ok.model_dump_json())
    del bare["schema_version"]
    with pytest.raises(DropError, match="schema_version None"):
        decode(Heartbeat, json.dumps(bare).encode(), "ceaseless.j.heartbeat.p1")


def test_plan_lookups_follow_the_members():
    plan = Plan(generation=1, members=[Member(pod="a", rank=0), Member(pod="b", rank=1)],
                world_size=2, global_batch_size=16, micro_batch_size=4, shares={0: 2, 1: 2})
    assert (plan.rank_of("b"), plan.pod_of(0), plan.rank_of("zz"), plan.pod_of(5)) == (
        1, "a", None, None)
    # model_copy(update=...) runs no validator: the index must not go stale
    moved = plan.model_copy(update={"members": [Member(pod="c", rank=0),
                                                Member(pod="b", rank=1)]})
    assert (moved.rank_of("c"), moved.rank_of("a"), moved.pod_of(0)) == (0, None, "c")
    assert plan.rank_of("a") == 0
    # the cached index is not part of the model: equality and the wire form ignore it
    again = Plan.model_validate_json(plan.model_dump_json())
    assert again == plan and "index" not in plan.model_dump_json()


def test_plan_validation():
    members = [Member(pod="a", rank=0), Member(pod="b", rank=1)]
    Plan(generation=1, members=members, world_size=2, global_batch_size=16,
         micro_batch_size=4, shares={0: 2, 1: 2})
    with pytest.raises(ValueError):  # ranks with a hole
        Plan(generation=1, members=[Member(pod="a", rank=0), Member(pod="b", rank=2)],
             world_size=2, global_batch_size=16, micro_batch_size=4, shares={0: 2, 1: 2})
    with pytest.raises(ValueError):  # shares do not cover the batch
        Plan(generation=1, members=members, world_size=2, global_batch_size=16,
             micro_batch_size=4, shares={0: 2, 1: 1})


async def test_roundtrip_and_drop(bus):
    got: list[Heartbeat] = []

    async def handler(msg, env):
        got.append(msg)

    await bus.subscribe(bus.subjects.heartbeat(), Heartbeat, handler)
    await bus.publish(bus.subjects.heartbeat("p1"),
                      Heartbeat(pod="p1", role=Role.spare, generation=3))
    await bus.nc.publish(bus.subjects.heartbeat("p2"), b"garbage")
    await bus.nc.publish(bus.subjects.heartbeat("p3"), json.dumps({"schema_version": 9}).encode())
    await bus.nc.flush()
    for _ in range(100):
        if got and sum(bus.dropped.values()) == 2:
            break
        await asyncio.sleep(0.02)
    assert [h.pod for h in got] == ["p1"]
    assert sum(bus.dropped.values()) == 2


async def test_kv_idempotent(bus):
    kv1 = await bus.kv()
    kv2 = await bus.kv()
    rev = await kv1.put("plan", b"1")
    assert (await kv2.get("plan")).revision == rev
    await bus.ensure_stream()  # twice is fine


async def test_round_trip_times_out_on_a_paused_server_and_the_client_still_reads(
        nats_server, bus):
    """nats-py's flush(timeout) cancels its PONG future, and the late PONG then stops the
    client's read loop for good (is_connected stays True). Bus.round_trip must not."""
    import os
    import signal

    from schemas.messages import Heartbeat, Role

    got: list = []

    async def on_hb(hb, _env):
        got.append(hb)
    await bus.subscribe(bus.subjects.heartbeat(), Heartbeat, on_hb)
    os.kill(nats_server.proc.pid, signal.SIGSTOP)
    try:
        # stopped for sure (the signal lands asynchronously): state T in /proc
        await until(lambda: open(f"/proc/{nats_server.proc.pid}/stat").read().split(") ")[1][0]
                    == "T", what="nats-server stopped")
        assert await bus.round_trip(0.3) is False
        assert await bus.round_trip(0.3) is False
    finally:
        os.kill(nats_server.proc.pid, signal.SIGCONT)
    assert await bus.round_trip(5.0) is True
    await bus.publish(bus.subjects.heartbeat("w0"), Heartbeat(pod="w0", role=Role.worker,
                                                              generation=1))
    await until(lambda: got, what="a message after the paused server woke up")


async def test_own_close_is_no_disconnect_warning_but_a_lost_server_is(nats_server):
    """Issue 33: a client's own close (`ceaseless status` ending) logged "nats
    disconnected" as a warning, which went into `status --json`'s output; it is debug now.
    A server that goes away is still a warning."""
    import structlog

    from plumbing.bus import Bus

    b = await Bus.connect(nats_server.url, "test", "closer", nats_server.creds)
    with structlog.testing.capture_logs() as cap:
        await b.close()
        # the callback runs on the client's own task: wait for it (bounded), not a fixed
        # 0.1 s, which a loaded machine overran once
        await until(lambda: [e for e in cap if e["event"].startswith("nats disconnected")],
                    5, what="the disconnect callback")
    assert not [e for e in cap if e["log_level"] == "warning"], cap
    b = await Bus.connect(nats_server.url, "test", "stays", nats_server.creds)
    try:
        with structlog.testing.capture_logs() as cap:
            nats_server.stop()
            await until(lambda: [e for e in cap if e["log_level"] == "warning"
                                 and e["event"] == "nats disconnected"], 10,
                        what="a disconnect warning")
    finally:
        await asyncio.wait_for(b.nc.close(), 5)


def test_cli_logs_go_to_stderr(capsys):
    """The CLI's log lines never go to stdout (a command's output: `status --json | jq`)."""
    from ops.cli import main
    from plumbing import logs

    assert main(["schemas", "export", str(__import__("tempfile").mkdtemp())]) == 0
    capsys.readouterr()
    logs.get("test").warning("a log line")
    out, err = capsys.readouterr()
    assert "a log line" not in out and "a log line" in err
