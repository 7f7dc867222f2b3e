"""Guards benchmark (issue 32): what state verification costs, a preemption notice's
hand-over against a crash recovery, a bit flip found and undone, a straggler swapped out,
on the example's model.

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
* **Corruption**: 3 workers + a spare verifying every ``--verify-at`` steps; one bit of rank
  1's parameters flipped at step ``--at``: the steps until the replicas found it (detection
  latency in steps), the steps computed again (the goodput ledger's rollback), the
  ``corruption`` incident's downtime (the odd pod replaced), and the run's effective
  training time ratio against the same run without the flip.
* **Straggler**: 3 workers + a spare; rank 1 slowed ``--factor`` times from step ``--at``
  (`inject slow`): seconds from the slowdown to the health monitor's ``straggler`` fault
  (with ``--straggler-window``), and the job's step time (rank 0's commits) before, while
  slow and after the swap: the goodput before/after.
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
PARTS = ("verify", "handover", "corruption", "straggler")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="10m")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--at", type=int, default=25, help="the step of the kill / the notice")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--parts", default=",".join(PARTS), help="which, of " + ",".join(PARTS))
    p.add_argument("--verify-at", type=int, default=10, help="corruption: --verify-every")
    p.add_argument("--factor", type=float, default=5.0, help="straggler: the slowdown")
    p.add_argument("--straggler-window", type=float, default=5.0)
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
               fault: Any = None, workers: int | None = None) -> dict:
    from ops.launcher import Cluster

    async with Cluster(d, workers or a.workers, spares, a.steps, timeout=1800,
                       extra=["--model", a.model, *extra]) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        if code != 0:
            raise RuntimeError(f"run {d.name} failed ({code}): {c.output()[-2000:]}")
        return c.summary() | {"t_fault": getattr(c, "t_fault", None), "plans": list(c.plans),
                              "faults": list(getattr(c, "faults", []))}


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


def _median_gap(commits: list[tuple[int, float]], lo: float, hi: float) -> float | None:
    ts = [t for _, t in commits if lo <= t <= hi]
    gaps = [b - a for a, b in zip(ts, ts[1:])]
    return statistics.median(gaps) if gaps else None


async def _watch_faults(c: Any) -> None:
    from schemas.messages import Fault

    c.faults = []

    async def on(m, env):
        c.faults.append(m)
    await c.bus.subscribe(c.bus.subjects.fault, Fault, on)


async def corruption(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """A bit flip in a 3-replica job: detection latency in steps, steps recomputed, downtime."""
    from schemas.messages import Inject, InjectAction

    flags = ["--verify-every", str(a.verify_at)]
    lat, recomp, down, ratio, ratio_ref = [], [], [], [], []
    for r in range(a.repeats):
        async def flip(c):
            await c.wait_rank_step(1, 2)
            await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.bitflip,
                                                              rank=1, at_step=a.at))
        ref = await _run(work / f"noflip-{r}", a, 1, flags, None, workers=3)
        s = await _run(work / f"flip-{r}", a, 1, flags, flip, workers=3)
        g = s.get("goodput") or {}
        rb = [e for e in g.get("incidents", []) if e["recomputed_s"] > 0]
        found = [int(json.loads(x)["step"]) for x in (work / f"flip-{r}" / "logs" / "w0.log")
                 .read_text().splitlines() if '"rolled back to the last verified copy"' in x]
        if found:
            lat.append(found[0] - a.at)
        if rb:
            recomp.append(rb[0]["recomputed_s"])
        down += [i["downtime"] for i in s["incidents"] if i["kind"] == "corruption"
                 and i.get("downtime") is not None]
        ratio.append(g.get("effective_ratio") or float("nan"))
        ratio_ref.append((ref.get("goodput") or {}).get("effective_ratio") or float("nan"))
        same = s["param_sha256"] == ref["param_sha256"]
        print(f"[corruption {r + 1}/{a.repeats}] found {lat[-1:]} steps later, recomputed "
              f"{recomp[-1:]} s, incidents {[i['kind'] for i in s['incidents']]}, bitwise "
              f"{same}", flush=True)
    return {"corruption_latency_steps": lat, "corruption_recomputed_s": summary(recomp or [float("nan")]),
            "corruption_downtime_s": summary(down or [float("nan")]),
            "corruption_goodput": summary(ratio), "corruption_goodput_ref": summary(ratio_ref)}


async def straggler(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Rank 1 slowed: detection time, and the job's step time before, while slow, after."""
    import time

    from schemas.messages import FaultKind, Inject, InjectAction

    flags = ["--straggler-window", str(a.straggler_window)]
    det, before, slow, after = [], [], [], []
    for r in range(a.repeats):
        async def straggle(c):
            await _watch_faults(c)
            await c.wait_rank_step(1, a.at)
            c.t_fault = time.time()
            await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.slow, rank=1,
                                                              factor=a.factor))
        d = work / f"straggler-{r}"
        s = await _run(d, a, 1, flags, straggle, workers=3)
        f = next((x for x in s["faults"] if x.kind == FaultKind.straggler), None)
        cm = sorted(((int(k), float(t)) for k, t in _rank0(d)["commits"]), key=lambda x: x[1])
        if f is not None:
            det.append(f.detected_at - s["t_fault"])
            swap = next((p for p in s["plans"] if p.reason.startswith("straggler:")), None)
            t_swap = f.detected_at
            if swap is not None and swap.apply_step is not None:
                t_swap = next((t for k, t in cm if k >= swap.apply_step), t_swap)
            before.append(_median_gap(cm, 0, s["t_fault"]) or float("nan"))
            slow.append(_median_gap(cm, s["t_fault"] + 1.0, f.detected_at) or float("nan"))
            after.append(_median_gap(cm, t_swap + 1.0, float("inf")) or float("nan"))
        print(f"[straggler {r + 1}/{a.repeats}] detected after {det[-1:]} s; step time "
              f"{before[-1:]} / {slow[-1:]} / {after[-1:]} s", flush=True)
    return {"straggler_detect_s": summary(det or [float("nan")]),
            "straggler_step_before_s": summary(before or [float("nan")]),
            "straggler_step_slow_s": summary(slow or [float("nan")]),
            "straggler_step_after_s": summary(after or [float("nan")])}


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    import time

    from schemas.messages import Inject, InjectAction

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-guards-"))
    parts = set(a.parts.split(","))
    extra: dict[str, Any] = {}
    if "corruption" in parts:
        extra |= await corruption(a, work)
    if "straggler" in parts:
        extra |= await straggler(a, work)
    off, on, ratios, costs = [], [], [], []
    for r in range(a.repeats if "verify" in parts else 0):
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
    step_off = statistics.median(off) if off else float("nan")

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
    for r in range(a.repeats if "handover" in parts else 0):
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
            **extra,
            "step_off_s": summary(off or [float("nan")]),
            "step_verify10_s": summary(on or [float("nan")]),
            "ratio_verify10": summary(ratios or [float("nan")]),
            "verify_cost_s": summary(costs or [float("nan")]),
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
        *_more_rows(res), ""]) + "\n"


def _more_rows(res: dict[str, Any]) -> list[str]:
    rows = []
    if "corruption_latency_steps" in res:
        rows += [
            f"| bit flip (3 replicas + spare, verify every {res['config']['verify_at']}): found "
            f"after (steps) | {res['corruption_latency_steps']} |",
            f"| bit flip: steps computed again (ledger, s) | {fmt(res['corruption_recomputed_s'], 's', 3)} |",
            f"| bit flip: `corruption` incident downtime (odd pod replaced) | {fmt(res['corruption_downtime_s'], 's', 3)} |",
            f"| bit flip: effective training time ratio, with / without the flip | "
            f"{fmt(res['corruption_goodput'], '', 4)} / {fmt(res['corruption_goodput_ref'], '', 4)} |"]
    if "straggler_detect_s" in res:
        rows += [
            f"| straggler (x{res['config']['factor']:g}, window {res['config']['straggler_window']:g} s): "
            f"slowdown to `straggler` fault | {fmt(res['straggler_detect_s'], 's', 2)} |",
            f"| straggler: job step time before / while slow / after the swap | "
            f"{fmt(res['straggler_step_before_s'], 's', 3)} / {fmt(res['straggler_step_slow_s'], 's', 3)} / "
            f"{fmt(res['straggler_step_after_s'], 's', 3)} |"]
    notes = []
    if "corruption_latency_steps" in res:
        notes.append("A flipped bit is found at the next verification (at most N steps "
                     "later) and costs the steps since the last verified copy (at most N) "
                     "times the step time, plus the replacement of the odd pod.")
    if "straggler_detect_s" in res:
        notes.append("A straggler is declared once its heartbeat's compute time (the median "
                     "of its last 5 steps) has been over the factor for the window: about 3 "
                     "slow steps plus the window; after the swap the job steps at its "
                     "earlier pace.")
    return rows + ([""] + notes if notes else [])


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit(res, markdown(res), SECTION, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
