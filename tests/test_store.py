"""NatsStore: c10d semantics against a real nats-server, and real gloo groups over it."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from agent.store import NatsStore, StoreLoop, StoreTimeout, decode_key, encode_key
from helpers.procs import Group, nats_cfg


@pytest.fixture
def store_loop(nats_server):
    sl = StoreLoop(nats_server.url, "test", nats_server.creds)
    try:
        yield sl
    finally:
        sl.close()


def test_key_encoding():
    for k in ["0/1", "", "a b:c", "ünï", "x" * 300, "rank_0/addr."]:
        e = encode_key(k)
        assert all(c.isalnum() or c in "-_=" for c in e)
        assert decode_key(e) == k
    with pytest.raises(ValueError):
        NatsStore(None, None, prefix="no-dot")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        NatsStore(None, None, prefix="a..b.")  # type: ignore[arg-type]


def test_store_semantics(store_loop):
    s = store_loop.store("g1.", timeout=2.0)
    s.set("0/1", b"hello")
    s.set("str", "text")
    assert s.get("0/1") == b"hello" and s.get("str") == b"text"
    assert [s.add("c", 1), s.add("c", 5), s.add("c", -2)] == [1, 6, 4]
    assert s.add("zero", 0) == 0 and s.get("zero") == b"0"
    # TCPStore compare_set semantics
    assert s.compare_set("x", "", "a") == b"a"          # missing + empty expected: set
    assert s.compare_set("x", "b", "c") == b"a"         # mismatch: current value
    assert s.compare_set("x", "a", "c") == b"c"         # match: swapped
    assert s.compare_set("y", "q", "w") == b"q"         # missing + non-empty expected
    assert not s.check(["y"])
    assert s.check(["0/1", "c"]) and not s.check(["0/1", "nope"])
    assert s.num_keys() == 5
    assert s.delete_key("x") and not s.delete_key("x") and not s.check(["x"])
    assert s.num_keys() == 4
    s.set("", b"empty")
    assert s.get("") == b"empty"
    s.append("ap", "ab")
    s.append("ap", b"cd")
    assert s.get("ap") == b"abcd"
    assert s.multi_get(["0/1", "ap"]) == [b"hello", b"abcd"]
    # another prefix is another store
    other = store_loop.store("g2.", timeout=0.3)
    assert other.num_keys() == 0 and not other.check(["0/1"])
    s.set_timeout(timedelta(seconds=1.5))
    assert s.timeout == timedelta(seconds=1.5)


def test_store_blocking_get_and_wait(store_loop):
    s = store_loop.store("g3.", timeout=5.0)
    writer = store_loop.store("g3.")

    def later():
        time.sleep(0.3)
        writer.set("late", b"v")
        writer.set("x", b"again")

    s.set("x", b"first")
    assert s.delete_key("x")
    th = threading.Thread(target=later)
    th.start()
    t0 = time.perf_counter()
    assert s.get("late") == b"v"
    blocked = time.perf_counter() - t0
    s.wait(["x", "late"])
    assert s.get("x") == b"again"  # a deleted key is waited for until it is set again
    th.join()
    assert 0.25 < blocked < 1.5, blocked
    # a set is seen by a blocked getter promptly (watch, no polling)
    lat = []
    for i in range(5):
        def put(i=i):
            time.sleep(0.05)
            lat.append(time.perf_counter())
            writer.set(f"k{i}", b"1")
        th = threading.Thread(target=put)
        th.start()
        s.get(f"k{i}")
        lat[-1] = time.perf_counter() - lat[-1]
        th.join()
    print(f"\nwake-up latency of a blocked get: {min(lat) * 1e3:.2f}-{max(lat) * 1e3:.2f} ms")
    assert max(lat) < 0.5
    # timeouts name the key
    s.set_timeout(timedelta(seconds=0.4))
    t0 = time.perf_counter()
    with pytest.raises(StoreTimeout, match="never"):
        s.get("never")
    assert 0.35 < time.perf_counter() - t0 < 3
    with pytest.raises(StoreTimeout, match=r"\['never2'\]"):
        s.wait(["never2", "late"], timedelta(seconds=0.3))


def test_store_concurrent_add(store_loop):
    stores = [store_loop.store("g4.") for _ in range(4)]
    ths = [threading.Thread(target=lambda s=s: [s.add("cnt", 1) for _ in range(15)])
           for s in stores]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    assert stores[0].get("cnt") == b"60"


def test_store_refuses_loop_thread(store_loop):
    s = store_loop.store("g5.")

    async def inside():
        s.set("a", b"b")

    with pytest.raises(RuntimeError, match="thread"):
        store_loop.call(inside())


def test_gloo_groups_over_nats_store(nats_server):
    """Three freshly started processes build gloo groups over NatsStore, two generations."""
    world = 3
    with Group("groups", world, dict(nats_cfg(nats_server), tag="t1.")) as g:
        gens = [g.expect_all("gen", timeout=60) for _ in range(2)]
        g.expect_all("done", timeout=30)
    expect = float(world * (world + 1) // 2)
    for gen in gens:
        for m in gen:
            assert m["value"] == [expect] * 4
    for i, gen in enumerate(gens, 1):
        ms = ", ".join(f"{m['create_ms']:.1f}" for m in gen)
        print(f"\ngeneration {i}: gloo group creation per rank (ms): {ms}; "
              f"store calls per rank: {[m['calls'] for m in gen]}")
    assert all(m["calls"] == 2 * world + 1 for m in gens[1])


def test_a_write_that_reaches_no_stream_is_made_again(store_loop):
    """JetStream answers "no responders" while a bucket's stream is not there to take a write
    (after a nats-server restart, while a cluster elects its leader): nothing was stored, so
    the store writes again rather than failing the rendezvous (two ranks that failed at once
    on it read as a bug in the script: the soak). Here the bucket's stream is deleted under a
    live store and made again 0.6 s into a ``set``."""
    from agent import store as store_mod

    s = store_loop.store("gr.", timeout=10.0)
    s.set("before", b"1")
    stream = store_loop.kv._stream
    bus = store_loop.bus
    assert store_loop.call(bus.js.delete_stream(stream))
    done: list[float] = []

    def writer():
        t0 = time.monotonic()
        s.set("during", b"2")
        done.append(time.monotonic() - t0)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    time.sleep(0.6)
    assert not done, "the write cannot have landed: the bucket has no stream"
    store_loop.call(bus.store_kv())  # the bucket made again
    t.join(15)
    assert done, "the write was not made again once the stream was back"
    assert s.get("during") == b"2"

    # past the store's timeout it fails as the store's error, not the bus's raw one
    assert store_loop.call(bus.js.delete_stream(stream))
    quick = store_loop.store("gq.", timeout=0.5)
    with pytest.raises(store_mod.StoreError, match="did not take it"):
        quick.set("k", b"v")


def test_an_error_of_the_bus_is_not_the_scripts():
    """A rank failing on the bus or the rendezvous store reports its failure as the pod's
    (``recovery_failed``: replaced), never as an exception the health monitor would judge a
    bug in the script when two ranks raise it together."""
    import torch.distributed as dist
    from nats.js.errors import NoStreamResponseError

    from agent.incident import the_bus_failed
    from agent.store import StoreError

    assert the_bus_failed(NoStreamResponseError())
    assert the_bus_failed(StoreError("store 'g2.': watcher failed"))
    assert the_bus_failed(dist.DistStoreError("timeout"))
    try:
        try:
            raise NoStreamResponseError()
        except Exception as e:
            raise RuntimeError("rendezvous of generation 2 failed") from e
    except RuntimeError as chained:
        assert the_bus_failed(chained)
    assert not the_bus_failed(ValueError("the script's own"))
    assert not the_bus_failed(KeyError("x"))


def test_a_state_declared_lost_is_not_the_scripts_bug():
    """The soak (seed 7): after a kill_all of a job restarted from its checkpoint, the two
    replacement pods of the next generation both raised ``JobStateLost`` out of their
    scripts; reported as ``exception`` with the same text, the monitor judged one bug on two
    pods (``job_failed``) and `up` stopped instead of restarting from the checkpoint."""
    from agent.incident import not_the_scripts
    from agent.vocab import JobStateLost

    lost = JobStateLost("no member of generation 8 holds committed state")
    assert not_the_scripts(lost)
    try:
        try:
            raise lost
        except JobStateLost as e:  # a framework wrapping what the loop raised
            raise RuntimeError("training failed") from e
    except RuntimeError as wrapped:
        assert not_the_scripts(wrapped)
    assert not not_the_scripts(ValueError("the script's own"))
    from types import SimpleNamespace

    from agent import wiring
    from schemas.messages import AgentState, ReportKind

    said: list = []
    rt = SimpleNamespace(hb=SimpleNamespace(state=AgentState.recovering),
                         report_sync=lambda kind, why: said.append(kind),
                         update=lambda **kw: None, stop=lambda: None)
    wiring.stop(rt, JobStateLost, lost, None)
    wiring.stop(rt, ValueError, ValueError("the script's own"), None)
    assert said == [ReportKind.recovery_failed, ReportKind.exception]
