"""Process-group init benchmark: gloo group creation with the NATS-backed c10d store
(``agent.store.NatsStore``) against a plain ``TCPStore`` rendezvous, and the time to rebuild
the group for a new generation.

    python -m bench.init_bench [--world-sizes 4,8,16] [--repeats 3] [--generations 4]
                               [--json PATH] [--svg PATH] [--write-doc]
    ceaseless bench init ...        (same options)

For each world size W, W processes are started once (on this machine; interpreter start and
``import torch`` are not measured) and connected to one nats-server on 127.0.0.1 (the
``StoreLoop`` connection: the agent's runtime holds it before any group is built). Then, for
each repeat, both stores in turn (order alternating per repeat), all ranks released at the
same wall-clock instant (a go file the orchestrator writes; the processes only wait on it):

* **create**: from the go instant to the rank's group being built (``agent.collectives.
  make_group``, gloo), the slowest rank; with NATS: ``NatsStore`` under a fresh prefix; with
  TCP: rank 0 starts a ``TCPStore`` server on a free port, the others connect to it, the
  group is built over a ``PrefixStore`` of it (as ``init_process_group`` does);
* **rebuild**: after an all-reduce barrier on the current group, the time to build the group
  of the next generation (NATS: a new prefix on the same connection, as the agent does; TCP:
  a new ``PrefixStore`` on the same ``TCPStore``, which only works while rank 0, its host,
  is alive), the slowest rank, ``--generations - 1`` times per repeat.

Each new group is checked with an all-reduce. Medians and min–max over the repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, config, emit_with_plot, fmt, machine, machine_line, summary, main

SECTION = "## Process-group init"
KINDS = ("nats", "tcp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-sizes", default="4,8,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--generations", type=int, default=4,
                   help="groups per repeat and store: 1 creation + N-1 rebuilds")
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--svg", help="write the plot here (default with --write-doc: "
                                 "docs/img/bench-init.svg)")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


# ---------------------------------------------------------------------------- worker
def _wait_file(p: Path, timeout: float) -> str:
    end = time.monotonic() + timeout
    while not p.exists():
        if time.monotonic() > end:
            raise TimeoutError(f"{p} did not appear")
        time.sleep(0.002)
    for _ in range(100):
        t = p.read_text()
        if t.endswith("\n"):
            return t
        time.sleep(0.002)
    raise RuntimeError(f"{p}: incomplete")


def worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from agent.collectives import make_group
    from agent.store import StoreLoop
    from plumbing.bus import Credentials

    torch.set_num_threads(1)
    d = Path(a.dir)
    t = time.time()
    sl = StoreLoop(a.nats, job=a.job, creds=Credentials.load(a.creds), name=f"init-{a.rank}")
    connect = time.time() - t
    out = open(d / f"rank{a.rank}.jsonl", "a", buffering=1)
    out.write(json.dumps({"rank": a.rank, "nats_connect_s": connect}) + "\n")
    (d / f"ready.{a.rank}").write_text("1\n")
    x = torch.ones(4)
    phase = 0
    while True:
        go = json.loads(_wait_file(d / f"go.{phase}", 600))
        if go.get("stop"):
            break
        kind, W, rank = go["kind"], a.world, a.rank
        while time.time() < go["t"]:
            time.sleep(0.0005)
        t_go = time.time()
        tcp = None
        times = []
        for g in range(1, a.generations + 1):
            if g == 1:
                t0 = t_go
            else:
                pg.allreduce(x).wait()  # barrier on the current generation
                t0 = time.time()
            if kind == "nats":
                # W in the prefix: one nats-server serves every world size of the run, and a
                # key of an earlier size would name peers that have exited
                store = sl.store(f"w{W}.p{phase}.g{g}.", timeout=60)
            else:
                if tcp is None:
                    tcp = dist.TCPStore("127.0.0.1", go["port"], W, is_master=rank == 0,
                                        timeout=__import__("datetime").timedelta(seconds=60),
                                        wait_for_workers=False)
                store = dist.PrefixStore(f"g{g}/", tcp)
            new = make_group(store, rank, W, timeout_s=60, backend="gloo")
            t1 = time.time()
            y = torch.ones(4)
            new.allreduce(y).wait()
            assert float(y[0]) == W
            times.append(t1 - t0)
            pg = new
        out.write(json.dumps({"rank": rank, "phase": phase, "kind": kind, "times": times})
                  + "\n")
        pg.allreduce(x).wait()
        del pg, new
        (d / f"done.{phase}.{rank}").write_text("1\n")
        phase += 1
    sl.close()
    out.close()


# ---------------------------------------------------------------------------- orchestrator
def one_size(d: Path, W: int, a: argparse.Namespace, srv, creds_path: Path) -> list[dict]:
    from services.common.natsserver import free_port

    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = []
    pidfile = d / "init.pids"
    try:
        for r in range(W):
            log = open(d / f"rank{r}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.init_bench", "worker", "--dir", str(d), "--rank",
                 str(r), "--world", str(W), "--nats", srv.url, "--creds", str(creds_path),
                 "--job", "initbench", "--generations", str(a.generations)],
                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL))
            log.close()
            with open(pidfile, "a") as f:
                f.write(f"rank{r} {procs[-1].pid}\n")

        def wait_all(names: list[str], timeout: float) -> None:
            end = time.monotonic() + timeout
            while not all((d / n).exists() for n in names):
                for r, p in enumerate(procs):
                    if p.poll() is not None:
                        raise RuntimeError(f"init worker {r} exited {p.returncode}: "
                                           f"{(d / f'rank{r}.log').read_text()[-2000:]}")
                if time.monotonic() > end:
                    raise TimeoutError(f"init bench W={W}: waiting for {names[:3]}…")
                time.sleep(0.01)

        wait_all([f"ready.{r}" for r in range(W)], 120 + 10 * W)
        phase = 0
        plan = []
        for rep in range(a.repeats):
            for kind in (KINDS if rep % 2 == 0 else KINDS[::-1]):
                plan.append((rep, kind))
                go = {"kind": kind, "t": time.time() + 0.3, "port": free_port(), "repeat": rep}
                tmp = d / f"go.{phase}.tmp"
                tmp.write_text(json.dumps(go) + "\n")
                os.replace(tmp, d / f"go.{phase}")
                wait_all([f"done.{phase}.{r}" for r in range(W)], 120)
                phase += 1
        (d / f"go.{phase}").write_text(json.dumps({"stop": True}) + "\n")
        for p in procs:
            p.wait(30)
    finally:
        for p in procs:  # by PID
            if p.poll() is None:
                p.kill()
                p.wait(5)
    recs = [json.loads(x) for r in range(W)
            for x in (d / f"rank{r}.jsonl").read_text().splitlines() if x.strip()]
    connect = [x["nats_connect_s"] for x in recs if "nats_connect_s" in x]
    out = []
    for ph, (rep, kind) in enumerate(plan):
        rs = [x for x in recs if x.get("phase") == ph]
        G = len(rs[0]["times"])
        per_gen = [max(x["times"][g] for x in rs) for g in range(G)]
        out.append({"world": W, "repeat": rep, "kind": kind, "create_s": per_gen[0],
                    "create_median_rank_s": sorted(x["times"][0] for x in rs)[len(rs) // 2],
                    "rebuild_s": per_gen[1:], "nats_connect_s": max(connect)})
    return out


def run_all(a: argparse.Namespace) -> dict[str, Any]:
    from services.common.natsserver import NatsServer, write_credentials

    sizes = [int(x) for x in a.world_sizes.split(",") if x.strip()]
    if a.generations < 2:
        raise SystemExit("need --generations >= 2 (a creation and at least one rebuild)")
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    creds_path = work / "creds.json"
    srv = NatsServer.start(work / "nats", creds=write_credentials(creds_path))
    (work / "nats.pids").write_text(f"nats-server {srv.proc.pid}\n")
    runs = []
    try:
        for W in sizes:
            rs = one_size(work / f"w{W}", W, a, srv, creds_path)
            runs += rs
            for kind in KINDS:
                k = [x for x in rs if x["kind"] == kind]
                print(f"W={W:>2} {kind:<4}: create {fmt(summary(x['create_s'] for x in k))}, "
                      f"rebuild {fmt(summary(v for x in k for v in x['rebuild_s']))}", flush=True)
    finally:
        srv.stop()
    agg = {}
    for W in sizes:
        agg[W] = {}
        for kind in KINDS:
            k = [x for x in runs if x["world"] == W and x["kind"] == kind]
            agg[W][kind] = {"create_s": summary(x["create_s"] for x in k),
                            "rebuild_s": summary(v for x in k for v in x["rebuild_s"])}
        n, t = agg[W]["nats"], agg[W]["tcp"]
        agg[W]["ratio_create_nats_tcp"] = (n["create_s"]["median"] / t["create_s"]["median"]
                                           if t["create_s"]["median"] else None)
        agg[W]["ratio_rebuild_nats_tcp"] = (n["rebuild_s"]["median"] / t["rebuild_s"]["median"]
                                            if t["rebuild_s"]["median"] else None)
        agg[W]["nats_connect_s"] = max(x["nats_connect_s"] for x in runs if x["world"] == W)
    return {"benchmark": "init", "machine": machine(),
            "config": config(a) | {"command": "python -m bench.init_bench "
                                   + " ".join(sys.argv[1:])},
            "runs": runs, "summary": {str(k): v for k, v in agg.items()}}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    out = [SECTION, "", machine_line(res["machine"]),
           f"Command: `{c['command']}`. W processes on this machine, gloo on 127.0.0.1, one "
           f"nats-server; {c['repeats']} repeats, stores alternating; per repeat and store one "
           f"creation and {c['generations'] - 1} rebuilds; each figure is the slowest rank, "
           "median (min–max) over repeats (rebuilds: over every rebuild).", "",
           "| world size | create, NATS store | create, TCPStore | ratio | rebuild, NATS store "
           "| rebuild, TCPStore (same store, new prefix) | ratio | NATS connect (once per "
           "process, not in the figures) |", "|---|---|---|---|---|---|---|---|"]
    for W, a in res["summary"].items():
        r1, r2 = a["ratio_create_nats_tcp"], a["ratio_rebuild_nats_tcp"]
        out.append(f"| {W} | {fmt(a['nats']['create_s'], 's', 4)} | "
                   f"{fmt(a['tcp']['create_s'], 's', 4)} | {r1:.2f} | "
                   f"{fmt(a['nats']['rebuild_s'], 's', 4)} | {fmt(a['tcp']['rebuild_s'], 's', 4)} "
                   f"| {r2:.2f} | {a['nats_connect_s']:.3f} s |")
    out += ["", "![init](img/bench-init.svg)"]
    return "\n".join(out) + "\n"


def plot(res: dict[str, Any]) -> str:
    from bench.report import svg

    groups, vals = [], {}
    for W, a in res["summary"].items():
        g = f"world size {W}"
        groups.append(g)
        vals[(g, "create, NATS store")] = a["nats"]["create_s"]
        vals[(g, "create, TCPStore")] = a["tcp"]["create_s"]
        vals[(g, "rebuild, NATS store")] = a["nats"]["rebuild_s"]
        vals[(g, "rebuild, TCPStore")] = a["tcp"]["rebuild_s"]
    return svg.bars(f"Gloo process-group init ({res['machine']['cores']} CPU cores)", groups,
                    ["create, NATS store", "create, TCPStore", "rebuild, NATS store",
                     "rebuild, TCPStore"], vals, "seconds", log=True,
                    note=f"{res['machine']['date']}; slowest rank; "
                         f"{res['config']['repeats']} repeats")


def run(a: argparse.Namespace) -> int:
    res = run_all(a)
    return emit_with_plot(a, res, markdown(res), SECTION, "bench-init.svg", plot)


def _worker(argv: list[str]) -> None:
    """One rank: a mode of this benchmark's command line."""
    p = argparse.ArgumentParser(description="one rank")
    for k in ("--dir", "--nats", "--creds", "--job"):
        p.add_argument(k, required=True)
    for k in ("--rank", "--world", "--generations"):
        p.add_argument(k, type=int, required=True)
    worker(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main(__name__, modes={"worker": _worker}))
