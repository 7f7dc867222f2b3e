"""Recovery benchmark: downtime of an in-process recovery, with its phase breakdown, against a
checkpoint-restart baseline measured in the same invocation.

    python -m bench.recovery [--workers 4] [--spares 1] [--model 10m] [--steps 30]
                             [--repeats 3] [--scenarios kill,hang,kill0] [--seed 0]
                             [--systems ceaseless,ckpt20,ckpt100,torchft1000] [--json PATH]
                             [--svg PATH] [--write-doc]
    ceaseless bench recovery ...        (same options)

Systems: ``ceaseless`` (every scenario below) and ``ckptN``: plain DDP under ``torchrun
--max-restarts`` with ``torch.save`` every N steps and a load on start (``bench/baselines/ckpt_restart.py``;
the SIGKILL-of-a-worker scenario only) and ``torchftMS``: torchft (when installed), one
process per replica group, lighthouse heartbeat timeout MS ms (``bench/baselines/torchft_bench.py``;
SIGKILL of a worker only; survivors continue without it) or ``torchftMShttp`` /
``torchftMSpg``: the same, but the killed replica group is restarted at once and heals from
a survivor over torchft's HTTP or process-group checkpoint transport. In each repeat every system gets the same fault step
and victim rank; the order of the systems rotates per repeat (A B C, B C A, C A B, …).

Each run is a real `ceaseless up` cluster (nats-server, the services, gloo process groups on
loopback) training the example GPT. At a random step (seeded) one process gets:

* ``kill``: SIGKILL of a worker (not rank 0);
* ``hang``: SIGSTOP of a worker (found by the heartbeat timeout, fenced, replaced);
* ``kill0``: SIGKILL of rank 0.

Scenarios interleave (kill hang kill0 kill hang kill0 …) so drift on a shared machine hits
all of them alike. From every survivor's commit log (``results/<pod>.json``: the wall time of
each committed step) it reports:

* **downtime**: the survivors' longest gap between committed steps around the fault, minus
  their median step time (so a fault-free run scores ~0);
* **kill to step**: from the signal to the first step committed after it;
* **lost steps**: committed steps that had to be recomputed (the summary's count);
* **phases**: the incident's critical path from the traces (detect, plan, transfer plan,
  abort or finish_step (a survivor that finished the interrupted step), rendezvous, state
  sync, data resume, first step).

For a baseline: kill -> first step after the restart, kill -> back at the pre-kill step, and
the steps recomputed (from the per-step commit files of its workers). The ratio of
Ceaseless' downtime to each baseline's "back at the pre-kill step" is reported as the ratio of
the medians and per repeat.

Medians and min–max over the repeats; ``--write-doc`` replaces the ``## Recovery`` section of
docs/benchmarks.md and writes docs/img/bench-recovery.svg.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (main, cmdline, config, emit_with_plot, fmt, machine, machine_line, summary,
                          window_gap)
from bench.baselines.torchft_bench import TORCHFT_TIMEOUT
from schemas.timeouts import DEFAULTS as TIMEOUTS

SECTION = "## Recovery"
SCENARIOS = {"kill": ("SIGKILL of a worker", signal.SIGKILL, False),
             "hang": ("SIGSTOP of a worker", signal.SIGSTOP, False),
             "kill0": ("SIGKILL of rank 0", signal.SIGKILL, True)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--spares", type=int, default=1)
    p.add_argument("--model", default="10m", help="example model: tiny | small | 10m")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--fault-timeout", type=float, default=TIMEOUTS["fault_timeout"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--scenarios", default="kill,hang,kill0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--systems", default="ceaseless,ckpt20,ckpt100,torchft1000",
                   help="ceaseless, ckptN (torchrun --max-restarts, torch.save every N "
                        "steps) and/or torchftMS (torchft, lighthouse heartbeat timeout MS ms; "
                        "torchftMShttp / torchftMSpg: the killed replica is restarted and heals "
                        "over torchft's HTTP / PG checkpoint transport; skipped with a note "
                        "when torchft is not installed); the baselines run "
                        "the crash scenario only")
    p.add_argument("--corpus-tokens", type=int, default=2_000_000,
                   help="the baselines' synthetic corpus (default: what `ceaseless up` "
                        "generates for its runs)")
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun, for ckptN")
    p.add_argument("--monitor-interval", type=float, default=0.1, help="torchrun, for ckptN")
    p.add_argument("--torchft-timeout", type=float, default=TORCHFT_TIMEOUT,
                   help="torchft: timeout of its collectives (ProcessGroupGloo and Manager), s; "
                        "a survivor whose all-reduce peer died waits this long "
                        "(default %(default)g)")
    p.add_argument("--svg", help="write the plot here (default with --write-doc: "
                                 "docs/img/bench-recovery.svg)")
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


# ---------------------------------------------------------------------------- one run
async def one_run(run_dir: Path, a: argparse.Namespace, scenario: str, fault_step: int,
                  rank: int) -> dict[str, Any]:
    from ops.launcher import Cluster

    _, sig, rank0 = SCENARIOS[scenario]
    extra = ["--model", a.model, "--global-batch-size", str(a.global_batch_size),
             "--micro-batch-size", str(a.micro_batch_size),
             "--fault-timeout", str(a.fault_timeout)]
    stopped: list[int] = []
    async with Cluster(run_dir, a.workers, a.spares, a.steps, extra=extra,
                       timeout=60 + a.steps * 20) as c:
        try:
            await c.wait_spares(a.spares)
            await c.wait_for(lambda: (h := c.member(rank)) is not None and h.step >= fault_step,
                             60 + fault_step * 20, f"rank {rank} at step {fault_step}")
            pid = c.member(rank).pid
            t_kill = time.time()
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                stopped.append(pid)
            code = await c.finish()
        finally:
            for pid in stopped:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    if code != 0:
        raise RuntimeError(f"{scenario}: cluster exited {code}:\n{c.output()}")
    return analyse(run_dir, scenario, rank, t_kill)


def analyse(run_dir: Path, scenario: str, rank: int, t_kill: float) -> dict[str, Any]:
    summ = json.loads((run_dir / "summary.json").read_text())
    logs = []
    for f in sorted((run_dir / "results").glob("*.json")):
        logs.append([(int(s), float(t)) for s, t in json.loads(f.read_text()).get("commits", [])])
    # The recovered job's first step: the first step a promoted spare committed (it commits
    # only in the new generation); without one, the survivors' first step after the kill.
    spare_first = [c[0][0] for c in logs if c and c[0][1] >= t_kill]
    recovered_step = min(spare_first) if spare_first else None
    gaps, to_step, steps_med, pre_kill = [], [], [], -1
    back = []
    for commits in logs:
        before = [c for c in commits if c[1] < t_kill]
        after = [c for c in commits if c[1] >= t_kill]
        if not before or not after:
            continue  # a promoted spare (or a pod that left): not a survivor
        diffs = [b[1] - a[1] for a, b in zip(commits, commits[1:])]
        med = statistics.median(diffs)
        first = next((c for c in after if recovered_step is None or c[0] >= recovered_step),
                     after[0])
        gap = window_gap(commits, t_kill, first[1]) or (after[0][1] - before[-1][1])
        gaps.append(gap - med)
        steps_med.append(med)
        to_step.append(first[1] - t_kill)
        pre_kill = max(pre_kill, before[-1][0])
        nxt = [t for s, t in after if s > before[-1][0]]
        if nxt:
            back.append(nxt[0] - t_kill)
    if not gaps:
        raise RuntimeError(f"{scenario}: no survivor committed steps on both sides of the fault")
    return {"scenario": scenario, "rank": rank, "pre_kill_step": pre_kill,
            "downtime_s": max(gaps), "kill_to_step_s": max(to_step),
            "back_at_step_s": max(back) if back else None,
            "median_step_s": statistics.median(steps_med),
            "lost_steps": summ.get("lost_steps"), "final_step": summ.get("final_step"),
            "incidents": len(summ.get("incidents", [])), "phases": phases(run_dir),
            "run_dir": str(run_dir)}


def phases(run_dir: Path) -> dict[str, float]:
    """The incident's critical path, segment -> ms (empty if the traces are missing)."""
    try:
        from ops import trace_tools as tt

        # The fault's incident (its id names the pod), not the initial plan's trace.
        incs = [i for i in tt.incidents(tt.load_spans(run_dir / "traces"))
                if i.attr(tt.T.ATTR_INCIDENT)]
        if not incs:
            return {}
        out: dict[str, float] = {}
        for seg in tt.critical_path(incs[-1]):
            out[seg.label] = out.get(seg.label, 0.0) + seg.duration_ms
        return {k: round(v, 2) for k, v in out.items()}
    except Exception as e:  # the breakdown is extra; the downtime stands on the commit logs
        return {"error": str(e)[:200]}  # type: ignore[dict-item]


# ---------------------------------------------------------------------------- many runs
def parse_systems(a: argparse.Namespace) -> tuple[list[str], list[str]]:
    scenarios = [s.strip() for s in a.scenarios.split(",") if s.strip()]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; choose from {', '.join(SCENARIOS)}")
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in systems:
        if s != "ceaseless" and not (s.startswith("ckpt") and s[4:].isdigit()) and not (
                TORCHFT.fullmatch(s)):
            raise SystemExit(f"unknown system {s!r}: ceaseless, ckptN (N = checkpoint every "
                             "N steps), torchftMS (MS = heartbeat timeout, ms; the killed "
                             "replica is not replaced) or torchftMShttp / torchftMSpg (it is "
                             "restarted and heals over that checkpoint transport)")
    return systems, scenarios


def ckpt_every(system: str) -> int:
    return int(system[4:])


TORCHFT = re.compile(r"torchft(\d+)(http|pg)?")


def torchft_hb(system: str) -> int:
    return int(TORCHFT.fullmatch(system).group(1))


def torchft_transport(system: str) -> str | None:
    """``http``/``pg``: the killed replica is restarted and heals over that transport."""
    return TORCHFT.fullmatch(system).group(2)


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    systems, scenarios = parse_systems(a)
    if a.repeats < 1 or a.steps < 8:
        raise SystemExit("need --repeats >= 1 and --steps >= 8")
    lo = min(5, a.steps // 3)
    # leave a quarter of the run after the fault: a fast model finishes a few steps within
    # one heartbeat interval, and the fault step must be seen before the job ends
    hi = max(lo, a.steps - max(6, a.steps // 4))
    skipped = {}
    if any(x.startswith("torchft") for x in systems):
        from bench.baselines import torchft_bench

        why = torchft_bench.available()
        if why:
            skipped = {x: f"torchft not usable here: {why}" for x in systems
                       if x.startswith("torchft")}
            systems = [x for x in systems if x not in skipped]
            print(f"skipping {', '.join(skipped)}: {why}", flush=True)
    rng = random.Random(a.seed)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-bench-"))
    data = work / f"data-{a.corpus_tokens}"
    if any(s != "ceaseless" for s in systems):
        from agent.data import corpus

        data = corpus.ensure(data, n_tokens=a.corpus_tokens, seed=0)  # as `ceaseless up` does
    runs: list[dict[str, Any]] = []
    for r in range(a.repeats):
        # one fault schedule per repeat, shared by every system: step and victim rank
        sched = {sc: (rng.randint(lo, hi),
                      0 if SCENARIOS[sc][2] else rng.randrange(1, a.workers))
                 for sc in (scenarios if "kill" in scenarios else [*scenarios, "kill"])}
        # rotate the order each repeat (A B C, B C A, ...) so no system always runs first
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            todo = scenarios if system == "ceaseless" else ["kill"]
            for scenario in todo:
                fault_step, rank = sched[scenario]
                d = work / f"{system}-{scenario}-{r}"
                t0 = time.monotonic()
                if system == "ceaseless":
                    res = await one_run(d, a, scenario, fault_step, rank)
                elif system.startswith("torchft"):
                    from bench.baselines import torchft_bench

                    res = await asyncio.to_thread(
                        torchft_bench.run_once, d, a, torchft_hb(system), data, fault_step,
                        rank, 120 + a.steps * 30, torchft_transport(system))
                    res["scenario"] = "kill"
                else:
                    from bench.baselines import ckpt_restart

                    res = await asyncio.to_thread(
                        ckpt_restart.run_once, d, a, ckpt_every(system), data, fault_step,
                        rank, 120 + a.steps * 30)
                    res["scenario"] = "kill"
                res["system"], res["repeat"] = system, r
                res["wall_s"] = round(time.monotonic() - t0, 1)
                runs.append(res)
                if system == "ceaseless":
                    print(f"[{r + 1}/{a.repeats}] ceaseless {scenario:<6} step "
                          f"{res['pre_kill_step']:>3}: downtime {res['downtime_s']:.3f}s, "
                          f"kill->step {res['kill_to_step_s']:.3f}s, lost {res['lost_steps']}, "
                          f"step {res['median_step_s']:.3f}s  {res['phases']}", flush=True)
                elif system.startswith("torchft"):
                    print(f"[{r + 1}/{a.repeats}] {system:<9} kill   step "
                          f"{res['pre_kill_step']:>3}: downtime {res['downtime_s']:.3f}s, "
                          f"kill->step {res['kill_to_step_s']:.3f}s, back at step "
                          f"{res['back_at_step_s']:.3f}s, recomputed {res['recomputed_steps']}, "
                          f"step {res['median_step_s']:.3f}s"
                          + (f", heal {res['heal_s']}, full size {res['full_size_s']}, "
                             f"join stall {res['join_stall_s']} (s)" if res.get("replaced")
                             else ""),
                          flush=True)
                else:
                    print(f"[{r + 1}/{a.repeats}] {system:<9} kill   step "
                          f"{res['pre_kill_step']:>3}: kill->step {res['downtime_s']:.3f}s, "
                          f"back at step {res['back_at_step_s']:.3f}s, recomputed "
                          f"{res['recomputed_steps']} (restored {res['restored_step']}), step "
                          f"{res['median_step_s']:.3f}s  {res['phases_s']}", flush=True)
    return {"benchmark": "recovery", "machine": machine(),
            "config": config(a) | {"command": cmdline("recovery"), "systems_run": ",".join(systems)},
            "runs": runs, "skipped": skipped, "summary": aggregate(runs, systems, scenarios)}


def aggregate(runs: list[dict[str, Any]], systems: list[str],
              scenarios: list[str]) -> dict[str, Any]:
    agg: dict[str, Any] = {}
    for s in scenarios if "ceaseless" in systems else []:
        rs = [x for x in runs if x["system"] == "ceaseless" and x["scenario"] == s]
        names: list[str] = []
        for x in rs:
            names += [k for k in x["phases"] if k not in names and k != "error"]
        agg[s] = {"downtime_s": summary(x["downtime_s"] for x in rs),
                  "kill_to_step_s": summary(x["kill_to_step_s"] for x in rs),
                  "back_at_step_s": summary(x["back_at_step_s"] for x in rs
                                            if x["back_at_step_s"] is not None),
                  "lost_steps": summary(x["lost_steps"] or 0 for x in rs),
                  "median_step_s": summary(x["median_step_s"] for x in rs),
                  "phases_ms": {k: summary(x["phases"].get(k, 0.0) for x in rs) for k in names}}
    for b in [x for x in systems if x != "ceaseless"]:
        rs = [x for x in runs if x["system"] == b]
        agg[b] = {"downtime_s": summary(x["downtime_s"] for x in rs),
                  "back_at_step_s": summary(x["back_at_step_s"] for x in rs
                                            if x["back_at_step_s"] is not None),
                  "recomputed_steps": summary(x["recomputed_steps"] for x in rs),
                  "median_step_s": summary(x["median_step_s"] for x in rs)}
        if b.startswith("torchft"):
            agg[b]["kill_to_step_s"] = summary(x["kill_to_step_s"] for x in rs)
            if torchft_transport(b):
                for k in ("heal_s", "full_size_s", "join_stall_s"):
                    agg[b][k] = summary(x[k] for x in rs if x.get(k) is not None)
                agg[b]["healed_runs"] = sum(1 for x in rs if x.get("heal_s") is not None)
                agg[b]["runs"] = len(rs)
        else:
            names = list(rs[0]["phases_s"]) if rs else []
            agg[b]["gap_s"] = summary(x["gap_s"] for x in rs if x["gap_s"] is not None)
            agg[b]["phases_ms"] = {k: summary(1000 * x["phases_s"][k] for x in rs)
                                   for k in names}
        # Ceaseless' downtime per scenario / this baseline's "back at the pre-kill step" (and,
        # for torchft, / its own downtime, the stall): the ratio of the medians, and the
        # per-repeat ratios (same fault schedule)
        for key, theirs in (("ratio_ceaseless_downtime_to_back_at_step", "back_at_step_s"),
                            ("ratio_ceaseless_downtime_to_downtime", "downtime_s")):
            ratios = {}
            for s in scenarios if "ceaseless" in systems else []:
                cs = {x["repeat"]: x["downtime_s"] for x in runs
                      if x["system"] == "ceaseless" and x["scenario"] == s}
                pairs = [cs[x["repeat"]] / x[theirs] for x in rs
                         if x["repeat"] in cs and x[theirs]]
                med_c, med_b = agg[s]["downtime_s"]["median"], agg[b][theirs]["median"]
                ratios[s] = {"of_medians": (med_c / med_b) if med_c is not None and med_b
                             else None, "per_repeat": summary(pairs)}
            agg[b][key] = ratios
    return agg


def label(system: str) -> str:
    if system.startswith("ckpt"):
        return f"torchrun --max-restarts, torch.save every {ckpt_every(system)} steps"
    if system.startswith("torchft"):
        t = torchft_transport(system)
        return (f"torchft, heartbeat timeout {torchft_hb(system)} ms"
                + (f", replica restarted, heals over {t.upper()} transport" if t else ""))
    return "Ceaseless"


def _systems(c: dict[str, Any]) -> tuple[list[str], list[str]]:
    return parse_systems(argparse.Namespace(**(c | {"systems": c.get("systems_run",
                                                                      c["systems"])})))


def crash_row(agg: dict[str, Any], system: str) -> dict[str, Any]:
    """The crash figures of one system under common names."""
    if system == "ceaseless":
        a = agg["kill"]
        return {"downtime": a["downtime_s"], "to_step": a["kill_to_step_s"],
                "back": a["back_at_step_s"], "redone": a["lost_steps"],
                "step": a["median_step_s"]}
    a = agg[system]
    if system.startswith("ckpt"):
        return {"downtime": a["gap_s"], "to_step": a["downtime_s"], "back": a["back_at_step_s"],
                "redone": a["recomputed_steps"], "step": a["median_step_s"]}
    return {"downtime": a["downtime_s"], "to_step": a["kill_to_step_s"],
            "back": a["back_at_step_s"], "redone": a["recomputed_steps"],
            "step": a["median_step_s"]}


def markdown(res: dict[str, Any]) -> str:
    c, m, agg = res["config"], res["machine"], res["summary"]
    systems, scenarios = _systems(c)
    base = [b for b in systems if b != "ceaseless"]
    ckpt = [b for b in base if b.startswith("ckpt")]
    tft = [b for b in base if b.startswith("torchft")]
    out = [SECTION, "",
           machine_line(m),
           f"Command: `{c['command']}`. {c['workers']} workers, model `{c['model']}`, "
           f"{c['steps']} steps, global batch {c['global_batch_size']} (micro-batch "
           f"{c['micro_batch_size']}), AdamW, gloo on CPU, loopback. Ceaseless: "
           f"{c['spares']} spare (a shadow spare: it follows the committed state), heartbeat "
           f"fault timeout {c['fault_timeout']} s; survivors still computing the interrupted "
           "step finish it (resume in place). "
           + (f"Checkpoint-restart: plain DDP under `torchrun --max-restarts {c['max_restarts']} "
              f"--monitor-interval {c['monitor_interval']}` (c10d rendezvous on 127.0.0.1, "
              "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`), rank 0 `torch.save`s model + optimizer "
              "+ scheduler every N steps, every rank loads it on start. " if ckpt else "")
           + ("torchft: one process per replica group, `Manager` + `ProcessGroupGloo`, "
              "synchronous quorum, its lighthouse on 127.0.0.1 (min replicas = workers − 1), "
              f"collective timeout {c.get('torchft_timeout', TORCHFT_TIMEOUT)} s; the killed "
              "replica is not replaced unless the system says it is restarted (then a new "
              "process with the same replica id starts right after the kill, as torchelastic "
              "would, and "
              "heals from a survivor over torchft's checkpoint transport). " if tft else "")
           + f"{c['repeats']} repeats; in each, every system gets the same fault step and "
           "victim rank (seeded), systems interleaved with the order rotated per repeat; "
           "median (min–max).", ""]
    for b, why in (res.get("skipped") or {}).items():
        out += [f"Not run: `{b}`: {why}", ""]
    if "kill" in scenarios or base:
        out += ["**SIGKILL of a worker, every system**", "",
                "| system | downtime (longest commit gap − step time) | kill → first step after "
                "recovery | back at pre-kill step | steps recomputed | step time |",
                "|---|---|---|---|---|---|"]
        for b in (["ceaseless"] if "ceaseless" in systems and "kill" in scenarios else []) + base:
            r = crash_row(agg, b)
            out.append(f"| {label(b)} | {fmt(r['downtime'])} | {fmt(r['to_step'])} | "
                       f"{fmt(r['back'])} | {fmt(r['redone'], '', 0)} | {fmt(r['step'])} |")
        out.append("")
    if "ceaseless" in systems:
        out += ["**Ceaseless, every scenario**", "",
                "| scenario | downtime | kill → next step | back at pre-kill step "
                "| lost steps | step time |", "|---|---|---|---|---|---|"]
        for s in scenarios:
            a = agg[s]
            out.append(f"| {SCENARIOS[s][0]} | {fmt(a['downtime_s'])} | "
                       f"{fmt(a['kill_to_step_s'])} | {fmt(a['back_at_step_s'])} | "
                       f"{fmt(a['lost_steps'], '', 0)} | {fmt(a['median_step_s'])} |")
        out.append("")
    if base and "ceaseless" in systems:
        cols = [(b, "ratio_ceaseless_downtime_to_back_at_step", f"÷ {b} back at pre-kill step")
                for b in base]
        cols += [(b, "ratio_ceaseless_downtime_to_downtime", f"÷ {b} downtime (stall)")
                 for b in tft]
        out += ["**Ratios** (Ceaseless downtime ÷ the baseline's figure; ratio of the medians, "
                "then the per-repeat ratios, same fault step and victim)", "",
                "| Ceaseless scenario | " + " | ".join(h for _, _, h in cols) + " |",
                "|---|" + "---|" * len(cols)]
        for s in scenarios:
            cells = []
            for b, key, _ in cols:
                r = agg[b][key][s]
                om = r["of_medians"]
                cells.append((f"{om:.3f}" if om is not None else "–")
                             + f" (per repeat {fmt(r['per_repeat'], '', 3)})")
            out.append(f"| {SCENARIOS[s][0]} | " + " | ".join(cells) + " |")
        out.append("")
    healers = [b for b in tft if torchft_transport(b)]
    if healers:
        out += ["**Back to full size** (torchft with the killed replica restarted; Ceaseless's "
                "promoted spare is at full size from its first step): heal = kill → the "
                "replacement's first commit; join stall = when the survivors ran a smaller "
                "quorum first, their longest commit gap until it was full again minus the "
                "step time (serving the heal; runs where the replacement joined the recovered "
                "quorum have none)", "",
                "| system | kill → full size | heal | join stall | runs healed |",
                "|---|---|---|---|---|"]
        if "ceaseless" in systems and "kill" in scenarios:
            out.append(f"| Ceaseless | {fmt(agg['kill']['kill_to_step_s'])} | – | – | – |")
        for b in healers:
            a = agg[b]
            out.append(f"| {label(b)} | {fmt(a['full_size_s'])} | {fmt(a['heal_s'])} | "
                       f"{fmt(a['join_stall_s'])} | {a['healed_runs']} of {a['runs']} |")
        out.append("")
    if ckpt:
        out += ["Restart phases of the checkpoint-restart baselines (the slowest rank, ms): "
                "respawn = kill → the new worker's first line; import = torch, the model code; "
                "process_group = `init_process_group`; build = data + model + optimizer; "
                "ckpt_load = `torch.load` + `load_state_dict`; first_step = the first step "
                "after it:", ""]
        for b in ckpt:
            out.append(f"- {label(b)}: " + "; ".join(
                f"{k} {fmt(v, 'ms', 0)}" for k, v in agg[b]["phases_ms"].items()))
        out.append("")
    if "ceaseless" in systems:
        out += ["Ceaseless phase breakdown (the incident's critical path from the traces, "
                "ms, median (min–max)):", ""]
        for s in scenarios:
            a = agg[s]
            if a["phases_ms"]:
                out.append(f"- {SCENARIOS[s][0]}: " + "; ".join(
                    f"{k} {fmt(v, 'ms', 1)}" for k, v in a["phases_ms"].items()))
        out.append("")
    out += ["![recovery](img/bench-recovery.svg)"]
    return "\n".join(out) + "\n"


def plot(res: dict[str, Any]) -> str:
    from bench.report import svg

    c, agg = res["config"], res["summary"]
    systems, scenarios = _systems(c)
    groups, vals = [], {}
    for s in scenarios if "ceaseless" in systems else []:
        g = f"Ceaseless: {s}"
        groups.append(g)
        vals[(g, "downtime")] = agg[s]["downtime_s"]
        vals[(g, "kill → first step")] = agg[s]["kill_to_step_s"]
        vals[(g, "back at pre-kill step")] = agg[s]["back_at_step_s"]
    for b in [x for x in systems if x != "ceaseless"]:
        g = (f"torchrun + ckpt every {ckpt_every(b)}" if b.startswith("ckpt")
             else f"torchft, heartbeat {torchft_hb(b)} ms"
             + (f", restarted ({torchft_transport(b)})" if torchft_transport(b) else ""))
        groups.append(g)
        r = crash_row(agg, b)
        vals[(g, "downtime")] = r["downtime"]
        vals[(g, "kill → first step")] = r["to_step"]
        vals[(g, "back at pre-kill step")] = r["back"]
    return svg.bars(f"Recovery after a fault: model {c['model']}, {c['workers']} workers, "
                    f"{res['machine']['cores']} CPU cores", groups,
                    ["downtime", "kill → first step", "back at pre-kill step"], vals, "seconds",
                    log=True, note=f"{res['machine']['date']}; {c['repeats']} repeats; "
                                   "downtime = longest commit gap minus median step time; "
                                   "baselines: SIGKILL of a worker")


def run(a: argparse.Namespace) -> int:
    res = asyncio.run(run_all(a))
    return emit_with_plot(a, res, markdown(res), SECTION, "bench-recovery.svg", plot)


if __name__ == "__main__":
    sys.exit(main(__name__))
