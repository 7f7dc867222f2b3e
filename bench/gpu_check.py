"""GPU check (issue 19): the example GPT with its model on CUDA, faults against fault-free runs.

One command on a machine with a GPU (under 8 minutes on one H200):

    python -m bench.gpu_check --json bench/results/gpu-check.json --write-doc

* ``--workers`` pods + ``--spares`` spare sharing the GPU(s) as ``ceaseless up`` places them
  (on one GPU: gloo carrying CUDA tensors), ``--deterministic``: SIGKILL of a worker, SIGKILL
  of rank 0 and SIGSTOP of a worker, each against the fault-free run (bitwise, lost steps,
  downtime);
* NCCL at world size 1 with a spare (``CEASELESS_BACKEND=nccl``): the worker is killed, the
  spare takes over from its shadow copy; against the fault-free NCCL run;
* peak GPU memory and median step time of that NCCL pod against the same script run plainly
  (``python -m examples.train_gpt``, no Ceaseless).

``--device cpu`` runs the same on a machine without a GPU (no NCCL part, no memory figures):
a check of the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, emit, machine, machine_line, main

SECTION = "## GPU"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--fault-at", type=int, default=10, help="the victim's step at the fault")
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (a dry run)")
    p.add_argument("--sleep", type=float, default=0.02,
                   help="fault runs sleep this long per micro-batch: time to aim the fault")
    p.add_argument("--run-dir", help="keep the runs here (default: a temporary dir)")
    p.add_argument("--json", help="write the raw results here")
    p.add_argument("--write-doc", action="store_true", help=f"update {SECTION!r} of docs/benchmarks.md")


def _cmd(a: argparse.Namespace, slow: bool) -> list[str]:
    cmd = [sys.executable, "-m", "examples.train_gpt", "--steps", str(a.steps),
           "--device", a.device, "--deterministic"]
    return cmd + (["--sleep", str(a.sleep)] if slow else [])


def _median_gap(commits: list) -> float | None:
    gaps = [b[1] - a_[1] for a_, b in zip(commits, commits[1:]) if b[0] == a_[0] + 1]
    return statistics.median(gaps[len(gaps) // 5:]) if gaps else None  # skip the warm-up


def _results(run_dir: Path) -> dict[str, dict]:
    out = {}
    for p in sorted((run_dir / "results").glob("*.json")):
        out[p.stem] = json.loads(p.read_text())
    return out


async def _job(run_dir: Path, a: argparse.Namespace, workers: int, spares: int,
               fault: str | None = None, victim: int = 1) -> dict[str, Any]:
    from ops.launcher import Cluster

    stopped: list[int] = []
    out: dict[str, Any] = {"workers": workers, "spares": spares, "fault": fault,
                           "victim": victim if fault else None}
    try:
        async with Cluster(run_dir, workers, spares, a.steps, cmd=_cmd(a, bool(fault)),
                           timeout=300) as c:
            if fault:
                await c.wait_spares(spares)
                await c.wait_rank_step(victim, a.fault_at)
                await c.wait_for(lambda: any(h.role.value == "spare" and h.step >= a.fault_at
                                             for h in c.hb.values()), 60, "the spare to follow")
                pid = c.member(victim).pid
                if fault == "stop":
                    os.kill(pid, signal.SIGSTOP)
                    stopped.append(pid)
                else:
                    os.kill(pid, signal.SIGKILL)
            code = await c.finish(300)
            s = c.summary()
    finally:
        for pid in stopped:  # the scaler fences (kills) it; make sure
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    res = _results(run_dir)
    out.update(exit_code=code, final_step=s["final_step"], sha=s["param_sha256"],
               lost_steps=s["lost_steps"], incidents=s["incidents"],
               peak_mem={p: r.get("cuda_max_memory_allocated") for p, r in res.items()},
               step_s={p: _median_gap(r.get("commits", [])) for p, r in res.items()})
    return out


def _plain(run_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    env.update(CEASELESS_RUN_DIR=str(run_dir), PYTHONPATH=str(REPO))
    subprocess.run(_cmd(a, False), cwd=REPO, env=env, check=True, timeout=300,
                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    r = json.loads((run_dir / "results" / "local.json").read_text())
    return {"sha": r["param_sha256"], "peak_mem": r.get("cuda_max_memory_allocated"),
            "step_s": _median_gap(r.get("commits", []))}


async def _main(a: argparse.Namespace) -> dict[str, Any]:
    base = Path(a.run_dir) if a.run_dir else Path(tempfile.mkdtemp(prefix="ceaseless-gpu-"))
    t0 = time.monotonic()
    res: dict[str, Any] = {"machine": machine(), "config": {k: v for k, v in vars(a).items()
                                                           if not callable(v)}}
    try:
        import torch

        if torch.cuda.is_available():
            res["gpu"] = {"name": torch.cuda.get_device_name(0),
                          "count": torch.cuda.device_count(),
                          "nccl": ".".join(map(str, torch.cuda.nccl.version()))}
    except Exception:
        pass
    res["plain"] = _plain(base / "plain", a)
    res["ref"] = await _job(base / "ref", a, a.workers, 0)
    res["faults"] = [await _job(base / f"{f}{v}", a, a.workers, a.spares, f, v)
                     for f, v in (("kill", 1), ("kill", 0), ("stop", 1))]
    if a.device != "cpu":
        saved = os.environ.get("CEASELESS_BACKEND")
        os.environ["CEASELESS_BACKEND"] = "nccl"
        try:
            res["nccl_ref"] = await _job(base / "nccl-ref", a, 1, 0)
            res["nccl_kill"] = await _job(base / "nccl-kill", a, 1, 1, "kill", 0)
        finally:
            if saved is None:
                os.environ.pop("CEASELESS_BACKEND", None)
            else:
                os.environ["CEASELESS_BACKEND"] = saved
    res["wall_s"] = time.monotonic() - t0
    return res


def _mib(b: Any) -> str:
    return "–" if not b else f"{b / 2**20:.0f} MiB"


def render(res: dict[str, Any]) -> str:
    cfg, ref = res["config"], res["ref"]
    gpu = res.get("gpu")
    lines = [SECTION, "", machine_line(res["machine"])
             + (f" GPU: {gpu['count']}× {gpu['name']}, NCCL {gpu['nccl']}." if gpu else
                " No GPU (a dry run on the CPU)."),
             "", "```bash", f"python -m bench.gpu_check --workers {cfg['workers']} --spares "
             f"{cfg['spares']} --steps {cfg['steps']} --device {cfg['device']}", "```", "",
             f"The example GPT (`tiny`), `--device {cfg['device']} --deterministic`, "
             f"{cfg['steps']} steps; fault runs sleep {cfg['sleep']} s per micro-batch (same "
             "numerics). One run per row: a correctness check, not a benchmark "
             f"(total {res['wall_s']:.0f} s).", "",
             "| run | result vs fault-free | lost steps | downtime |", "|---|---|---|---|"]
    rows = [(f"{cfg['workers']} pods + {cfg['spares']} spare, SIGKILL rank {f['victim']}"
             if f["fault"] == "kill" else
             f"{cfg['workers']} pods + {cfg['spares']} spare, SIGSTOP rank {f['victim']}", f, ref)
            for f in res["faults"]]
    if "nccl_kill" in res:
        rows.append(("NCCL, 1 pod + 1 spare, SIGKILL the pod", res["nccl_kill"], res["nccl_ref"]))
    for name, f, r in rows:
        same = f["sha"] is not None and f["sha"] == r["sha"] and f["final_step"] == cfg["steps"] - 1
        downs = [i["downtime"] for i in f["incidents"] if i.get("downtime") is not None]
        lines.append(f"| {name} | {'**bitwise equal**' if same else '**DIFFERENT**'} | "
                     f"{f['lost_steps']} | "
                     + (", ".join(f"{d:.3f} s" for d in downs) if downs else "–") + " |")
    if "nccl_ref" in res:
        p, n = res["plain"], res["nccl_ref"]
        mem = next(iter(n["peak_mem"].values()), None)
        st = next(iter(n["step_s"].values()), None)
        lines += ["", "One pod on its GPU (NCCL, world size 1) against the same script run "
                  "plainly:", "", "| | plain script | Ceaseless | ratio |", "|---|---|---|---|",
                  f"| peak GPU memory (`max_memory_allocated`) | {_mib(p['peak_mem'])} | "
                  f"{_mib(mem)} | "
                  + (f"{mem / p['peak_mem']:.3f}" if mem and p["peak_mem"] else "–") + " |",
                  "| median step time | "
                  + (f"{p['step_s'] * 1e3:.1f} ms" if p["step_s"] else "–") + " | "
                  + (f"{st * 1e3:.1f} ms" if st else "–") + " | "
                  + (f"{st / p['step_s']:.3f}" if st and p["step_s"] else "–") + " |"]
    lines += ["", "Not covered on one GPU: NCCL between pods (NCCL refuses two ranks on one "
              "device; `tests/test_cuda.py::test_cuda_one_gpu_per_pod_survives_a_kill_over_nccl` "
              "runs it on a 2+ GPU node).", ""]
    return "\n".join(lines)


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(_main(a))
    emit(res, render(res), SECTION, a.json, a.write_doc)
    ok = all(f["sha"] == res["ref"]["sha"] and not f["lost_steps"] for f in res["faults"])
    if "nccl_kill" in res:
        ok = ok and res["nccl_kill"]["sha"] == res["nccl_ref"]["sha"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(__name__))
