"""Global sample order for any map-style dataset: a seeded permutation per epoch.

Micro-batch ``k`` of step ``s`` holds global positions ``[s*B + k*m, s*B + (k+1)*m)``; an
epoch holds ``n // B`` whole steps, so a step never straddles two epochs. A dataset that
brings its own order (``dataset.global_order(B, seed)``, e.g. the memory-mapped token
dataset with its cached permutation) is used as it is.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class PermutationOrder:
    def __init__(self, n_samples: int, global_batch_size: int, seed: int) -> None:
        if n_samples < global_batch_size:
            raise ValueError(f"dataset has {n_samples} samples, fewer than one global batch "
                             f"({global_batch_size})")
        self.n = n_samples
        self.B = global_batch_size
        self.seed = seed
        self.steps_per_epoch = n_samples // global_batch_size
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        p = self._perms.get(epoch)
        if p is None:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            p = torch.randperm(self.n, generator=g).numpy()
            self._perms = {epoch: p}  # keep one epoch: O(n) memory
        return p

    def indices(self, step: int, k: int, m: int) -> np.ndarray:
        epoch, s = divmod(step, self.steps_per_epoch)
        start = s * self.B + k * m
        return self._perm(epoch)[start:start + m]


def order_for(dataset: Any, global_batch_size: int, seed: int) -> Any:
    own = getattr(dataset, "global_order", None)
    if callable(own):
        return own(global_batch_size, seed)
    return PermutationOrder(len(dataset), global_batch_size, seed)
