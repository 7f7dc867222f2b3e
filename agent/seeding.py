"""The global RNGs seeded per (seed, step[, micro-batch]): randomness drawn anywhere in a step
is the same after a fault, whichever rank computes a micro-batch."""

from __future__ import annotations

import random

import numpy as np
import torch

from .data.order import micro_seed

STEP_STREAM = (1 << 63) + 1  # micro_seed's index for the start of a step (not a micro-batch)


def seed_all(seed: int, step: int, k: int | None) -> None:
    """Seed torch (CPU and every CUDA device), numpy's global generator and ``random`` with
    ``micro_seed(seed, step, k)``: ``k`` a micro-batch index (its samples' randomness,
    whichever rank computes it) or None (the start of the step: whatever the script draws
    before or between its micro-batches is the same on every rank and after any fault)."""
    v = micro_seed(seed, step, STEP_STREAM if k is None else k)
    torch.manual_seed(v)
    random.seed(v)
    np.random.seed(v & 0xFFFFFFFF)
