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
    assert cfg.min_replicas <= p.replicas <= cfg.max_replicas      # (= world size, k == 1)
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


def test_a_spare_gone_from_the_scalers_view_is_fenced_by_the_next_plan():
    """The host chaos run (issue 42): a spare on a partitioned host was declared lost and
    left out of the next plan's spares, but nothing told it: after the heal it followed the
    job as a spare no plan named, and `up` never replaced it (its process was alive). The
    next plan now fences it, so it exits and is replaced."""
    cfg = PolicyConfig(workers=3, min_replicas=1, max_replicas=4, global_batch_size=24,
                       micro_batch_size=4)
    plan = initial_plan(["w0", "w1", "w2"], ["s0", "s1"], cfg)
    assert plan.spares == ["s0", "s1"]
    new = on_fault(plan, "w2", ["s0"], cfg)   # s1 lost with w2's host
    assert {m.rank: m.pod for m in new.members} == {0: "w0", 1: "w1", 2: "s0"}
    assert new.spares == [] and "s1" in new.fenced and "w2" in new.fenced
    grown = scale_plan(plan, 4, ["s0"], cfg, apply_step=5)  # s1 gone before a scale-up
    assert "s1" in grown.fenced and "s0" not in grown.fenced
    same = on_fault(plan, "w2", ["s0", "s1"], cfg)  # both alive: nobody but w2 fenced
    assert same.fenced == ["w2"]


# ----------------------------------------------------------------------------- sharded (issue 21)
@st.composite
def sharded_scenario(draw):
    """A plan of R replicas of k ranks (k in 1..4), spares, and a set of failed pods."""
    k = draw(st.integers(1, 4))
    micro = draw(st.integers(1, 4))
    reps = draw(st.integers(1, 5))
    rows = draw(st.integers(reps, 12))               # micro-batch rows (per shard)
    min_rep = draw(st.integers(1, reps))
    cfg = PolicyConfig(workers=reps * k, min_replicas=min_rep, max_replicas=8,
                       global_batch_size=micro * rows * k, micro_batch_size=micro, shard_size=k)
    ws = [f"w{i:02d}" for i in range(reps * k + draw(st.integers(0, 2)))]
    sp = [f"s{i}" for i in range(draw(st.integers(0, 2 * k + 1)))]
    plan = initial_plan(ws, sp, cfg)
    assert isinstance(plan, Plan)
    return cfg, plan


def _check_sharded(p: Plan, cfg: PolicyConfig, prev: Plan | None = None) -> None:
    k = cfg.shard_size
    _check_plan(p, cfg)
    assert p.shard_size == k and p.world_size % k == 0
    assert cfg.min_replicas <= p.replicas <= cfg.max_replicas
    for r in p.shares:                                   # equal shares inside a replica
        assert p.shares[r] == p.shares[r - r % k]
    covered = [i for r in range(p.world_size)
               for i in micro_batch_range(cfg.num_micro, p.world_size, r, k)]
    assert covered == list(range(cfg.num_micro))
    if prev is not None:                                 # members keep their shard position
        old = {m.pod: m.rank for m in prev.members}
        for m in p.members:
            if m.pod in old:
                assert m.rank % k == old[m.pod] % k, (m, old[m.pod])


@given(sharded_scenario(), st.data())
def test_sharded_fault_decisions(sc, data):
    cfg, plan = sc
    k = cfg.shard_size
    _check_sharded(plan, cfg)
    pods = [m.pod for m in plan.members]
    failed = data.draw(st.sets(st.sampled_from(pods + ["ghost"]), min_size=1))
    alive = data.draw(st.sets(st.sampled_from(plan.spares), max_size=len(plan.spares))
                      if plan.spares else st.just(set()))
    out = on_fault(plan, failed, alive, cfg, incident="inc-s")
    old = {m.rank: m.pod for m in plan.members}
    dead = {p for p in old.values() if p in failed}
    if not dead:
        assert out is None
        return
    holed = {r // k for r, p in old.items() if p in failed}
    # the most replicas the spares can complete: those with the fewest holes first
    n_holes = sorted(sum(1 for i in range(k) if old[j * k + i] in failed) for j in holed)
    done, left = 0, len(alive)
    for h in n_holes:
        if h <= left:
            done, left = done + 1, left - h
    remaining = plan.replicas - (len(holed) - done)
    if isinstance(out, Wait):
        assert len(dead) > len(alive) and "waiting for capacity" in out.reason
        assert remaining < cfg.min_replicas
        return
    assert out.replicas == remaining
    _check_sharded(out, cfg, plan)
    new = {m.rank: m.pod for m in out.members}
    assert out.generation == plan.generation + 1
    assert not set(new.values()) & failed                 # no failed pod in the plan
    assert set(out.fenced) >= dead and not set(out.fenced) & (set(old.values()) - dead)
    released = set(old.values()) - dead - set(new.values())
    assert not released & set(out.spares)                 # released members are not spares
    assert not released & set(out.fenced)
    promoted = set(new.values()) - set(old.values())
    assert promoted <= alive
    dropped = plan.replicas - out.replicas
    if len(dead) <= len(alive):                           # enough spares: replace in place
        assert dropped == 0 and not released
        assert all(new[r] == p for r, p in old.items() if p not in failed)
    # every survivor of a replica that stays is kept; released ones come from holed replicas
    for r, p in old.items():
        if p in released:
            assert r // k in holed
    # the released + the failed of dropped replicas are whole replicas
    assert len(released) + len([p for p in dead if p not in promoted]) >= dropped * k - len(
        promoted)
    assert len(set(new.values())) == out.world_size
    # replicas move whole, and only from above the new size into lower slots
    where = {}
    for r, p in new.items():
        if p in old.values():
            o = next(x for x, q in old.items() if q == p)
            where.setdefault(o // k, set()).add(r // k)
            assert r == o or (o // k >= out.replicas and r < o)
    assert all(len(v) == 1 for v in where.values())
    # the next fault is handled too
    nxt = on_fault(out, {new[0]}, set(), cfg)
    assert nxt is not None
    if isinstance(nxt, Plan):
        _check_sharded(nxt, cfg, out)


@given(sharded_scenario(), st.integers(1, 8), st.integers(0, 100), st.data())
def test_sharded_scale_plans(sc, target, step, data):
    cfg, plan = sc
    k = cfg.shard_size
    spares = [f"x{i}" for i in range(data.draw(st.integers(0, 3 * k)))]
    leave = data.draw(st.sets(st.sampled_from([m.pod for m in plan.members]), max_size=2))
    new = scale_plan(plan, target, spares, cfg, apply_step=step, leave=leave)
    if new is None:
        assert desired_size(plan.replicas, target, len(spares) // k, cfg) == plan.replicas
        return
    _check_sharded(new, cfg, plan)
    old = {m.pod for m in plan.members}
    pods = {m.pod for m in new.members}
    assert new.world_size in [n * k for n in cfg.sizes()]
    if new.replicas > plan.replicas:
        assert new.replicas <= target and old <= pods
        assert len(pods - old) == new.world_size - plan.world_size
    else:
        gone = old - pods
        assert len(gone) == plan.world_size - new.world_size   # whole replicas leave
        assert not gone & set(new.spares)                      # released, not spares
        # a replica holding a named pod leaves before an unnamed one
        named_reps = {plan.rank_of(p) // k for p in leave}
        if len(named_reps) <= plan.replicas - new.replicas:
            assert not set(leave) & pods


@given(sharded_scenario(), st.integers(1, 4), st.integers(0, 9))
def test_sharded_releases_count_replicas(sc, count, n_idle):
    cfg, plan = sc
    k = cfg.shard_size
    idle = [f"i{j}" for j in range(n_idle)]
    d = on_release(plan.replicas, plan.replicas, count, idle, cfg)
    if isinstance(d, Refused):
        return
    assert len(d.stop_spares) % k == 0
    assert len(d.stop_spares) // k + d.shrink_by == count
    assert d.target == plan.replicas - d.shrink_by >= cfg.min_replicas


def test_sharded_config_validation():
    import pytest
    with pytest.raises(ValueError, match="not a multiple of the shard size 2"):
        PolicyConfig(workers=3, shard_size=2, global_batch_size=64, micro_batch_size=8)
    with pytest.raises(ValueError, match="micro-batches, not a multiple of the shard size 3"):
        PolicyConfig(workers=3, shard_size=3, global_batch_size=64, micro_batch_size=8)
    cfg = PolicyConfig(workers=6, shard_size=2, global_batch_size=64, micro_batch_size=8,
                       min_replicas=1, max_replicas=8)
    assert cfg.target_replicas == 3 and cfg.target_workers == 6 and cfg.sizes() == [1, 2, 3, 4]


def _cfg(reps: int, k: int, **kw) -> PolicyConfig:
    return PolicyConfig(workers=reps * k, shard_size=k, global_batch_size=96,
                        micro_batch_size=4, **kw)


def test_2x2_one_spare_replaces_in_place():
    cfg = _cfg(2, 2)
    plan = initial_plan(["w0", "w1", "w2", "w3"], ["s0"], cfg)
    assert plan.shard_size == 2 and plan.replicas == 2 and plan.spares == ["s0"]
    out = on_fault(plan, "w1", ["s0"], cfg)
    assert {m.rank: m.pod for m in out.members} == {0: "w0", 1: "s0", 2: "w2", 3: "w3"}
    assert out.fenced == ["w1"] and out.spares == [] and out.reason == "replace w1 with s0"


def test_2x2_without_spare_drops_the_replica_and_moves_the_other():
    cfg = _cfg(2, 2)
    plan = initial_plan(["w0", "w1", "w2", "w3"], [], cfg)
    out = on_fault(plan, "w1", [], cfg)
    assert {m.rank: m.pod for m in out.members} == {0: "w2", 1: "w3"}
    assert out.world_size == 2 and out.replicas == 1
    assert out.fenced == ["w1"] and out.spares == []        # w0 released: neither
    assert "w0 released" in out.reason and "replica 1 (w2, w3) moves to replica 0" in out.reason
    assert sum(out.shares.values()) * 4 == 96


def test_3x2_kill_rank_0_without_spare_moves_replica_2_into_slots_0_1():
    cfg = _cfg(3, 2)
    plan = initial_plan([f"w{i}" for i in range(6)], [], cfg)
    out = on_fault(plan, "w0", [], cfg)
    assert {m.rank: m.pod for m in out.members} == {0: "w4", 1: "w5", 2: "w2", 3: "w3"}
    assert "w1" not in out.spares and "w1" not in out.fenced


def test_sharded_spares_complete_replicas_fewest_holes_first():
    """Two replicas hurt (replica 0: two holes, replica 1: one), one spare: it completes
    replica 1; replica 0 is dropped (no spare spent on it), replica 2 moves into its slots."""
    cfg = _cfg(3, 2)
    plan = initial_plan([f"w{i}" for i in range(6)], [], cfg)
    out = on_fault(plan, {"w0", "w1", "w3"}, ["s0"], cfg)
    assert {m.rank: m.pod for m in out.members} == {0: "w4", 1: "w5", 2: "w2", 3: "s0"}
    # too few replicas would remain: wait
    cfg2 = _cfg(3, 2, min_replicas=3)
    assert isinstance(on_fault(plan, {"w0", "w3"}, ["s0"], cfg2), Wait)


def test_sharded_scale_grows_and_shrinks_whole_replicas():
    cfg = _cfg(2, 2, max_replicas=4)
    plan = initial_plan(["w0", "w1", "w2", "w3"], [], cfg)
    assert scale_plan(plan, 3, ["s0"], cfg, apply_step=5) is None   # 1 spare < k
    up = scale_plan(plan, 3, ["s0", "s1", "s2"], cfg, apply_step=5)
    assert up.world_size == 6 and up.spares == ["s2"] and up.apply_step == 5
    assert [up.pod_of(r) for r in (4, 5)] == ["s0", "s1"]
    down = scale_plan(up, 2, [], cfg, apply_step=9, leave=["w1"])
    assert {m.rank: m.pod for m in down.members} == {0: "s0", 1: "s1", 2: "w2", 3: "w3"}
    assert "w0" not in down.spares and "w1" not in down.spares
    d = on_release(3, 3, 1, ["a", "b", "c"], cfg)
    assert d.stop_spares == ("c", "b") and d.shrink_by == 0
    d = on_release(3, 3, 2, ["a", "b", "c"], cfg)
    assert d.stop_spares == ("c", "b") and d.shrink_by == 1 and d.target == 2
