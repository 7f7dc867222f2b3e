"""The state transfer (agent/transfer.py) and the state's descriptions (agent/state.py): the
pieces cover every byte once, a recipient receives into its own tensors (no second copy of
the state), over a real gloo group of threads of this process (an in-memory store) that
matches sends and receives per peer in order, ignoring tags, as NCCL does
(helpers/in_order.py: gloo alone honours tags and would hide a receive posted out of order)."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.thread_ranks import run_ranks
from agent.collectives import AbortableGroup, make_group
from agent.state import (StateMismatch, describe, destinations, snapshot)
from agent.transfer import plan_pieces, recv_state, send_state
from agent import transfer

pytestmark = [pytest.mark.timeout(120)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 5000), max_size=12), st.integers(1, 5),
       st.sampled_from([64, 128, 1024]))
def test_pieces_cover_every_byte_once_aligned(nbytes, k, piece):
    pieces = plan_pieces(nbytes, k, piece_bytes=piece)
    seen = [[0] * n for n in nbytes]
    for p in pieces:
        assert 0 <= p.start < p.end <= nbytes[p.tensor] and 0 <= p.source < k
        assert p.start % 64 == 0 and p.end - p.start <= piece
        for b in range(p.start, p.end):
            seen[p.tensor][b] += 1
    assert all(c == 1 for row in seen for c in row)
    # a source's pieces are contiguous in the stream: stripes, not a scatter
    order = [p.source for p in pieces]
    assert order == sorted(order)


def test_the_in_order_group_meets_a_receive_posted_out_of_order():
    """The test group does what NCCL does: two messages, received in the other order than
    they were sent, meet the wrong buffers (plain gloo matches them by tag)."""
    def fn(r: int, g: AbortableGroup):
        a, b = torch.zeros(4), torch.zeros(8)
        if r == 0:
            a += 1
            b += 2
            g.wait_all([g.isend(a, 1, 1), g.isend(b, 1, 2)], None, "send", timeout_s=5)
            return None
        g.wait_all([g.irecv(b, 0, 2), g.irecv(a, 0, 1)], None, "recv", timeout_s=5)
        return a.sum().item(), b.sum().item()

    assert run_ranks(fn, 2)[1] == (4.0, 16.0)  # gloo: by tag
    with pytest.raises(AssertionError, match="NCCL matches in order"):
        run_ranks(fn, 2, in_order=True)


def _objs(seed: int, stepped: bool) -> dict:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    m[2].weight = torch.nn.Parameter(m[2].weight.detach().clone())
    o = torch.optim.AdamW(m.parameters(), lr=1e-2)
    if stepped:
        for i in range(3):
            o.zero_grad()
            m(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
            o.step()
    return {"model": m, "opt": o}


def _flat(objs: dict) -> bytes:
    sd = snapshot(objs)
    return b"".join(b.numpy().tobytes() for b in sd.buffers)


def test_destinations_are_the_objects_own_tensors():
    src = _objs(0, stepped=True)
    dst = _objs(1, stepped=False)  # an optimizer that never stepped has no state yet
    live = describe(src, {"step": 7})
    tensors, in_place = destinations(dst, live.skeleton)
    params = list(dst["model"].parameters())
    ptrs = {p.data_ptr() for p in params}
    assert {tensors[i].data_ptr() for i in in_place} == ptrs  # every parameter, in place
    assert len(tensors) == len(live.tensors) and len(in_place) == len(params)
    for t, s in zip(tensors, live.tensors):
        assert t.shape == s.shape and t.dtype == s.dtype



@pytest.mark.parametrize("stepped_recipient", [False, True])
def test_received_in_place_bitwise_with_small_pieces(monkeypatch, stepped_recipient):
    """Two sources striped, pieces and windows far smaller than the state (many of each):
    the recipient ends bitwise equal to the sources, its parameters (and, when its optimizer
    had stepped, its optimizer state) are the same tensor objects, nothing else allocated
    for them."""
    monkeypatch.setattr(transfer, "PIECE_BYTES", 256)
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 1024)
    src = _objs(0, stepped=True)
    expect = _flat(src)

    def fn(r: int, g: AbortableGroup):
        if r < 2:
            return send_state(g, describe(copy.deepcopy(src) if r else src, {"step": 5}),
                              r, {2: [0, 1]}, None)
        objs = _objs(3, stepped=stepped_recipient)
        before = [id(t) for t in objs["model"].parameters()]
        opt_before = [id(v) for s in objs["opt"].state.values() for v in s.values()]
        got = recv_state(g, 2, [0, 1], None, into=lambda sk: destinations(objs, sk))
        extra = got.restore(objs)
        opt_after = [id(v) for s in objs["opt"].state.values() for v in s.values()]
        return (extra, _flat(objs), before == [id(t) for t in objs["model"].parameters()],
                opt_before == opt_after if stepped_recipient else True, got.stats)

    out = run_ranks(fn, 3, in_order=True)
    extra, flat, same_params, same_opt, stats = out[2]
    assert extra == {"step": 5} and flat == expect and same_params and same_opt
    assert out[0] > 0 and out[1] > 0  # both sources sent a stripe
    assert stats["in_place_bytes"] > 0



class _Recording:
    """A group that records the buffers its receives are posted into (kept alive here, so
    that distinct storages are distinct buffers, not the allocator's reused addresses)."""

    def __init__(self, g: AbortableGroup) -> None:
        self.g, self.pieces = g, []

    def __getattr__(self, name):
        return getattr(self.g, name)

    def irecv(self, t, src, tag=0):
        if tag >= transfer.TAG_BASE + transfer._TAG_PIECE:
            self.pieces.append(t)
        return self.g.irecv(t, src, tag)


def test_the_recipient_stages_pieces_in_two_slots_per_source(monkeypatch):
    """Issue 43: a piece used to be received into a buffer of its own, allocated for it, so
    every byte of the state faulted fresh pages in once more on the recipient (32 MiB pieces
    are mmapped and unmapped each). Now each source's windows take turns in two staging
    slots, reused window after window: many pieces, four buffers for two sources; bitwise."""
    monkeypatch.setattr(transfer, "PIECE_BYTES", 256)
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 1024)
    src = _objs(0, stepped=True)
    expect = _flat(src)

    def fn(r: int, g: AbortableGroup):
        if r < 2:
            return send_state(g, describe(src), r, {2: [0, 1]}, None)
        rec = _Recording(g)
        objs = _objs(3, stepped=False)
        recv_state(rec, 2, [0, 1], None, into=lambda sk: destinations(objs, sk)).restore(objs)
        storages = {t.untyped_storage().data_ptr() for t in rec.pieces}
        return _flat(objs), len(rec.pieces), len(storages)

    flat, pieces, storages = run_ranks(fn, 3, in_order=True)[2]
    assert flat == expect
    assert pieces > 20 and storages <= 4, (pieces, storages)


def test_the_exact_digest_makes_no_widened_copy():
    """Issue 43: ``exact`` summed an int32 view of each float tensor into int64, which widens
    the whole tensor into a temporary twice its size first (about 1 GB/s on a CPU: the
    sources' largest cost in a transfer of a few 64 MiB tensors). It now reads the bytes as
    int64 words: nothing it allocates is near the size of a tensor."""
    from torch.profiler import ProfilerActivity, profile

    from agent.digests import exact

    ts = [torch.randn(1 << 20), torch.randn(1000, 3).half(), torch.arange(10)]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        exact(ts)
    largest = max((e.cpu_memory_usage for e in prof.events()), default=0)
    assert largest < ts[0].nbytes // 64, largest


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2), st.integers(0, 10_000), st.integers(0, 63))
def test_the_exact_digest_sees_any_flipped_bit(which, pos, bit):
    """Equal states, equal digests (a copy elsewhere in memory); any one flipped bit of any
    tensor (any dtype, a sign bit, the tail of a tensor not a multiple of 8 bytes) changes it."""
    from agent.digests import exact

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(2051, generator=g), torch.randn(37, generator=g).double(),
          torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8)]
    assert int(exact(ts)) == int(exact([t.clone() for t in ts]))
    u8 = ts[which].view(-1).view(torch.uint8)
    bad = [t.clone() for t in ts]
    bad[which].view(-1).view(torch.uint8)[pos % u8.numel()] ^= 1 << (bit % 8)
    assert int(exact(ts)) != int(exact(bad))

def test_a_corrupted_piece_is_named_and_raises():
    src = _objs(0, stepped=True)

    def flip(tensors):
        tensors[0].reshape(-1).view(torch.uint8)[5] ^= 1

    def fn(r: int, g: AbortableGroup):
        if r == 0:
            return send_state(g, snapshot(src), 0, {1: [0]}, None)
        with pytest.raises(StateMismatch) as e:
            recv_state(g, 1, [0], None, tamper=flip)
        return e.value.bad

    assert run_ranks(fn, 2, in_order=True)[1] == [(0, 0)]


def test_a_live_description_holds_no_copy():
    """``describe`` references the live tensors (a tied weight once); a snapshot copies."""
    objs = _objs(0, stepped=True)
    live = describe(objs)
    ptrs = {t.data_ptr() for t in live.tensors}
    assert all(p.data_ptr() in ptrs for p in objs["model"].parameters())
    assert all(v.data_ptr() in ptrs for s in objs["opt"].state.values() for v in s.values())
    flat = snapshot(objs).view()
    assert not ptrs & {t.data_ptr() for t in flat.tensors}
    assert [t.shape for t in flat.tensors] == [t.shape for t in live.tensors]
    assert all(t.data_ptr() % 64 == 0 for t in flat.tensors)  # aligned: sent as views


def test_an_aborted_works_buffers_go_once_it_finished():
    """A group closed with an all-reduce pending is parked (its destructor could block on a
    stuck peer) and the work's tensor with it; once the peer is gone the work fails, and
    ``reap`` lets it go: nothing is held per incident after its aborted work finished."""
    import weakref

    from agent.groups import reap

    store = dist.HashStore()
    parked, peer_closed = threading.Event(), threading.Event()
    out: dict = {}

    def rank0() -> None:
        g = AbortableGroup(make_group(dist.PrefixStore("w", store), 0, 2, 30.0, "gloo"))
        t = torch.ones(1 << 16)
        ref = weakref.ref(t)
        pending = g.allreduce_start([t])  # rank 1 never joins it
        g.close()
        del pending, t
        out["held_while_pending"] = ref() is not None
        parked.set()
        peer_closed.wait(30)
        deadline = time.monotonic() + 20
        while ref() is not None and time.monotonic() < deadline:
            reap()
            time.sleep(0.05)
        out["freed"] = ref() is None

    def rank1() -> None:
        g = AbortableGroup(make_group(dist.PrefixStore("w", store), 1, 2, 30.0, "gloo"))
        parked.wait(30)
        g.close()  # idle: destroyed, its connections close
        peer_closed.set()

    ts = [threading.Thread(target=rank0), threading.Thread(target=rank1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert out == {"held_while_pending": True, "freed": True}


def test_one_source_serves_two_recipients_at_once(monkeypatch):
    """Two lanes on the source (its window shared between them): both recipients bitwise."""
    monkeypatch.setattr(transfer, "PIECE_BYTES", 512)
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 2048)
    src = _objs(0, stepped=True)
    expect = _flat(src)

    def fn(r: int, g: AbortableGroup):
        if r == 0:
            return send_state(g, describe(src), 0, {1: [0], 2: [0]}, None)
        objs = _objs(r, stepped=False)
        recv_state(g, r, [0], None, into=lambda sk: destinations(objs, sk)).restore(objs)
        return _flat(objs)

    out = run_ranks(fn, 3, in_order=True)
    assert out[1] == expect and out[2] == expect and out[0] >= 2 * describe(src).nbytes


# ------------------------------------------ a failed transfer and the recipient's own state
def _holding(step: int):
    """A recipient's TrainState over its own model and stepped optimizer, holding ``step``."""
    from agent.train_state import TrainState

    objs = _objs(3, stepped=True)
    st = TrainState()
    st.register(model=objs["model"], optimizer=objs["opt"])
    st.last_committed, st.loss, st.recent_losses = step, 0.5, [0.5, 0.6]
    return st, objs


def test_a_transfer_that_fails_before_landing_keeps_the_older_step():
    """Issue 41 item 7(b): a recipient that held an older step whose transfer fails (its
    source lost while connecting, an abort) still holds that step, its tensors untouched:
    it reports it in the next incident and the broker can roll back to it, as before the
    state was received in place. (It used to forget its step before the first byte.)"""
    from agent.collectives import Aborted, PeerError
    from agent.handoff import receive

    abort = threading.Event()

    def fn(r: int, g: AbortableGroup):
        if r == 0:  # the source never sends: it leaves (or the plan is superseded)
            abort.set()
            return None
        st, objs = _holding(4)
        before = _flat(objs)
        with pytest.raises((Aborted, PeerError)):
            receive(st, g, 1, [0], abort)
        return st.last_committed, st.loss, st.recent_losses, _flat(objs) == before

    assert run_ranks(fn, 2)[1] == (4, 0.5, [0.5, 0.6], True)


def test_a_transfer_that_fails_after_landing_holds_no_step(monkeypatch):
    """Once a piece landed in its own tensors, a failed transfer (here a corrupted piece,
    found at the end) leaves it holding no step: half written, it must not report one."""
    from agent.train_state import TrainState

    monkeypatch.setattr(transfer, "PIECE_BYTES", 256)
    monkeypatch.setattr(transfer, "WINDOW_BYTES", 1024)
    src = _objs(0, stepped=True)
    calls: list[int] = []

    def flip(tensors):
        tensors[0].reshape(-1).view(torch.uint8)[5] ^= 1

    def fn(r: int, g: AbortableGroup):
        if r == 0:
            return send_state(g, describe(src, {"step": 5}), 0, {1: [0]}, None)
        st, _ = _holding(4)

        def forget() -> None:
            calls.append(st.last_committed)
            TrainState.forget(st)
        with pytest.raises(StateMismatch):
            recv_state(g, 1, [0], None, tamper=flip, into=st.destinations, on_write=forget)
        return st.last_committed

    assert run_ranks(fn, 2)[1] == -1 and calls == [4]  # once, before the first write


def _digest(objs: dict) -> str:
    from agent.train_state import TrainState

    ts = TrainState()
    ts.register(**objs)
    return ts.digest()


def test_the_majority_digest_covers_every_registered_object():
    """The digest the broker takes the majority of (to choose the sources) sees a
    difference in the optimizer state or in a second module, not only in the first module's
    parameters; module buffers stay out (they may differ per rank by design)."""
    def two_modules(seed: int) -> dict:
        objs = _objs(seed, stepped=True)
        torch.manual_seed(seed + 1)
        objs["head"] = torch.nn.Linear(8, 4)
        return objs

    a = two_modules(0)
    base = _digest(a)
    assert _digest(copy.deepcopy(a)) == base
    opt_only = copy.deepcopy(a)
    for s in opt_only["opt"].state.values():  # the moments differ, the parameters do not
        s["exp_avg"].mul_(1.5)
    assert _digest(opt_only) != base
    head_only = copy.deepcopy(a)
    with torch.no_grad():
        head_only["head"].weight.add_(0.5)
    assert _digest(head_only) != base
    buffers = copy.deepcopy(a)
    buffers["head"].register_buffer("stat", torch.full((3,), 7.0))
    a["head"].register_buffer("stat", torch.zeros(3))
    assert _digest(buffers) == _digest(a)


@pytest.mark.parametrize("differ", ["optimizer", "second module"])
def test_sources_holding_different_states_are_refused(differ):
    """Two sources at the same step and layout whose states differ in one element of the
    optimizer state (or of a second module): each stripe matches its own sender's checksums,
    so before the header carried the state's digest the recipient accepted a mix of both.
    It refuses them before anything else moves."""
    a = _objs(0, stepped=True)
    torch.manual_seed(5)
    a["head"] = torch.nn.Linear(8, 4)
    b = copy.deepcopy(a)
    with torch.no_grad():
        if differ == "optimizer":
            next(iter(b["opt"].state.values()))["exp_avg_sq"].view(-1)[-1] += 1.0
        else:
            b["head"].bias[-1] += 1.0
    assert describe(a).layout_hash() == describe(b).layout_hash()

    def fn(r: int, g: AbortableGroup):
        if r < 2:
            try:
                return send_state(g, describe(a if r == 0 else b, {"step": 5}), r,
                                  {2: [0, 1]}, None, timeout_s=20)
            except Exception as e:  # the recipient refused and went away
                return type(e).__name__
        objs = _objs(3, stepped=False)
        objs["head"] = torch.nn.Linear(8, 4)
        with pytest.raises(StateMismatch, match="sources hold different states"):
            recv_state(g, 2, [0, 1], None, timeout_s=20,
                       into=lambda sk: destinations(objs, sk))
        return "refused"

    assert run_ranks(fn, 3, in_order=True)[2] == "refused"
