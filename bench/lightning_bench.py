"""Lightning benchmark: step time of ``Trainer(strategy=CeaselessStrategy())`` under
``ceaseless up`` against Lightning's own ``DDPStrategy`` under torchrun, the same script
(issue 44: the "before" and "after" examples differ by their import line), side by side.

    python -m bench.lightning_bench [--workers 2] [--steps 200] [--warmup 20] [--repeats 3]
                                    [--width 1024] [--batch-size 32] [--json PATH] [--write-doc]
    ceaseless bench lightning ...        (same options)

Ceaseless: ``ceaseless up --workers W --spares 0 -- python lightning_after.py``; DDP:
``torchrun --standalone --nproc-per-node W lightning_before.py``; fault-free, no validation,
logging or checkpoints. Runs alternate (C D D C …). A run's step time is the median gap
between rank 0's train-batch ends (the script's own ``--times``) after ``--warmup``;
reported: median (min–max) over runs and the ratio Ceaseless / DDP per pair of neighbouring
runs.
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
BEFORE = "examples/frameworks/lightning_before.py"
AFTER = "examples/frameworks/lightning_after.py"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--width", type=int, default=1024, help="the example's hidden units")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank and step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def _args(d: Path, a: argparse.Namespace) -> list[str]:
    return ["--max-steps", str(a.steps), "--width", str(a.width), "--batch-size",
            str(a.batch_size), "--times", str(d / "times.txt")]


def step_time(d: Path, warmup: int) -> float:
    ts = [float(x) for x in (d / "times.txt").read_text().split()][warmup:]
    if len(ts) < 3:
        raise RuntimeError(f"too few steps after warm-up {warmup} in {d}: {len(ts)}")
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


async def ceaseless_run(d: Path, a: argparse.Namespace) -> float:
    from ops.launcher import Cluster

    d.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, AFTER, *_args(d, a)]
    async with Cluster(d, a.workers, 0, a.steps, cmd=cmd, timeout=1800) as c:
        code = await c.finish()
        if code != 0:
            raise RuntimeError(f"ceaseless run failed ({code}): {c.output()[-2000:]}")
    return step_time(d, a.warmup)


def ddp_run(d: Path, a: argparse.Namespace) -> float:
    d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.workers}", BEFORE, *_args(d, a)]
    with open(d / "torchrun.log", "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1800)
    if r.returncode != 0:
        raise RuntimeError(f"torchrun failed ({r.returncode}): see {d / 'torchrun.log'}")
    return step_time(d, a.warmup)


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    if a.steps < a.warmup + 5:
        raise SystemExit("need --steps >= --warmup + 5")
    # one intra-op thread per process (torchrun sets it for DDP; the same for Ceaseless's
    # pods): several processes on few cores otherwise spin against each other
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-lt-"))
    got: dict[str, list[float]] = {"ceaseless": [], "ddp": []}
    ratios = []
    for r in range(a.repeats):
        now = {}
        for which in (("ceaseless", "ddp") if r % 2 == 0 else ("ddp", "ceaseless")):
            d = work / f"{which}-{r}"
            now[which] = await ceaseless_run(d, a) if which == "ceaseless" else ddp_run(d, a)
            got[which].append(now[which])
        ratios.append(now["ceaseless"] / now["ddp"])
        print(f"[{r + 1}/{a.repeats}] Ceaseless {now['ceaseless']:.4f} s/step, DDP "
              f"{now['ddp']:.4f} s/step, ratio {ratios[-1]:.3f}", flush=True)
    return {"benchmark": "lightning", "machine": machine(),
            "config": config(a) | {"command": cmdline("lightning_bench")},
            "ceaseless_step_s": summary(got["ceaseless"]), "ddp_step_s": summary(got["ddp"]),
            "ratio": summary(ratios)}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
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


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit(res, markdown(res), SECTION, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
