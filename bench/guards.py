"""Guards benchmark (issue 32): what state verification costs, and a preemption notice's
hand-over against a crash recovery, on the example's model.

    python -m bench.guards [--model 10m] [--workers 2] [--steps 60] [--repeats 2]
                           [--json PATH] [--write-doc]
    ceaseless bench guards ...        (same options)

* **Verification**: `ceaseless up --verify-every 0` and `--verify-every 10`, alternating, the
  step time of each run (the median gap between rank 0's commits after ``--warmup``) and
  the ratio per pair; and each verification's own time (digest, all-reduce, host copy; the
  agents' `state verified` log lines), from which the ratio at every 100 steps follows as
  1 + cost / (100 x step time): two cores cannot resolve a 1 % difference run against run.
* **Hand-over**: 2 workers and a spare; at step ``--at`` rank 1 gets SIGKILL (a crash:
  detected, planned, recovered) or `inject preempt` (a planned departure at the next step
  boundary). Reported: the survivors' longest gap between commits around it, minus their
  median step time (as `bench recovery` counts downtime), and the steps recomputed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import cmdline, config, emit, fmt, machine, machine_line, summary, main
from bench.overhead import step_time

SECTION = "## Guards: verification cost, preemption hand-over"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="10m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--at", type=int, default=25, help="the step of the kill / the notice")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def _verify_seconds(run: Path) -> list[float]:
    out = []
    for log in (run / "logs").glob("w*.log"):
        for line in log.read_text().splitlines():
            if '"state verified"' in line:
                try:
                    out.append(float(json.loads(line)["seconds"]))
                except (ValueError, KeyError):
                    pass
    return out


def _rank0(run: Path) -> dict:
    for p in (run / "results").glob("*.json"):
        r = json.loads(p.read_text())
        if r.get("rank") == 0:
            return r
    raise RuntimeError(f"no rank-0 result in {run}")


async def _run(d: Path, a: argparse.Namespace, spares: int, extra: list[str],
               fault: Any = None) -> dict:
    from ops.launcher import Cluster

    async with Cluster(d, a.workers, spares, a.steps, timeout=1800,
                       extra=["--model", a.model, *extra]) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        if code != 0:
            raise RuntimeError(f"run {d.name} failed ({code}): {c.output()[-2000:]}")
        return c.summary() | {"t_fault": getattr(c, "t_fault", None)}


def _gap(run: Path, t_fault: float) -> float | None:
    """The survivors' longest gap between commits after the fault, minus their median."""
    best = None
    for p in (run / "results").glob("*.json"):
        r = json.loads(p.read_text())
        ts = sorted(t for _, t in r["commits"])
        gaps = [b - a for a, b in zip(ts, ts[1:])]
        if len(gaps) < 3:
            continue
        around = [g for (x, y), g in zip(zip(ts, ts[1:]), gaps) if y >= t_fault and x <= t_fault + 30]
        if around:
            d = max(around) - statistics.median(gaps)
            best = d if best is None else max(best, d)
    return best


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    import time

    from schemas.messages import Inject, InjectAction

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-guards-"))
    off, on, ratios, costs = [], [], [], []
    for r in range(a.repeats):
        now = {}
        for every in ((0, 10) if r % 2 == 0 else (10, 0)):
            d = work / f"verify{every}-{r}"
            await _run(d, a, 0, ["--verify-every", str(every)])
            now[every] = step_time(_rank0(d)["commits"], a.warmup)
            if every:
                costs += _verify_seconds(d)
        off.append(now[0])
        on.append(now[10])
        ratios.append(now[10] / now[0])
        print(f"[verify {r + 1}/{a.repeats}] off {now[0]:.4f} s/step, every 10 "
              f"{now[10]:.4f} s/step, ratio {ratios[-1]:.3f}", flush=True)
    cost = statistics.median(costs) if costs else float("nan")
    step_off = statistics.median(off)

    async def kill(c):
        await c.wait_rank_step(1, a.at)
        c.t_fault = time.time()
        os.kill(c.member(1).pid, signal.SIGKILL)

    async def preempt(c):
        await c.wait_rank_step(1, a.at)
        c.t_fault = time.time()
        await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.preempt, rank=1))

    hand: dict[str, list[float]] = {"crash": [], "preempt": []}
    lost: dict[str, list[int]] = {"crash": [], "preempt": []}
    for r in range(a.repeats):
        for name, f in ((("crash", kill), ("preempt", preempt)) if r % 2 == 0
                        else (("preempt", preempt), ("crash", kill))):
            d = work / f"{name}-{r}"
            s = await _run(d, a, 1, ["--verify-every", "0"], f)
            g = _gap(d, s["t_fault"])
            if g is not None:
                hand[name].append(g)
            lost[name].append(s["lost_steps"])
            print(f"[{name} {r + 1}/{a.repeats}] downtime {g:.3f} s, incidents "
                  f"{[i['kind'] for i in s['incidents']]}", flush=True)
    return {"benchmark": "guards", "machine": machine(),
            "config": config(a) | {"command": cmdline("guards")},
            "step_off_s": summary(off), "step_verify10_s": summary(on),
            "ratio_verify10": summary(ratios), "verify_cost_s": summary(costs or [float("nan")]),
            "implied_ratio_verify100": 1 + cost / (100 * step_off),
            "implied_ratio_verify10": 1 + cost / (10 * step_off),
            "downtime_crash_s": summary(hand["crash"] or [float("nan")]),
            "downtime_preempt_s": summary(hand["preempt"] or [float("nan")]),
            "lost_crash": lost["crash"], "lost_preempt": lost["preempt"]}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    return "\n".join([
        SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command']}`. {c['workers']} workers, model `{c['model']}`, {c['steps']} "
        f"steps (first {c['warmup']} skipped), {c['repeats']} runs each, alternating; median "
        "(min–max).", "",
        "| | figure |", "|---|---|",
        f"| step time, verification off | {fmt(res['step_off_s'], 's', 4)} |",
        f"| step time, verification every 10 steps | {fmt(res['step_verify10_s'], 's', 4)} |",
        f"| ratio every 10 / off (per pair, measured) | {fmt(res['ratio_verify10'], '', 3)} |",
        f"| one verification (digest, all-reduce, host copy) | {fmt(res['verify_cost_s'], 's', 4)} |",
        f"| implied ratio, every 100 steps (1 + cost / 100 steps) | {res['implied_ratio_verify100']:.4f} |",
        f"| implied ratio, every 10 steps | {res['implied_ratio_verify10']:.4f} |",
        f"| downtime, SIGKILL of rank 1 (crash recovery, a spare) | {fmt(res['downtime_crash_s'], 's', 3)} |",
        f"| downtime, `inject preempt` of rank 1 (planned departure) | {fmt(res['downtime_preempt_s'], 's', 3)} |",
        f"| steps recomputed: crash / preempt | {res['lost_crash']} / {res['lost_preempt']} |",
        ""]) + "\n"


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit(res, markdown(res), SECTION, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
