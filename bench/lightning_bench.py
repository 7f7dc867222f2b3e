"""Framework benchmark: step time of a framework's integration under ``ceaseless up`` against
the framework's own DDP under torchrun, the same script (issue 44: the "before" and "after"
examples differ by their import line), side by side. ``--framework lightning``:
``Trainer(strategy=CeaselessStrategy())`` against Lightning's ``DDPStrategy``;
``--framework hf``: ``agent.hf.Trainer`` against ``transformers.Trainer`` (DDP through
Accelerate).

    python -m bench.lightning_bench [--framework lightning|hf] [--workers 2] [--steps 200]
                                    [--warmup 20] [--repeats 3] [--width N] [--batch-size N]
                                    [--json PATH] [--write-doc]
    ceaseless bench lightning ...        (same options)

Ceaseless: ``ceaseless up --workers W --spares 0 -- python <fw>_after.py``; DDP:
``torchrun --standalone --nproc-per-node W <fw>_before.py``; fault-free, no validation or
checkpoints. Runs alternate (C D D C …). A run's step time is the median gap between rank 0's
step ends (the script's own ``--times``) after ``--warmup``; reported: median (min–max) over
runs and the ratio Ceaseless / DDP per pair of neighbouring runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import cmdline, config, emit, fmt, machine, machine_line, summary, main

SECTION = "## Lightning: CeaselessStrategy against DDPStrategy"
HF_SECTION = "## Hugging Face Trainer: agent.hf.Trainer against transformers.Trainer"
BEFORE = "examples/frameworks/{}_before.py"
AFTER = "examples/frameworks/{}_after.py"
WIDTH = {"lightning": 1024, "hf": 32}  # the example's hidden units / n_embd
BATCH = {"lightning": 32, "hf": 4}  # per rank and (micro-)batch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--framework", choices=sorted(WIDTH), default="lightning")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--width", type=int, help="the example's hidden units (lightning: 1024) "
                   "or n_embd (hf: 32)")
    p.add_argument("--batch-size", type=int, help="samples per rank and (micro-)batch "
                   "(lightning: 32, hf: 4, 2 micro-batches a step)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def _args(d: Path, a: argparse.Namespace) -> list[str]:
    width = "--width" if a.framework == "lightning" else "--n-embd"
    out = ["--output-dir", str(d / "out")] if a.framework == "hf" else []
    return ["--max-steps", str(a.steps), width, str(a.width), "--batch-size",
            str(a.batch_size), "--times", str(d / "times.txt"), *out]


def step_time(d: Path, warmup: int) -> float:
    ts = [float(x) for x in (d / "times.txt").read_text().split()][warmup:]
    if len(ts) < 3:
        raise RuntimeError(f"too few steps after warm-up {warmup} in {d}: {len(ts)}")
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


async def ceaseless_run(d: Path, a: argparse.Namespace) -> float:
    from ops.launcher import Cluster

    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, AFTER.format(a.framework), *_args(d, a)]
    async with Cluster(d, a.workers, 0, a.steps, cmd=cmd, timeout=1800) as c:
        code = await c.finish()
        if code != 0:
            raise RuntimeError(f"ceaseless run failed ({code}): {c.output()[-2000:]}")
    return step_time(d, a.warmup)


def ddp_run(d: Path, a: argparse.Namespace) -> float:
    d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.workers}", BEFORE.format(a.framework), *_args(d, a)]
    with open(d / "torchrun.log", "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if r.returncode != 0:
        # transformers' Trainer under torchrun sometimes aborts at interpreter exit, after
        # training ("terminate called without an active exception"): the run's step times
        # count if rank 0 finished (its last line, and its times, written)
        done = f"step {a.steps}: parameters sha256" in (d / "torchrun.log").read_text()
        if not (done and (d / "times.txt").exists()):
            raise RuntimeError(f"torchrun failed ({r.returncode}): see {d / 'torchrun.log'}")
        print(f"torchrun exited {r.returncode} after training (kept): {d / 'torchrun.log'}",
              flush=True)
    return step_time(d, a.warmup)


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    if a.steps < a.warmup + 5:
        raise SystemExit("need --steps >= --warmup + 5")
    a.width = a.width or WIDTH[a.framework]
    a.batch_size = a.batch_size or BATCH[a.framework]
    # one intra-op thread per process (torchrun sets it for DDP; the same for Ceaseless's
    # pods): several processes on few cores otherwise spin against each other
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-lt-"))
    got: dict[str, list[float]] = {"ceaseless": [], "ddp": []}
    ratios = []
    load = [os.getloadavg()[0]]  # the 1-minute load average at the start and after each run
    for r in range(a.repeats):
        now = {}
        for which in (("ceaseless", "ddp") if r % 2 == 0 else ("ddp", "ceaseless")):
            d = work / f"{which}-{r}"
            now[which] = await ceaseless_run(d, a) if which == "ceaseless" else ddp_run(d, a)
            got[which].append(now[which])
            load.append(os.getloadavg()[0])
        ratios.append(now["ceaseless"] / now["ddp"])
        print(f"[{r + 1}/{a.repeats}] Ceaseless {now['ceaseless']:.4f} s/step, DDP "
              f"{now['ddp']:.4f} s/step, ratio {ratios[-1]:.3f}", flush=True)
    return {"benchmark": a.framework, "machine": machine(),
            "config": config(a) | {"command": cmdline("lightning_bench")},
            "ceaseless_step_s": summary(got["ceaseless"]), "ddp_step_s": summary(got["ddp"]),
            "ratio": summary(ratios), "pairs": ratios, "load_1min": load}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    if c.get("framework") == "hf":
        return hf_markdown(res)
    return "\n".join([
        SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command']}`. {c['workers']} workers, no spare, the Lightning example "
        f"(`examples/frameworks/`, an MLP 16-{c['width']}-1, AdamW, StepLR, a "
        f"`DistributedSampler`), {c['batch_size']} samples per rank and step, {c['steps']} "
        f"steps, first {c['warmup']} skipped; {c['repeats']} runs each, alternating; median "
        "(min–max).",
        "", "| strategy | step time |", "|---|---|",
        f"| `CeaselessStrategy` under `ceaseless up` | {fmt(res['ceaseless_step_s'], 's', 4)} |",
        f"| Lightning's `DDPStrategy` under torchrun | {fmt(res['ddp_step_s'], 's', 4)} |",
        f"| ratio Ceaseless / DDP (per pair) | {fmt(res['ratio'], '', 3)} |", ""]) + "\n"


def hf_markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    return "\n".join([
        HF_SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command']}`. {c['workers']} workers, no spare, the Hugging Face "
        f"example (`examples/frameworks/`, a 2-layer GPT-2 of n_embd {c['width']} built from "
        "its config, AdamW, cosine LR with warm-up, clipping), "
        f"{c['batch_size']} sequences of 32 tokens per rank and micro-batch, 2 micro-batches a "
        f"step, {c['steps']} steps, first {c['warmup']} skipped; {c['repeats']} runs each, "
        "alternating; median (min–max).",
        "", "| trainer | step time |", "|---|---|",
        f"| `agent.hf.Trainer` under `ceaseless up` | {fmt(res['ceaseless_step_s'], 's', 4)} |",
        f"| `transformers.Trainer` (DDP) under torchrun | {fmt(res['ddp_step_s'], 's', 4)} |",
        f"| ratio Ceaseless / DDP (per pair) | {fmt(res['ratio'], '', 3)} |", ""]) + "\n"


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    section = HF_SECTION if a.framework == "hf" else SECTION
    return emit(res, markdown(res), section, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
