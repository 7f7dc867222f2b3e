"""Unit tests of the guards' decisions (issue 32): the loss-spike guard, a skipped step that is
computed again after a rollback, the state that carries both, and the settings' checks."""

from __future__ import annotations

import pytest
import torch

from agent.config import AgentConfig
from agent.stepper import Stepper
from agent.train_state import SPIKE_MIN, SPIKE_WINDOW, TrainState


def _state(losses: list[float]) -> TrainState:
    st = TrainState()
    st.register(model=torch.nn.Linear(2, 2))
    for i, x in enumerate(losses):
        st.note_commit(i, x, False)
    return st


def _stepper(st: TrainState, spike: float = 3.0) -> Stepper:
    return Stepper(8, st, cfg=AgentConfig(nats_url="nats://127.0.0.1:1", pod="p0",
                                          loss_spike=spike))


def test_a_loss_over_the_factor_times_the_median_is_skipped():
    st = _state([1.0 + 0.01 * i for i in range(SPIKE_MIN)])
    sp = _stepper(st)
    sp.guard(20, 3.0)  # 3.0 < 3 x 1.05
    assert sp.nonfinite is None
    sp.guard(20, 3.5)
    assert sp.nonfinite == []  # skipped, with no rank to blame
    off = _stepper(st, spike=0.0)
    off.guard(20, 1e9)
    assert off.nonfinite is None


def test_the_spike_guard_waits_for_enough_losses_and_keeps_a_window():
    st = _state([1.0] * (SPIKE_MIN - 1))
    sp = _stepper(st)
    sp.guard(9, 100.0)
    assert sp.nonfinite is None  # too few losses for a median
    st.note_commit(9, float("nan"), False)  # not finite: not in the median
    st.note_commit(10, 50.0, True)          # skipped: not in it either
    assert len(st.recent_losses) == SPIKE_MIN - 1
    for i in range(200):
        st.note_commit(11 + i, 2.0, False)
    assert len(st.recent_losses) == SPIKE_WINDOW and st.loss_median() == 2.0


def test_a_skipped_step_computed_again_is_skipped_again_once_listed():
    st = _state([1.0] * SPIKE_MIN)
    st.note_commit(12, float("nan"), True)
    assert st.new_skip and st.skipped == [12]
    before = list(st.recent_losses)
    st.note_commit(12, 1.5, True)  # the same step committed again, finite this time
    assert not st.new_skip and st.skipped == [12]
    assert st.recent_losses == before  # a skipped step's loss is no baseline
    sp = _stepper(st, spike=0.0)
    sp.guard(11, 1.0)
    assert sp.nonfinite is None
    sp.guard(12, 1.0)  # finite this time, but its data is skipped (the rollback policy)
    assert sp.nonfinite == []


def test_the_guards_state_travels_with_the_snapshot():
    st = _state([1.0, 2.0, 3.0])
    st.note_commit(3, float("inf"), True)
    st.last_committed = 3
    snap = st.snapshot()
    other = _state([])
    other.restore(snap)
    assert other.recent_losses == [1.0, 2.0, 3.0] and other.skipped == [3]
    other.forget()
    assert other.recent_losses == [] and other.skipped == []


def test_settings_are_checked():
    base = dict(nats_url="nats://127.0.0.1:1", pod="p0")
    with pytest.raises(ValueError, match="needs verification on"):
        AgentConfig(**base, on_nonfinite="rollback")
    AgentConfig(**base, on_nonfinite="rollback", verify_every=10)
    with pytest.raises(ValueError, match="skip or rollback"):
        AgentConfig(**base, on_nonfinite="ignore")
    with pytest.raises(ValueError, match="loss_spike"):
        AgentConfig(**base, loss_spike=0.5)


# ---------------------------------------------------------------- a straggler without a spare
from hypothesis import given, settings, strategies as hs  # noqa: E402

from schemas.batching import micro_batch_range, shares, shares_range, uneven_shares  # noqa: E402
from services.scaler import policy  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(hs.integers(1, 64), hs.lists(hs.floats(0.01, 100), min_size=1, max_size=16))
def test_uneven_shares_cover_the_batch_and_give_everyone_one(m, ws):
    weights = dict(enumerate(ws))
    if m < len(ws):
        with pytest.raises(ValueError):
            uneven_shares(m, weights)
        return
    out = uneven_shares(m, weights)
    assert sum(out.values()) == m and min(out.values()) >= 1
    ranges = [shares_range(out, r) for r in sorted(out)]
    assert [k for r in ranges for k in r] == list(range(m))  # contiguous, in rank order
    assert uneven_shares(m, {r: float(n) for r, n in out.items()}) == out  # a fixed point
    if len(set(ws)) == 1:  # equal speeds: the even spread
        assert out == shares(m, len(ws))
        assert ranges == [micro_batch_range(m, len(ws), r) for r in range(len(ws))]


def _plan(world=3, m=8, shard=1):
    return policy.make_plan(4, {r: f"w{r}" for r in range(world)}, global_batch_size=4 * m,
                            micro_batch_size=4, shard_size=shard)


def test_share_out_cuts_the_stragglers_share_and_keeps_the_batch():
    p = _plan()
    d = policy.share_out(p, "w1", 6.0, apply_step=20, incident="inc-w1-g4")
    assert d.generation == 5 and d.apply_step == 20 and d.members == p.members
    assert d.shares == {0: 4, 1: 1, 2: 3} and d.global_batch_size == p.global_batch_size
    assert d.reason.startswith("straggler: w1 computes 1 of 8") and d.fenced == []
    # a second look after the cut: the same slowness per micro-batch, nothing to change
    assert policy.share_out(d, "w1", 1.0, apply_step=30) is None
    assert policy.share_out(p, "nobody", 6.0, apply_step=20) is None
    assert isinstance(policy.share_out(_plan(world=4, shard=2), "w1", 6.0, apply_step=20),
                      policy.Wait)


def test_the_verified_copy_is_written_over_in_place():
    st = _state([])
    opt = torch.optim.AdamW(st.objs["model"].parameters())
    st.register(opt=opt)
    first = st.snapshot()
    with torch.no_grad():
        st.objs["model"].weight.add_(1.0)
    again = st.snapshot(reuse=first)
    assert [b.data_ptr() for b in again.buffers] == [b.data_ptr() for b in first.buffers]
    w = st.objs["model"].weight.detach().clone()
    with torch.no_grad():
        st.objs["model"].weight.zero_()
    st.restore(again)
    assert torch.equal(st.objs["model"].weight, w)  # the newer state, not the first
    # a changed layout (AdamW's state appears at its first step): new buffers where needed
    st.objs["model"].weight.grad = torch.ones_like(w)
    st.objs["model"].bias.grad = torch.ones(2)
    opt.step()
    grown = st.snapshot(reuse=again)
    assert grown.nbytes > again.nbytes
    st2 = _state([])
    st2.register(opt=torch.optim.AdamW(st2.objs["model"].parameters()))
    st2.restore(grown)
    assert torch.equal(st2.objs["model"].weight, st.objs["model"].weight)


def test_only_the_step_that_rolled_back_is_excused_from_recovering():
    """A rollback at step 29's verification restores the copy of step 19: step 29 ended
    without its own commit but is no discarded step. Step 20, computed again and discarded
    before its commit (a plan arrived), is one: it must recover. (Excusing every step until
    the next commit made a loaded member retry step 20 for ever, out of the next generation:
    the job stalled and its state was declared lost.)"""
    from agent.verify import Verifier

    class _Rt:
        def update(self, **kw):
            pass

    st = _state([1.0] * 20)
    st.last_committed = 19
    v = Verifier(every=10)
    v.copy, v.verified = st.snapshot(), 19
    st.last_committed = 29
    v._rollback(29, st, _Rt(), "corruption")
    assert st.last_committed == 19 and v.rolled_back_at == 29
    assert not v.discarded(29, st.last_committed)   # its own commit rolled back
    assert v.discarded(20, st.last_committed)       # the first step computed again, discarded
    v.after_commit(20, st, None, _Rt(), None)       # a commit clears the excuse
    assert v.rolled_back_at is None and v.discarded(29, 20)
    assert not v.discarded(21, 21)


def test_a_recipient_that_held_the_restore_step_with_another_digest_is_a_corrupt_replica():
    """The soak (seed 7): a bit flipped on rank 2, then a capacity add's plan came before
    the next verification; the broker made rank 2 a recipient (its digest at the restore step
    was not the majority's), the handoff repaired it and nobody reported it: the suspect pod
    trained on. The handoff now names it (agent/handoff.py ``diverged``)."""
    from agent.handoff import diverged
    from schemas.messages import Member, Plan, Transfer

    def plan(g: int, shard_size: int = 1) -> Plan:
        return Plan(generation=g, members=[Member(pod=f"p{r}", rank=r) for r in range(4)],
                    world_size=4, global_batch_size=16, micro_batch_size=4,
                    shares={r: 1 for r in range(4)}, shard_size=shard_size)

    t = Transfer(generation=16, restore_step=2058, sources={2: [0, 1, 3]}, digest="a" * 32)
    why = diverged(plan(16), t, 2058, "b" * 32)
    assert why is not None and "2058" in why and "bbbb" in why
    assert diverged(plan(16), t, 2058, "a" * 32) is None      # the same state: not odd
    assert diverged(plan(16), t, 2057, "b" * 32) is None      # behind: simply missing steps
    assert diverged(plan(16), t, 2058, "") is None            # its digest not known
    assert diverged(plan(1), t.model_copy(update={"generation": 1}), 2058, "b" * 32) is None
    at_init = t.model_copy(update={"restore_step": -1})
    assert diverged(plan(16), at_init, -1, "b" * 32) is None  # each rank's own init
    assert diverged(plan(16, shard_size=2), t, 2058, "b" * 32) is None
    one = t.model_copy(update={"sources": {2: [0]}})
    assert diverged(plan(16), one, 2058, "b" * 32) is None   # one against one: no majority


def test_every_member_sees_alike_that_the_handoff_found_replicas_that_disagreed():
    """What each member tells from the transfer alone (its own digest unknown to the others):
    a recipient that held the restore step (``steps``) was made one for its digest."""
    from agent.handoff import disagreed
    from schemas.messages import Member, Plan, Transfer

    plan = Plan(generation=16, members=[Member(pod=f"p{r}", rank=r) for r in range(4)],
                world_size=4, global_batch_size=16, micro_batch_size=4,
                shares={r: 1 for r in range(4)})
    held = {0: 2058, 1: 2058, 2: 2058, 3: 2058}
    t = Transfer(generation=16, restore_step=2058, sources={2: [0, 1, 3]}, digest="a" * 32,
                 steps=held)
    assert disagreed(plan, t)
    behind = t.model_copy(update={"steps": {**held, 2: 2057}})
    assert not disagreed(plan, behind)                     # a member missing steps
    assert not disagreed(plan, t.model_copy(update={"steps": {}}))  # an older broker
    # one against one: nobody is named (diverged), but both states hold the corrupt
    # replica's gradients, so every member still goes back to the verified copy
    assert disagreed(plan, t.model_copy(update={"sources": {2: [0]}, "steps": {0: 2058,
                                                                              2: 2058}}))
    assert not disagreed(plan.model_copy(update={"generation": 1}),
                         t.model_copy(update={"generation": 1}))
    assert not disagreed(plan, t.model_copy(update={"restore_step": -1,
                                                   "steps": {r: -1 for r in range(4)}}))


@pytest.mark.parametrize("copies", [(9, 9, 9), (9, 9, None), (None, 9, 4)])
def test_a_divergence_found_at_a_handoff_rolls_every_member_back_alike(copies):
    """The soak (seed 7, event 103): a flipped bit met by a handoff before the check. The
    corrupt replica's gradients since the flip are in every member's update, so every member
    goes back to the newest verified copy at its next commit: holders restore theirs, a member
    without it (a spare promoted since: None; one with an older copy: 4) receives it from
    them over the group (NCCL's in-order matching). All end with the same state of step 9;
    the corrupt member (rank 1) reports itself at the commit after."""
    import threading
    from types import SimpleNamespace

    from agent.verify import Verifier
    from helpers.thread_ranks import run_ranks

    good = _state([1.0] * 10)
    good.last_committed = 9
    verified = good.snapshot()
    want = {k: v.clone() for k, v in good.objs["model"].state_dict().items()}
    reports: list = []

    def fn(r: int, g):
        st = _state([1.0] * 10)
        v = Verifier(every=10)
        if copies[r] is not None:
            st.last_committed = copies[r]
            if copies[r] == 9:
                st.restore(verified)
            v.copy, v.verified = st.snapshot(), copies[r]
        with torch.no_grad():  # trained on since: steps 10..16, each rank alike but not the copy
            for p in st.objs["model"].parameters():
                p.add_(float(r + 1))
        st.last_committed = 16
        rt = SimpleNamespace(abort=threading.Event(), update=lambda **kw: None,
                             report_sync=lambda kind, why: reports.append((r, why)))
        m = SimpleNamespace(world_size=3, rank=r, group=g, sharding=None, is_member=True,
                            diverged=(15, "corrupt" if r == 1 else None),
                            leader=SimpleNamespace(generation=0))
        cfg = SimpleNamespace(collective_slice=0.5, collective_timeout=20.0)
        v.after_commit(16, st, m, rt, cfg)
        assert m.diverged is None and v.rolled_back_at == 16 and st.last_committed == 9
        assert (r, "corrupt") not in reports
        v.after_commit(10, st, m, rt, cfg)  # the first step computed again: reported then
        return {k: t.clone() for k, t in st.objs["model"].state_dict().items()}

    for out in run_ranks(fn, 3, in_order=True):
        assert all(torch.equal(out[k], want[k]) for k in want)
    assert reports == [(1, "corrupt")]
