"""Overhead benchmark: steady-state step time of the example under Ceaseless against the same
loop with plain ``DistributedDataParallel`` and no Ceaseless.

    python -m bench.overhead [--workers 4] [--model 10m] [--steps 30] [--repeats 3]
                             [--bus-servers 3] [--json PATH] [--write-doc]
    ceaseless bench overhead ...        (same options)

Ceaseless runs are `ceaseless up --spares 0` (nats-server, the three services, heartbeats,
the session's own bucketed all-reduce); baseline runs are ``bench/baselines/plain_ddp.py`` started as
one process per rank with a gloo ``env://`` rendezvous on loopback. Same model, corpus,
global batch, micro-batches, optimizer, one intra-op thread per process. Runs alternate
(C D C D …). The step time of a run is the median gap between rank 0's committed steps,
skipping the first ``--warmup`` steps; reported: median and min–max over runs, and the
ratio Ceaseless / DDP computed per pair of neighbouring runs.

``--bus-servers N`` (N > 1, issue 42): the same, but the pair is Ceaseless on a bus of N
clustered nats-servers (`up --bus-servers N`: JetStream replicated, clients given every
server) against Ceaseless on one, alternating in the same invocation; its own section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import config, REPO, emit, fmt, machine, machine_line, summary, main

SECTION = "## Overhead"
BUS_SECTION = "## Overhead of a clustered bus"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default="10m")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bus-servers", type=int, default=1, metavar="N",
                   help="N > 1: compare Ceaseless on N clustered nats-servers against "
                        "Ceaseless on one, instead of against plain DDP")
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def step_time(commits: list[list[float]], warmup: int) -> float:
    ts = [float(t) for s, t in commits if int(s) >= warmup]
    if len(ts) < 3:
        raise RuntimeError(f"too few steps after warm-up {warmup}: {len(ts)}")
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


async def ceaseless_run(d: Path, a: argparse.Namespace, bus_servers: int = 1) -> float:
    from ops.launcher import Cluster

    extra = ["--model", a.model, "--global-batch-size", str(a.global_batch_size),
             "--micro-batch-size", str(a.micro_batch_size), "--bus-servers", str(bus_servers)]
    async with Cluster(d, a.workers, 0, a.steps, extra=extra, timeout=60 + a.steps * 20) as c:
        code = await c.finish()
    if code != 0:
        raise RuntimeError(f"ceaseless run exited {code}:\n{c.output()}")
    for f in (d / "results").glob("*.json"):
        r = json.loads(f.read_text())
        if r.get("rank") == 0:
            return step_time(r["commits"], a.warmup)
    raise RuntimeError(f"no rank-0 result in {d}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ddp_run(d: Path, data: Path, a: argparse.Namespace) -> float:
    d.mkdir(parents=True, exist_ok=True)
    out = d / "ddp.json"
    port = _free_port()
    procs = []
    try:
        for r in range(a.workers):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(a.workers),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "PYTHONPATH": str(REPO)}
            log = open(d / f"rank{r}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.baselines.plain_ddp", "--steps", str(a.steps),
                 "--model", a.model, "--global-batch-size", str(a.global_batch_size),
                 "--micro-batch-size", str(a.micro_batch_size), "--data", str(data),
                 "--out", str(out)], env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=REPO))
            log.close()
        deadline = time.monotonic() + 60 + a.steps * 20
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"plain DDP rank exited {p.returncode}: see {d}")
    finally:
        for p in procs:  # by PID, bounded
            if p.poll() is None:
                p.kill()
                p.wait(5)
    return step_time(json.loads(out.read_text())["commits"], a.warmup)


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    from agent.data import corpus

    if a.steps < a.warmup + 5:
        raise SystemExit("need --steps >= --warmup + 5")
    if a.bus_servers < 1:
        raise SystemExit("need --bus-servers >= 1")
    if a.bus_servers > 1:
        return await bus_all(a)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-bench-"))
    data = corpus.ensure(work / "data", n_tokens=2_000_000, seed=0)  # what `ceaseless up` uses
    cs, ds, ratios = [], [], []
    for r in range(a.repeats):
        # alternate which goes first so neither always runs on a warmer machine
        order = ("ceaseless", "ddp") if r % 2 == 0 else ("ddp", "ceaseless")
        got = {}
        for which in order:
            if which == "ceaseless":
                got[which] = await ceaseless_run(work / f"ceaseless-{r}", a)
            else:
                got[which] = ddp_run(work / f"ddp-{r}", data, a)
        cs.append(got["ceaseless"])
        ds.append(got["ddp"])
        ratios.append(got["ceaseless"] / got["ddp"])
        print(f"[{r + 1}/{a.repeats}] ceaseless {got['ceaseless']:.4f}s/step, ddp "
              f"{got['ddp']:.4f}s/step, ratio {ratios[-1]:.3f}", flush=True)
    return {"benchmark": "overhead", "machine": machine(),
            "config": config(a) | {"command": "python -m bench.overhead " + " ".join(sys.argv[1:])},
            "ceaseless_step_s": summary(cs), "ddp_step_s": summary(ds), "ratio": summary(ratios)}


async def bus_all(a: argparse.Namespace) -> dict[str, Any]:
    """Ceaseless on ``a.bus_servers`` clustered servers against Ceaseless on one, runs
    alternating (which goes first, too), the ratio per pair of neighbouring runs."""
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-bench-"))
    n = a.bus_servers
    many, one, ratios = [], [], []
    for r in range(a.repeats):
        order = (n, 1) if r % 2 == 0 else (1, n)
        got = {k: await ceaseless_run(work / f"bus{k}-{r}", a, k) for k in order}
        many.append(got[n])
        one.append(got[1])
        ratios.append(got[n] / got[1])
        print(f"[{r + 1}/{a.repeats}] {n} servers {got[n]:.4f}s/step, 1 server "
              f"{got[1]:.4f}s/step, ratio {ratios[-1]:.3f}", flush=True)
    return {"benchmark": "overhead-bus", "machine": machine(),
            "config": config(a) | {"command": "python -m bench.overhead " + " ".join(sys.argv[1:])},
            "many_step_s": summary(many), "one_step_s": summary(one), "ratio": summary(ratios)}


def bus_markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    n = c["bus_servers"]
    return "\n".join([
        BUS_SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command']}`. {c['workers']} workers, model `{c['model']}`, global batch "
        f"{c['global_batch_size']} (micro-batch {c['micro_batch_size']}), {c['steps']} steps, "
        f"first {c['warmup']} skipped (a run's step time: the median gap between rank 0's "
        f"commits); {c['repeats']} runs each, alternating, in the same invocation; median "
        "(min–max). Target (issue 42): ratio ≤ 1.02.",
        "", "| bus | step time |", "|---|---|",
        f"| `ceaseless up --bus-servers {n}` (clustered, JetStream R{min(3, n)}) | "
        f"{fmt(res['many_step_s'], 's', 4)} |",
        f"| `ceaseless up` (one nats-server) | {fmt(res['one_step_s'], 's', 4)} |",
        f"| ratio {n} servers / 1 (per pair) | {fmt(res['ratio'], '', 3)} |", ""]) + "\n"


def markdown(res: dict[str, Any]) -> str:
    if res["benchmark"] == "overhead-bus":
        return bus_markdown(res)
    c = res["config"]
    return "\n".join([
        SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command']}`. {c['workers']} workers, model `{c['model']}`, global batch "
        f"{c['global_batch_size']} (micro-batch {c['micro_batch_size']}), {c['steps']} steps, "
        f"first {c['warmup']} skipped; {c['repeats']} runs each, alternating; median (min–max).",
        "", "| loop | step time |", "|---|---|",
        f"| Ceaseless (`ceaseless up`, control plane running) | {fmt(res['ceaseless_step_s'], 's', 4)} |",
        f"| plain DDP, no Ceaseless | {fmt(res['ddp_step_s'], 's', 4)} |",
        f"| ratio Ceaseless / DDP (per pair) | {fmt(res['ratio'], '', 3)} |", ""]) + "\n"


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit(res, markdown(res), BUS_SECTION if a.bus_servers > 1 else SECTION, a.json,
                a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
