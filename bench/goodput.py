"""Goodput: fixed-length runs with a fault every K seconds; goodput = useful time / wall time.

    python -m bench.goodput [--systems ceaseless,ckpt20,torchft1000] [--duration 120]
                            [--fault-every 30] [--workers 4] [--model small] [--repeats 1]
                            [--seed 0] [--json PATH] [--svg PATH] [--write-doc]
    ceaseless bench goodput ...        (same options)

The systems are those of ``bench recovery``: ``ceaseless`` (a real `ceaseless up` cluster with
one hot spare per fault), ``ckptN`` (plain DDP under ``torchrun --max-restarts``, ``torch.save``
every N steps, ``bench/baselines/ckpt_restart.py``; torchrun restarts every worker and they reload the
last checkpoint) and ``torchftMS`` (torchft, one process per replica group, lighthouse
heartbeat timeout MS ms, ``bench/baselines/torchft_bench.py``; the killed replica is not replaced: the
group continues with fewer replicas and the same global batch). The default is every system
whose dependencies are installed (torchft is optional).

Each run starts the system with far more steps than it can train in the run, waits until it
has trained ``--warmup-steps`` steps (Ceaseless: and every spare has registered), and starts
the clock at that commit (``t0``). Every ``--fault-every`` seconds after ``t0`` it SIGKILLs
one worker, never rank 0 (the victims are drawn from ``--seed``, the same list for every
system in a repeat; torchft: the next live replica when the drawn one is already gone). At
``t0 + --duration`` the run is stopped. From the commit log of every process (``step
wall-time``; Ceaseless: written by the example under ``python -m bench.goodput worker``, a
wrapper that logs each step ``Session.step()`` committed; the baselines: their own files):

* **steps committed**: distinct steps the job holds at the end of the window, counted once
  however often they were recomputed (the final step minus the step at ``t0``; for a
  checkpoint-restart job that is still restarting at the end, the last checkpoint);
* **recomputed**: steps committed again after a fault rolled the job back;
* **step time** (fault-free, same run): the median time between two consecutive commits of
  one process with no fault between them (torchft: only while every replica is in the
  quorum), over the whole window, so that a load drift on a shared machine moves it and the
  wall time alike; ``--step-time first``: only the steps before the first fault (the JSON
  has both, and both goodputs);
* **goodput** = steps committed x step time / (end - ``t0``); 1.0 means no time was lost.

The ratio of each system's goodput to the ``ckpt20`` baseline's (else the first ``ckptN``)
is given per repeat and as the ratio of the medians. The order of the systems rotates per
repeat (A B C, B C A, ...). ``--write-doc`` replaces the ``## Goodput`` section of
docs/benchmarks.md and writes docs/img/bench-goodput.svg.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from bench.common import (main, REPO, cmdline, config, emit_with_plot, fmt, machine, machine_line,
                          summary)
from bench.recovery import label
from bench.baselines.torchft_bench import TORCHFT_TIMEOUT
from schemas.timeouts import DEFAULTS as TIMEOUTS

SECTION = "## Goodput"
BIG_STEPS = 1_000_000  # a run never finishes: it is stopped at --duration
BASELINE = "ckpt20"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systems", default=None,
                   help="comma-separated: ceaseless, ckptN (torchrun --max-restarts, torch.save "
                        "every N steps), torchftMS (torchft, heartbeat timeout MS ms); default: "
                        "ceaseless,ckpt20 and torchft1000 when torchft is installed")
    p.add_argument("--duration", type=float, default=120.0,
                   help="seconds of each run, from the clock start (after warm-up) to the stop")
    p.add_argument("--fault-every", type=float, default=30.0,
                   help="seconds between faults (SIGKILL of a worker that is not rank 0)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--spares", type=int, default=None,
                   help="Ceaseless hot spares (default: one per fault of the run)")
    p.add_argument("--model", default="small", help="example model: tiny | small | 10m")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-steps", type=int, default=3,
                   help="steps trained before the clock starts (first-step costs excluded)")
    p.add_argument("--step-time", choices=["run", "first"], default="run",
                   help="fault-free step time of the goodput: median time between consecutive "
                        "commits with no fault between them and (torchft) every replica in the "
                        "quorum, over the whole run (run) or only before the first fault "
                        "(first); the JSON has both")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--fault-timeout", type=float, default=TIMEOUTS["fault_timeout"],
                   help="Ceaseless heartbeat timeout")
    p.add_argument("--corpus-tokens", type=int, default=2_000_000,
                   help="synthetic corpus every system trains on (as `ceaseless up` generates)")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun, for ckptN")
    p.add_argument("--torchft-timeout", type=float, default=TORCHFT_TIMEOUT,
                   help="torchft: timeout of its collectives (ProcessGroupGloo and Manager), s")
    p.add_argument("--start-timeout", type=float, default=300.0,
                   help="seconds a system may take to reach the clock start")
    p.add_argument("--svg", help="write the plot here (default with --write-doc: "
                                 "docs/img/bench-goodput.svg)")
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


# ---------------------------------------------------------------------------- Ceaseless worker
def worker(argv: list[str]) -> None:
    """``python -m bench.goodput worker [train_gpt args]``: the example GPT of `ceaseless up`,
    with every committed step appended to ``$CEASELESS_RUN_DIR/commits/<pod>.txt`` as
    ``step wall-time generation`` (line-buffered: a run is stopped, not finished, so the
    session's own result file is never written)."""
    import agent

    out = Path(os.environ.get("CEASELESS_RUN_DIR", ".")) / "commits"
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Any] = {}
    orig = agent.Session.step

    def step(self: Any, *args: Any, **kwargs: Any) -> bool:
        ok = orig(self, *args, **kwargs)
        if ok:
            f = files.get(self.pod)
            if f is None:
                f = files[self.pod] = open(out / f"{self.pod}.txt", "a", buffering=1)
                f.write(f"# pid {os.getpid()}\n")
            f.write(f"{self.last_committed} {time.time():.6f} {self.generation}\n")
        return ok

    agent.Session.step = step  # type: ignore[method-assign]
    from examples import train_gpt

    train_gpt.main(argv)


def read_ceaseless(run_dir: Path) -> dict[str, list[tuple[int, float, int]]]:
    out: dict[str, list[tuple[int, float, int]]] = {}
    for f in sorted((run_dir / "commits").glob("*.txt")):
        cs = []
        for ln in f.read_text().splitlines():
            p = ln.split()
            if len(p) == 3 and p[0] != "#":
                try:
                    cs.append((int(p[0]), float(p[1]), int(p[2])))
                except ValueError:
                    pass  # a torn last line
        out[f.stem] = cs
    return out


# ---------------------------------------------------------------------------- analysis
Event = tuple[float, int, int]  # (wall time, step, episode)


def progress(events: list[Event], t: float) -> tuple[int, int | None, float | None]:
    """The job's step at time ``t``: within an episode (Ceaseless generation, torchrun
    attempt) the highest step committed; a newer episode starts from its first commit (a
    rollback shows as a lower step). Returns (step, episode, time of its last commit)."""
    ep, prog, last = None, -1, None
    for tt, s, e in sorted(events):
        if tt > t:
            break
        if ep is None or e > ep:
            ep, prog, last = e, s, tt
        elif e == ep:
            if s >= prog:
                prog, last = s, tt
    return prog, ep, last


def step_gaps(logs: list[list[Event]], lo: float, hi: float,
              faults: list[float]) -> list[float]:
    """Times between consecutive commits of one process, both in [lo, hi], the step
    advancing, no fault in between (so a recovery or restart gap is never one)."""
    out = []
    for log in logs:
        cs = sorted((t, s) for t, s, _ in log if lo <= t <= hi)
        out += [b[0] - a[0] for a, b in zip(cs, cs[1:])
                if b[1] > a[1] and not any(a[0] < f <= b[0] for f in faults)]
    return out


def analyse(logs: list[list[Event]], t0: float, t_end: float, faults: list[float],
            lost_state: Callable[[int], int] | None = None, step_time: str = "run",
            full_logs: list[list[Event]] | None = None) -> dict[str, Any]:
    """``logs``: one commit list per process. ``lost_state(step)``: the step a job that was
    at ``step`` falls back to when a fault hits it (checkpoint-restart: the last checkpoint);
    applied when no commit came after the last fault. ``step_time``: the fault-free step
    time is the median over the whole window (``run``) or before the first fault
    (``first``); ``full_logs``: the commits made at full strength, for that median (torchft:
    those with every replica in the quorum)."""
    events = [e for log in logs for e in log if e[0] <= t_end]
    if not events:
        raise RuntimeError("no step committed")
    start, _, _ = progress(events, t0)
    final, _, last = progress(events, t_end)
    if lost_state is not None and faults and last is not None and max(faults) > last:
        final = lost_state(final)
    full = logs if full_logs is None else full_logs
    first = step_gaps(full, t0, min(faults) if faults else t_end, faults)
    run = step_gaps(full, t0, t_end, faults)
    if not first:
        raise RuntimeError("no fault-free step between the clock start and the first fault")
    med_first, med_run = statistics.median(first), statistics.median(run)
    med = med_first if step_time == "first" else med_run
    # recomputed: steps an episode committed that an earlier one had already committed, plus
    # a process committing the same step twice within one episode
    seen: set[int] = set()
    redone = 0
    for ep in sorted({e for _, _, e in events}):
        steps = {s for _, s, e in events if e == ep}
        redone += len(steps & seen)
        seen |= steps
    dup = 0
    for log in logs:
        by_ep: dict[int, list[int]] = {}
        for t, s, e in log:
            if t <= t_end:
                by_ep.setdefault(e, []).append(s)
        dup = max([dup] + [len(v) - len(set(v)) for v in by_ep.values()])
    steps = max(0, final - start)
    wall = t_end - t0
    return {"goodput": steps * med / wall, "steps_committed": steps, "start_step": start,
            "final_step": final, "recomputed_steps": redone + dup, "median_step_s": med,
            "median_step_first_s": med_first, "median_step_run_s": med_run,
            "goodput_first": steps * med_first / wall, "goodput_run": steps * med_run / wall,
            "step_time": step_time, "window_s": wall, "useful_s": steps * med,
            "t0": t0, "t_end": t_end}


def _sleep_until(t: float) -> float:
    return max(0.0, t - time.time())


def clock_start(logs: list[list[Event]], warmup: int) -> float | None:
    """The last commit so far once the job has committed step ``warmup - 1``."""
    events = [e for log in logs for e in log]
    if not events or max(s for _, s, _ in events) < warmup - 1:
        return None
    return max(t for t, _, _ in events)


def _alive(pid: int | None, marker: str) -> bool:
    if not pid:
        return False
    try:
        st = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return st.split(")")[-1].split()[0] not in ("Z", "X") and marker in cmd


# ---------------------------------------------------------------------------- Ceaseless
async def run_ceaseless(d: Path, a: argparse.Namespace, data: Path,
                        victims: list[int]) -> dict[str, Any]:
    import json

    from ops.launcher import Cluster

    n_faults = len(victims)
    spares = a.spares if a.spares is not None else max(1, n_faults)
    extra = ["--global-batch-size", str(a.global_batch_size),
             "--micro-batch-size", str(a.micro_batch_size),
             "--fault-timeout", str(a.fault_timeout)]
    cmd = [sys.executable, "-m", "bench.goodput", "worker", "--steps", str(BIG_STEPS),
           "--global-batch-size", str(a.global_batch_size),
           "--micro-batch-size", str(a.micro_batch_size), "--model", a.model,
           "--data", str(data)]
    faults: list[float] = []
    killed: set[int] = set()
    async with Cluster(d, a.workers, spares, BIG_STEPS, extra=extra, cmd=cmd,
                       timeout=a.start_timeout + a.duration + 120) as c:
        await c.wait_spares(spares, a.start_timeout)
        deadline = time.monotonic() + a.start_timeout
        while (t0 := clock_start(_ceaseless_logs(d), a.warmup_steps)) is None:
            if c.proc.poll() is not None:
                raise RuntimeError(f"ceaseless up exited {c.proc.returncode}:\n{c.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ceaseless: no step {a.warmup_steps - 1} in "
                                   f"{a.start_timeout}s:\n{c.output()}")
            await asyncio.sleep(0.05)
        t_end = t0 + a.duration
        for i, rank in enumerate(victims):
            await asyncio.sleep(_sleep_until(t0 + (i + 1) * a.fault_every))

            def target() -> Any:
                now = time.time()
                live = [h for h in c.hb.values() if h.rank == rank and h.pid
                        and h.role.value == "worker" and h.state.value == "training"
                        and h.pid not in killed and now - h.ts < 2.0]
                spare = spares == 0 or any(h.role.value == "spare" and now - h.ts < 2.0
                                           for h in c.hb.values())
                return max(live, key=lambda h: h.generation) if live and spare else None

            # the victim is the live member at that rank (after the previous recovery), with
            # a spare there to take its place
            h = None
            while time.time() < t_end and (h := target()) is None:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"ceaseless up exited {c.proc.returncode}:\n"
                                       f"{c.output()}")
                await asyncio.sleep(0.02)
            if h is None:
                break
            os.kill(h.pid, signal.SIGKILL)
            faults.append(time.time())
            killed.add(h.pid)
            print(f"  ceaseless: fault {i + 1}/{n_faults} at +{faults[-1] - t0:.1f}s: SIGKILL "
                  f"rank {rank} ({h.pod})", flush=True)
        await asyncio.sleep(_sleep_until(t_end) + 0.5)  # commits up to t_end are on disk
    logs = _ceaseless_logs(d)
    res = analyse(logs, t0, t_end, faults, step_time=a.step_time)
    try:
        summ = json.loads((d / "summary.json").read_text())
    except (OSError, ValueError):
        summ = {}
    res.update(faults=len(faults), fault_s=[round(f - t0, 3) for f in faults],
               victims=victims[:len(faults)], spares=spares,
               lost_steps=summ.get("lost_steps"))
    return res


def _ceaseless_logs(d: Path) -> list[list[Event]]:
    return [[(t, s, g) for s, t, g in cs] for cs in read_ceaseless(d).values()]


# ---------------------------------------------------------------------------- checkpoint-restart
def run_ckpt(d: Path, a: argparse.Namespace, every: int, data: Path,
             victims: list[int]) -> dict[str, Any]:
    from bench.baselines import ckpt_restart as cr
    from services.common.natsserver import free_port

    d.mkdir(parents=True, exist_ok=True)
    ns = argparse.Namespace(**(vars(a) | {"steps": BIG_STEPS,
                                          "max_restarts": len(victims) + 3}))
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "OMP_NUM_THREADS": "1"}
    out = open(d / "torchrun.out", "wb")
    proc = subprocess.Popen(cr.torchrun_cmd(d, ns, every, data, free_port()), env=env,
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    out.close()
    (d / "torchrun.pid").write_text(f"{proc.pid}\n")  # its own session: cleanup by group id
    faults: list[float] = []
    killed: set[int] = set()

    def logs() -> list[list[Event]]:
        return [[(t, s, r["attempt"]) for s, t in r["commits"]] for r in cr.read_commits(d)]

    def check() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"torchrun exited {proc.returncode}: "
                               f"{(d / 'torchrun.out').read_text()[-3000:]}")

    try:
        deadline = time.monotonic() + a.start_timeout
        while (t0 := clock_start(logs(), a.warmup_steps)) is None:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchrun: no step {a.warmup_steps - 1} in "
                                   f"{a.start_timeout}s")
            time.sleep(0.05)
        t_end = t0 + a.duration
        for i, rank in enumerate(victims):
            time.sleep(_sleep_until(t0 + (i + 1) * a.fault_every))
            pid = None
            while time.time() < t_end:  # the victim rank's current process (once restarted)
                check()
                recs = [r for r in cr.read_commits(d) if r["rank"] == rank]
                cur = max(recs, key=lambda r: r["attempt"]) if recs else None
                if cur and cur["pid"] not in killed and _alive(cur["pid"], str(d)):
                    pid = cur["pid"]
                    break
                time.sleep(0.02)
            if pid is None:
                break
            os.kill(pid, signal.SIGKILL)
            faults.append(time.time())
            killed.add(pid)
            print(f"  ckpt{every}: fault {i + 1}/{len(victims)} at +{faults[-1] - t0:.1f}s: "
                  f"SIGKILL rank {rank}", flush=True)
        while time.time() < t_end + 0.5:
            check()
            time.sleep(0.05)
    finally:
        cr._kill_tree(proc)
        cr._kill_workers(d)
    recs = cr.read_commits(d)

    def last_checkpoint(step: int) -> int:
        # the job was hit after its last commit and has not committed since: it holds only
        # the checkpoint the restarted workers load (or will load)
        loaded = [r["loaded_step"] for r in recs if "loaded" in r and r["loaded"] <= t_end
                  and r.get("start", 0.0) > max(faults)]
        if loaded:
            return min(loaded)
        return (step + 1) // every * every - 1

    res = analyse([[(t, s, r["attempt"]) for s, t in r["commits"]] for r in recs], t0, t_end,
                  faults, lost_state=last_checkpoint, step_time=a.step_time)
    res.update(faults=len(faults), fault_s=[round(f - t0, 3) for f in faults],
               victims=victims[:len(faults)], every=every,
               restarts=max(r["attempt"] for r in recs))
    return res


# ---------------------------------------------------------------------------- torchft
def run_torchft(d: Path, a: argparse.Namespace, heartbeat_ms: int, data: Path,
                victims: list[int]) -> dict[str, Any]:
    from bench.baselines import torchft_bench as tb
    from services.common.natsserver import free_port

    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(x for x in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if x)}
    procs: list[subprocess.Popen] = []
    start = tb.starter(d, env, procs)

    lh_port = free_port()
    faults: list[float] = []
    killed: list[int] = []
    W = a.workers
    try:
        # min replicas 1: the group keeps training however many replicas are gone
        lh = Path(sys.executable).parent / "torchft_lighthouse"
        start([str(lh) if lh.exists() else (shutil.which("torchft_lighthouse") or str(lh)),
               "--bind",
               f"127.0.0.1:{lh_port}", "--min_replicas", "1", "--join_timeout_ms", "60000",
               "--quorum_tick_ms", "100", "--heartbeat_timeout_ms", str(heartbeat_ms)],
              "lighthouse")
        workers = [start([sys.executable, "-m", "bench.baselines.torchft_bench", "worker", "--dir", str(d),
                          "--replica", str(r), "--steps", str(BIG_STEPS), "--model", a.model,
                          "--data", str(data), "--global-batch-size", str(a.global_batch_size),
                          "--micro-batch-size", str(a.micro_batch_size), "--min-replicas", "1",
                          "--lighthouse", f"http://127.0.0.1:{lh_port}",
                          "--store-port", str(free_port()),
                          "--pg-timeout", str(a.torchft_timeout)], f"replica{r}")
                   for r in range(W)]

        def logs() -> list[list[Event]]:
            return [[(t, s, 0) for s, t, _ in rec["commits"]]
                    for rec in tb.read_commits(d).values()]

        def check() -> None:
            for r, p in enumerate(workers):
                if r not in killed and p.poll() is not None:
                    raise RuntimeError(f"torchft replica {r} exited {p.returncode}: see {d}")

        deadline = time.monotonic() + a.start_timeout
        t0 = None
        while t0 is None:  # every replica in the quorum, then the warm-up steps
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft: no full quorum at step {a.warmup_steps - 1} in "
                                   f"{a.start_timeout}s")
            recs = tb.read_commits(d)
            full = [[(t, s, 0) for s, t, n in rec["commits"] if n == W] for rec in recs.values()]
            if len(recs) == W and all(full):
                t0 = clock_start(full, a.warmup_steps)
            time.sleep(0.05)
        t_end = t0 + a.duration
        for i, rank in enumerate(victims):
            time.sleep(_sleep_until(t0 + (i + 1) * a.fault_every))
            if time.time() >= t_end:
                break
            live = [r for r in range(1, W) if r not in killed]
            if not live:
                print(f"  torchft{heartbeat_ms}: fault {i + 1}: no replica but 0 left",
                      flush=True)
                break
            r = rank if rank in live else min(live, key=lambda x: (x - rank) % W)
            workers[r].kill()
            faults.append(time.time())
            killed.append(r)
            print(f"  torchft{heartbeat_ms}: fault {i + 1}/{len(victims)} at "
                  f"+{faults[-1] - t0:.1f}s: SIGKILL replica {r}", flush=True)
        while time.time() < t_end + 0.5:
            check()
            time.sleep(0.05)
        full = [[(t, s, 0) for s, t, n in rec["commits"] if n == W]
                for rec in tb.read_commits(d).values()]
        res = analyse(logs(), t0, t_end, faults, step_time=a.step_time, full_logs=full)
    finally:
        for p in procs:  # by PID
            if p.poll() is None:
                p.kill()
                p.wait(5)
    res.update(faults=len(faults), fault_s=[round(f - t0, 3) for f in faults],
               victims=killed, replicas_left=W - len(killed), heartbeat_ms=heartbeat_ms)
    return res


# ---------------------------------------------------------------------------- many runs
def parse_systems(spec: str | None) -> list[str]:
    if spec is None:
        from bench.baselines import torchft_bench

        return ["ceaseless", BASELINE] + ([] if torchft_bench.available() else ["torchft1000"])
    systems = [s.strip() for s in spec.split(",") if s.strip()]
    for s in systems:
        if s != "ceaseless" and not (s.startswith("ckpt") and s[4:].isdigit()) and not (
                s.startswith("torchft") and s[7:].isdigit()):
            raise SystemExit(f"unknown system {s!r}: ceaseless, ckptN (N = checkpoint every "
                             "N steps) or torchftMS (MS = heartbeat timeout, ms)")
    return systems


def fault_times(a: argparse.Namespace) -> list[float]:
    n = max(0, math.ceil(a.duration / a.fault_every) - 1)
    return [(i + 1) * a.fault_every for i in range(n)]


def baseline_of(systems: list[str]) -> str | None:
    if BASELINE in systems:
        return BASELINE
    return next((s for s in systems if s.startswith("ckpt")), None)


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    systems = parse_systems(a.systems)
    if a.repeats < 1 or a.duration <= 0 or a.fault_every <= 0 or a.workers < 2:
        raise SystemExit("need --repeats >= 1, --duration > 0, --fault-every > 0, "
                         "--workers >= 2")
    if a.fault_every >= a.duration:
        raise SystemExit("--fault-every must be shorter than --duration (no fault otherwise)")
    skipped = {}
    if any(x.startswith("torchft") for x in systems):
        from bench.baselines import torchft_bench

        why = torchft_bench.available()
        if why:
            skipped = {x: f"torchft not usable here: {why}" for x in systems
                       if x.startswith("torchft")}
            systems = [x for x in systems if x not in skipped]
            print(f"skipping {', '.join(skipped)}: {why}", flush=True)
    if not systems:
        raise SystemExit("no system to run")
    rng = random.Random(a.seed)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-goodput-"))
    work.mkdir(parents=True, exist_ok=True)
    from agent.data import corpus

    data = corpus.ensure(work / f"data-{a.corpus_tokens}", n_tokens=a.corpus_tokens, seed=0)
    n_faults = len(fault_times(a))
    runs: list[dict[str, Any]] = []
    for r in range(a.repeats):
        victims = [rng.randrange(1, a.workers) for _ in range(n_faults)]  # shared per repeat
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            d = work / f"{system}-{r}"
            t = time.monotonic()
            print(f"[{r + 1}/{a.repeats}] {system}: {a.duration:.0f}s, a fault every "
                  f"{a.fault_every:.0f}s (victim ranks {victims})", flush=True)
            if system == "ceaseless":
                res = await run_ceaseless(d, a, data, victims)
            elif system.startswith("torchft"):
                res = await asyncio.to_thread(run_torchft, d, a, int(system[7:]), data, victims)
            else:
                res = await asyncio.to_thread(run_ckpt, d, a, int(system[4:]), data, victims)
            res.update(system=system, repeat=r, run_dir=str(d),
                       wall_s=round(time.monotonic() - t, 1))
            runs.append(res)
            print(f"[{r + 1}/{a.repeats}] {system:<11} goodput {res['goodput']:.3f}: "
                  f"{res['steps_committed']} steps committed in {res['window_s']:.1f}s, "
                  f"{res['faults']} faults, {res['recomputed_steps']} recomputed, step "
                  f"{res['median_step_s']:.3f}s (run {res['wall_s']:.0f}s)", flush=True)
    return {"benchmark": "goodput", "machine": machine(),
            "config": config(a) | {"command": cmdline("goodput"), "systems_run": ",".join(systems),
                                   "faults_per_run": n_faults},
            "runs": runs, "skipped": skipped, "summary": aggregate(runs, systems)}


def aggregate(runs: list[dict[str, Any]], systems: list[str]) -> dict[str, Any]:
    agg: dict[str, Any] = {}
    base = baseline_of(systems)
    for s in systems:
        rs = [x for x in runs if x["system"] == s]
        agg[s] = {k: summary(x[k] for x in rs if x.get(k) is not None)
                  for k in ("goodput", "faults", "steps_committed", "recomputed_steps",
                            "median_step_s", "lost_steps", "wall_s")}
    for s in systems:
        ratio: dict[str, Any] = {"baseline": base, "of_medians": None,
                                 "per_repeat": summary([])}
        if base is not None:
            b = {x["repeat"]: x["goodput"] for x in runs if x["system"] == base}
            pairs = [x["goodput"] / b[x["repeat"]] for x in runs
                     if x["system"] == s and b.get(x["repeat"])]
            mc, mb = agg[s]["goodput"]["median"], agg[base]["goodput"]["median"]
            ratio.update(of_medians=(mc / mb) if mc is not None and mb else None,
                         per_repeat=summary(pairs))
        agg[s]["ratio_to_baseline"] = ratio
    return agg


def markdown(res: dict[str, Any]) -> str:
    c, m, agg = res["config"], res["machine"], res["summary"]
    systems = [s for s in c["systems_run"].split(",") if s]
    base = baseline_of(systems)
    n_faults = c.get("faults_per_run", 0)
    spares = c.get("spares") if c.get("spares") is not None else max(1, n_faults)
    out = [SECTION, "", machine_line(m),
           f"Command: `{c['command']}`. Each run: {c['duration']:g} s of training (the clock "
           f"starts once {c['warmup_steps']} steps are done), a SIGKILL of a worker that is not "
           f"rank 0 every {c['fault_every']:g} s ({n_faults} faults; victims seeded, the same "
           f"for every system in a repeat), then stopped. {c['workers']} workers, model "
           f"`{c['model']}`, global batch {c['global_batch_size']} (micro-batch "
           f"{c['micro_batch_size']}), AdamW, gloo on CPU, loopback. "
           + (f"Ceaseless: {spares} hot spares (one per fault), heartbeat fault timeout "
              f"{c['fault_timeout']} s. " if "ceaseless" in systems else "")
           + ("Checkpoint-restart: plain DDP under `torchrun --max-restarts` (every worker "
              "restarts and loads rank 0's last `torch.save` of model + optimizer + "
              "scheduler, written every N steps). "
              if any(s.startswith("ckpt") for s in systems) else "")
           + ("torchft: one process per replica group, synchronous quorum, min replicas 1; "
              "the killed replica is not replaced, so the group continues with fewer "
              "replicas (the same global batch over fewer processes: slower steps where each "
              "process has a core of its own). "
              if any(s.startswith("torchft") for s in systems) else "")
           + f"{c['repeats']} repeat(s), systems interleaved with the order rotated per "
           "repeat; median (min–max).", ""]
    for b, why in (res.get("skipped") or {}).items():
        out += [f"Not run: `{b}`: {why}", ""]
    out += [f"| system | goodput | ÷ {base or 'baseline'} goodput | faults | steps committed "
            "| steps recomputed | fault-free step time |", "|---|---|---|---|---|---|---|"]
    for s in systems:
        a = agg[s]
        r = a["ratio_to_baseline"]
        ratio = (f"{r['of_medians']:.2f} (per repeat {fmt(r['per_repeat'], '', 2)})"
                 if r["of_medians"] is not None else "–")
        out.append(f"| {label(s)} | {fmt(a['goodput'], '', 3)} | {ratio} | "
                   f"{fmt(a['faults'], '', 0)} | {fmt(a['steps_committed'], '', 0)} | "
                   f"{fmt(a['recomputed_steps'], '', 0)} | {fmt(a['median_step_s'])} |")
    out += ["", "Goodput = steps committed × fault-free step time ÷ the run's wall time. Steps "
            "committed: distinct steps the job holds at the end (a step recomputed after a "
            "rollback counts once); fault-free step time: the median time between two consecutive "
            "commits of one process with no fault between them (torchft: with every replica in "
            "the quorum), "
            + ("before the first fault" if c.get("step_time") == "first" else
               "over the whole run") + " (the JSON has both estimates). Each system's own step "
            "time, so its per-step overhead is not counted as lost time (`bench overhead` "
            "measures that). Read from every "
            "process's commit log (Ceaseless: the example under `python -m bench.goodput "
            "worker`, which logs each step `Session.step()` commits).", "",
            "![goodput](img/bench-goodput.svg)"]
    return "\n".join(out) + "\n"


def plot(res: dict[str, Any]) -> str:
    from bench.report import svg

    c, agg = res["config"], res["summary"]
    systems = [s for s in c["systems_run"].split(",") if s]
    def short(s: str) -> str:
        return (f"torchrun + ckpt every {s[4:]}" if s.startswith("ckpt")
                else f"torchft, heartbeat {s[7:]} ms" if s.startswith("torchft") else "Ceaseless")

    groups = [short(s) for s in systems]
    vals = {(short(s), "goodput"): agg[s]["goodput"] for s in systems}
    return svg.bars(f"Goodput with a fault every {c['fault_every']:g} s: model {c['model']}, "
                    f"{c['workers']} workers, {res['machine']['cores']} CPU cores", groups,
                    ["goodput"], vals, "useful training time / wall time",
                    note=f"{res['machine']['date']}; {c['duration']:g} s runs, "
                         f"{c['repeats']} repeat(s); SIGKILL of a worker (not rank 0)")


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit_with_plot(a, res, markdown(res), SECTION, "bench-goodput.svg", plot)


if __name__ == "__main__":
    sys.exit(main(__name__, modes={"worker": worker}))
