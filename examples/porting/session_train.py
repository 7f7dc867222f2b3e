"""examples/porting/ddp_train.py ported to the Session API (agent.Session): the loop rewritten
around s.steps / s.micro_batches / s.backward / s.step (docs/porting.md, "The Session API").

    ceaseless up --workers 2 --spares 1 -- python examples/porting/session_train.py --max-iters 20
    python examples/porting/session_train.py --max-iters 20   # one process
"""
import argparse
import math
import os
import time
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
import agent

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
args = p.parse_args()

s = agent.init(global_batch_size=args.grad_accum * args.batch_size, seed=1337)
device = args.device  # with `ceaseless up`, 'cuda' is this pod's GPU (CUDA_VISIBLE_DEVICES)
torch.manual_seed(1337)  # the model's initial weights (rank 0's are used anyway)
device_type = 'cuda' if 'cuda' in device else 'cpu'
ctx = nullcontext() if device_type == 'cpu' else torch.autocast(device_type, dtype=torch.bfloat16)

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
if args.resume:
    optimizer.load_state_dict(checkpoint['optimizer'])
s.register(model=model, optimizer=optimizer)


@torch.no_grad()
def estimate_loss():  # each rank evaluates its own fixed batches; returns the mean over ranks
    model.eval()
    g = torch.Generator().manual_seed(s.rank)
    losses = torch.zeros(2, device=device)
    for i, split in enumerate(['train', 'val']):
        for _ in range(args.eval_iters):
            X, Y = get_batch(split, g)
            with ctx:
                losses[i] += model(X, Y)[1].float() / args.eval_iters
    ok = s.all_reduce(losses, "mean")  # False: a fault interrupted it (the step is redone)
    model.train()
    return losses if ok else None


t0 = time.time()
for iter_num in s.steps(args.max_iters, start=iter_num):
    lr = get_lr(iter_num)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr
    if iter_num % args.eval_interval == 0 or iter_num == args.max_iters - 1:
        losses = estimate_loss()
        if s.rank == 0 and losses is not None:
            print(f"iter {iter_num}: train loss {losses[0]:.4f}, val loss {losses[1]:.4f}")
    for micro_step in s.micro_batches(args.batch_size):  # this rank's share of the batch
        X, Y = get_batch('train')  # drawn per micro-batch: the RNG is seeded for each
        with ctx:
            logits, loss = model(X, Y)
        s.backward(loss)
    committed = s.step(max_grad_norm=1.0)  # all-reduce, clip, optimizer step, zero-grad
    if committed and iter_num % args.log_interval == 0 and s.rank == 0:
        dt, t0 = time.time() - t0, time.time()
        print(f"iter {iter_num}: loss {s.loss:.4f}, lr {lr:.2e}, {dt * 1000:.0f} ms")

if s.rank == 0:
    os.makedirs(args.out_dir, exist_ok=True)
    checkpoint = {'model': model.state_dict(), 'optimizer': optimizer.state_dict(),
                  'iter_num': s.last_committed + 1}
    torch.save(checkpoint, ckpt_path)
    print(f"saved {ckpt_path} at iter {s.last_committed + 1}")
