"""Elastic transitions: how fast capacity and priority events take effect, and how long the
other replicas pause.

One run per repeat, on a `ceaseless up` cluster of W workers + 1 pre-warmed spare
(scale-up snooze 0), with every event published on the bus:

1. ``capacity add 1``: the pre-warmed spare is promoted (W -> W+1); the actuator also
   starts one cold pod, which becomes an idle spare.
2. ``priority release 1``: the idle spare is stopped (spares go first).
3. ``priority release 1``: the highest rank leaves at a step boundary (W+1 -> W).
4. ``capacity add 1``: a cold pod is started and joins (W -> W+1).

Measured: event -> joiner's first completed step (pre-warmed, cold); event -> release
completed on the bus (the slot is free: the pod exited); the pause of the replicas that
stayed (longest gap between their commits across the change minus the median step time).

    python -m bench.elastic --repeats 3 --workers 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import config, emit, fmt, machine, machine_line, summary, main

HEADING = "## Elastic transitions"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=2, help="replicas before the first event")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", default="tiny", help="example model: tiny | small | 10m")
    p.add_argument("--steps", type=int, default=100000,
                   help="job length (the run is stopped after the schedule)")
    p.add_argument("--settle", type=float, default=2.0,
                   help="seconds of training between events")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--no-doc", action="store_true", help="do not update docs/benchmarks.md")


async def _one(run_dir: Path, a: argparse.Namespace) -> dict[str, Any]:
    from schemas.messages import (Capacity, CapacityChange, Decision, Lifecycle, Priority,
                                  Recovery)
    from ops.launcher import Cluster

    decisions: dict[str, list[tuple[float, Decision]]] = {}
    recoveries: list[Recovery] = []
    exits: dict[str, float] = {}
    out: dict[str, Any] = {}
    extra = ["--scale-up-snooze", "0", "--model", a.model]
    async with Cluster(run_dir, a.workers, 1, a.steps, extra=extra, timeout=600) as c:
        bus, s = c.bus, c.bus.subjects

        async def on_dec(d: Decision, _e) -> None:
            decisions.setdefault(d.request_id, []).append((time.time(), d))

        async def on_rec(r: Recovery, _e) -> None:
            recoveries.append(r)

        async def on_life(ev: Lifecycle, _e) -> None:
            if ev.event.value == "exited":
                exits[ev.pod] = ev.ts

        await bus.subscribe(s.decision, Decision, on_dec)
        await bus.subscribe(s.recovery, Recovery, on_rec)
        await bus.subscribe(s.lifecycle(), Lifecycle, on_life)
        await c.wait_spares(1)
        await c.wait_rank_step(0, 5)

        def world(n: int, after: int = 2):
            def ok():
                p = c.plans[-1] if c.plans else None
                if p is None or p.world_size != n:
                    return False
                return all((h := c.hb.get(m.pod)) is not None and h.generation == p.generation
                           and h.state.value == "training"
                           and h.step >= (p.apply_step or 0) + after for m in p.members)
            return c.wait_for(ok, 300, f"{n} replicas training")

        def joined(pod_of, gen_from: int) -> float | None:
            rs = [r for r in recoveries if r.generation > gen_from and r.pod == pod_of]
            return min(r.ts for r in rs) if rs else None

        async def event(subject, msg) -> float:
            t = time.time()
            await bus.publish(subject, msg)
            return t

        w = a.workers
        # 1. pre-warmed join
        g = c.plans[-1].generation
        t = await event(s.capacity, Capacity(change=CapacityChange.add, count=1,
                                             request_id="warm"))
        await world(w + 1)
        joiner = c.plans[-1].pod_of(w)
        await c.wait_for(lambda: joined(joiner, g), 30, "joiner's recovery report")
        out["join_warm"] = joined(joiner, g) - t
        out["pause_warm"] = _pause(recoveries, c.plans[-1].generation, joiner)
        # 2. release of the idle (cold-started) spare
        await c.wait_spares(1)
        await asyncio.sleep(a.settle)
        t = await event(s.priority, Priority(release=1, request_id="rel-spare"))
        await c.wait_for(lambda: any(d.completed for _, d in decisions.get("rel-spare", [])),
                         60, "spare released")
        out["release_spare"] = [tt for tt, d in decisions["rel-spare"] if d.completed][0] - t
        # 3. release of a member (shrink at a step boundary)
        await asyncio.sleep(a.settle)
        leaving = c.plans[-1].pod_of(w)
        t = await event(s.priority, Priority(release=1, request_id="rel-member"))
        await c.wait_for(lambda: any(d.completed for _, d in decisions.get("rel-member", [])),
                         60, "member released")
        out["release_member"] = [tt for tt, d in decisions["rel-member"] if d.completed][0] - t
        out["release_member_exit"] = exits.get(leaving, time.time()) - t
        await world(w)
        out["pause_shrink"] = _pause(recoveries, c.plans[-1].generation, None)
        # 4. cold join
        await asyncio.sleep(a.settle)
        g = c.plans[-1].generation
        t = await event(s.capacity, Capacity(change=CapacityChange.add, count=1,
                                             request_id="cold"))
        await world(w + 1)
        joiner = c.plans[-1].pod_of(w)
        await c.wait_for(lambda: joined(joiner, g), 30, "joiner's recovery report")
        out["join_cold"] = joined(joiner, g) - t
        out["pause_cold"] = _pause(recoveries, c.plans[-1].generation, joiner)
        times = [h.step_time for h in c.hb.values() if h.step_time]
        out["step_time"] = statistics.median(times) if times else None
    return out


def _pause(recoveries, generation: int, joiner: str | None) -> float | None:
    """The longest pause of the replicas that stayed, from their recovery reports
    (``downtime`` = last commit before the change -> first commit after it)."""
    d = [r.downtime for r in recoveries
         if r.generation == generation and r.pod != joiner and r.downtime is not None]
    return max(d) if d else None


KEYS = [("join_warm", "capacity add -> pre-warmed spare's first step"),
        ("join_cold", "capacity add -> cold-started pod's first step"),
        ("release_spare", "priority release -> idle spare's slot free"),
        ("release_member", "priority release -> member's slot free (completed on the bus)"),
        ("release_member_exit", "priority release -> leaving member's process exited"),
        ("pause_warm", "pause of the others, pre-warmed join"),
        ("pause_cold", "pause of the others, cold join"),
        ("pause_shrink", "pause of the others, shrink"),
        ("step_time", "median step time")]


def run(a: argparse.Namespace) -> int:
    runs = []
    with tempfile.TemporaryDirectory(prefix="ceaseless-elastic-") as tmp:
        for i in range(a.repeats):
            r = asyncio.run(_one(Path(tmp) / f"r{i}", a))
            print(f"repeat {i + 1}/{a.repeats}: " + ", ".join(
                f"{k} {v:.3f}" for k, v in r.items() if v is not None), flush=True)
            runs.append(r)
    stats = {k: summary(r[k] for r in runs if r.get(k) is not None) for k, _ in KEYS}
    st = stats["step_time"]["median"] or 0.0
    targets = {
        "release_member <= step_time + 0.5 s": stats["release_member"]["median"] is not None
        and stats["release_member"]["median"] <= st + 0.5,
        "pauses < 1 s": all(stats[k]["max"] is not None and stats[k]["max"] < 1.0
                            for k in ("pause_warm", "pause_cold", "pause_shrink")),
    }
    m = machine()
    cmd = "python -m bench.elastic " + " ".join(sys.argv[1:])
    rows = "\n".join(f"| {label} | {fmt(stats[k])} |" for k, label in KEYS)
    md = (f"{HEADING}\n\n{machine_line(m)} Command: `{cmd.strip()}` ({a.repeats} repeats, "
          f"{a.workers} -> {a.workers + 1} -> {a.workers} -> {a.workers + 1} replicas, model "
          f"`{a.model}`, events published on the bus). Median (min–max).\n\n"
          f"| measure | value |\n|---|---|\n{rows}\n\n"
          "Targets: " + "; ".join(f"{k}: {'met' if v else 'NOT met'}"
                                  for k, v in targets.items()) + ".\n"
          "A join's time is dominated by the joiner itself: a cold pod first starts Python and "
          "imports torch; a pre-warmed spare only builds the group and receives the state. The "
          "replicas that stay keep training until the planned step, so their pause is the "
          "group rebuild plus the state transfer to the joiner.\n")
    res = {"config": config(a), "machine": m, "runs": runs, "stats": stats, "targets": targets}
    return emit(res, md, HEADING, a.json, not a.no_doc)


if __name__ == "__main__":
    raise SystemExit(main(__name__))
