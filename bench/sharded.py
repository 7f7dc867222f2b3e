"""Sharded models (FSDP2 inside replicas): step time against plain HSDP, per-rank state bytes,
crash downtime with a spare, and the join of a replica, per layout R x K.

    python -m bench.sharded [--layouts 2x2,2x4] [--model tiny] [--steps 40] [--repeats 2]
                            [--json PATH] [--write-doc]
    ceaseless bench sharded ...          (same options)

For each layout RxK (R replicas of K shard ranks), with the example (`examples/train_gpt.py`,
`s.shard(model, *model.blocks)`):

1. **Step time**: ``bench/baselines/plain_hsdp.py`` (R*K processes, TCPStore on loopback, gloo, a 2-D
   mesh ``(replicate R, shard K)``, ``fully_shard`` on every block and the model: HSDP; the
   same model, data, micro-batch assignment and AdamW) against ``ceaseless up --workers R*K
   --shard-size K --spares 0``. Runs alternate (baseline, ceaseless, baseline, ...). A run's
   step time is the median gap between rank 0's commits after ``--warmup`` steps; the ratio
   is Ceaseless / baseline per pair of neighbouring runs.
2. **State bytes per rank**: model + AdamW state of a rank, local shards (sharded) and the
   whole model (unsharded), counted by the baseline; cross-checked with Ceaseless' own
   figures: the generation-1 ``sent`` of rank 0 (its snapshot; the optimizer has no state
   yet, so model only), also for one unsharded run (``--shard-size 1``), and the bytes a
   replacement received after a crash (model + optimizer of its shard).
3. **Crash with a spare**: ``up --workers R*K --shard-size K --spares 1``, SIGKILL of rank 1
   (a shard rank) at ``--kill-step``: the incident's ``downtime`` (summary.json), the lost
   steps, the bytes the replacement received.
4. **Joining a replica**: ``up --workers (R-1)*K --shard-size K`` (scale-up snooze 0), then
   ``Capacity(add, 1)`` on the bus: K cold pods start and join at a step boundary. Measured
   from the event: the plan of the new world (R*K) published; every member's heartbeat at
   that generation in state training; the joiners' first committed step. The pause of the
   members that stayed: rank 0's gap between its commits around the plan's apply_step
   (its Recovery report's ``downtime``) minus the median step time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, config, emit, fmt, machine, machine_line, summary, main

SECTION = "## Sharded models"
RESULTS = REPO / "bench" / "results"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", default="2x2,2x4",
                   help="comma-separated RxK: R replicas of K shard ranks")
    p.add_argument("--model", default="tiny", help="example model: tiny | small | 10m | mlp10m")
    p.add_argument("--steps", type=int, default=40, help="steps of the step-time and crash runs")
    p.add_argument("--warmup", type=int, default=5, help="first steps left out of step times")
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    p.add_argument("--repeats", type=int, default=2, help="step-time runs of each loop")
    p.add_argument("--kill-step", type=int, default=8, help="crash: SIGKILL rank 1 at this step")
    p.add_argument("--join-after", type=int, default=5,
                   help="join: publish the capacity event once rank 0 is at this step")
    p.add_argument("--join-timeout", type=float, default=300.0)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: "
                   "steptime,crash,join,unsharded")
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", default=str(RESULTS / "sharded.json"),
                   help="write the results here (default bench/results/sharded.json)")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def parse_layouts(s: str) -> list[tuple[int, int]]:
    out = []
    for part in s.split(","):
        r, _, k = part.strip().lower().partition("x")
        if not (r.isdigit() and k.isdigit()) or int(r) < 1 or int(k) < 1:
            raise SystemExit(f"--layouts: {part!r} is not RxK (e.g. 2x4)")
        out.append((int(r), int(k)))
    return out


# ---------------------------------------------------------------------------- helpers
def step_time(commits: list[list[float]], warmup: int) -> float:
    ts = [float(t) for s, t in sorted(commits) if int(s) >= warmup]
    if len(ts) < 3:
        raise RuntimeError(f"too few steps after warm-up {warmup}: {len(ts)}")
    return statistics.median(b - a for a, b in zip(ts, ts[1:]))


def example_cmd(a: argparse.Namespace, data: Path, steps: int) -> list[str]:
    """What `up` runs by default, plus ``--threads``."""
    return [sys.executable, "-m", "examples.train_gpt", "--steps", str(steps),
            "--global-batch-size", str(a.global_batch_size),
            "--micro-batch-size", str(a.micro_batch_size), "--model", a.model,
            "--data", str(data), "--threads", str(a.threads)]


def up_extra(a: argparse.Namespace) -> list[str]:
    return ["--model", a.model, "--global-batch-size", str(a.global_batch_size),
            "--micro-batch-size", str(a.micro_batch_size)]


def joined_records(run_dir: Path) -> list[dict[str, Any]]:
    """Every agent's "joined generation" log record (with its pod)."""
    out = []
    for f in sorted((run_dir / "logs").glob("*.log")):
        for line in f.read_text(errors="replace").splitlines():
            if '"joined generation"' not in line:
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            out.append(rec | {"pod": f.stem})
    return out


def rank_result(run_dir: Path, rank: int) -> dict[str, Any]:
    for f in (run_dir / "results").glob("*.json"):
        r = json.loads(f.read_text())
        if r.get("rank") == rank:
            return r
    raise RuntimeError(f"no rank-{rank} result in {run_dir}")


def gen1_sent(run_dir: Path) -> int | None:
    """Rank 0's ``sent`` bytes at generation 1: its snapshot as a source."""
    for rec in joined_records(run_dir):
        if rec.get("generation") == 1 and rec.get("rank") == 0:
            return int(rec.get("sent") or 0)
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- runs
def baseline_run(d: Path, data: Path, a: argparse.Namespace, R: int, K: int) -> dict[str, Any]:
    """bench/baselines/plain_hsdp.py on R*K processes; its rank 0's output, plus the step time."""
    d.mkdir(parents=True, exist_ok=True)
    out, port, world = d / "hsdp.json", _free_port(), R * K
    procs = []
    try:
        for r in range(world):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "PYTHONPATH": str(REPO)}
            log = open(d / f"rank{r}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "bench.baselines.plain_hsdp", "--shard-size", str(K),
                 "--steps", str(a.steps), "--model", a.model,
                 "--global-batch-size", str(a.global_batch_size),
                 "--micro-batch-size", str(a.micro_batch_size), "--threads", str(a.threads),
                 "--data", str(data), "--out", str(out)],
                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=REPO))
            log.close()
        deadline = time.monotonic() + 120 + a.steps * 20
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"plain HSDP rank exited {p.returncode}: see {d}")
    finally:
        for p in procs:  # by PID, bounded
            if p.poll() is None:
                p.kill()
                p.wait(5)
    res = json.loads(out.read_text())
    res["step_time"] = step_time(res["commits"], a.warmup)
    return res


async def ceaseless_run(d: Path, data: Path, a: argparse.Namespace, R: int, K: int,
                        steps: int | None = None) -> dict[str, Any]:
    """`up --workers R*K --shard-size K --spares 0`: rank 0's step time, gen-1 sent bytes."""
    from ops.launcher import Cluster

    steps = steps or a.steps
    async with Cluster(d, R * K, 0, steps, extra=up_extra(a), shard_size=K,
                       cmd=example_cmd(a, data, steps), timeout=120 + steps * 20) as c:
        code = await c.finish()
    if code != 0:
        raise RuntimeError(f"ceaseless run exited {code}:\n{c.output()}")
    r0 = rank_result(d, 0)
    out = {"gen1_sent": gen1_sent(d), "shard": r0.get("shard")}
    if steps >= a.warmup + 3:
        out["step_time"] = step_time(r0["commits"], a.warmup)
    return out


async def crash_run(d: Path, data: Path, a: argparse.Namespace, R: int, K: int) -> dict[str, Any]:
    """SIGKILL of rank 1 with one spare: downtime, lost steps, bytes the replacement got."""
    from ops.launcher import Cluster

    async with Cluster(d, R * K, 1, a.steps, extra=up_extra(a), shard_size=K,
                       cmd=example_cmd(a, data, a.steps), timeout=120 + a.steps * 20) as c:
        await c.wait_spares(1)
        h = await c.wait_rank_step(1, a.kill_step, timeout=120 + a.kill_step * 20)
        victim, t_kill = h.pod, time.time()
        os.kill(h.pid, signal.SIGKILL)
        code = await c.finish()
    if code != 0:
        raise RuntimeError(f"crash run exited {code}:\n{c.output()}")
    summ = json.loads((d / "summary.json").read_text())
    inc = summ.get("incidents") or []
    got = [r for r in joined_records(d) if r.get("generation", 0) > 1 and r.get("received")]
    return {"killed": victim, "killed_rank": 1, "t_kill": t_kill,
            "downtime": inc[0].get("downtime") if inc else None,
            "rank_downtime": inc[0].get("rank_downtime") if inc else None,
            "detection_latency": inc[0].get("detection_latency") if inc else None,
            "incidents": len(inc), "lost_steps": summ.get("lost_steps"),
            "final_step": summ.get("final_step"),
            "param_sha256_consistent": summ.get("param_sha256_consistent"),
            "replacement": got[0]["pod"] if got else None,
            "replacement_received": int(got[0]["received"]) if got else None,
            "replacement_rank": got[0].get("rank") if got else None}


async def join_run(d: Path, data: Path, a: argparse.Namespace, R: int, K: int) -> dict[str, Any]:
    """(R-1) replicas, then Capacity(add, 1): K cold pods form replica R-1."""
    from schemas.messages import Capacity, CapacityChange, Recovery
    from ops.launcher import Cluster

    steps = 100000  # the job runs until the join is measured; the cluster is then stopped
    recoveries: list[Recovery] = []
    out: dict[str, Any] = {}
    async with Cluster(d, (R - 1) * K, 0, steps, extra=up_extra(a) + ["--scale-up-snooze", "0"],
                       shard_size=K, cmd=example_cmd(a, data, steps),
                       timeout=a.join_timeout + 300) as c:
        bus, s = c.bus, c.bus.subjects

        async def on_rec(r: Recovery, _e) -> None:
            recoveries.append(r)

        await bus.subscribe(s.recovery, Recovery, on_rec)
        await c.wait_rank_step(0, a.join_after, timeout=120 + a.join_after * 20)
        g0 = c.plans[-1].generation
        before = {m.pod for m in c.plans[-1].members}
        t = time.time()
        await bus.publish(s.capacity, Capacity(change=CapacityChange.add, count=1,
                                               request_id="bench-sharded-join"))
        t_plan: list[float] = []

        def new_plan():
            p = c.plans[-1] if c.plans else None
            if p is not None and p.generation > g0 and p.world_size == R * K:
                if not t_plan:
                    t_plan.append(time.time())
                return p
            return None

        def all_training():
            p = new_plan()
            return p is not None and all(
                (h := c.hb.get(m.pod)) is not None and h.generation == p.generation
                and h.state.value == "training" for m in p.members)

        await c.wait_for(all_training, a.join_timeout, f"{R} replicas training")
        out["event_to_all_training"] = time.time() - t
        plan = new_plan()
        out["event_to_plan"] = t_plan[0] - t
        out["generation"], out["apply_step"] = plan.generation, plan.apply_step
        joiners = [m.pod for m in plan.members if m.pod not in before]
        out["joiners"] = joiners

        def first_steps():
            rs = [r for r in recoveries if r.generation == plan.generation]
            return rs if {r.pod for r in rs} >= {m.pod for m in plan.members} else None

        recs = await c.wait_for(first_steps, 60, "every member's recovery report")
        out["event_to_joiners_first_step"] = max(r.ts for r in recs if r.pod in joiners) - t
        stayed = [r for r in recs if r.pod not in joiners and r.downtime is not None]
        r0 = [r for r in stayed if r.rank == 0]
        out["rank0_gap"] = r0[0].downtime if r0 else None
        out["stayed_max_gap"] = max((r.downtime for r in stayed), default=None)
        out["joiner_received"] = max((r.bytes_received for r in recs if r.pod in joiners),
                                     default=None)
        # rank 0's step time before the event (heartbeat step_time: the agent's own median)
        h0 = c.member(0)
        await c.wait_rank_step(0, (plan.apply_step or 0) + 3, timeout=60)
        times = [h.step_time for h in c.hb.values() if h.step_time and h.rank is not None]
        out["step_time"] = statistics.median(times) if times else (h0.step_time if h0 else None)
    st = out.get("step_time") or 0.0
    out["pause_rank0"] = (max(0.0, out["rank0_gap"] - st)
                          if out.get("rank0_gap") is not None else None)
    out["pause_stayed_max"] = (max(0.0, out["stayed_max_gap"] - st)
                               if out.get("stayed_max_gap") is not None else None)
    return out


# ---------------------------------------------------------------------------- driver
async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    from agent.data import corpus

    if a.steps < a.warmup + 5:
        raise SystemExit("need --steps >= --warmup + 5")
    if a.kill_step + 5 > a.steps:
        raise SystemExit("need --steps >= --kill-step + 5")
    skip = {x.strip() for x in a.skip.split(",") if x.strip()}
    layouts = parse_layouts(a.layouts)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-sharded-"))
    data = corpus.ensure(work / "data", n_tokens=2_000_000, seed=0)  # what `ceaseless up` uses
    t_start = time.time()
    res: dict[str, Any] = {"benchmark": "sharded", "machine": machine(),
                           "config": config(a) | {"command": _command()}, "layouts": {}}
    for R, K in layouts:
        name = f"{R}x{K}"
        L: dict[str, Any] = {"replicas": R, "shard_size": K, "world_size": R * K}
        res["layouts"][name] = L
        base, cl, ratios, sent = [], [], [], []
        if "steptime" not in skip:
            for i in range(a.repeats):
                b = baseline_run(work / name / f"hsdp-{i}", data, a, R, K)
                c = await ceaseless_run(work / name / f"ceaseless-{i}", data, a, R, K)
                base.append(b["step_time"])
                cl.append(c["step_time"])
                ratios.append(c["step_time"] / b["step_time"])
                if c.get("gen1_sent"):
                    sent.append(c["gen1_sent"])
                L["state_bytes"] = b["state_bytes"]
                L["unsharded_bytes"] = b["unsharded_bytes"]
                L["baseline_losses_last"] = b["losses"].get(str(a.steps - 1))
                print(f"[{name} {i + 1}/{a.repeats}] plain HSDP {b['step_time']:.4f}s/step, "
                      f"ceaseless {c['step_time']:.4f}s/step, ratio {ratios[-1]:.3f}", flush=True)
            L["baseline_step_s"], L["ceaseless_step_s"] = summary(base), summary(cl)
            L["ratio"] = summary(ratios)
            L["gen1_sent_rank0"] = sent[0] if sent else None
        if "crash" not in skip:
            L["crash"] = await crash_run(work / name / "crash", data, a, R, K)
            cr = L["crash"]
            print(f"[{name} crash] downtime {cr['downtime']}, lost steps {cr['lost_steps']}, "
                  f"replacement received {cr['replacement_received']} B", flush=True)
        if "join" not in skip:
            if R < 2:
                L["join"] = {"skipped": "needs R >= 2"}
            else:
                L["join"] = await join_run(work / name / "join", data, a, R, K)
                j = L["join"]
                print(f"[{name} join] event -> all training {j['event_to_all_training']:.3f}s, "
                      f"pause of rank 0 {j['pause_rank0']}", flush=True)
    if "unsharded" not in skip:
        # Ceaseless' own unsharded figure: rank 0's snapshot at generation 1, 2 x 1
        c = await ceaseless_run(work / "unsharded", data, a, 2, 1, steps=3)
        res["unsharded_gen1_sent_rank0"] = c["gen1_sent"]
    res["wall_s"] = time.time() - t_start
    res["work_dir"] = str(work)
    return res


def _command() -> str:
    if sys.argv[0].endswith("sharded.py") or "bench.sharded" in " ".join(sys.argv[:2]):
        return "python -m bench.sharded " + " ".join(sys.argv[1:])
    return " ".join(["ceaseless", *sys.argv[1:]])


def _b(n: Any) -> str:
    if n is None:
        return "–"
    return f"{n / 1024:.1f} KiB" if n < 2**20 else f"{n / 2**20:.2f} MiB"


def _s(x: Any, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f} s"


def _ranks(layout: str) -> int:
    r, k = layout.lower().split("x")
    return int(r) * int(k)


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    names = list(res["layouts"])
    Ls = [res["layouts"][n] for n in names]

    def row(label: str, f) -> str:
        cells = []
        for L in Ls:
            try:
                cells.append(f(L))
            except (KeyError, TypeError, IndexError, ZeroDivisionError):
                cells.append("–")
        return f"| {label} | " + " | ".join(cells) + " |"

    def sb(L, rank):  # a rank's (model + optimizer) bytes, from the baseline
        return L["state_bytes"][rank]["total"]

    rows = [
        row("plain HSDP step time", lambda L: fmt(L["baseline_step_s"], "s", 4)),
        row("Ceaseless step time", lambda L: fmt(L["ceaseless_step_s"], "s", 4)),
        row("ratio Ceaseless / HSDP (target <= 1.03)", lambda L: fmt(L["ratio"], "", 3)),
        row("state per rank, sharded (model + AdamW, rank 0)",
            lambda L: f"{_b(sb(L, 0))} ({_b(L['state_bytes'][0]['model'])} model)"),
        row("state, unsharded (model + AdamW)",
            lambda L: f"{_b(L['unsharded_bytes']['total'])} "
                      f"({_b(L['unsharded_bytes']['model'])} model)"),
        row("sharded / unsharded", lambda L: f"{sb(L, 0) / L['unsharded_bytes']['total']:.3f}"),
        row("rank 0's gen-1 snapshot sent (Ceaseless, model only)",
            lambda L: _b(L["gen1_sent_rank0"])),
        row("crash of rank 1 with a spare: downtime", lambda L: _s(L["crash"]["downtime"])),
        row("crash: lost steps", lambda L: str(L["crash"]["lost_steps"])),
        row("crash: bytes the replacement received",
            lambda L: f"{_b(L['crash']['replacement_received'])} "
                      f"(baseline rank 1: {_b(sb(L, 1))})"),
        row("join of a replica: event -> plan", lambda L: _s(L["join"]["event_to_plan"])),
        row("join: event -> every member training",
            lambda L: _s(L["join"]["event_to_all_training"])),
        row("join: event -> joiners' first step",
            lambda L: _s(L["join"]["event_to_joiners_first_step"])),
        row("join: pause of rank 0 (gap - step time)", lambda L: _s(L["join"]["pause_rank0"])),
        row("join: longest pause of the members that stayed",
            lambda L: _s(L["join"]["pause_stayed_max"])),
        row("join: bytes a joiner received", lambda L: _b(L["join"]["joiner_received"])),
    ]
    un = res.get("unsharded_gen1_sent_rank0")
    cores = (res.get("machine") or {}).get("cores") or 0
    over = [n for n in names if cores and _ranks(n) > cores]
    notes = [
        "Reading: the crash and join rows include the replacement's own preparation (a spare "
        "learns its shard position when promoted, then shards its model and builds its "
        "optimizer; the survivors wait for it in the rendezvous) and three groups per "
        "generation (world, shard, position)."]
    if over:
        notes.append(f"Layouts {', '.join(over)} run more training processes than the "
                     f"machine has cores ({cores}), beside NATS and three services that "
                     "plain HSDP does not run: their step-time ratio measures CPU contention "
                     "more than Ceaseless; the 1.03 target is for a machine with a core per "
                     "rank.")
    return "\n".join([
        SECTION, "", machine_line(res["machine"]),
        f"Command: `{c['command'].strip()}`. Model `{c['model']}`, global batch "
        f"{c['global_batch_size']} (micro-batch {c['micro_batch_size']}), {c['steps']} steps, "
        f"first {c['warmup']} skipped, {c['threads']} thread(s) per process; step time: "
        f"{c['repeats']} runs of each loop, alternating, median (min–max). Layout RxK: R "
        f"replicas of K shard ranks. Crash: SIGKILL of rank 1 at step {c['kill_step']}, one "
        "spare. Join: R-1 replicas, then a capacity event adds one (K cold pods). Total "
        f"wall time {res.get('wall_s', 0):.0f} s.",
        "", "| measure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names), *rows, "",
        (f"Unsharded cross-check: rank 0's generation-1 snapshot of a 2 x 1 run is {_b(un)} "
         "(model only, as the sharded rows' snapshot).") if un else "",
        "", " ".join(notes), ""]) + "\n"


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit(res, markdown(res), SECTION, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
