"""A deep MLP trained with Ceaseless: the second shape of `ceaseless bench size` (issue 43).

    python -m examples.train_mlp --width 4096 --depth 6 --steps 20     # one process
    ceaseless up --workers 2 --steps 20 -- python -m examples.train_mlp --width 4096

``depth`` x (Linear(width, width) + ReLU) and a head Linear(width, classes): at width 4096 and
depth 6, 100.7M parameters in a few large tensors (the GPT shapes have many small ones). The
data is synthetic: sample i is a vector drawn from a generator seeded with i, its class i %
classes, so every rank and every run sees the same samples.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import agent


class SyntheticVectors(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int, classes: int) -> None:
        self.n, self.width, self.classes = n, width, classes

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randn(self.width, generator=g), torch.tensor(i % self.classes)


def build_model(width: int, depth: int, classes: int) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, classes))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--classes", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--global-batch-size", type=int, default=6)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    a = p.parse_args(argv)
    if a.width < 1 or a.depth < 1 or a.classes < 2:
        raise SystemExit("--width and --depth: at least 1; --classes: at least 2")
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = build_model(a.width, a.depth, a.classes)
    dataset = SyntheticVectors(4096, a.width, a.classes)
    n_params = sum(t.numel() for t in model.parameters())
    with agent.Session.from_env(global_batch_size=a.global_batch_size, seed=a.seed) as s:
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
        s.register(model=model, optimizer=opt)
        print(f"mlp {a.depth} x {a.width}: {n_params / 1e6:.2f}M parameters; pod {s.pod}",
              flush=True)
        for step in s.steps(total=a.steps):
            for x, y in s.batches(dataset, micro_batch_size=a.micro_batch_size):
                s.backward(F.cross_entropy(model(x), y))
            if s.step():
                print(f"step {step:5d}  loss {s.loss:.4f}  rank {s.rank}/{s.world_size} "
                      f"gen {s.generation}", flush=True)


if __name__ == "__main__":
    main()
    sys.stdout.flush()  # everything is written: skip the interpreter's teardown of torch
    sys.stderr.flush()
    os._exit(0)
