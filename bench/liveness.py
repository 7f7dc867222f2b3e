"""Liveness stress: rank-0 SIGKILLs with a hot spare under CPU load, repeated (issue 24).

Each repeat runs the example (``--workers`` + ``--spares``) under a busy loop per core,
SIGKILLs rank 0 at ``--kill-at`` and waits, bounded by ``--run-timeout``, for the job to
finish. A run that does not finish is a hang; a run that finishes must be bitwise equal to
the fault-free reference (computed once, same world size and steps) with no lost step. It
also counts, per run, the members that took the resume-in-place path and the abort requests
that found no newer plan (the race of issue 24, now ignored instead of hanging the job).

    python -m bench.liveness --repeats 30 --json bench/results/liveness.json --write-doc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, emit, machine, machine_line, summary, main

DOC = REPO / "docs" / "reliability.md"
SECTION = "## Liveness under load: rank-0 kills with a spare"
BUSY = "import time\nwhile True:\n    pass\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=15, help="rank 0's step at the SIGKILL")
    p.add_argument("--sleep", type=float, default=0.0,
                   help="the example sleeps this long per micro-batch (a slower model, same "
                        "numerics): more of each step is compute, where resume-in-place applies")
    p.add_argument("--after-step", type=float, default=0.0,
                   help="the example sleeps this long after each s.step() (a script that logs "
                        "there): the window in which issue 24's race happened")
    p.add_argument("--rank0-after-step", type=float, default=0.0,
                   help="rank 0 sleeps this much longer after each s.step() (rank-0 logging): "
                        "the others wait for it in the next all-reduce, the spare for its "
                        "confirmation of the step (issue 24's sequence)")
    p.add_argument("--load", type=int, default=os.cpu_count() or 1,
                   help="busy-loop processes during the fault runs (default: one per core)")
    p.add_argument("--run-timeout", type=float, default=150.0,
                   help="a fault run not finished after this many seconds is a hang")
    p.add_argument("--run-dir", help="keep the runs here (default: a temporary dir)")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--write-doc", action="store_true", help=f"update {SECTION!r} in {DOC}")
    p.add_argument("--from-json", help="render the runs stored in this JSON instead of running")


class Load:
    """``n`` busy-loop processes, stopped by PID."""

    def __init__(self, n: int) -> None:
        self.procs = [subprocess.Popen([sys.executable, "-c", BUSY],
                                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL) for _ in range(n)]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()


def _count(run_dir: Path, needle: str) -> int:
    n = 0
    for log in (run_dir / "logs").glob("*.log"):
        try:
            n += log.read_text(errors="replace").count(needle)
        except OSError:
            pass
    return n


async def _one(run_dir: Path, a: argparse.Namespace, fault: bool) -> dict[str, Any]:
    from ops.launcher import Cluster

    t0 = time.monotonic()
    out: dict[str, Any] = {"run_dir": str(run_dir)}
    extra = ["--", sys.executable, "-m", "examples.train_gpt", "--steps", str(a.steps)]
    if fault and a.sleep:
        extra += ["--sleep", str(a.sleep)]
    if fault and a.after_step:
        extra += ["--after-step", str(a.after_step)]
    if fault and a.rank0_after_step:
        extra += ["--rank0-after-step", str(a.rank0_after_step)]
    async with Cluster(run_dir, a.workers, a.spares if fault else 0, a.steps, extra=extra,
                       timeout=a.run_timeout + 60) as c:
        try:
            if fault:
                await c.wait_spares(a.spares)
                await c.wait_rank_step(0, a.kill_at)
                h = c.member(0)
                os.kill(h.pid, signal.SIGKILL)
                out["killed"] = h.pod
            code = await c.finish(a.run_timeout)
        except AssertionError as e:
            out.update(hang=True, error=str(e)[-400:], wall_s=time.monotonic() - t0)
            return out
        s = c.summary()
    out.update(hang=False, exit_code=code, final_step=s["final_step"],
               sha=s["param_sha256"], lost_steps=s["lost_steps"],
               downtime=[i["downtime"] for i in s["incidents"]],
               generation=s["generation"], wall_s=time.monotonic() - t0)
    return out


def counts(run_dir: Path) -> dict[str, int]:
    """What the pods' logs say happened: the preconditions of issue 24's race are a
    survivor whose all-reduce failed on the dead rank 0 and a spare that lost rank 0's last
    confirmation (so it needs the state: the transfer has sources)."""
    return {"resumed": _count(run_dir, "fault plan while computing"),
            "peer_failed": _count(run_dir, "peer error: all-reduce failed"),
            "spare_unconfirmed": _count(run_dir, "applied but not confirmed"),
            "stale_aborts": _count(run_dir, "abort request ignored")}


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    base = Path(a.run_dir) if a.run_dir else Path(tempfile.mkdtemp(prefix="ceaseless-liveness-"))
    base.mkdir(parents=True, exist_ok=True)
    ref = await _one(base / "ref", a, fault=False)
    if ref.get("hang") or not ref.get("sha"):
        raise SystemExit(f"the fault-free reference failed: {ref}")
    runs = []
    load = Load(a.load)
    try:
        for i in range(a.repeats):
            r = await _one(base / f"run{i:03d}", a, fault=True)
            r.update(counts(base / f"run{i:03d}"))
            r["bitwise"] = r.get("sha") == ref["sha"] and r.get("final_step") == a.steps - 1
            runs.append(r)
            print(f"run {i + 1}/{a.repeats}: "
                  + ("HANG" if r["hang"] else
                     f"{'bitwise' if r['bitwise'] else 'DIFFERENT'}, lost {r['lost_steps']}, "
                     f"downtime {r['downtime']}, resumed {r['resumed']}, "
                     f"stale aborts ignored {r['stale_aborts']}, {r['wall_s']:.1f}s"),
                  flush=True)
    finally:
        load.stop()
    return {"machine": machine(), "config": {k: v for k, v in vars(a).items()
                                            if not callable(v)},
            "reference": ref, "runs": runs}


def render(res: dict[str, Any]) -> str:
    runs, cfg = res["runs"], res["config"]
    hangs = sum(r["hang"] for r in runs)
    ok = sum(1 for r in runs if not r["hang"] and r["bitwise"] and r["lost_steps"] == 0)
    downs = [d for r in runs if not r["hang"] for d in r["downtime"] if d is not None]
    d = summary(downs)
    return "\n".join([
        SECTION, "",
        machine_line(res["machine"]) + f" Under load: {cfg['load']} busy-loop process(es).",
        "", "```bash",
        f"python -m bench.liveness --repeats {cfg['repeats']} --workers {cfg['workers']} "
        f"--spares {cfg['spares']} --steps {cfg['steps']} --kill-at {cfg['kill_at']} "
        f"--sleep {cfg['sleep']} --after-step {cfg['after_step']} "
        f"--rank0-after-step {cfg['rank0_after_step']} --load {cfg['load']}", "```", "",
        "| | |", "|---|---|",
        f"| runs | {len(runs)} |",
        f"| hangs (not finished in {cfg['run_timeout']:.0f} s) | **{hangs}** |",
        f"| bitwise equal to the fault-free run, no lost step | **{ok} / {len(runs)}** |",
        "| downtime per incident, median (min–max) | "
        + (f"{d['median']:.3f} s ({d['min']:.3f}–{d['max']:.3f})" if d["n"] else "–") + " |",
        f"| runs where a survivor took the resume-in-place path | "
        f"{sum(1 for r in runs if r.get('resumed'))} |",
        f"| runs with issue 24's preconditions (a survivor's all-reduce failed on the dead "
        f"rank 0 and the spare lost its last confirmation) | "
        f"{sum(1 for r in runs if r.get('peer_failed') and r.get('spare_unconfirmed'))} |",
        f"| runs where a stale abort request was ignored (the second guard) | "
        f"{sum(1 for r in runs if r.get('stale_aborts'))} |", ""])


def run(a: argparse.Namespace) -> int:
    if a.from_json:  # render stored runs again (recounting the logs of runs still on disk)
        res = json.loads(Path(a.from_json).read_text())
        for r in res["runs"]:
            if Path(r["run_dir"], "logs").is_dir():
                r.update(counts(Path(r["run_dir"])))
    else:
        res = asyncio.run(_main(a))
    emit(res, render(res), SECTION, a.json, a.write_doc, DOC)
    bad = [r for r in res["runs"] if r["hang"] or not r["bitwise"] or r["lost_steps"]]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(__name__))
