"""Elastic batch arithmetic (docs/elastic.md), one pure function shared by scaler and agent."""

from __future__ import annotations


def num_micro_batches(global_batch_size: int, micro_batch_size: int) -> int:
    if global_batch_size <= 0 or micro_batch_size <= 0:
        raise ValueError("global_batch_size and micro_batch_size must be positive")
    if global_batch_size % micro_batch_size:
        raise ValueError(
            f"global_batch_size {global_batch_size} is not a multiple of "
            f"micro_batch_size {micro_batch_size}"
        )
    return global_batch_size // micro_batch_size


def shares(num_micro: int, world_size: int, shard_size: int = 1) -> dict[int, int]:
    """Micro-batches per rank: ``M // W`` each, one more for the first ``M % W`` ranks.

    Sharded (``shard_size`` k > 1, replicas of k ranks that run FSDP together): every rank
    of a replica computes the same number of micro-batches (each forward and backward is a
    collective inside the replica), so ``M`` must be a multiple of k; the ``M / k`` rows
    are spread over the ``W / k`` replicas as above, and each rank of replica ``j`` gets
    replica ``j``'s row count."""
    if world_size <= 0:
        raise ValueError("world_size must be positive")
    R, rows = _replicas(num_micro, world_size, shard_size)
    if rows < R:
        what = "ranks" if shard_size == 1 else f"replicas of {shard_size} ranks"
        raise ValueError(f"{rows} micro-batches{' per shard' if shard_size > 1 else ''} "
                         f"cannot be spread over {R} {what}")
    base, extra = divmod(rows, R)
    return {r: base + (1 if r // shard_size < extra else 0) for r in range(world_size)}


def _replicas(num_micro: int, world_size: int, shard_size: int) -> tuple[int, int]:
    """(replicas, micro-batch rows): ``(W, M)`` unsharded, ``(W / k, M / k)`` sharded."""
    if shard_size < 1:
        raise ValueError("shard_size must be at least 1")
    if world_size % shard_size:
        raise ValueError(f"world size {world_size} is not a multiple of the shard size "
                         f"{shard_size} (whole replicas only)")
    if num_micro % shard_size:
        raise ValueError(f"{num_micro} micro-batches per step are not a multiple of the "
                         f"shard size {shard_size}: every rank of a replica computes as many "
                         "micro-batches as the others")
    return world_size // shard_size, num_micro // shard_size


def micro_batch_range(num_micro: int, world_size: int, rank: int,
                      shard_size: int = 1) -> range:
    """The contiguous run of micro-batch indices ``rank`` computes in every step (sharded:
    ranks in rank order, each with its replica's row count, as ``shares``)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    R, rows = _replicas(num_micro, world_size, shard_size)
    base, extra = divmod(rows, R)
    j, i = divmod(rank, shard_size)
    n = base + (1 if j < extra else 0)
    start = shard_size * (j * base + min(j, extra)) + i * n
    return range(start, start + n)


def shares_range(shares: dict[int, int], rank: int) -> range:
    """The micro-batches ``rank`` computes under a plan's explicit ``shares`` (unsharded): the
    ranks' runs in rank order. Equal to :func:`micro_batch_range` for the even shares
    :func:`shares` gives; a straggler's smaller share (the scaler's ``share_out``) moves the
    others' runs, not which samples a micro-batch holds."""
    if rank not in shares:
        raise ValueError(f"rank {rank} has no share")
    start = sum(n for r, n in shares.items() if r < rank)
    return range(start, start + shares[rank])


def uneven_shares(num_micro: int, weights: dict[int, float]) -> dict[int, int]:
    """``num_micro`` micro-batches over the ranks of ``weights`` in proportion to them (each
    at least one; largest remainders first, ties to the lower rank): a straggler weighted by
    its speed gets fewer. Weights equal to a distribution give it back (a fixed point)."""
    ranks = sorted(weights)
    if num_micro < len(ranks):
        raise ValueError(f"{num_micro} micro-batches cannot be spread over {len(ranks)} ranks")
    if any(not w > 0 for w in weights.values()):
        raise ValueError("weights must be positive")
    total = sum(weights.values())
    exact = {r: num_micro * weights[r] / total for r in ranks}
    out = {r: max(1, int(exact[r])) for r in ranks}
    rest = {r: exact[r] - out[r] for r in ranks}
    left = num_micro - sum(out.values())
    for r in sorted(ranks, key=lambda r: (-rest[r], r))[:max(0, left)]:
        out[r] += 1
    while left < 0:  # the ones given to tiny weights, taken from the least deserving
        r = min((q for q in ranks if out[q] > 1), key=lambda q: (rest[q], -q))
        out[r], rest[r], left = out[r] - 1, rest[r] + 1, left + 1
    return out


def lr_factor_at(step: int, start: int, prev: float, target: float, warmup_steps: int) -> float:
    """The learning-rate factor at ``step`` of a generation that began at ``start``: a
    linear ramp from ``prev`` to ``target`` over ``warmup_steps`` steps (0: at once)."""
    if warmup_steps <= 0 or step >= start + warmup_steps - 1:
        return target
    frac = (max(step, start) - start + 1) / warmup_steps
    return prev + (target - prev) * frac
