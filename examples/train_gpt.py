"""A small GPT trained with Ceaseless: the example `ceaseless up` runs.

    python -m examples.train_gpt --steps 50              # single process, plain python
    ceaseless up --workers 3 --spares 1 --steps 200      # a cluster that survives faults

Prints step, loss and samples/s. Dropout is on, to show that randomness is reproducible:
it is drawn from (seed, step, micro-batch), never from a process's RNG history.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import agent

MODELS = {
    # name: (d_model, layers, heads, seq_len)
    "tiny": (64, 2, 4, 32),
    "small": (128, 4, 4, 64),
    "10m": (384, 6, 6, 128),
    # GPT-2 shapes (issue 34: state at the sizes users train), with GPT-2's vocabulary of
    # 50257 tokens when the data is synthetic: 124M, 355M and 1.2B parameters (tied head)
    "124m": (768, 12, 12, 1024),
    "350m": (1024, 24, 16, 1024),
    "1b": (2048, 22, 16, 1024),
}
GPT2_VOCAB = 50257
GPT2_SIZES = ("124m", "350m", "1b")
MLP_MODELS = {
    # name: (d_model, context tokens, hidden, seq_len): a feed-forward LM, no attention
    "mlp10m": (256, 8, 2304, 128),
}
ALL_MODELS = sorted(MODELS) + sorted(MLP_MODELS)


def seq_len_of(name: str) -> int:
    if name in MODELS:
        return MODELS[name][3]
    if name in MLP_MODELS:
        return MLP_MODELS[name][3]
    raise ValueError(f"unknown model {name!r} (one of {', '.join(ALL_MODELS)})")


def build_model(name: str, vocab: int, dropout: float = 0.1) -> nn.Module:
    """The example's model ``name`` (``ALL_MODELS``) for a vocabulary of ``vocab``."""
    seq_len_of(name)
    if name in MLP_MODELS:
        d, context, hidden, seq_len = MLP_MODELS[name]
        return MLPLM(vocab, d, context, hidden, dropout=dropout)
    d, layers, heads, seq_len = MODELS[name]
    return GPT(vocab, d, layers, heads, seq_len, dropout=dropout)


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.heads, self.dropout = heads, dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq_len: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.drop = nn.Dropout(dropout)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)
        h = self.drop(self.tok(x) + self.pos(pos))
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


class MLPLM(nn.Module):
    """A feed-forward language model: each position sees the embeddings of its last
    ``context`` tokens (zeros before the start), concatenated, through a two-hidden-layer MLP.
    The benchmarks' second model kind: dense matmuls only, no attention."""

    def __init__(self, vocab: int, d: int, context: int, hidden: int,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d)
        self.net = nn.Sequential(nn.Linear(context * d, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, hidden), nn.GELU(), nn.Dropout(dropout),
                                 nn.Linear(hidden, d))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(GPT._init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T = x.shape
        e = self.tok(x)
        e = torch.cat([e.new_zeros(B, self.context - 1, e.shape[-1]), e], 1)
        win = e.unfold(1, self.context, 1)                  # B, T, d, context
        h = win.transpose(2, 3).reshape(B, T, -1)           # oldest token first
        return self.head(self.ln(self.net(h)))


class SyntheticTokens(torch.utils.data.Dataset):
    """Fallback data when no data dir is given: a deterministic, learnable sequence."""

    def __init__(self, n: int, seq_len: int, vocab: int = 257, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        base = torch.randint(0, vocab - 1, (97,), generator=g)
        idx = torch.arange(n * seq_len + 1)
        self.tokens = base[(idx * 7 + idx // 97) % 97]
        self.seq_len, self.n = seq_len, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        s = self.tokens[i * self.seq_len: i * self.seq_len + self.seq_len + 1]
        return s[:-1], s[1:]


def load_dataset(data: str | None, seq_len: int, vocab: int = 257):
    """The data dir's tokens, or synthetic ones over ``vocab`` tokens."""
    if data and (Path(data) / "index.json").exists():
        from agent.data import TokenDataset

        ds = TokenDataset(data, seq_len=seq_len)
        return ds, ds.vocab_size
    return SyntheticTokens(4096, seq_len, vocab=vocab), vocab


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--model", choices=ALL_MODELS, default="tiny",
                   help="GPT sizes (124m, 350m, 1b: GPT-2 shapes and vocabulary), or mlp10m: "
                        "a feed-forward LM of about 10M parameters")
    p.add_argument("--seq-len", type=int, default=0,
                   help="tokens per sample (default: the model's; at most the model's)")
    p.add_argument("--data", help="a data dir from `ceaseless data prepare|generate`")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="parameter dtype (float64: runs that differ only in the order of "
                        "additions, e.g. at different world sizes, agree to ~1e-12)")
    p.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                   help="also keep an exponential moving average of the weights (registered: "
                        "part of the training state), updated after each step; 0: off")
    p.add_argument("--sleep", type=float, default=0.0, metavar="S",
                   help="sleep S seconds per micro-batch: a slower model, same numerics (tests)")
    p.add_argument("--sleep-while", default=None, metavar="PATH",
                   help="--sleep only while PATH exists: a test keeps the job slow until its "
                        "checks are done, then removes PATH and the job ends at full speed")
    p.add_argument("--after-step", type=float, default=0.0, metavar="S",
                   help="sleep S seconds after each s.step(), as a script that logs or "
                        "evaluates there (same numerics; the liveness stress)")
    p.add_argument("--rank0-after-step", type=float, default=0.0, metavar="S",
                   help="rank 0 sleeps S more seconds after each s.step(), as a script whose "
                        "rank 0 logs or evaluates there (same numerics; the liveness stress)")
    p.add_argument("--rank0-every", type=int, default=1, metavar="N",
                   help="--rank0-after-step only every N steps (an evaluation's cadence)")
    p.add_argument("--solo", type=float, default=0.0, metavar="MAX_S",
                   help="run the rank-0 work of --rank0-after-step inside s.solo(max_s=MAX_S), "
                        "so it may outlast the collective timeout; 0: not in a solo")
    p.add_argument("--hang-at-step", type=int, default=-1, metavar="N",
                   help="test: the training thread of rank --hang-rank hangs after "
                        "committing step N (a deadlock in user code; its heartbeats go on)")
    p.add_argument("--hang-rank", type=int, default=0)
    p.add_argument("--device", default="cpu",
                   help="where the model trains: cpu, cuda, cuda:N, or auto (CUDA when this "
                        "process sees a GPU; with `ceaseless up`, each pod's "
                        "CUDA_VISIBLE_DEVICES says which GPU that is)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic algorithms only (GPU runs then compare bit for bit)")
    p.add_argument("--grad-clip", type=float, default=0.0, metavar="NORM",
                   help="clip the synchronised gradient by its global L2 norm; 0: off")
    p.add_argument("--outside-rng", action="store_true",
                   help="draw randomness outside s.batches() (a loss jitter drawn at the top "
                        "of each step, as a prefetch or augmentation would): reproducible "
                        "through faults because every step starts from a seeded RNG")
    p.add_argument("--amp", choices=["none", "bf16", "fp16"], default="none",
                   help="autocast the forward; fp16 also registers a torch.amp.GradScaler "
                        "(the Session scales, unscales and skips for it)")
    p.add_argument("--init-scale", type=float, default=2.0 ** 16,
                   help="fp16: the GradScaler's initial scale")
    p.add_argument("--growth-interval", type=int, default=2000,
                   help="fp16: the GradScaler's growth interval")
    p.add_argument("--log-every", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    seq_len = a.seq_len or seq_len_of(a.model)
    if not 0 < seq_len <= seq_len_of(a.model):
        raise SystemExit(f"--seq-len {a.seq_len}: 1 to {seq_len_of(a.model)} for {a.model}")
    dataset, vocab = load_dataset(a.data, seq_len,
                                  GPT2_VOCAB if a.model in GPT2_SIZES else 257)
    torch.manual_seed(a.seed)  # every rank builds the same model; rank 0's weights win anyway
    if a.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
        torch.use_deterministic_algorithms(True)
    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu")
                       if a.device == "auto" else a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {a.device}: no CUDA device visible to this process "
                         f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    model = build_model(a.model, vocab, dropout=a.dropout).to(getattr(torch, a.dtype))
    model = model.to(dev)  # built on the CPU first: the same initial weights on any device
    n_params = sum(p.numel() for p in model.parameters())
    amp = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[a.amp]
    if amp is not None and a.dtype != "float32":
        raise SystemExit(f"--amp {a.amp} needs --dtype float32 (autocast lowers float32 ops)")
    with agent.Session.from_env(global_batch_size=a.global_batch_size, seed=a.seed) as s:
        # `ceaseless up --shard-size K`: FSDP2 over each replica of K ranks (each block, then
        # the whole model); unsharded, the model comes back as it is. Before the optimizer.
        model = s.shard(model, *getattr(model, "blocks", ()))
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps))
        s.register(model=model, optimizer=opt, scheduler=sched)
        if a.amp == "fp16":  # registered: s.backward scales, s.step unscales/skips/updates
            s.register(scaler=torch.amp.GradScaler(dev.type, init_scale=a.init_scale,
                                                   growth_interval=a.growth_interval))
        ema = None
        if a.ema > 0 and s.shard_size > 1:
            raise SystemExit("--ema: not with a sharded model (the copy would be sharded too)")
        if a.ema > 0:
            import copy

            ema = copy.deepcopy(model).requires_grad_(False)
            s.register(ema=ema)
        print(f"model {a.model}: {n_params / 1e6:.2f}M parameters; pod {s.pod}", flush=True)
        t_last, logged = time.perf_counter(), None
        for step in s.steps(total=a.steps):
            model.train()
            jitter = 1.0 + 0.05 * float(torch.rand(())) if a.outside_rng else 1.0
            for x, y in s.batches(dataset, micro_batch_size=a.micro_batch_size):
                x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
                with torch.autocast(dev.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
                    logits = model(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                           y.reshape(-1))
                s.backward(loss * jitter if a.outside_rng else loss)
                if a.sleep and (a.sleep_while is None or os.path.exists(a.sleep_while)):
                    time.sleep(a.sleep)
            committed = s.step(max_grad_norm=a.grad_clip) if a.grad_clip else s.step()
            if a.after_step:
                time.sleep(a.after_step)
            if a.rank0_after_step and s.rank == 0 and step % a.rank0_every == 0:
                if a.solo:  # e.g. a long evaluation: the peers wait for it, up to MAX_S
                    with s.solo(max_s=a.solo):
                        time.sleep(a.rank0_after_step)
                else:
                    time.sleep(a.rank0_after_step)
            if committed and s.rank == a.hang_rank and step == a.hang_at_step:
                print(f"hanging after step {step} (--hang-at-step)", flush=True)
                threading.Event().wait()  # for ever: only the stall watchdog ends this
            if committed and ema is not None:
                with torch.no_grad():
                    for pe, pm in zip(ema.parameters(), model.parameters()):
                        pe.lerp_(pm, 1.0 - a.ema)
            if committed and step % a.log_every == 0:
                now = time.perf_counter()
                n = step - logged if logged is not None and step > logged else 1
                sps = n * a.global_batch_size / max(now - t_last, 1e-9)
                t_last, logged = now, step
                print(f"step {step:5d}  loss {s.loss:.4f}  ppl {math.exp(min(s.loss, 20)):8.2f}  "
                      f"{sps:8.1f} samples/s  rank {s.rank}/{s.world_size} gen {s.generation}"
                      + (f"  gnorm {s.grad_norm:.4f}" if s.grad_norm is not None else "")
                      + ("  (update skipped: fp16 overflow)" if s.skipped else ""),
                      flush=True)


if __name__ == "__main__":
    main()
    # Everything is written (results, traces, the final heartbeat): skip the interpreter's
    # teardown of torch, which takes 0.5-2 s on a small machine while the pod holds its slot.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
