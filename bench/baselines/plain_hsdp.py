"""The example's training loop with plain FSDP2/HSDP and no Ceaseless: the baseline of
``bench sharded``. One process per rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT`` set by the launcher; TCPStore on loopback), gloo, a 2-D ``DeviceMesh``
(``replicate`` R x ``shard`` K), ``fully_shard`` on every block and then on the model (HSDP:
sharded inside a replica, replicated across). The same model, data, global batch,
micro-batch assignment (``micro_batch_range(M, W, rank, K)``: each rank computes M/(R*K)
micro-batches), AdamW and scheduler as ``examples/train_gpt.py`` under ``ceaseless up
--shard-size K``; gradients are summed (divide factor 1) and each micro-batch's loss is
scaled by m/B, as Ceaseless' ``s.backward`` does. Rank 0 writes the wall time of every
step to ``--out``, and every rank its model + optimizer state bytes (local shards) and, on
rank 0, those of the unsharded model with AdamW state.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from agent.data.order import order_for
from agent.state import local
from examples.train_gpt import ALL_MODELS, build_model, load_dataset, seq_len_of
from schemas.batching import micro_batch_range, num_micro_batches


def _tensor_bytes(t: torch.Tensor) -> int:
    t = local(t)
    return t.numel() * t.element_size()


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds: parameters (local shards; tied weights once) and the optimizer's
    tensors (AdamW: exp_avg, exp_avg_sq, step)."""
    seen, pb = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            pb += _tensor_bytes(p)
    ob = sum(_tensor_bytes(v) for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor))
    return {"model": pb, "optimizer": ob, "total": pb + ob}


def unsharded_bytes(name: str, vocab: int, lr: float) -> dict[str, int]:
    """The same figures for the whole model with AdamW state (after one step: state exists)."""
    m = build_model(name, vocab, dropout=0.0)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.01)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return state_bytes(m, opt)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--shard-size", type=int, required=True, help="K: ranks per replica")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--model", choices=ALL_MODELS, default="tiny")
    p.add_argument("--data", required=True)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from agent.sharded import gradient_divide_factor_one

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    K = a.shard_size
    if world % K:
        raise SystemExit(f"world size {world} is not a multiple of --shard-size {K}")
    R = world // K
    mesh = init_device_mesh("cpu", (R, K), mesh_dim_names=("replicate", "shard"))
    dataset, vocab = load_dataset(a.data, seq_len_of(a.model))
    torch.manual_seed(a.seed)
    model = build_model(a.model, vocab, dropout=a.dropout)
    for b in getattr(model, "blocks", ()):
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    gradient_divide_factor_one([model])  # sums, as Ceaseless (the loss is scaled to B)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps))
    B, m = a.global_batch_size, a.micro_batch_size
    M = num_micro_batches(B, m)
    order = order_for(dataset, B, a.seed)  # the same samples per step as the example
    mine = list(micro_batch_range(M, world, rank, K))
    commits, losses = [], {}
    for s in range(a.steps):
        model.train()
        tot = torch.zeros(())
        for k in mine:
            x, y = dataset.batch(order.indices(s, k, m))
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            (loss * (m / B)).backward()
            tot += loss.detach() * (m / B)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(tot)  # the loss over the world group, as Ceaseless' step does
        losses[s] = float(tot)
        commits.append([s, time.time()])
    mine_bytes = state_bytes(model, opt)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine_bytes)
    dist.barrier()
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"commits": commits, "losses": losses, "world_size": world,
                       "replicas": R, "shard_size": K, "state_bytes": per_rank,
                       "unsharded_bytes": unsharded_bytes(a.model, vocab, a.lr),
                       "pid": os.getpid()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
