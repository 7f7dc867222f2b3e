"""The example's training loop with plain ``DistributedDataParallel`` and no Ceaseless: the
baseline of ``bench overhead``. One process per rank (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` set by the launcher), gloo, the same model, data, global
batch, micro-batches (gradient accumulation under ``no_sync``), AdamW and scheduler as
``examples/train_gpt.py``. Rank 0 writes the wall time of every committed step to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from schemas.batching import micro_batch_range, num_micro_batches
from agent.data.order import order_for
from examples.train_gpt import ALL_MODELS, build_model, load_dataset, seq_len_of


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--model", choices=ALL_MODELS, default="10m")
    p.add_argument("--data", required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset, vocab = load_dataset(a.data, seq_len_of(a.model))
    torch.manual_seed(a.seed)
    model = DDP(build_model(a.model, vocab, dropout=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps))
    B, m = a.global_batch_size, a.micro_batch_size
    M = num_micro_batches(B, m)
    order = order_for(dataset, B, a.seed)  # the same samples per step as the example
    mine = list(micro_batch_range(M, world, rank))
    commits = []
    for s in range(a.steps):
        model.train()
        for i, k in enumerate(mine):
            batch = dataset.batch(order.indices(s, k, m))
            x, y = batch
            # DDP averages over ranks; scale so the sum is the mean over the global batch
            sync = i == len(mine) - 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                (loss * (m * world / B)).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        commits.append([s, time.time()])
    dist.barrier()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"commits": commits, "world_size": world, "pid": os.getpid()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
