"""Checkpoint-restart baseline of ``bench recovery``: plain DDP under ``torchrun --max-restarts``
with ``torch.save`` of model + optimizer (+ scheduler) every N steps and a load on start.

The worker (``python -m bench.baselines.ckpt_restart worker ...``, one process per rank, started by
torchrun) trains the same model, data, global batch, micro-batches, AdamW and scheduler as
``examples/train_gpt.py`` / ``bench/baselines/plain_ddp.py``, gloo on CPU. On start it loads
``<dir>/ckpt.pt`` when there is one and continues after its step. After each committed step
it appends ``step wall-time`` to ``<dir>/commits/rank<R>.attempt<A>.txt`` (``A`` =
``TORCHELASTIC_RESTART_COUNT``) and flushes; rank 0 then saves the checkpoint every N steps
(to a temporary file, then ``os.replace``, so a kill mid-save leaves the previous one).

The orchestrator (:func:`run_once`, used by ``bench/recovery.py``) starts torchrun (c10d
rendezvous on a free 127.0.0.1 port, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``), waits until
the victim rank has committed the fault step, SIGKILLs it, waits for the job to finish and
reads the commit files:

* **downtime**: kill -> the first step committed by the restarted workers (every rank; the
  latest of them);
* **back at step**: kill -> the first step above the highest step committed before the kill;
* **recomputed**: steps at or below that one which the restarted workers committed again.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------- the worker
def worker(a: argparse.Namespace) -> None:
    t_start = time.time()
    import contextlib

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from agent.data.order import order_for
    from examples.train_gpt import build_model, load_dataset, seq_len_of
    from schemas.batching import micro_batch_range, num_micro_batches

    torch.set_num_threads(a.threads)
    t_import = time.time()
    dist.init_process_group("gloo")
    t_pg = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    d = Path(a.dir)
    (d / "commits").mkdir(parents=True, exist_ok=True)
    log = open(d / "commits" / f"rank{rank}.attempt{attempt}.txt", "a", buffering=1)
    log.write(f"# pid {os.getpid()} start {t_start:.6f} import {t_import:.6f} pg {t_pg:.6f}\n")
    dataset, vocab = load_dataset(a.data, seq_len_of(a.model))
    torch.manual_seed(a.seed)
    net = build_model(a.model, vocab, dropout=0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps))
    ckpt = d / "ckpt.pt"
    first = 0
    log.write(f"# built {time.time():.6f}\n")
    if ckpt.exists():
        st = torch.load(ckpt, map_location="cpu", weights_only=False)
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])
        first = int(st["step"]) + 1
    t_load = time.time()
    log.write(f"# loaded {first - 1} at {t_load:.6f}\n")
    model = DDP(net)
    B, m = a.global_batch_size, a.micro_batch_size
    M = num_micro_batches(B, m)
    order = order_for(dataset, B, a.seed)
    mine = list(micro_batch_range(M, world, rank))
    for s in range(first, a.steps):
        model.train()
        for i, k in enumerate(mine):
            x, y = dataset.batch(order.indices(s, k, m))
            sync = i == len(mine) - 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                logits = model(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
                (loss * (m * world / B)).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        log.write(f"{s} {time.time():.6f}\n")
        if rank == 0 and a.every > 0 and (s + 1) % a.every == 0 and s + 1 < a.steps:
            tmp = d / "ckpt.pt.tmp"
            torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(), "step": s}, tmp)
            os.replace(tmp, ckpt)
    log.close()
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------- orchestrator
def read_commits(d: Path) -> list[dict[str, Any]]:
    """One record per (rank, attempt): pid, header times, commits [(step, t)]."""
    out = []
    for f in sorted((d / "commits").glob("rank*.attempt*.txt")):
        rank, attempt = f.stem.split(".")
        rec: dict[str, Any] = {"rank": int(rank[4:]), "attempt": int(attempt[7:]),
                               "pid": None, "commits": []}
        for ln in f.read_text().splitlines():
            p = ln.split()
            if not p:
                continue
            if p[0] == "#":
                if p[1] == "pid":
                    rec["pid"] = int(p[2])
                    rec.update(start=float(p[4]), imported=float(p[6]), pg=float(p[8]))
                elif p[1] == "built":
                    rec["built"] = float(p[2])
                elif p[1] == "loaded":
                    rec.update(loaded_step=int(p[2]), loaded=float(p[4]))
            elif len(p) == 2:
                try:
                    rec["commits"].append((int(p[0]), float(p[1])))
                except ValueError:
                    pass  # a torn last line of a killed process
        out.append(rec)
    return out


def torchrun_cmd(d: Path, a: argparse.Namespace, every: int, data: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(a.workers), "--max-restarts", str(a.max_restarts),
            "--monitor-interval", str(a.monitor_interval), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ckpt-{os.getpid()}",
            "--local-addr", "127.0.0.1", "--master-addr", "127.0.0.1",
            "-m", "bench.baselines.ckpt_restart", "worker", "--dir", str(d), "--every", str(every),
            "--steps", str(a.steps), "--model", a.model, "--data", str(data),
            "--global-batch-size", str(a.global_batch_size),
            "--micro-batch-size", str(a.micro_batch_size)]


def _kill_tree(proc: subprocess.Popen) -> None:
    """torchrun runs in its own session: end it, then anything left in that group (by the
    group id we created, never by name)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.kill()
        proc.wait(5)


def _kill_workers(d: Path) -> None:
    """torchrun starts its workers in sessions of their own: any left, by the pid each wrote."""
    for rec in read_commits(d):
        pid = rec.get("pid")
        try:
            if pid and str(d) in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


def run_once(d: Path, a: argparse.Namespace, every: int, data: Path, fault_step: int,
             victim: int, timeout: float) -> dict[str, Any]:
    """One torchrun job with a SIGKILL of rank ``victim`` once it has committed ``fault_step``."""
    from services.common.natsserver import free_port

    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "OMP_NUM_THREADS": "1"}
    out = open(d / "torchrun.out", "wb")
    proc = subprocess.Popen(torchrun_cmd(d, a, every, data, free_port()), env=env, cwd=REPO,
                            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    out.close()
    (d / "torchrun.pid").write_text(f"{proc.pid}\n")  # its own session: cleanup by group id
    t_kill = None
    deadline = time.monotonic() + timeout
    try:
        victim_file = d / "commits" / f"rank{victim}.attempt0.txt"
        while t_kill is None:
            if proc.poll() is not None:
                raise RuntimeError(f"torchrun exited {proc.returncode} before the fault: "
                                   f"{(d / 'torchrun.out').read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {victim} did not reach step {fault_step}")
            if victim_file.exists():
                rec = next(r for r in read_commits(d) if r["rank"] == victim and r["attempt"] == 0)
                if rec["commits"] and rec["commits"][-1][0] >= fault_step and rec["pid"]:
                    t_kill = time.time()
                    os.kill(rec["pid"], signal.SIGKILL)
                    break
            time.sleep(0.01)
        proc.wait(max(1.0, deadline - time.monotonic()))
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun exited {proc.returncode}: "
                               f"{(d / 'torchrun.out').read_text()[-3000:]}")
    finally:
        _kill_tree(proc)
        _kill_workers(d)
    return analyse(d, t_kill, victim, every)


def analyse(d: Path, t_kill: float, victim: int, every: int) -> dict[str, Any]:
    recs = read_commits(d)
    before = [c for r in recs if r["attempt"] == 0 for c in r["commits"] if c[1] < t_kill]
    pre_kill = max(s for s, _ in before)
    later = [r for r in recs if r["attempt"] > 0]
    if not later:
        raise RuntimeError(f"no restarted worker in {d}")
    attempt = min(r["attempt"] for r in later)
    rs = [r for r in later if r["attempt"] == attempt]
    first = max(r["commits"][0][1] for r in rs if r["commits"])
    back = max(next(t for s, t in r["commits"] if s > pre_kill) for r in rs)
    redone = sorted({s for r in rs for s, _ in r["commits"] if s <= pre_kill})
    diffs = [b[1] - a_[1] for r in recs if r["attempt"] == 0
             for a_, b in zip(r["commits"], r["commits"][1:]) if b[1] < t_kill]
    gaps = []
    for r in recs:  # longest gap around the fault on each rank (old attempt -> new one)
        cs = sorted([c for x in recs if x["rank"] == r["rank"] for c in x["commits"]],
                    key=lambda c: c[1])
        b = [c for c in cs if c[1] < t_kill]
        a_ = [c for c in cs if c[1] >= t_kill]
        if b and a_:
            gaps.append(a_[0][1] - b[-1][1])
    med = statistics.median(diffs) if diffs else 0.0
    phases = {"respawn": max(r["start"] for r in rs) - t_kill,
              "import": max(r["imported"] - r["start"] for r in rs),
              "process_group": max(r["pg"] - r["imported"] for r in rs),
              "build": max(r["built"] - r["pg"] for r in rs if "built" in r),
              "ckpt_load": max(r["loaded"] - r["built"] for r in rs if "loaded" in r),
              "first_step": first - max(r.get("loaded", r["pg"]) for r in rs)}
    return {"every": every, "rank": victim, "pre_kill_step": pre_kill,
            "restored_step": min(r.get("loaded_step", -1) for r in rs),
            "downtime_s": first - t_kill, "back_at_step_s": back - t_kill,
            "gap_s": (max(gaps) - med) if gaps else None,
            "recomputed_steps": len(redone), "median_step_s": med, "restarts": attempt,
            "final_step": max(s for r in recs for s, _ in r["commits"]),
            "phases_s": {k: round(v, 4) for k, v in phases.items()}, "run_dir": str(d)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="one rank (under torchrun)")
    w.add_argument("--dir", required=True)
    w.add_argument("--every", type=int, default=20, help="checkpoint every N steps (0: never)")
    w.add_argument("--steps", type=int, default=30)
    w.add_argument("--model", default="small")
    w.add_argument("--data", required=True)
    w.add_argument("--global-batch-size", type=int, default=32)
    w.add_argument("--micro-batch-size", type=int, default=4)
    w.add_argument("--lr", type=float, default=3e-3)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    worker(a)


if __name__ == "__main__":
    main()
