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


def shares(num_micro: int, world_size: int) -> dict[int, int]:
    """Micro-batches per rank: ``M // W`` each, one more for the first ``M % W`` ranks."""
    if world_size <= 0:
        raise ValueError("world_size must be positive")
    if num_micro < world_size:
        raise ValueError(f"{num_micro} micro-batches cannot be spread over {world_size} ranks")
    base, extra = divmod(num_micro, world_size)
    return {r: base + (1 if r < extra else 0) for r in range(world_size)}


def micro_batch_range(num_micro: int, world_size: int, rank: int) -> range:
    """The contiguous run of micro-batch indices ``rank`` computes in every step."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside 0..{world_size - 1}")
    base, extra = divmod(num_micro, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def lr_factor_at(step: int, start: int, prev: float, target: float, warmup_steps: int) -> float:
    """The learning-rate factor at ``step`` of a generation that began at ``start``: a
    linear ramp from ``prev`` to ``target`` over ``warmup_steps`` steps (0: at once)."""
    if warmup_steps <= 0 or step >= start + warmup_steps - 1:
        return target
    frac = (max(step, start) - start + 1) / warmup_steps
    return prev + (target - prev) * frac
