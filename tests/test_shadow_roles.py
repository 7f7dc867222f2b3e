"""Shadow spares' two ends in one process, against a real nats-server: rank 0's
``ShadowLeader`` and a spare's ``ShadowFollower``, each with its own ``Runtime`` (NATS
connection, store bucket), find each other through the spare's KV request and stream over
a real gloo pair. The spare ends up holding rank 0's committed state bit for bit, step by
step (also when the script sets the learning rate itself every step), and stops following
(holding nothing) when rank 0's state changes outside a step. It drops the steps a rollback
of the job discarded, and asks again when its first ask got no state."""

from __future__ import annotations

import time
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from agent.config import AgentConfig
from agent.runtime import Runtime
from agent.shadow_roles import ShadowFollower, ShadowLeader
from agent.train_state import TrainState
from schemas.messages import Member, Plan

pytestmark = pytest.mark.timeout(120)


def _state(seed: int, width: int = 8, device: str = "cpu") -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, width), torch.nn.Linear(width, 2)).to(device)
    st = TrainState()
    st.register(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    return st


def _runtime(nats_server, pod: str, **timeouts: float) -> Runtime:
    timeouts = {"collective_timeout": 10.0, "store_timeout": 10.0, **timeouts}
    rt = Runtime(AgentConfig(nats_url=nats_server.url, job="test", pod=pod,
                             creds_path=str(nats_server.creds_path), **timeouts))
    rt.start()
    return rt


def _until(pred, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _train_step(st: TrainState, s: int) -> tuple[list[torch.Tensor], list[float]]:
    """A member's step: forward/backward, the script's own learning rate for this step
    (nanoGPT's way: ``param_group['lr'] = lr``), update, zero-grad; returns the gradients
    and the optimizer's hyper-parameters the update used."""
    model = st.objs["model"]
    g = torch.Generator().manual_seed(s)
    x = torch.randn(16, 4, generator=g).to(st.device)
    loss = model(x).pow(2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in st.params()]
    for group in st.objs["optimizer"].param_groups:
        group["lr"] = 1e-2 / s
    hypers = st.hypers()
    st.update(1.0)
    st.zero_grad()
    st.last_committed, st.loss = s, float(loss.detach())
    return grads, hypers


def test_a_spare_follows_rank_0_bit_for_bit_and_stops_on_divergence(nats_server):
    rt0, rt1 = _runtime(nats_server, "p0"), _runtime(nats_server, "p1")
    lead_state, spare_state = _state(0), _state(1)  # the spare starts from other weights
    plan = Plan(generation=1, members=[Member(pod="p0", rank=0)], world_size=1,
                global_batch_size=16, micro_batch_size=16, shares={0: 1}, spares=["p1"])
    leader = ShadowLeader(rt0, rt0.cfg, lead_state)
    follower = ShadowFollower(rt1, rt1.cfg, spare_state)
    try:
        assert lead_state.digest() != spare_state.digest()
        follower.follow(plan)         # the spare asks (its KV request) ...
        assert follower.following
        lead_state.last_committed = 0
        leader.lead(plan)   # ... rank 0 answers it with the state
        assert leader.streaming

        def caught_up(step: int) -> bool:
            follower.apply()
            return spare_state.last_committed == step

        _until(lambda: caught_up(0), "the spare to hold the initial state")
        assert spare_state.param_sha256() == lead_state.param_sha256()

        for s in (1, 2, 3):
            grads, hypers = _train_step(lead_state, s)
            leader.offer(s, grads, 1.0, hypers=hypers)
            leader.confirm(s)
            _until(lambda: caught_up(s), f"the spare to hold step {s}")
            assert spare_state.param_sha256() == lead_state.param_sha256(), s
            assert spare_state.loss == lead_state.loss
            assert spare_state.objs["optimizer"].param_groups[0]["lr"] == 1e-2 / s
        assert rt1.hb.step == 3 and rt1.hb.digest == lead_state.digest()

        # rank 0's script changes registered state outside s.step(): the confirmation's
        # checksum no longer matches what the spare replayed, so it holds nothing
        grads, hypers = _train_step(lead_state, 4)
        with torch.no_grad():
            lead_state.objs["model"][0].bias.add_(1.0)
        leader.offer(4, grads, 1.0, hypers=hypers)
        leader.confirm(4)
        _until(lambda: (follower.apply(), not follower.following)[1], "the spare to stop")
        assert spare_state.last_committed == -1 and rt1.hb.step == -1
    finally:
        follower.stop(quiet=True)
        leader.end()
        rt0.stop()
        rt1.stop()


def _plan() -> Plan:
    return Plan(generation=1, members=[Member(pod="p0", rank=0)], world_size=1,
                global_batch_size=16, micro_batch_size=16, shares={0: 1}, spares=["p1"])


@contextmanager
def _streaming(nats_server, **spare_timeouts: float):
    """Rank 0 (p0) streaming to a spare (p1) that asked: both ends, stopped after."""
    rt0, rt1 = _runtime(nats_server, "p0"), _runtime(nats_server, "p1", **spare_timeouts)
    lead_state, spare_state = _state(0), _state(1)
    plan = _plan()
    leader = ShadowLeader(rt0, rt0.cfg, lead_state)
    follower = ShadowFollower(rt1, rt1.cfg, spare_state)
    try:
        follower.follow(plan)
        lead_state.last_committed = 0
        leader.lead(plan)
        leader.generation = plan.generation
        yield SimpleNamespace(rt0=rt0, rt1=rt1, lead_state=lead_state,
                              spare_state=spare_state, leader=leader, follower=follower)
    finally:
        follower.stop(quiet=True)
        leader.end()
        rt0.stop()
        rt1.stop()


def _train_until_current(leader, follower, lead_state, spare_state, s: int,
                         seen: list[int], tries: int = 100) -> int:
    """Rank 0 trains on from step ``s`` (each step offered, then confirmed, as Session does)
    until the spare holds its state; the spare's training thread polls as a waiting spare
    does (``ready()``, then ``apply()``) and ``seen`` gets every step it reported."""
    for _ in range(tries):
        s += 1
        grads, hypers = _train_step(lead_state, s)
        leader.offer(s, grads, 1.0, hypers=hypers)
        leader.confirm(s)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if follower.ready():
                follower.apply()
            seen.append(spare_state.last_committed)
            if spare_state.last_committed == s:
                assert spare_state.param_sha256() == lead_state.param_sha256(), s
                return s
            time.sleep(0.01)
    raise AssertionError(f"the spare never became current (rank 0 at step {s})")


def test_a_spare_drops_the_steps_a_rollback_discarded_and_follows_again(nats_server):
    """Two members verifying every few steps disagree (a flipped bit): rank 0 rolls back to
    its verified copy (``Verifier._rollback``, the path of both guards). A spare that followed
    the steps after the copy held and reported them (seen: its step stayed above the
    rolled-back one): it must drop them, report nothing newer than the copy, and follow the
    steps computed again."""
    from agent.verify import Verifier

    with _streaming(nats_server) as t:
        rt0, rt1, leader, follower = t.rt0, t.rt1, t.leader, t.follower
        lead_state, spare_state = t.lead_state, t.spare_state
        seen: list[int] = []
        verifier = Verifier(every=2)
        s = _train_until_current(leader, follower, lead_state, spare_state, 0, seen)
        verifier.copy, verifier.verified = lead_state.snapshot(), s  # the verified copy
        for _ in range(2):
            s = _train_until_current(leader, follower, lead_state, spare_state, s, seen)
        assert s > verifier.verified + 1 and rt1.hb.step == s  # held past the copy
        # the next step's verification disagrees: back to the copy, as every member does
        grads, hypers = _train_step(lead_state, s + 1)
        rank0 = SimpleNamespace(leader=leader)  # the verifier reaches the leader through it
        verifier._rollback(s + 1, lead_state, rt0, "corruption", m=rank0)
        leader.offer(s + 1, grads, 1.0, hypers=hypers)  # Session.step's offer, after the commit
        assert lead_state.last_committed == verifier.verified
        seen.clear()
        _until(lambda: (follower.ready() and follower.apply(), rt1.hb.step == -1)[1],
               "the spare to drop the discarded steps")
        assert spare_state.last_committed == -1
        # rank 0 computes the steps after the copy again; the spare asked anew and follows
        again = _train_until_current(leader, follower, lead_state, spare_state,
                                     verifier.verified, seen)
        assert max(seen) == again and rt1.hb.step == again, seen
        assert all(x == -1 or x > verifier.verified for x in seen), seen


def test_a_spare_promoted_as_rank_0_commits_takes_that_step_before_it_reports(nats_server):
    """A fault as rank 0 commits a step: the step and its confirmation are still in rank
    0's queue (or on the wire) when the plan promotes the spare. Rank 0 ends its stream at
    the plan with END after them (``ShadowLeader.end``) and the promoted spare applies until
    that END (``settle``): it holds the members' step, no state transfer needed. (Before,
    rank 0 closed the stream, dropping them, and the spare reported the step before: a
    loaded CI run's spare stood one step behind, and a corrupt replica met by that handoff
    could not be named.)"""
    with _streaming(nats_server) as t:
        leader, follower = t.leader, t.follower
        lead_state, spare_state = t.lead_state, t.spare_state
        s = _train_until_current(leader, follower, lead_state, spare_state, 0, [])
        grads, hypers = _train_step(lead_state, s + 1)  # the members commit s + 1 ...
        leader.offer(s + 1, grads, 1.0, hypers=hypers)
        leader.confirm(s + 1)
        leader.end()                                     # ... and the plan comes at once
        follower.settle()                                # promoted: as handoff.py does
        follower.stop()
        assert spare_state.last_committed == s + 1, (spare_state.last_committed, s + 1)
        assert spare_state.param_sha256() == lead_state.param_sha256()
        assert t.rt1.hb.step == s + 1


def test_a_spare_whose_first_ask_failed_asks_again_and_becomes_current(nats_server):
    """Rank 0's first answer to a spare fails (its stream is closed as it starts, as when its
    send errs or times out; the state may or may not have gone out): the spare asks again,
    after a pause, and becomes current. (Before, rank 0 had marked the spare served and it
    never became current in that generation.)"""
    from agent.shadow_roles import _request_key

    # the spare's waits short, so that the failed answer shows soon whichever way it fails
    with _streaming(nats_server, collective_timeout=2.0, recovery_timeout=3.0,
                    store_timeout=3.0) as t:  # rank 0 answered the ask ...
        first = t.rt1.stores.get(_request_key(1, "p1"))
        t.leader._out["p1"].close()               # ... and that answer fails
        seen: list[int] = []
        s = _train_until_current(t.leader, t.follower, t.lead_state, t.spare_state, 0, seen)
        assert t.rt1.hb.step == s and t.rt1.stores.get(_request_key(1, "p1")) != first


def test_a_spare_that_gets_no_answer_stops_asking_after_a_few_tries(nats_server, monkeypatch):
    """Nobody answers (rank 0 gone): the spare asks ``ASK_TRIES`` times, each after a longer
    pause, then stops asking for this generation (it takes the state transfer if
    promoted); it never asks in a loop."""
    import agent.shadow_roles as roles

    monkeypatch.setattr(roles, "ASK_BACKOFF_S", 0.05)
    rt1 = _runtime(nats_server, "p1", collective_timeout=0.5, recovery_timeout=0.5,
                   store_timeout=0.5)
    follower = ShadowFollower(rt1, rt1.cfg, _state(1))
    asks: set[bytes] = set()
    try:
        follower.follow(_plan())

        def gave_up() -> bool:
            asks.add(rt1.stores.get(roles._request_key(1, "p1")))
            if follower.ready():
                follower.apply()
            return not follower.following

        _until(gave_up, "the spare to stop asking", timeout=60.0)
        time.sleep(1.0)
        assert not follower.ready() and not follower.following
        assert len(asks - {None}) == roles.ASK_TRIES, asks
    finally:
        follower.stop(quiet=True)
        rt1.stop()


def test_a_spare_promoted_while_an_ask_is_due_asks_no_more(nats_server, monkeypatch):
    """Promoted (``settle`` then ``stop``, as handoff does) between a failed ask and the next:
    no ask is made after that (a member waiting for a plan polls ``ready()`` too, and must
    never ask to follow, whose stream would write into its state)."""
    import agent.shadow_roles as roles

    monkeypatch.setattr(roles, "ASK_BACKOFF_S", 0.2)
    rt1 = _runtime(nats_server, "p1", collective_timeout=0.5, recovery_timeout=0.5,
                   store_timeout=0.5)
    follower = ShadowFollower(rt1, rt1.cfg, _state(1))
    try:
        follower.follow(_plan())
        _until(lambda: (follower.ready(), follower._retry_at is not None)[1],
               "the first ask to fail")
        asked = rt1.stores.get(roles._request_key(1, "p1"))
        if follower.following:  # as handoff.py: a following spare settles, then stops
            follower.settle()
            follower.stop()
        time.sleep(4 * roles.ASK_BACKOFF_S)
        assert not follower.ready() and not follower.following
        follower.apply()
        assert rt1.stores.get(roles._request_key(1, "p1")) == asked and not follower.following
    finally:
        follower.stop(quiet=True)
        rt1.stop()


def _allocated_bytes(fn) -> int:
    """Bytes the calling thread allocates in ``fn()`` (torch's CPU allocator, as the profiler
    records it; other threads are not counted)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(0, e.self_cpu_memory_usage) for e in prof.events())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_rank_0_serves_a_spare_from_its_live_state_and_the_spare_receives_in_place(nats_server,
                                                                                   device):
    """Issue 43: a spare that asks while rank 0 trains gets its first state from rank 0's
    live tensors (before, a host snapshot of the whole state: rank 0 peaked at 1.5x), and
    receives it into its own parameters, not a staging copy. Rank 0's next update waits for
    it to be out, so the spare still ends bit for bit current. CUDA: read on a side stream
    (the allocation count is the CPU's: there the old copy went to pinned host memory)."""
    rt0, rt1 = _runtime(nats_server, "p0"), _runtime(nats_server, "p1")
    lead_state, spare_state = _state(0, 512, device), _state(1, 512, device)
    spare_ptrs = [p.data_ptr() for p in spare_state.params()]
    plan = _plan()
    leader = ShadowLeader(rt0, rt0.cfg, lead_state)
    follower = ShadowFollower(rt1, rt1.cfg, spare_state)
    try:
        leader.lead(plan)  # the generation began; no spare has asked yet
        s = 0
        for s in (1, 2):   # the optimizer holds its state: the whole state is 3x the model
            _train_step(lead_state, s)
            leader.confirm(s)
        state_bytes = lead_state.describe().nbytes
        follower.follow(plan)  # the spare asks now: rank 0 answers at its step boundary
        _until(lambda: leader._requests.get("p1") is not None, "the spare's ask")
        served = _allocated_bytes(lambda: leader.confirm(s))
        assert leader.streaming
        if device == "cpu":  # the buffers' copies only
            assert served < state_bytes / 20, (served, state_bytes)
        _until(follower.ready, "the first state to arrive")
        kind, first = follower._in._items[0]
        assert kind == "state"
        param_bytes = sum(p.numel() * p.element_size() for p in spare_state.params())
        assert first.stats["in_place_bytes"] >= param_bytes
        for s in (3, 4, 5):
            grads, hypers = _train_step(lead_state, s)  # its update waits for the state
            leader.offer(s, grads, 1.0, hypers=hypers)
            leader.confirm(s)
            _until(lambda: (follower.apply(), spare_state.last_committed == s)[1],
                   f"the spare to hold step {s}")
            assert spare_state.param_sha256() == lead_state.param_sha256(), s
            assert spare_state.digest() == lead_state.digest(), s
        assert [p.data_ptr() for p in spare_state.params()] == spare_ptrs
    finally:
        follower.stop(quiet=True)
        leader.end()
        rt0.stop()
        rt1.stop()


def test_a_stream_whose_pair_comes_up_late_starts_from_the_state_of_then(nats_server):
    """Rank 0 answers an ask, but the spare's end of the pair comes up only after rank 0 has
    trained on: the first state it was served went stale at the next update (it is the live
    state, not a copy), so the stream takes it again at each step boundary and the spare gets
    the state of the step rank 0 holds when the pair is up, then the steps after it."""
    from agent.shadow import IDLE_TIMEOUT_S, ShadowReceiver
    from agent.shadow_roles import _request_key, _store

    rt0, rt1 = _runtime(nats_server, "p0"), _runtime(nats_server, "p1")
    lead_state, spare_state = _state(0), _state(1)
    plan = _plan()
    leader = ShadowLeader(rt0, rt0.cfg, lead_state)
    rx = None
    try:
        rid = "late"
        assert rt1.stores.put(_request_key(1, "p1"), rid.encode())  # the ask, no receiver yet
        lead_state.last_committed = 0
        leader.lead(plan)
        for s in (1, 2, 3):
            grads, hypers = _train_step(lead_state, s)  # nobody to wait for: it goes stale
            leader.offer(s, grads, 1.0, hypers=hypers)
            leader.confirm(s)                            # ... and is taken again here
        assert leader._out["p1"].stale is False
        rx = ShadowReceiver(_store(rt1, 1, "p1", rid, IDLE_TIMEOUT_S),
                            spare_state.params() + spare_state.buffers(), lambda: None,
                            timeout_s=10.0, slice_s=0.05, hypers=len(spare_state.hypers()))
        _until(rx.ready, "the first state")
        kind, first = rx.take(1)[0]
        assert kind == "state" and spare_state.restore(first) == 3
        spare_state.zero_grad()
        assert spare_state.param_sha256() == lead_state.param_sha256()
        grads, hypers = _train_step(lead_state, 4)
        leader.offer(4, grads, 1.0, hypers=hypers)
        _until(rx.ready, "step 4")
        kind, u = rx.take(1)[0]
        assert kind == "step" and u.step == 4
    finally:
        if rx is not None:
            rx.close()
        leader.end()
        rt0.stop()
        rt1.stop()
