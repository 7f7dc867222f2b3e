"""Finishing a step at the handoff (sharded jobs): a step that committed on some ranks only.

Each rank commits a step on its own, once the step's last collective completes there (the
world's loss sum, ``reduction.ShardedReduction``). A fault during that collective can let
some members through and not others: in a sharded job, one shard position's members may
then hold step s while another position's hold s - 1, and nobody holds s - 1 of the first
(a rank keeps one copy of its shard). That used to lose the job's state (CI: "no replica
holds shard 0 at step 17").

Those behind are not stuck, though: the collective completed somewhere, so every rank had
entered it, after its own position's gradient sum completed. A member behind therefore holds
step s's gradients summed across the replicas (``TrainState.pending``, reported as
``Heartbeat.pending_step``); what it lacks is the step's verdict, which came with the loss
sum: whether the guards skipped the update, and the loss. The broker names such members
their position's sources (``Transfer.steps`` shows them one step behind), and here every
member of the generation takes the verdict from the lowest member holding s (one small
all-reduce only it contributes to: x + 0 is x, bit for bit), then those behind finish the
step exactly as it was taken (``TrainState.update`` with the step's own learning-rate factor),
before any state is sent.

Only a plain update can be finished so: a step with a gradient clip, an fp16 scaler or a
gradient hook needs collectives or code of the step's own (``Stepper._keep_pending``), and
such a step is still lost as before.
"""

from __future__ import annotations

import math

import torch

from schemas.messages import Plan, Transfer
from plumbing import logs

from .ports import Entrant
from .vocab import JobStateLost

log = logs.get("agent")


def finishers(plan: Plan, transfer: Transfer) -> list[int]:
    """The members that finish the restore step at this handoff, as every member sees them:
    sharded, one step behind it, and not recipients (the broker made them sources)."""
    if plan.shard_size <= 1 or plan.generation <= 1 or transfer.restore_step < 0:
        return []
    behind = transfer.restore_step - 1
    return sorted(r for r, s in transfer.steps.items()
                  if s == behind and r not in transfer.sources)


def finish(m: Entrant, plan: Plan, transfer: Transfer, rank: int) -> bool:
    """Take the verdict of the restore step (every member, when anyone finishes it) and
    finish it here if this member is one of ``finishers``. True: finished here."""
    who = finishers(plan, transfer)
    if not who:
        return False
    state, step, cfg = m.state, transfer.restore_step, m.cfg
    holders = [r for r, s in transfer.steps.items() if s == step]
    verdict = torch.zeros(3, dtype=torch.float64)
    if holders and rank == min(holders) and state.last_committed == step:
        loss = state.loss if state.loss is not None else math.nan
        verdict.copy_(torch.tensor([1.0, float(step in state.skipped), loss],
                                   dtype=torch.float64))
    m.group.allreduce_([verdict], m.rt.abort, slice_s=cfg.collective_slice,
                       timeout_s=cfg.collective_timeout)
    if rank not in who:
        return False
    known, skip, loss = verdict.tolist()
    pending = state.pending
    if known != 1.0 or pending is None or pending[0] != step:
        raise JobStateLost(f"rank {rank} was to finish step {step} at the handoff of generation "
                           f"{plan.generation} but holds {pending and pending[0]} pending "
                           f"(the verdict {'known' if known == 1.0 else 'unknown'})")
    state.update(pending[1], bool(skip))
    state.note_commit(step, loss, bool(skip))
    state.last_committed, state.loss = step, loss
    state.pending = None
    log.warning("finished a step at the handoff: its last collective failed here after "
                "other members committed it", step=step, generation=plan.generation,
                skipped=bool(skip), finishers=who)
    return True
