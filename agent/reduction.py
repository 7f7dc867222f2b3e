"""A member's gradient reduction, one strategy per generation (``Stepper`` picks it when the
generation, its group or the sharding changes; ``choose``).

* ``FusedReduction``: the gradients and the loss in one bucketed all-reduce of the world
  group (``CEASELESS_OVERLAP=0``).
* ``OverlappedReduction``: the buckets posted during the last backward (``grad_sync.py``),
  the rest and the loss now; one span per step with ``CEASELESS_TRACE_STEPS=1``.
* ``ShardedReduction``: FSDP2 summed the replica's gradients into this rank's shards during
  the backward; the other replicas' (the same shard position, the position group) are
  added, then the loss over the world group. A step whose shard group failed is discarded.

Each ``reduce`` raises ``Aborted`` / ``PeerError`` as the group does; the stepper turns them
into a discarded step. False: the step is discarded already (the shard group failed).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Protocol

import torch

from .config import AgentConfig
from .ports import StepMember
from .state import local

Args = dict[str, Any]  # Stepper.collective_args(): op_timeout_s, extend


class Reduction(Protocol):
    def reduce(self, s: int, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
               loss_t: torch.Tensor, abort: threading.Event, args: Args) -> bool: ...


class FusedReduction:
    def __init__(self, m: StepMember, cfg: AgentConfig) -> None:
        self.m, self.cfg = m, cfg

    def reduce(self, s: int, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
               loss_t: torch.Tensor, abort: threading.Event, args: Args) -> bool:
        cfg = self.cfg
        self.m.group.allreduce_(grads + [loss_t], abort, slice_s=cfg.collective_slice,
                                timeout_s=cfg.collective_timeout, **args)
        return True


class OverlappedReduction:
    def __init__(self, m: StepMember, cfg: AgentConfig, grad_sync: Callable[[], Any]) -> None:
        self.m, self.cfg = m, cfg
        self._grad_sync = grad_sync  # the stepper's GradSync (rebuilt if the params change)

    def reduce(self, s: int, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
               loss_t: torch.Tensor, abort: threading.Event, args: Args) -> bool:
        m, cfg, sync = self.m, self.cfg, self._grad_sync()
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g
        sync.finish(m.group, [loss_t], abort, args["op_timeout_s"],
                    slice_s=cfg.collective_slice, timeout_s=cfg.collective_timeout,
                    extend=args["extend"])
        if cfg.trace_steps:
            from .incident import trace_grad_sync

            trace_grad_sync(cfg, s, m.rank, m.generation, len(sync.buckets), sync.last_times)
        return True


class ShardedReduction:
    def __init__(self, m: StepMember, cfg: AgentConfig, failed: Callable[[], bool],
                 summed: Callable[[int], None] = lambda s: None) -> None:
        self.m, self.cfg = m, cfg
        self._failed = failed  # the stepper's check of the shard group (discards the step)
        self._summed = summed  # a test hook, once the loss sum completed (inject.summed)
        # the last step whose gradients the position group summed: if the loss sum after it
        # fails, this member can still finish that step (``agent/rollforward.py``)
        self.positioned = -2

    def reduce(self, s: int, params: list[torch.nn.Parameter], grads: list[torch.Tensor],
               loss_t: torch.Tensor, abort: threading.Event, args: Args) -> bool:
        m, cfg = self.m, self.cfg
        if self._failed():
            return False
        m.sharding.pos_group.allreduce_([local(g) for g in grads], abort,
                                        slice_s=cfg.collective_slice,
                                        timeout_s=cfg.collective_timeout, **args)
        self.positioned = s
        # the step's last collective: once it completes anywhere, every rank's position sum
        # had completed (each enters it after its own), so a member whose own copy of it
        # fails still holds the step's gradients whole
        m.group.allreduce_([loss_t], abort, slice_s=cfg.collective_slice,
                           timeout_s=cfg.collective_timeout, **args)
        self._summed(s)
        return True


def choose(m: StepMember, cfg: AgentConfig, grad_sync: Callable[[], Any],
           shard_failed: Callable[[], bool],
           summed: Callable[[int], None] = lambda s: None) -> Reduction:
    """The reduction of ``m``'s generation: sharded, else overlapped when the stepper has a
    ``GradSync`` for this member (``CEASELESS_OVERLAP=1`` and a group), else fused."""
    if m.sharding is not None:
        return ShardedReduction(m, cfg, shard_failed, summed)
    if grad_sync() is not None:
        return OverlappedReduction(m, cfg, grad_sync)
    return FusedReduction(m, cfg)
