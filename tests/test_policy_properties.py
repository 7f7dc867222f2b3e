"""Property tests (hypothesis) for the batch arithmetic, the plan schema and the scaler's
decision functions (services/scaler/policy.py: pure, so every case runs in microseconds)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from schemas import micro_batch_range, num_micro_batches, shares
from schemas.messages import Plan
from schemas.policy import ScalingPolicy
from services.scaler.policy import (PolicyConfig, Refused, Wait, desired_size, initial_plan,
                                    on_fault, on_release, scale_plan)

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


# ----------------------------------------------------------------------------- elastic
@st.composite
def elastic_scenario(draw):
    micro = draw(st.integers(1, 4))
    num_micro = draw(st.integers(2, 24))
    max_rep = draw(st.integers(1, 16))
    min_rep = draw(st.integers(1, max_rep))
    discrete = draw(st.none() | st.lists(st.integers(min_rep, max_rep), min_size=1,
                                         max_size=5, unique=True).map(sorted))
    pol = ScalingPolicy(min_replicas=min_rep, max_replicas=max_rep,
                        replica_discrete_values=discrete)
    sizes = [n for n in pol.sizes() if n <= num_micro]
    if not sizes:
        return None
    workers = draw(st.sampled_from(sizes))
    cfg = PolicyConfig.from_policy(pol, workers=workers, global_batch_size=micro * num_micro,
                                   micro_batch_size=micro)
    plan = initial_plan([f"w{i}" for i in range(workers)], [], cfg)
    assert isinstance(plan, Plan)
    spares = [f"s{i}" for i in range(draw(st.integers(0, 6)))]
    return cfg, plan, spares, draw(st.integers(1, 20)), draw(st.integers(0, 10_000))


@given(elastic_scenario())
def test_scale_plans_keep_ranks_batch_and_policy(sc):
    if sc is None:
        return
    cfg, plan, spares, target, step = sc
    new = scale_plan(plan, target, spares, cfg, apply_step=step)
    if new is None:
        assert desired_size(plan.world_size, target, len(spares), cfg) == plan.world_size
        return
    assert new.generation == plan.generation + 1 and new.apply_step == step
    assert sorted(m.rank for m in new.members) == list(range(new.world_size))
    assert new.world_size in cfg.sizes() and new.world_size <= cfg.num_micro
    assert sum(new.shares.values()) * new.micro_batch_size == plan.global_batch_size
    old = {m.rank: m.pod for m in plan.members}
    for m in new.members:  # nobody moves: ranks below the old size keep their pod
        assert old.get(m.rank, m.pod) == m.pod
        assert m.rank < plan.world_size or m.pod in spares
    if new.world_size > plan.world_size:
        assert new.world_size <= target
    else:
        assert new.world_size < plan.world_size and not set(old.values()) & set(new.spares)


@given(elastic_scenario(), st.integers(1, 10))
def test_release_answers_within_policy(sc, count):
    if sc is None:
        return
    cfg, plan, spares, _, _ = sc
    d = on_release(plan.world_size, plan.world_size, count, spares, cfg)
    if isinstance(d, Refused):
        assert d.reason.startswith("release")
        assert plan.world_size - (count - min(count, len(spares))) < cfg.min_replicas or \
            plan.world_size - (count - min(count, len(spares))) not in cfg.sizes()
        return
    assert len(d.stop_spares) == min(count, len(spares))  # spares go first
    assert d.target == plan.world_size - d.shrink_by >= cfg.min_replicas
    assert len(d.stop_spares) + d.shrink_by == count


def test_a_release_naming_pods_takes_those_pods():
    """A drained node's pods (issue 22): the named idle spare is stopped, not another one;
    the named member leaves and the highest rank that stays moves into its hole."""
    cfg = PolicyConfig(workers=3, min_replicas=1, max_replicas=4, global_batch_size=24,
                       micro_batch_size=4)
    plan = initial_plan(["w0", "w1", "w2"], [], cfg)
    d = on_release(3, 3, 1, ["s0", "s1"], cfg, pods=["s0"])
    assert d.stop_spares == ("s0",) and d.shrink_by == 0 and d.target == 3
    d = on_release(3, 3, 2, ["s0", "s1"], cfg, pods=["s0", "w0"])
    assert d.stop_spares == ("s0",) and d.shrink_by == 1 and d.target == 2
    new = scale_plan(plan, 2, [], cfg, apply_step=7, leave=["w0"])
    assert {m.rank: m.pod for m in new.members} == {0: "w2", 1: "w1"}
    assert "w0 leave" in new.reason and "rank 2 (w2) moves to rank 0" in new.reason
    assert sum(new.shares.values()) * new.micro_batch_size == plan.global_batch_size
    new = scale_plan(plan, 2, [], cfg, apply_step=7)  # nobody named: the highest rank
    assert {m.rank: m.pod for m in new.members} == {0: "w0", 1: "w1"}
