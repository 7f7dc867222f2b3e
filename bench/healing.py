"""Healing (issue 20): replacement pods, and last-resort checkpoints' cost and restore.

Three measurements, each repeated ``--repeats`` times with the example on the CPU:

* **refill**: ``--workers`` + 1 spare, SIGKILL of rank 1: seconds from the kill until the
  job is back at full strength, i.e. the spare took rank 1 *and* the replacement pod is a
  spare that holds the job's state again (following rank 0).
* **grow back**: ``--workers``, no spare, SIGKILL of rank 1: the job shrinks; seconds from
  the kill until the replacement has grown it back to ``--workers`` (includes the scaler's
  scale-up snooze, ``--snooze``).
* **pod start**: both of the above are run twice, interleaved: with the pods forked from
  `up`'s zygote (the default) and exec'd (``--no-prefork``), the baseline of the same run.
* **checkpoints**: the same fault-free job with and without ``--checkpoint-every`` (rank 0,
  background, torch.distributed.checkpoint), interleaved: median step time of each and
  their ratio; then the time a resumed job takes to load the newest checkpoint.

    python -m bench.healing --repeats 3 --json bench/results/healing.json --write-doc
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import cmdline, config, emit, fmt, machine, machine_line, summary, main

SECTION = "## Healing"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--snooze", type=float, default=2.0, help="the scaler's scale-up snooze")
    p.add_argument("--checkpoint-every", type=int, default=20)
    p.add_argument("--run-dir", help="keep the runs here (default: a temporary dir)")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def _pods(how: str) -> list[str]:
    return ["--no-prefork"] if how == "exec" else []


async def _refill(base: Path, a: argparse.Namespace, i: int, how: str = "fork"
                  ) -> dict[str, Any]:
    from ops.launcher import Cluster

    async with Cluster(base / f"refill{i}-{how}", a.workers, 1, a.steps, replace=True,
                       extra=_pods(how)) as c:
        await c.wait_spares(1)
        await c.wait_rank_step(1, 10)
        first = {p for p, h in c.hb.items() if h.role.value == "spare"}
        t0 = time.monotonic()
        os.kill(c.member(1).pid, signal.SIGKILL)
        await c.wait_for(lambda: len(c.plans) >= 2, 60, "the replacement plan")
        promoted = time.monotonic() - t0
        await c.wait_for(lambda: any(h.role.value == "spare" and p not in first and h.step >= 0
                                     for p, h in c.hb.items()), 120, "a refilled spare")
        refilled = time.monotonic() - t0
        code = await c.finish()
        s = c.summary()
    return {"pods": how, "promoted_s": promoted, "refilled_s": refilled, "exit": code,
            "world_sizes": sorted({p.world_size for p in c.plans}),
            "lost_steps": s["lost_steps"]}


async def _grow(base: Path, a: argparse.Namespace, i: int, how: str = "fork"
                ) -> dict[str, Any]:
    from ops.launcher import Cluster

    async with Cluster(base / f"grow{i}-{how}", a.workers, 0, a.steps, replace=True,
                       extra=["--scale-up-snooze", str(a.snooze), "--dtype", "float64",
                              *_pods(how)]) as c:
        await c.wait_rank_step(1, 10)
        t0 = time.monotonic()
        os.kill(c.member(1).pid, signal.SIGKILL)
        await c.wait_for(lambda: c.plans[-1].world_size < a.workers, 60, "the shrink")
        shrunk = time.monotonic() - t0
        await c.wait_for(lambda: c.plans[-1].world_size == a.workers, 120, "the grow-back")
        back = time.monotonic() - t0
        code = await c.finish()
        s = c.summary()
    return {"pods": how, "shrunk_s": shrunk, "back_s": back, "exit": code,
            "lost_steps": s["lost_steps"],
            "consistent": s.get("param_sha256_consistent")}


def _step_median(run_dir: Path) -> float:
    res = json.loads((run_dir / "results" / "w0.json").read_text())
    ts = [t for _, t in res["commits"]]
    gaps = [b - a for a, b in zip(ts[5:], ts[6:])]  # after the start-up steps
    return statistics.median(gaps)


async def _ckpt_pair(base: Path, a: argparse.Namespace, i: int) -> dict[str, Any]:
    from ops.launcher import Cluster

    out: dict[str, Any] = {}
    for kind in ("plain", "ckpt") if i % 2 == 0 else ("ckpt", "plain"):  # interleaved
        d = base / f"{kind}{i}"
        extra = (["--checkpoint-dir", str(d / "ckpt"), "--checkpoint-every",
                  str(a.checkpoint_every)] if kind == "ckpt" else [])
        async with Cluster(d, 2, 0, a.steps, extra=extra) as c:
            assert await c.finish() == 0, c.output()
        out[f"{kind}_step_s"] = _step_median(d)
        if kind == "ckpt":
            out["checkpoints"] = len(list((d / "ckpt").glob("step-*")))
            async with Cluster(base / f"resume{i}", 2, 0, a.steps,
                               extra=["--resume", str(d / "ckpt")]) as c:
                assert await c.finish() == 0, c.output()
            out["restore_s"] = _restore_seconds(base / f"resume{i}" / "logs" / "w0.log")
    out["ratio"] = out["ckpt_step_s"] / out["plain_step_s"]
    return out


def _restore_seconds(log: Path) -> float:
    """From the pod's start ("backend" record) to "resumed from a checkpoint"."""
    t: dict[str, float] = {}
    for line in log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the script's own prints
        ev = rec.get("event")
        if ev in ("backend", "resumed from a checkpoint") and ev not in t:
            t[ev] = dt.datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
    return t["resumed from a checkpoint"] - t["backend"]


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    base = Path(a.run_dir or tempfile.mkdtemp(prefix="ceaseless-healing-"))
    res: dict[str, Any] = {"machine": machine(), "command": cmdline("healing"),
                           "config": config(a),
                           "refill": [], "grow": [], "ckpt": []}
    for i in range(a.repeats):
        for how in ("fork", "exec") if i % 2 == 0 else ("exec", "fork"):  # interleaved
            res["refill"].append(await _refill(base, a, i, how))
            res["grow"].append(await _grow(base, a, i, how))
        res["ckpt"].append(await _ckpt_pair(base, a, i))
    return res


def render(res: dict[str, Any]) -> str:
    c, cfg = res["ckpt"], res["config"]
    r = [x for x in res["refill"] if x.get("pods", "fork") == "fork"]
    g = [x for x in res["grow"] if x.get("pods", "fork") == "fork"]
    rx = [x for x in res["refill"] if x.get("pods") == "exec"]
    gx = [x for x in res["grow"] if x.get("pods") == "exec"]
    rows = [
        ("kill → spare took the rank (plan)", fmt(summary(x["promoted_s"] for x in r))),
        ("kill → replacement spare holds the state (full strength)",
         fmt(summary(x["refilled_s"] for x in r))),
        (f"no spare: kill → grown back to {cfg['workers']} (snooze {cfg['snooze']:g} s)",
         fmt(summary(x["back_s"] for x in g))),
    ]
    if rx and gx:  # the same, every pod exec'd (--no-prefork): the baseline of this run
        rows += [
            ("full strength again, pods exec'd (`--no-prefork`)",
             fmt(summary(x["refilled_s"] for x in rx))),
            (f"grown back to {cfg['workers']}, pods exec'd (`--no-prefork`)",
             fmt(summary(x["back_s"] for x in gx))),
            ("ratio full strength again (forked / exec'd)",
             fmt(summary(f["refilled_s"] / e["refilled_s"] for f, e in zip(r, rx)), unit="")),
        ]
    rows += [
        ("step time, plain", fmt(summary(x["plain_step_s"] for x in c), digits=4)),
        (f"step time, checkpoint every {cfg['checkpoint_every']} steps",
         fmt(summary(x["ckpt_step_s"] for x in c), digits=4)),
        ("ratio (with / without checkpoints)", fmt(summary(x["ratio"] for x in c), unit="")),
        ("resume: pod start → checkpoint loaded", fmt(summary(x["restore_s"] for x in c))),
    ]
    lines = [SECTION, "", machine_line(res["machine"]) + f" Command: `{res['command']}`.", "",
             "| measurement | median (min–max) |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    ok = all(x["exit"] == 0 and x["lost_steps"] == 0 for x in res["refill"] + res["grow"])
    lines += ["", f"Runs: {len(r)} refill, {len(g)} grow-back (each also with exec'd pods: "
              f"{len(rx)}, {len(gx)}), {len(c)} checkpoint pairs "
              f"(interleaved); every run finished with no lost step: {'yes' if ok else 'NO'}. "
              "The example's `tiny` model steps in milliseconds, so the checkpoint ratio is an "
              "upper bound for real models (the host copy and the write are per checkpoint, "
              "not per step); measure on the GPU machine before quoting it for one.", ""]
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(_main(a))
    emit(res, render(res), SECTION, a.json, a.write_doc)
    return 0


if __name__ == "__main__":
    sys.exit(main(__name__))
