"""This rank's share of a step's global batch (``Session.micro_batches`` / ``batches``).

The indices ``k`` of the micro-batches this rank computes, each with the global RNGs seeded
from (seed, step, k), and, from a map-style dataset, their samples: whichever rank computes
micro-batch ``k`` of step ``s`` gets the same samples and randomness, which is what lets any
rank take over any share after a fault. Once per generation the script's batch is checked
against the plan's (``script_batch``).
"""

from __future__ import annotations

from typing import Any, Iterator

from schemas import micro_batch_range, num_micro_batches, shares_range
from schemas.messages import Plan
from schemas.policy import ScriptInfo

from .config import AgentConfig
from .script_batch import check_plan_batch
from .seeding import seed_all
from .stepper import Stepper


class BatchFeed:
    def __init__(self, global_batch_size: int, seed: int, pod: str) -> None:
        self.global_batch_size, self.seed, self.pod = global_batch_size, seed, pod
        self._checked = 0  # the generation whose batch was checked
        self._sources: dict[tuple[int, int], Any] = {}  # (dataset, m) -> BatchSource
        self._range: tuple[tuple, range] | None = None  # this rank's run, per plan and batch

    def micro_batches(self, step: int, m: int, *, rank: int | None, world_size: int | None,
                      plan: Plan | None, runtime: Any, cfg: AgentConfig | None,
                      stepper: Stepper, gradient_loop: bool, total: int | None
                      ) -> Iterator[int]:
        M = num_micro_batches(self.global_batch_size, m)
        if plan is not None and self._checked != plan.generation:
            check_plan_batch(runtime, cfg, plan, rank, world_size,
                             ScriptInfo(global_batch_size=self.global_batch_size,
                                        micro_batch_size=m, total=total, pod=self.pod),
                             M, first=not self._checked)
            self._checked = plan.generation
        ks = self._ks(M, world_size, rank, plan)
        stepper.micro_batches(m, ks, gradient_loop=gradient_loop)
        abort = runtime.abort if runtime is not None else None
        for k in ks:
            if abort is not None and abort.is_set():
                # A newer plan: this step will be discarded anyway (s.step() sees the same
                # flag), so stop computing it now instead of finishing every micro-batch.
                return
            seed_all(self.seed, step, k)
            if runtime is not None:
                runtime.progress()  # the stall watchdog: a micro-batch is progress
            yield k

    def source(self, dataset: Any, m: int, step: int, rank: int | None,
               world_size: int | None, plan: Plan | None, pin: bool) -> Any:
        """The dataset's ``BatchSource`` (one per dataset and micro-batch size), positioned
        on ``step`` for this rank (``pin``: pinned host memory, for a CUDA model)."""
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError("s.batches() needs a map-style dataset (__len__ and __getitem__): "
                            "the samples of a step are a pure function of the step, so that "
                            "any rank can compute any micro-batch after a fault; an "
                            "IterableDataset cannot be repositioned. Use s.micro_batches(m) "
                            "and draw the samples yourself")
        key = (id(dataset), m)
        if key not in self._sources:
            from .data.loader import BatchSource

            self._sources[key] = BatchSource(dataset, self.global_batch_size, self.seed, m,
                                             pin=pin)
        src = self._sources[key]
        src.begin(step, rank or 0, world_size or 1, plan.shard_size if plan else 1,
                  self._ks(num_micro_batches(self.global_batch_size, m), world_size, rank,
                           plan))
        return src

    def _ks(self, M: int, world_size: int | None, rank: int | None,
            plan: Plan | None) -> range:
        """``rank_range``, computed once per plan (it reads every rank's share)."""
        key = (plan.generation if plan is not None else None, M, world_size, rank)
        if self._range is None or self._range[0] != key:
            self._range = (key, rank_range(M, world_size, rank, plan))
        return self._range[1]


def rank_range(M: int, world_size: int | None, rank: int | None, plan: Plan | None) -> range:
    """The micro-batches ``rank`` computes: its plan's share when the plan carries its own
    (a straggler's smaller one), else the even spread."""
    if (plan is not None and plan.shard_size == 1 and rank is not None
            and world_size == plan.world_size and sum(plan.shares.values()) == M):
        return shares_range(plan.shares, rank)
    return micro_batch_range(M, world_size or 1, rank or 0, plan.shard_size if plan else 1)
