"""Property tests (hypothesis) for the batch arithmetic, the plan schema and the scaler's
decision functions (services/scaler/policy.py: pure, so every case runs in microseconds)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import micro_batch_range, num_micro_batches, shares
from schemas.messages import Plan
from services.scaler.policy import PolicyConfig, Wait, initial_plan, on_fault

settings.register_profile("ceaseless", max_examples=300, deadline=None)
settings.load_profile("ceaseless")


@given(st.integers(1, 512), st.integers(1, 64))
def test_every_micro_batch_is_covered_exactly_once(num_micro, world):
    if num_micro < world:
        return
    covered = [k for r in range(world) for k in micro_batch_range(num_micro, world, r)]
    assert covered == list(range(num_micro))  # contiguous, in rank order, no overlap
    sh = shares(num_micro, world)
    assert sum(sh.values()) == num_micro and max(sh.values()) - min(sh.values()) <= 1
    assert all(len(micro_batch_range(num_micro, world, r)) == sh[r] for r in range(world))


@st.composite
def scenario(draw):
    micro = draw(st.integers(1, 8))
    num_micro = draw(st.integers(1, 24))
    workers = draw(st.integers(1, min(12, num_micro)))
    n_spares = draw(st.integers(0, 4))
    min_rep = draw(st.integers(1, workers))
    cfg = PolicyConfig(workers=workers, min_replicas=min_rep, max_replicas=64,
                       global_batch_size=micro * num_micro, micro_batch_size=micro)
    ws = [f"w{i}" for i in range(workers)]
    sp = [f"s{i}" for i in range(n_spares)]
    plan = initial_plan(ws, sp, cfg)
    assert isinstance(plan, Plan)
    failed = draw(st.sets(st.sampled_from(ws + ["ghost"]), min_size=1))
    alive = draw(st.sets(st.sampled_from(sp), max_size=n_spares)) if sp else set()
    return cfg, plan, failed, alive


def _check_plan(p: Plan, cfg: PolicyConfig) -> None:
    ranks = sorted(m.rank for m in p.members)
    pods = [m.pod for m in p.members]
    assert ranks == list(range(p.world_size))            # ranks 0..W-1, no duplicates
    assert len(set(pods)) == len(pods)                    # members unique
    assert cfg.min_replicas <= p.world_size <= cfg.max_replicas
    assert p.global_batch_size == cfg.global_batch_size  # the global batch never changes
    assert sum(p.shares.values()) == num_micro_batches(p.global_batch_size, p.micro_batch_size)
    assert not set(p.spares) & set(pods)
    assert Plan.model_validate_json(p.model_dump_json()) == p  # the wire form round-trips


@given(scenario())
def test_fault_decisions(sc):
    cfg, plan, failed, alive = sc
    _check_plan(plan, cfg)
    old = {m.rank: m.pod for m in plan.members}
    out = on_fault(plan, failed, alive, cfg, incident="inc-x")
    dead = {p for p in old.values() if p in failed}
    if not dead:
        assert out is None                                # not a member: nothing to do
        return
    survivors = set(old.values()) - dead
    if isinstance(out, Wait):
        # only when spares ran out and shrinking would go below min_replicas
        assert len(dead) > len(alive)
        assert plan.world_size - (len(dead) - len(alive)) < cfg.min_replicas
        return
    _check_plan(out, cfg)
    new = {m.rank: m.pod for m in out.members}
    assert out.generation == plan.generation + 1          # strictly increasing
    assert not set(new.values()) & failed                 # no failed pod stays
    assert set(new.values()) <= survivors | alive         # members alive
    assert survivors <= set(new.values())                 # nobody healthy is dropped
    assert set(out.fenced) >= dead
    promoted = set(new.values()) - survivors
    assert len(promoted) == min(len(dead), len(alive))
    # ranks stay stable: a survivor keeps its rank unless it moved down into a hole
    for r, p in new.items():
        if p in survivors:
            old_rank = next(k for k, v in old.items() if v == p)
            assert r == old_rank or (old_rank >= out.world_size and r < old_rank)
    # the new plan must itself survive the next fault
    nxt = on_fault(out, {new[0]}, set(), cfg)
    assert nxt is not None
    if isinstance(nxt, Plan):
        assert nxt.generation == out.generation + 1
