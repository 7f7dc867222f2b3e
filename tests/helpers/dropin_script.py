"""A small DDP script on the drop-in (agent.ddp) for tests: a model that returns its loss,
two micro-batches per iteration, the next one drawn while the current one computes (as
nanoGPT does), and optionally long work on rank 0 alone inside ``dist.solo``."""

from __future__ import annotations

import argparse
import time

import torch

import agent.ddp as dist
from agent.ddp import DistributedDataParallel as DDP


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.f = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                     torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(self.f(x), y)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 8)
    return x, x.sum(1, keepdim=True).sin()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, required=True)
    p.add_argument("--rank0-sleep", type=float, default=0.0)  # seconds, inside dist.solo
    p.add_argument("--rank0-at", type=int, default=-1)       # at this iteration
    p.add_argument("--solo-max", type=float, default=None)
    a = p.parse_args()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model = DDP(model)
    it = 0
    x, y = batch()
    while (it := dist.iteration(it)) < a.iters:
        if rank == 0 and it == a.rank0_at:
            with dist.solo(max_s=a.solo_max):  # an evaluation, a save: rank 0 alone
                time.sleep(a.rank0_sleep)
        for micro in range(2):
            model.require_backward_grad_sync = micro == 1
            loss = model(x, y)
            x, y = batch()
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        it += 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
