"""What the training script says about itself (KV ``script``, rank 0 at its first step),
turned into the policy the scaler plans with: its batch (with ``--batch-from-script``) and a
DDP drop-in script's fixed world size. Pure: config in, config out."""

from __future__ import annotations

import dataclasses
from typing import Any

from schemas.policy import ScriptInfo

from .policy import PolicyConfig


def adopt(cfg: PolicyConfig, info: ScriptInfo, batch_from_script: bool,
          log: Any) -> PolicyConfig:
    """``cfg`` sized with the script's batch and world size (``cfg`` itself: no change)."""
    if info.fixed_world_size is not None:
        cfg = fixed_world(cfg, info.fixed_world_size, log)
    batch = (info.global_batch_size, info.micro_batch_size)
    if batch_from_script and batch != (cfg.global_batch_size, cfg.micro_batch_size):
        try:
            sized = dataclasses.replace(cfg, global_batch_size=batch[0],
                                        micro_batch_size=batch[1])
        except ValueError as e:  # e.g. fewer micro-batch rows than min_replicas
            log.warning("cannot size plans with the script's batch; keeping the "
                        "current one", script=list(batch), error=str(e)[:300],
                        current=[cfg.global_batch_size, cfg.micro_batch_size])
        else:
            log.info("sizing plans with the script's batch", script=list(batch),
                     was=[cfg.global_batch_size, cfg.micro_batch_size],
                     total=info.total, pod=info.pod)
            cfg = sized
    return cfg


def fixed_world(cfg: PolicyConfig, world: int, log: Any) -> PolicyConfig:
    """A DDP drop-in script's world size: min = max replicas = that (no shrink, no
    growth), whatever the flags or the policy file said."""
    reps = max(1, world // cfg.shard_size)
    if (cfg.min_replicas, cfg.max_replicas) == (reps, reps):
        return cfg
    try:
        fixed = dataclasses.replace(
            cfg, min_replicas=reps, max_replicas=reps,
            scaling=cfg.scaling.model_copy(update={"min_replicas": reps,
                                                   "max_replicas": reps,
                                                   "replica_discrete_values": None}))
    except ValueError as e:
        log.warning("cannot keep the script's world size fixed", world=world,
                    error=str(e)[:300])
        return cfg
    log.info("the script keeps its world size: no shrink, no growth (a fault "
             "without a live spare waits for a replacement)", replicas=reps,
             was=[cfg.min_replicas, cfg.max_replicas])
    return fixed
