"""The global RNGs seeded per (seed, step[, micro-batch]): randomness drawn anywhere in a step
is the same after a fault, whichever rank computes a micro-batch."""

from __future__ import annotations

import functools
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
    if _lazy_accelerators():
        torch.manual_seed(v)  # CPU, and CUDA (queued until it starts) and the others
    else:
        # No accelerator to seed: the CPU generator only. torch.manual_seed would queue a
        # lazy seed for CUDA, XPU and MTIA, each with a formatted stack trace: 5 % of a
        # small CPU step, called for every micro-batch.
        torch.default_generator.manual_seed(v)
    random.seed(v)
    np.random.seed(v & 0xFFFFFFFF)


@functools.lru_cache(maxsize=1)
def _lazy_accelerators() -> bool:
    """An accelerator torch.manual_seed must seed (or queue a seed for): CUDA or another
    available device, initialised or not."""
    for mod in ("cuda", "xpu", "mtia"):
        m = getattr(torch, mod, None)
        try:
            if m is not None and m.is_available():
                return True
        except Exception:  # a backend that cannot say: seed it the full way
            return True
    return False
