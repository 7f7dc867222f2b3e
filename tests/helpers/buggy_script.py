"""A script with a bug (issues 33 and 41), for ``tests/test_script_bugs_e2e.py``.

argv: total steps, the step at which it fails, how, and (optional) the API it uses.

how: ``raise`` (every rank raises the same error at that step), ``setup`` (every pod raises
the same error in its set-up, once it is a member: after ``s.join()`` or
``init_process_group``, before the first step; a spare raises it when promoted) or ``hang``
(rank 0 works longer than the collective timeout at the top of that step, outside
``s.solo``, as nanoGPT's evaluation does).

api: ``session`` (``with agent.Session``, the default), ``init`` (``s = agent.init(...)``, no
``with`` block), ``dropin`` (``agent.ddp``: a torchrun + DDP script's loop) or ``lightning``
(``Trainer(strategy=CeaselessStrategy())``: the error raised in ``training_step``, or in
the set-up after the strategy made this pod a member)."""

from __future__ import annotations

import os
import sys
import time

import torch

import agent


def check_batch(step: int, bad: int) -> None:
    if step == bad:
        raise ValueError(f"the batch of step {step} has the wrong shape")


def load_index() -> None:
    raise FileNotFoundError("the data set's index is missing")


total, bad, how = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
api = sys.argv[4] if len(sys.argv) > 4 else "session"
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def session_loop(s) -> None:
    s.register(model=model, optimizer=opt)
    if how == "setup":
        s.join()
        load_index()
    for step in s.steps(total=total):
        if how == "hang" and step == bad and s.rank == 0:
            time.sleep(600)  # an evaluation without s.solo
        for x, y in s.batches(data, micro_batch_size=2):
            if how == "raise":
                check_batch(step, bad)
            s.backward(torch.nn.functional.mse_loss(model(x), y))
        s.step()
        time.sleep(0.02)


if api == "session":
    with agent.Session.from_env(global_batch_size=8, seed=0) as s:
        session_loop(s)
elif api == "init":
    session_loop(agent.init(global_batch_size=8, seed=0))
elif api == "lightning":
    import lightning as L

    from agent.lightning import CeaselessStrategy

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = model

        def training_step(self, batch, batch_idx):
            if how == "raise":
                check_batch(self.trainer.global_step, bad)
            time.sleep(0.02)
            return torch.nn.functional.mse_loss(self.lin(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    strategy = CeaselessStrategy()  # a member from here on (a spare waits here)
    if how == "setup":
        load_index()
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=total,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(data, batch_size=4))
else:
    import agent.ddp as dist
    from agent.ddp import DistributedDataParallel as DDP

    dist.init_process_group(backend="gloo")
    if how == "setup":
        load_index()
    rank = int(os.environ["RANK"])
    model = DDP(model)
    i = 0
    while (i := dist.iteration(i)) < total:
        g = torch.Generator().manual_seed(1000 * i + rank)
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        if how == "raise":
            check_batch(i, bad)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        i += 1
        time.sleep(0.02)
    dist.destroy_process_group()
