"""Worker process for the distributed tests: ``dist_worker.py <scenario> <json config>``.

Prints ``@@ {json}`` lines (``event`` names what happened); any exception -> ``error``.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # helpers.*

import torch  # noqa: E402

from agent.collectives import (AbortableGroup, Aborted, PeerError, abandoned,  # noqa: E402
                               grads_of, make_group)
from agent.digests import digest  # noqa: E402
from agent.state import StateMismatch, describe, destinations, snapshot  # noqa: E402
from agent.transfer import recv_state, send_state  # noqa: E402
from agent.store import StoreLoop  # noqa: E402
from plumbing.bus import Credentials  # noqa: E402
from helpers.in_order import InOrderGroup  # noqa: E402

torch.set_num_threads(1)


def out(event: str, **kw) -> None:
    print("@@ " + json.dumps(dict(event=event, **kw)), flush=True)


def store_loop(cfg: dict) -> StoreLoop:
    creds = Credentials.load(cfg["creds"]) if cfg.get("creds") else None
    return StoreLoop(cfg["url"], cfg.get("job", "test"), creds, name=f"rank{cfg['rank']}")


def group(sl: StoreLoop, prefix: str, rank: int, world: int, in_order: bool = False,
          **kw) -> AbortableGroup:
    """``in_order``: sends and receives matched per peer in order, tags ignored, as NCCL
    does (helpers/in_order.py)."""
    pg = make_group(sl.store(prefix, timeout=30), rank, world, timeout_s=30)
    return AbortableGroup(InOrderGroup(pg) if in_order else pg, **kw)


# ---------------------------------------------------------------------------- store
def sc_groups(cfg: dict) -> None:
    """Two generations of raw gloo groups over NatsStore; all-reduce in each."""
    rank, world = cfg["rank"], cfg["world_size"]
    sl = store_loop(cfg)
    for gen in (1, 2):
        store = sl.store(f"{cfg['tag']}g{gen}.")
        t0 = time.perf_counter()
        pg = make_group(store, rank, world, timeout_s=30)
        ms = (time.perf_counter() - t0) * 1e3
        t = torch.full((4,), float(rank + 1))
        pg.allreduce([t]).wait()
        out("gen", gen=gen, create_ms=ms, calls=store.calls, value=t.tolist())
        AbortableGroup(pg).close()
    sl.close()
    out("done")


# ---------------------------------------------------------------------------- collectives
def _base(shape, dtype, seed):
    n = 1
    for s in shape:
        n *= s
    return ((torch.arange(n) * (seed + 3)) % 7).reshape(shape).to(dtype)


def sc_collect(cfg: dict) -> None:
    rank, world = cfg["rank"], cfg["world_size"]
    sl = store_loop(cfg)
    g = group(sl, "c1.", rank, world, bucket_bytes=4096)
    abort = threading.Event()
    specs = [((3, 5), torch.float32), ((100,), torch.float32), ((4, 6), torch.float32),
             ((0,), torch.float32), ((), torch.float32), ((2000,), torch.float32),
             ((7,), torch.float64), ((5,), torch.int64), ((33,), torch.float16),
             ((300,), torch.float32)]
    ts = []
    for i, (shape, dt) in enumerate(specs):
        t = _base(shape, dt, i) * (rank + 1)
        if i == 2:  # a non-contiguous tensor
            t = t.t()
        ts.append(t)
    g.allreduce_(ts, abort)
    k = world * (world + 1) // 2
    ok = all(torch.equal(t, (_base(s, d, i) * k).t() if i == 2 else _base(s, d, i) * k)
             for i, (t, (s, d)) in enumerate(zip(ts, specs)))
    # broadcast from rank 1
    bs = [torch.full((10,), float(rank)), torch.full((3000,), float(rank)),
          torch.full((2,), rank, dtype=torch.int64)]
    g.broadcast_(bs, 1, abort)
    ok_b = all(bool((b == 1).all()) for b in bs)
    # point to point 0 -> 1
    ok_p = True
    if rank == 0:
        g.send([torch.arange(10.0), torch.arange(5)], 1, abort, tag=7)
    elif rank == 1:
        a, b = torch.zeros(10), torch.zeros(5, dtype=torch.int64)
        g.recv([a, b], 0, abort, tag=7)
        ok_p = torch.equal(a, torch.arange(10.0)) and torch.equal(b, torch.arange(5))
    g.barrier(abort)
    # gradients, one parameter unused on some ranks (grad None -> zeros)
    torch.manual_seed(0)
    lin, extra = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    x = torch.ones(2, 4) * (rank + 1)
    loss = lin(x).sum() + (extra(x).sum() if rank == 0 else 0.0)
    loss.backward()
    params = list(lin.parameters()) + list(extra.parameters())
    grads = grads_of(params)
    g.allreduce_(grads, abort)
    gd = hashlib.sha256(b"".join(p.grad.numpy().tobytes() for p in params)).hexdigest()
    out("result", allreduce=ok, broadcast=ok_b, p2p=ok_p, grad_digest=gd,
        extra_grad_nonzero=bool(extra.weight.grad.abs().sum() > 0))
    g.close()
    sl.close()
    out("done")


def sc_kill(cfg: dict) -> None:
    """The victim stops taking part after a warm-up; the test SIGKILLs it."""
    rank, world, victim = cfg["rank"], cfg["world_size"], cfg["victim"]
    sl = store_loop(cfg)
    g = group(sl, "k1.", rank, world)
    abort = threading.Event()
    g.allreduce_([torch.ones(1000)], abort)
    if rank == victim:
        out("ready")
        time.sleep(1000)
    out("pending", t=time.time())
    try:
        g.allreduce_([torch.ones(250_000)], abort, timeout_s=20)
        out("error", error="all-reduce returned with a dead peer")
    except PeerError as e:
        t = time.time()
        try:
            g.allreduce_([torch.ones(1)], abort)
            after = "returned"
        except PeerError:
            after = "PeerError"
        out("peer_error", t=t, msg=str(e)[:200], after=after, state=g.state)
    g.close()
    sl.close()
    out("done")


def sc_stop(cfg: dict) -> None:
    """The victim SIGSTOPs itself after a warm-up; survivors abort, regroup without it."""
    rank, world, victim = cfg["rank"], cfg["world_size"], cfg["victim"]
    sl = store_loop(cfg)
    g = group(sl, "s1.", rank, world)
    abort = threading.Event()
    g.allreduce_([torch.ones(1000)], abort)
    if rank == victim:
        out("stopping")
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(1000)
    time.sleep(0.3)  # let the victim stop
    delay = cfg.get("abort_after", 0.5)
    t_set = [0.0]

    def fire() -> None:
        time.sleep(delay)
        t_set[0] = time.perf_counter()
        abort.set()

    threading.Thread(target=fire, daemon=True).start()
    t0 = time.perf_counter()
    try:
        g.allreduce_([torch.ones(250_000)], abort, slice_s=0.05)
        out("error", error="all-reduce returned with a stopped peer")
        return
    except Aborted:
        t1 = time.perf_counter()
    waited, latency = t1 - t0, t1 - t_set[0]
    # new generation without the stopped peer, while the old all-reduce is still stuck
    survivors = [r for r in range(world) if r != victim]
    new_rank = survivors.index(rank)
    t2 = time.perf_counter()
    g2 = group(sl, "s2.", new_rank, len(survivors))
    create_ms = (time.perf_counter() - t2) * 1e3
    x = torch.full((8,), float(rank + 1))
    g2.allreduce_([x], threading.Event())
    expect = float(sum(r + 1 for r in survivors))
    t3 = time.perf_counter()
    g.close()  # already aborted: returns at once
    close_ms = (time.perf_counter() - t3) * 1e3
    t4 = time.perf_counter()
    g2.close()  # healthy: destroyed normally
    close2_ms = (time.perf_counter() - t4) * 1e3
    out("result", waited=waited, latency=latency, create_ms=create_ms,
        value_ok=bool((x == expect).all()), abandoned=abandoned(), old_state=g.state,
        close_aborted_ms=close_ms, close_healthy_ms=close2_ms)
    sl.close()
    out("exiting")
    if cfg.get("hard_exit"):
        os._exit(0)


def sc_p2p(cfg: dict) -> None:
    """Point to point with waits longer than a slice: a late sender (must succeed: a
    timed-out gloo p2p wait would close the pair) and a sender that never sends (the
    receiver's abort must still return promptly)."""
    rank = cfg["rank"]
    sl = store_loop(cfg)
    g = group(sl, "p1.", rank, 2, slice_s=0.05)
    abort = threading.Event()
    n = int(cfg.get("mb", 16) * 1024 * 1024 // 4)
    t0 = time.perf_counter()
    if rank == 0:
        time.sleep(cfg.get("delay", 0.5))
        g.send([torch.arange(n, dtype=torch.float32)], 1, abort)
        late_ok = True
    else:
        buf = torch.zeros(n)
        g.recv([buf], 0, abort)
        late_ok = bool(torch.equal(buf, torch.arange(n, dtype=torch.float32)))
    late_s = time.perf_counter() - t0
    g.barrier(abort)
    # Rank 1 waits for a message rank 0 never sends; abort fires after a delay.
    aborted_after = None
    if rank == 1:
        delay = 0.3
        threading.Timer(delay, abort.set).start()
        t1 = time.perf_counter()
        try:
            g.recv([torch.zeros(4)], 0, abort, tag=9)
        except Aborted:
            aborted_after = time.perf_counter() - t1 - delay
    else:
        time.sleep(1.0)
    out("result", late_ok=late_ok, late_s=late_s, aborted_after=aborted_after, state=g.state)
    g.close()
    sl.close()
    out("done")
    os._exit(0)  # rank 1's abandoned recv thread may still be parked on the group


# ---------------------------------------------------------------------------- state
class Counter:
    """A user extra: anything with state_dict/load_state_dict."""

    def __init__(self) -> None:
        self.count = 0
        self.hist = torch.zeros(4, dtype=torch.int64)

    def state_dict(self):
        return {"count": self.count, "hist": self.hist.clone(), "nested": [(1, "a"), {"x": None}]}

    def load_state_dict(self, sd):
        self.count = sd["count"]
        self.hist.copy_(sd["hist"])


def build(seed: int):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
    s = torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=20)
    return {"model": m, "opt": o, "sched": s, "counter": Counter()}


def train(objs, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    m, o, s, c = objs["model"], objs["opt"], objs["sched"], objs["counter"]
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = m(x).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        s.step()
        c.count += 1
        c.hist[c.count % 4] += 1


def state_hash(objs) -> str:
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            h.update(f"T{x.dtype}{tuple(x.shape)}".encode())
            h.update(x.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(f"K{k!r}".encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(f"V{x!r}".encode())

    for name in sorted(objs):
        h.update(name.encode())
        walk(objs[name].state_dict())
    return h.hexdigest()


def param_hash(objs) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes()
                                   for p in objs["model"].parameters())).hexdigest()


class Big:
    def __init__(self, n: int, seed: int | None) -> None:
        g = torch.Generator().manual_seed(0)
        self.w = torch.randn(n, generator=g) if seed is not None else torch.zeros(n)

    def state_dict(self):
        return {"w": self.w}

    def load_state_dict(self, sd):
        self.w.copy_(sd["w"])


def sc_state(cfg: dict) -> None:
    rank, world = cfg["rank"], cfg["world_size"]
    sl = store_loop(cfg)
    g = group(sl, "st1.", rank, world, in_order=bool(cfg.get("in_order")))
    abort = threading.Event()
    recipient = world - 1
    sources = list(range(world - 1))
    src_objs = build(0)
    train(src_objs, 3, seed=1)
    extra = {"step": 2, "loss": 0.25}

    def phase(plan: dict[int, list[int]], fresh_seed: int, tamper=None, live=True):
        """One transfer (``live``: sent from the live tensors, received into the objects' own;
        else from a snapshot into new tensors); returns (objs, stats or None)."""
        if rank == recipient:
            objs = build(fresh_seed)  # different init, optimizer never stepped
            params = list(objs["model"].parameters())
            into = (lambda sk: destinations(objs, sk)) if live else None
            st = recv_state(g, rank, plan[rank], abort, tamper=tamper, into=into)
            got_extra = st.restore(objs)
            same_ids = all(a is b for a, b in zip(params, objs["model"].parameters()))
            opt_params_ok = all(a is b for a, b in zip(params, objs["opt"].param_groups[0]["params"]))
            return objs, dict(st.stats, extra=got_extra, same_ids=same_ids and opt_params_ok)
        if rank in plan[recipient]:
            st = describe(src_objs, extra) if live else snapshot(src_objs, extra)
            sent = send_state(g, st, rank, plan, abort)
            return src_objs, {"sent": sent}
        return src_objs, None

    # A: one source
    objs, stats = phase({recipient: [0]}, fresh_seed=123)
    g.barrier(abort)
    out("phase", name="one_source", hash=state_hash(objs), stats=_jsonable(stats))
    # B: striped over all sources
    objs, stats = phase({recipient: sources}, fresh_seed=456, live=False)
    g.barrier(abort)
    out("phase", name="striped", hash=state_hash(objs), stats=_jsonable(stats),
        digest=digest(objs["model"]))
    # one more identical step everywhere
    train(objs, 1, seed=99)
    out("phase", name="after_step", hash=param_hash(objs), state=state_hash(objs))
    g.barrier(abort)
    # C: a corrupted chunk (flip one byte of the last source's chunk before verification)
    def flip(tensors):  # the last tensor: in the last source's stripe
        b = tensors[-1].reshape(-1).view(torch.uint8)
        b[b.numel() - 3] ^= 0x10

    try:
        phase({recipient: sources}, fresh_seed=789, tamper=flip if rank == recipient else None)
        mismatch = None
    except StateMismatch as e:
        mismatch = {"msg": str(e)[:200], "bad": e.bad}
    g.barrier(abort)
    out("phase", name="corrupt", mismatch=mismatch)
    # D: timing of a big state, 1 source then all sources
    n = int(cfg.get("mb", 32) * 1024 * 1024 // 4)
    big = {"big": Big(n, 0 if rank != recipient else None)}
    timings = {}
    for label, plan in (("1->1", {recipient: [0]}), (f"{len(sources)}->1", {recipient: sources})):
        if rank == recipient:
            big["big"].w.zero_()
            st = recv_state(g, rank, plan[rank], abort, into=lambda sk: destinations(big, sk))
            st.restore(big)
            timings[label] = {"MB": st.stats["state_bytes"] / 2**20,
                              "seconds": st.stats["seconds"],
                              "transfer_seconds": st.stats["transfer_seconds"],
                              "verify_seconds": st.stats["verify_seconds"]}
        elif rank in plan[recipient]:
            t0 = time.perf_counter()
            st = describe(big)
            timings[label] = {"describe_s": time.perf_counter() - t0}
            send_state(g, st, rank, plan, abort)
        g.barrier(abort)
    ok_big = bool(torch.equal(big["big"].w, Big(n, 0).w)) if rank == recipient else True
    out("timing", timings=timings, ok=ok_big)
    g.close()
    sl.close()
    out("done")


def _jsonable(x):
    return json.loads(json.dumps(x, default=str)) if x is not None else None


SCENARIOS = {"groups": sc_groups, "collect": sc_collect, "kill": sc_kill, "stop": sc_stop,
             "state": sc_state, "p2p": sc_p2p}

if __name__ == "__main__":
    cfg = json.loads(sys.argv[2])
    try:
        SCENARIOS[sys.argv[1]](cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out("error", error=f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}")
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
