"""A small nanoGPT-style training script, before (ddp_train.py: torchrun + DDP) and after
(ceaseless_train.py: Ceaseless' drop-in) its port; docs/porting.md shows the diff.

    torchrun --standalone --nproc-per-node 2 examples/porting/ddp_train.py --max-iters 20
    ceaseless up --workers 2 --spares 1 -- python examples/porting/ceaseless_train.py --max-iters 20
    python examples/porting/ddp_train.py --max-iters 20        # one process (either script)

Synthetic data, no downloads: a random Markov chain over 64 tokens (fixed seed) in which each
token has at most 4 successors, so the best possible loss is about ln 4 = 1.39.
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
import agent.ddp as dist  # torch.distributed's calls, surviving faults
import torch.nn as nn
import torch.nn.functional as F
from agent.ddp import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument('--max-iters', type=int, default=200)
p.add_argument('--batch-size', type=int, default=8)     # sequences per micro-batch
p.add_argument('--grad-accum', type=int, default=8)     # micro-batches per iteration, all ranks
p.add_argument('--block-size', type=int, default=32)
p.add_argument('--lr', type=float, default=6e-3)
p.add_argument('--warmup-iters', type=int, default=5)
p.add_argument('--lr-decay-iters', type=int, default=200)
p.add_argument('--eval-interval', type=int, default=10)
p.add_argument('--eval-iters', type=int, default=4)
p.add_argument('--log-interval', type=int, default=1)
p.add_argument('--out-dir', default='out-porting')
p.add_argument('--resume', action='store_true')
p.add_argument('--device', default='cpu')               # cpu | cuda
p.add_argument('--dtype', default=None)                 # float32 | bfloat16 | float16 (GradScaler)
args = p.parse_args()
args.dtype = args.dtype or ('float16' if args.device == 'cuda' else 'float32')

ddp = dist.is_launched()  # started by torchrun or ceaseless up?
if ddp:
    dist.init_process_group(backend='nccl' if args.device == 'cuda' else 'gloo')
    ddp_rank, ddp_world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    device = f'cuda:{ddp_local_rank}' if args.device == 'cuda' else 'cpu'
    if args.device == 'cuda':
        torch.cuda.set_device(device)
    master_process, seed_offset = ddp_rank == 0, ddp_rank
    assert args.grad_accum % ddp_world_size == 0
    grad_accum = args.grad_accum // ddp_world_size  # this rank's share
else:
    ddp_rank, ddp_world_size, master_process, seed_offset = 0, 1, True, 0
    device, grad_accum = args.device, args.grad_accum
torch.manual_seed(1337 + seed_offset)
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[args.dtype]
ctx = nullcontext() if args.dtype == 'float32' else torch.autocast(device_type, dtype=ptdtype)

g = torch.Generator().manual_seed(0)  # the data: the same on every rank
succ = torch.randint(0, 64, (64, 4), generator=g).tolist()
tokens = [0]
for c in torch.randint(0, 4, (200_000,), generator=g).tolist():
    tokens.append(succ[tokens[-1]][c])
data = torch.tensor(tokens)
train_data, val_data = data[:180_000], data[180_000:]


def get_batch(split, generator=None):
    d = train_data if split == 'train' else val_data
    ix = torch.randint(len(d) - args.block_size, (args.batch_size,), generator=generator)
    x = torch.stack([d[i:i + args.block_size] for i in ix])
    y = torch.stack([d[i + 1:i + 1 + args.block_size] for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x, y


class GPT(nn.Module):  # a tiny GPT: pre-norm causal transformer blocks, tied embeddings
    def __init__(self, vocab=64, block_size=32, d=64, n_layer=2, n_head=4, dropout=0.1):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block_size, d)
        layer = nn.TransformerEncoderLayer(d, n_head, 4 * d, dropout, activation='gelu',
                                           batch_first=True, norm_first=True)
        self.h = nn.TransformerEncoder(layer, n_layer, enable_nested_tensor=False)
        self.ln_f, self.lm_head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        for w in self.parameters():  # GPT-2's initialisation of the weight matrices
            if w.dim() >= 2:
                nn.init.normal_(w, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(T, device=idx.device)
        logits = self.lm_head(self.ln_f(self.h(x, mask=mask, is_causal=True)))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def get_lr(it):  # linear warm-up, then cosine decay to lr / 10
    if it < args.warmup_iters:
        return args.lr * (it + 1) / (args.warmup_iters + 1)
    ratio = min(1.0, (it - args.warmup_iters) / (args.lr_decay_iters - args.warmup_iters))
    return args.lr / 10 + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.lr / 10)


iter_num, ckpt_path = 0, os.path.join(args.out_dir, 'ckpt.pt')
model = GPT(block_size=args.block_size)
if args.resume:
    checkpoint = torch.load(ckpt_path, map_location='cpu')
    model.load_state_dict(checkpoint['model'])
    iter_num = checkpoint['iter_num']
model.to(device)
decay = [p for p in model.parameters() if p.dim() >= 2]      # matmuls and embeddings
no_decay = [p for p in model.parameters() if p.dim() < 2]   # biases and LayerNorms
optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': 0.1},
                               {'params': no_decay, 'weight_decay': 0.0}], lr=args.lr, betas=(0.9, 0.95))
scaler = torch.amp.GradScaler(device_type, enabled=(args.dtype == 'float16'))  # no-op unless fp16
if args.resume:
    optimizer.load_state_dict(checkpoint['optimizer'])
    scaler.load_state_dict(checkpoint['scaler'])
if ddp:
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None)
raw_model = model.module if ddp else model


@torch.no_grad()
def estimate_loss():  # each rank evaluates its own fixed batches; returns the mean over ranks
    model.eval()
    g = torch.Generator().manual_seed(ddp_rank)
    losses = torch.zeros(2, device=device)
    for i, split in enumerate(['train', 'val']):
        for _ in range(args.eval_iters):
            X, Y = get_batch(split, g)
            with ctx:
                losses[i] += model(X, Y)[1].float() / args.eval_iters
    if ddp:
        dist.all_reduce(losses)  # gloo has no ReduceOp.AVG
        losses /= ddp_world_size
    model.train()
    return losses


X, Y = get_batch('train')  # the first batch; each next one is fetched during the forward
t0 = time.time()
while (iter_num := dist.iteration(iter_num)) < args.max_iters:  # the same step again after a fault
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    if iter_num % args.eval_interval == 0 or iter_num == args.max_iters - 1:
        losses = estimate_loss()
        if master_process:
            print(f"iter {iter_num}: train loss {losses[0]:.4f}, val loss {losses[1]:.4f}")
    for micro_step in range(grad_accum):
        if ddp:  # all-reduce the gradients in the last micro-step's backward only
            model.require_backward_grad_sync = (micro_step == grad_accum - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / grad_accum
        X, Y = get_batch('train')  # prefetch the next micro-batch while the GPU computes
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)  # clip the true gradients (fp16)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)      # skips the update when fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % args.log_interval == 0 and master_process:
        dt, t0 = time.time() - t0, time.time()
        print(f"iter {iter_num}: loss {loss.item() * grad_accum:.4f}, lr {lr:.2e}, {dt * 1000:.0f} ms")
    iter_num += 1

if master_process:
    os.makedirs(args.out_dir, exist_ok=True)
    checkpoint = {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                  'scaler': scaler.state_dict(), 'iter_num': iter_num}
    torch.save(checkpoint, ckpt_path)
    print(f"saved {ckpt_path} at iter {iter_num}")
if ddp:
    dist.destroy_process_group()
