"""The script's batch against the plan's, once per generation (``Session.micro_batches``).

Rank 0 publishes the script's own batch and step count (KV ``script``: `ceaseless status` and
`up` show it; the scaler adopts its batch when `up` was given none). A plan sized for another
batch is logged (at info when the scaler is about to adopt the script's, else a warning);
so are ranks left without a micro-batch.
"""

from __future__ import annotations

from schemas.messages import Plan
from schemas.policy import SCRIPT_KEY, ScriptInfo
from plumbing import logs

from .config import AgentConfig
from .ports import KVRuntime

log = logs.get("agent")


def check_plan_batch(rt: KVRuntime, cfg: AgentConfig, plan: Plan, rank: int | None, world_size: int | None,
                     script: ScriptInfo, micro_batches: int, first: bool) -> None:
    if rank == 0 and first:
        rt.kv.put(SCRIPT_KEY, script.model_dump_json(exclude_none=True).encode())
    mine = [script.global_batch_size, script.micro_batch_size]
    planned = [plan.global_batch_size, plan.micro_batch_size]
    if planned != mine:
        if cfg.batch_from_script:
            # `up` was given no batch: the plans made before the script's was known carry
            # the default; the scaler takes this one for the next (not a problem)
            log.info("the plan was made before the script's batch was known; the scaler "
                     "takes the script's from now on", script=mine, plan=planned)
        else:
            log.warning("the job was planned for another batch: pass the script's to "
                        "`ceaseless up` (--global-batch-size, --micro-batch-size)",
                        script=mine, plan=planned)
    if world_size is not None and micro_batches < world_size:
        log.warning("fewer micro-batches than members: some ranks compute nothing",
                    micro_batches=micro_batches, world_size=world_size)
