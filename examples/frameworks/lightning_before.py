"""A tiny PyTorch Lightning script: lightning_before.py on DDP, lightning_after.py the same with
one line changed (docs/porting.md, "PyTorch Lightning").

    torchrun --standalone --nproc-per-node 2 examples/frameworks/lightning_before.py --max-steps 40
    ceaseless up --workers 2 --spares 1 -- python examples/frameworks/lightning_after.py --max-steps 40
    python examples/frameworks/lightning_after.py --max-steps 40     # one process (either file)

Synthetic data (no downloads): 256 random inputs and a smooth target. Rank 0 writes the
final parameters' sha256 to --out, and with --ckpt-dir a ModelCheckpoint every --ckpt-every
steps; --val-every N validates every N steps (the loss logged with sync_dist); --resume FILE
continues from a checkpoint (ckpt_path=); --accumulate N accumulates gradients over N
batches a step (accumulate_grad_batches).
"""

import argparse
import hashlib
import os
import time

import lightning as L
import torch
import torch.nn as nn
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument('--max-steps', type=int, default=40)
p.add_argument('--batch-size', type=int, default=8)
p.add_argument('--out', default=None)  # rank 0 writes the final parameters' sha256 here
p.add_argument('--step-sleep', type=float, default=0.0)  # seconds per step (time for tests to kill)
p.add_argument('--ckpt-dir', default=None)  # ModelCheckpoint's directory (none: no checkpoints)
p.add_argument('--ckpt-every', type=int, default=10)  # ... every N steps
p.add_argument('--save-sleep', type=float, default=0.0)  # seconds per checkpoint (time to kill)
p.add_argument('--val-every', type=int, default=0)  # validation every N steps (0: none)
p.add_argument('--resume', default=None)  # a checkpoint to continue from (ckpt_path=)
p.add_argument('--width', type=int, default=64)  # hidden units (bench: a larger step)
p.add_argument('--times', default=None)  # rank 0 writes each step's end time here (bench)
p.add_argument('--accumulate', type=int, default=1)  # accumulate_grad_batches
args = p.parse_args()


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        w = args.width
        self.net = nn.Sequential(nn.Linear(16, w), nn.Tanh(), nn.Dropout(0.1), nn.Linear(w, 1))
        self.times = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.log('train_loss', loss)
        time.sleep(args.step_sleep)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.times.append(time.perf_counter())

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log('val_loss', nn.functional.mse_loss(self.net(x), y), sync_dist=True)
        if batch_idx == 0:
            print(f'validating after step {self.trainer.global_step}', flush=True)
        time.sleep(args.step_sleep)

    def on_save_checkpoint(self, checkpoint):
        print(f'saving a checkpoint at step {self.trainer.global_step}', flush=True)
        time.sleep(args.save_sleep)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.7)
        return {'optimizer': opt, 'lr_scheduler': {'scheduler': sched, 'interval': 'step'}}


g = torch.Generator().manual_seed(0)
x = torch.randn(256, 16, generator=g)
y = x[:, :4].sum(1, keepdim=True).sin() + 0.1 * torch.randn(256, 1, generator=g)
data = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
val = DataLoader(TensorDataset(x[:32], y[:32]), batch_size=args.batch_size)
torch.manual_seed(1337)  # the initial weights
model = Net()
trainer = L.Trainer(accelerator='cpu', devices=int(os.environ.get('LOCAL_WORLD_SIZE', 1)),
                    strategy=DDPStrategy(), max_steps=args.max_steps, logger=False,
                    enable_checkpointing=bool(args.ckpt_dir), enable_progress_bar=False,
                    callbacks=[ModelCheckpoint(dirpath=args.ckpt_dir, save_top_k=-1,
                                               every_n_train_steps=args.ckpt_every)]
                    if args.ckpt_dir else None,
                    val_check_interval=args.val_every or None, check_val_every_n_epoch=None,
                    num_sanity_val_steps=0, enable_model_summary=False,
                    accumulate_grad_batches=args.accumulate,
                    gradient_clip_val=1.0)  # by the global norm of the synchronised gradients
trainer.fit(model, data, val if args.val_every else None, ckpt_path=args.resume)
if trainer.global_rank == 0:
    digest = hashlib.sha256(b''.join(t.detach().cpu().numpy().tobytes()
                                     for t in model.state_dict().values())).hexdigest()
    print(f'step {trainer.global_step}: parameters sha256 {digest}')
    if args.out:
        with open(args.out, 'w') as f:
            f.write(digest + '\n')
    if args.times:
        with open(args.times, 'w') as f:
            f.write(' '.join(f'{t:.6f}' for t in model.times) + '\n')
