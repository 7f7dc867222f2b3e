"""Drop-in benchmark: step time of the DDP drop-in (``agent.ddp``) against the Session API,
the same script ported both ways, side by side in one run.

    python -m bench.dropin [--workers 2] [--iters 60] [--warmup 10] [--repeats 3]
                           [--grad-accum 8] [--batch-size 8] [--json PATH] [--write-doc]
    ceaseless bench dropin ...        (same options)

Both are ``ceaseless up --workers W --spares 0 -- python SCRIPT``, fault-free, of
``examples/porting/ceaseless_train.py`` (the drop-in: the DDP script with its loop) and
``examples/porting/session_train.py`` (the same script on ``agent.Session``): same model,
synthetic data, batch, optimizer; no evaluation or logging inside the timed steps. Runs
alternate (D S S D …). A run's step time is the median gap between rank 0's committed steps
after ``--warmup``; reported: median (min–max) over runs and the ratio drop-in / Session per
pair of neighbouring runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import cmdline, config, emit, fmt, machine, machine_line, summary, main
from bench.overhead import step_time

SECTION = "## DDP drop-in against the Session API"
SCRIPTS = {"dropin": "examples/porting/ceaseless_train.py",
           "session": "examples/porting/session_train.py"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--iters", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--grad-accum", type=int, default=8, help="micro-batches per step, all ranks")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


async def one_run(d: Path, which: str, a: argparse.Namespace) -> float:
    from ops.launcher import Cluster

    cmd = [sys.executable, SCRIPTS[which], "--max-iters", str(a.iters),
           "--eval-interval", str(10 * a.iters), "--log-interval", str(10 * a.iters),
           "--grad-accum", str(a.grad_accum), "--batch-size", str(a.batch_size),
           "--out-dir", str(d / "out")]
    async with Cluster(d, a.workers, 0, a.iters, cmd=cmd, timeout=1800) as c:
        code = await c.finish()
        if code != 0:
            raise RuntimeError(f"{which} run failed ({code}): {c.output()[-2000:]}")
    res = json.loads((d / "results" / "w0.json").read_text())
    if res.get("rank") != 0:  # rank 0's commits (w0 unless the plan said otherwise)
        for p in (d / "results").glob("*.json"):
            r = json.loads(p.read_text())
            if r.get("rank") == 0:
                res = r
    return step_time(res["commits"], a.warmup)


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    if a.iters < a.warmup + 5:
        raise SystemExit("need --iters >= --warmup + 5")
    # one intra-op thread per pod (as torchrun sets, and bench.overhead): several pods on few
    # cores otherwise spin against each other and the step times are the scheduler's
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-dropin-"))
    got: dict[str, list[float]] = {"dropin": [], "session": []}
    ratios = []
    for r in range(a.repeats):
        order = ("dropin", "session") if r % 2 == 0 else ("session", "dropin")
        now = {}
        for which in order:
            now[which] = await one_run(work / f"{which}-{r}", which, a)
            got[which].append(now[which])
        ratios.append(now["dropin"] / now["session"])
        print(f"[{r + 1}/{a.repeats}] drop-in {now['dropin']:.4f} s/step, Session "
              f"{now['session']:.4f} s/step, ratio {ratios[-1]:.3f}", flush=True)
    return {"benchmark": "dropin", "machine": machine(),
            "config": config(a) | {"command": cmdline("dropin")},
            "dropin_step_s": summary(got["dropin"]), "session_step_s": summary(got["session"]),
            "ratio": summary(ratios)}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    return "\n".join([
        SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command']}`. {c['workers']} workers, no spare, the porting example's "
        f"tiny GPT, {c['grad_accum']} micro-batches of {c['batch_size']} sequences per step, "
        f"{c['iters']} steps, first {c['warmup']} skipped; {c['repeats']} runs each, "
        "alternating; median (min–max).",
        "", "| loop | step time |", "|---|---|",
        f"| drop-in (`agent.ddp`, the script's own loop) | {fmt(res['dropin_step_s'], 's', 4)} |",
        f"| Session API (`s.steps`, `s.backward`, `s.step`) | {fmt(res['session_step_s'], 's', 4)} |",
        f"| ratio drop-in / Session (per pair) | {fmt(res['ratio'], '', 3)} |", ""]) + "\n"


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit(res, markdown(res), SECTION, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
