"""Model size: peak memory per role, state transfer against the link, recovery at real sizes.

    ceaseless bench size [--models 124m] [--workers 2] [--seq-len 64] [--steps 40]
    ceaseless bench size --shape mlp [--width 4096] [--depth 6] [--scenarios join]

Per model (the example's GPT-2 shapes, synthetic tokens; or ``--shape mlp``: examples/train_mlp,
depth x Linear(width, width) + a head, 100.7M parameters at 6 x 4096), on this machine (gloo over
loopback; CPU: peak memory is the process's peak RSS, ``VmHWM``):

* ``plain``: the example alone in one process (no cluster, no bus): the baseline peak;
* ``ref``: W workers, no fault: the final parameters' sha256 to compare against;
* ``join``: W workers; at step K ``capacity add 1`` starts a cold pod that joins and receives
  the whole state from the members (striped). Each member's peak just before the event and
  after the join, the joiner's peak, the members' pause, the state bytes and the throughput
  (bytes received / the joiner's ``state_sync`` phase: plan wait and checksums included),
  and the first step after the join (the slowest pod's ``first_step`` phase: from the state
  in place to its first commit) against the median step of the same run;
* ``kill0``: W workers + 1 spare that follows rank 0, SIGKILL of rank 0 at step K: the final
  parameters against ``ref`` (bitwise), the downtime, the peaks of rank 0 while a spare
  followed it and of the promoted spare.

The link, measured in the same run: a memcpy and one loopback TCP stream (the medians of 5
transfers of 256 MiB). Figures go to docs/benchmarks.md ("Model size").
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
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import cmdline, config, emit, machine, machine_line, main

HEADING = "## Model size: memory per role, transfer against the link"
REPO = Path(__file__).resolve().parent.parent
MB = 2**20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="124m", help="comma-separated: 124m, 350m, 1b")
    p.add_argument("--shape", choices=["gpt", "mlp"], default="gpt",
                   help="gpt: --models; mlp: --depth x Linear(--width, --width) + a head")
    p.add_argument("--width", type=int, default=4096, help="--shape mlp: layer width")
    p.add_argument("--depth", type=int, default=6, help="--shape mlp: hidden layers")
    p.add_argument("--scenarios", default="plain,ref,join,kill0",
                   help="comma-separated subset of plain, ref, join, kill0 (the full table "
                        "needs all four; a subset reports what it measured)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sample (CPU: short)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--follow-wait", type=float, default=90.0,
                   help="kill0: seconds to wait for the spare to follow rank 0 before the kill")
    p.add_argument("--fault-step", type=int, default=5, help="the join / the kill after it")
    p.add_argument("--threads", type=int, default=1, help="torch threads per pod")
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def _script(a: argparse.Namespace, model: str) -> list[str]:
    W = a.workers  # a batch that W and W + 1 replicas both divide (the join)
    if a.shape == "mlp":
        return [sys.executable, "-m", "examples.train_mlp", "--width", str(a.width),
                "--depth", str(a.depth), "--steps", str(a.steps), "--global-batch-size",
                str(W * (W + 1)), "--micro-batch-size", "1", "--threads", str(a.threads)]
    return [sys.executable, "-m", "examples.train_gpt", "--model", model, "--seq-len",
            str(a.seq_len), "--steps", str(a.steps), "--global-batch-size", str(W * (W + 1)),
            "--micro-batch-size", "1", "--dropout", "0", "--threads", str(a.threads)]


def vm_hwm(pid: int) -> int | None:
    """Peak resident set of ``pid`` in bytes (None: gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# ---------------------------------------------------------------------------- the link
def memcpy_gbs(nbytes: int = 256 * MB, repeats: int = 5) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t0)
    return nbytes / statistics.median(ts) / 1e9


def tcp_gbs(nbytes: int = 256 * MB, repeats: int = 5) -> float:
    """One loopback TCP stream (the sender and the receiver in two threads of this process:
    socket calls release the GIL)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    payload = memoryview(bytearray(nbytes))
    ts: list[float] = []

    def receive(conn: socket.socket) -> None:
        buf = memoryview(bytearray(4 * MB))
        for _ in range(repeats):
            left = nbytes
            t0 = time.perf_counter()
            while left:
                n = conn.recv_into(buf, min(left, len(buf)))
                if not n:
                    return
                left -= n
            ts.append(time.perf_counter() - t0)
            conn.sendall(b"k")

    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    th = threading.Thread(target=receive, args=(conn,))
    th.start()
    for _ in range(repeats):
        cli.sendall(payload)
        cli.recv(1)
    th.join()
    for s in (cli, conn, srv):
        s.close()
    return nbytes / statistics.median(ts) / 1e9


# ---------------------------------------------------------------------------- runs
def plain_peak(a: argparse.Namespace, model: str, run_dir: Path) -> dict[str, Any]:
    """The example alone: one process, the same model and batch, no cluster. Its peak RSS is
    read from /proc while it runs (it ends with ``os._exit``: nothing runs after it)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    env["PYTHONPATH"] = str(REPO)
    t0 = time.perf_counter()
    with open(run_dir / "plain.out", "wb") as out:
        proc = subprocess.Popen(_script(a, model), env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
        peak = 0
        try:
            while proc.poll() is None:
                peak = max(peak, vm_hwm(proc.pid) or 0)
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if proc.returncode != 0 or not peak:
        raise RuntimeError(f"plain run failed ({proc.returncode}): "
                           f"{(run_dir / 'plain.out').read_text()[-2000:]}")
    return {"peak_rss": peak, "seconds": time.perf_counter() - t0}


async def cluster_run(a: argparse.Namespace, model: str, run_dir: Path,
                      scenario: str) -> dict[str, Any]:
    from ops.launcher import Cluster
    from schemas.messages import Capacity, CapacityChange, Recovery

    spares = 1 if scenario == "kill0" else 0
    recoveries: list[Recovery] = []
    out: dict[str, Any] = {"scenario": scenario}
    t_start = time.time()
    async with Cluster(run_dir, a.workers, spares, a.steps, cmd=_script(a, model),
                       timeout=600 + a.steps * 60) as c:
        async def on_rec(r: Recovery, _e: Any) -> None:
            recoveries.append(r)

        await c.bus.subscribe(c.bus.subjects.recovery, Recovery, on_rec)
        if spares:
            await c.wait_spares(spares, timeout=600)
        await c.wait_rank_step(0, a.fault_step, timeout=600 + a.fault_step * 60)
        pids = {pod: h.pid for pod, h in c.hb.items()}
        before = {pod: vm_hwm(pid) for pod, pid in pids.items()}
        members = [m.pod for m in c.plans[-1].members]
        out["members"], out["before"] = members, before
        g = c.plans[-1].generation
        t = time.time()
        if scenario == "join":
            await c.bus.publish(c.bus.subjects.capacity,
                                Capacity(change=CapacityChange.add, count=1, request_id="size"))

            def joined() -> bool:
                p = c.plans[-1]
                return (p.generation > g and p.world_size == a.workers + 1 and all(
                    (h := c.hb.get(m.pod)) is not None and h.generation == p.generation
                    and h.step >= (p.apply_step or 0) + 1 for m in p.members))

            try:
                await c.wait_for(joined, 900, "the joiner training")
            except AssertionError as e:  # the job ended first: the join came too late
                raise RuntimeError(f"join: the joiner never trained a step after the join "
                                   f"(plan at step {c.plans[-1].apply_step} of {a.steps}: "
                                   "give more --steps or an earlier --fault-step)") from e
            out["after"] = {pod: vm_hwm(h.pid) for pod, h in c.hb.items()}
            out["joiner"] = c.plans[-1].pod_of(a.workers)
        elif scenario == "kill0":
            spare = out["spare"] = [pod for pod in pids if pod not in members][0]
            # a hot spare holds a committed step once it follows rank 0: wait for that (up to
            # --follow-wait), then kill; a spare that never got there is reported as such
            try:
                await c.wait_for(lambda: (h := c.hb.get(spare)) is not None and h.step >= 0,
                                 a.follow_wait, "the spare following rank 0")
            except (AssertionError, TimeoutError):
                pass
            h = c.hb.get(spare)
            out["spare_step_at_kill"] = h.step if h is not None else None
            out["rank0_step_at_kill"] = (c.hb[members[0]].step if members[0] in c.hb else None)
            out["spare_following_after_s"] = (time.time() - t_start
                                              if h is not None and h.step >= 0 else None)
            before = out["before"] = {pod: vm_hwm(pid) for pod, pid in pids.items()}
            kill_step = out["rank0_step_at_kill"] or a.fault_step
            os.kill(pids[members[0]], signal.SIGKILL)
            out["killed"] = members[0]

            def recovered() -> bool:
                p = c.plans[-1]
                h = c.hb.get(out["spare"])
                return p.generation > g and h is not None and h.generation == p.generation \
                    and h.step >= kill_step + 2

            await c.wait_for(recovered, 900, "the promoted spare training")
            out["after"] = {pod: vm_hwm(h.pid) for pod, h in c.hb.items()
                            if pod != members[0]}
        code = await c.finish(timeout=600 + a.steps * 60)
        summ = c.summary()
    if code != 0:
        raise RuntimeError(f"{scenario}: cluster exited {code}:\n{c.output()[-3000:]}")
    out["t_event"] = t
    out["param_sha256"] = summ.get("param_sha256")
    out["final_step"] = summ.get("final_step")
    out["lost_steps"] = summ.get("lost_steps")
    out["recoveries"] = [r.model_dump(mode="json") for r in recoveries if r.generation > g]
    out["median_step_s"] = _median_step(run_dir)
    out["commits"] = {f.stem: json.loads(f.read_text()).get("commits", [])
                      for f in (run_dir / "results").glob("*.json")}
    return out


def _gaps(commits: dict[str, list], keep: Any) -> list[float]:
    """Every pod's gaps between the commits of consecutive steps ``keep(step)`` admits."""
    out = []
    for cs in commits.values():
        for (s0, t0), (s1, t1) in zip(cs, cs[1:]):
            if s1 == s0 + 1 and keep(s1):
                out.append(float(t1) - float(t0))
    return out


def _median_step(run_dir: Path) -> float | None:
    """The median time between consecutive commits of every pod (its results file)."""
    diffs = []
    for f in (run_dir / "results").glob("*.json"):
        ts = [float(t) for _, t in json.loads(f.read_text()).get("commits", [])]
        diffs += [b - x for x, b in zip(ts, ts[1:])]
    return statistics.median(diffs) if diffs else None


def join_figures(join: dict[str, Any]) -> dict[str, Any]:
    """The join's figures against the median step of the same run: the first step after it
    (each pod's ``first_step`` phase: from its state in place to its first commit), the
    members' pause and the joiner's ``state_sync``."""
    step = join.get("median_step_s") or 0.0
    recs = join["recoveries"]
    # the steps before the join (W workers) and after its first step (W + 1 on the same
    # cores): the first step after the join against both
    at = min((r["restore_step"] for r in recs), default=None)
    commits = join.get("commits") or {}
    before = _gaps(commits, lambda s: at is not None and s <= at)
    after = _gaps(commits, lambda s: at is not None and s >= at + 2)
    med_before = statistics.median(before) if before else None
    med_after = statistics.median(after) if after else None
    first = {r["pod"]: r["phases"].get("first_step", 0.0) for r in recs}
    pauses = [r["downtime"] for r in recs
              if r["pod"] != join["joiner"] and r["downtime"] is not None]
    worst = max(first.values(), default=None)
    return {"join_median_step_s": step, "join_first_step_s": first,
            "join_first_step_vs_median": worst / step if worst is not None and step else None,
            "join_median_before_s": med_before, "join_median_after_s": med_after,
            "join_first_step_vs_after": (worst / med_after if worst is not None and med_after
                                         else None),
            "join_state_sync_s": max((r["phases"].get("state_sync", 0.0) for r in recs
                                      if r["pod"] == join["joiner"]), default=None),
            "join_members_pause_s": max(pauses) - step if pauses else None}


def join_line(model: str, f: dict[str, Any]) -> str:
    firsts = ", ".join(f"{p} {v:.2f} s" for p, v in sorted(f["join_first_step_s"].items()))
    return (f"{model}: median step {f['join_median_step_s']:.2f} s; first step after the join "
            f"{f['join_first_step_vs_median'] or 0:.2f}x the median ({firsts}; median "
            f"before the join {f.get('join_median_before_s') or 0:.2f} s, after its first "
            f"step {f.get('join_median_after_s') or 0:.2f} s: "
            f"{f.get('join_first_step_vs_after') or 0:.2f}x that); joiner "
            f"state_sync {f['join_state_sync_s'] or 0:.2f} s; members' pause beyond a median "
            f"step {f['join_members_pause_s'] or 0:.2f} s")


def analyse(model: str, plain: dict[str, Any], ref: dict[str, Any], join: dict[str, Any],
            kill: dict[str, Any], link: dict[str, float]) -> dict[str, Any]:
    base = plain["peak_rss"]
    members = join["members"]
    member_before = max(join["before"][p] for p in members)
    growth = {p: join["after"][p] / join["before"][p] for p in members}
    joiner = join["joiner"]
    jrec = [r for r in join["recoveries"] if r["pod"] == joiner]
    brecv = max((r["bytes_received"] for r in jrec), default=0)
    sync = max((r["phases"].get("state_sync", 0.0) for r in jrec), default=0.0)
    pauses = [r["downtime"] for r in join["recoveries"]
              if r["pod"] != joiner and r["downtime"] is not None]
    kdown = [r["downtime"] for r in kill["recoveries"] if r["downtime"] is not None]
    step = ref.get("median_step_s") or 0.0
    spare = kill["spare"]
    r0_before = kill["before"][kill["members"][0]]
    res = {
        "model": model, "plain_peak_gb": base / 1e9,
        "member_peak_gb": member_before / 1e9,
        "member_vs_plain": member_before / base,
        "member_growth_on_join": growth,
        "joiner_peak_gb": join["after"][joiner] / 1e9,
        "joiner_vs_member": join["after"][joiner] / member_before,
        "rank0_with_spare_vs_plain": r0_before / base,
        "spare_vs_plain": kill["after"][spare] / base,
        "state_gb": brecv / 1e9, "state_sync_s": sync,
        "transfer_gbs": brecv / sync / 1e9 if sync else None,
        "link_tcp_gbs": link["tcp_gbs"], "link_memcpy_gbs": link["memcpy_gbs"],
        "median_step_s": step,
        # the longest gap between a survivor's commits across the event, less a median step
        "join_pause_s": max(pauses) - step if pauses else None,
        "kill0_downtime_s": max(kdown) - step if kdown else None,
        "kill0_spare_step_at_kill": kill.get("spare_step_at_kill"),
        "kill0_rank0_step_at_kill": kill.get("rank0_step_at_kill"),
        "spare_following_after_s": kill.get("spare_following_after_s"),
        "kill0_bitwise": kill["param_sha256"] is not None
        and kill["param_sha256"] == ref["param_sha256"],
        "kill0_lost_steps": kill["lost_steps"],
        # a spare that followed rank 0 receives nothing at promotion
        "kill0_spare_received_gb": max((r.get("bytes_received", 0) for r in kill["recoveries"]
                                        if r["pod"] == spare), default=0) / 1e9,
    }
    res["transfer_vs_link"] = (res["transfer_gbs"] / link["tcp_gbs"]
                               if res["transfer_gbs"] else None)
    return res


def markdown(res: dict[str, Any], a: argparse.Namespace) -> str:
    m = res["machine"]
    rows = []
    for r in res["models"]:
        g = ", ".join(f"{p} {v:.2f}x" for p, v in r["member_growth_on_join"].items())
        rows.append(
            f"| {r['model']} | {r['plain_peak_gb']:.2f} GB | {r['member_vs_plain']:.2f}x | "
            f"{g} | {r['joiner_vs_member']:.2f}x | {r['rank0_with_spare_vs_plain']:.2f}x | "
            f"{r['spare_vs_plain']:.2f}x | {r['state_gb']:.2f} GB in {r['state_sync_s']:.2f} s "
            f"({(r['transfer_gbs'] or 0):.2f} GB/s, {100 * (r['transfer_vs_link'] or 0):.0f} % "
            f"of TCP {r['link_tcp_gbs']:.2f} GB/s) | {r['join_pause_s'] or 0:.2f} s | "
            f"{r['kill0_downtime_s'] or 0:.2f} s, {'bitwise' if r['kill0_bitwise'] else 'NOT bitwise'}"
            f", the spare received {r['kill0_spare_received_gb']:.2f} GB (it held step "
            f"{r['kill0_spare_step_at_kill']} when rank 0 was at "
            f"{r['kill0_rank0_step_at_kill']}) |")
    return (f"{HEADING}\n\n{machine_line(m)} Command: `{cmdline('size')}` ({a.workers} workers, "
            f"sequence {a.seq_len}, micro-batch 1, global batch {a.workers * (a.workers + 1)}, "
            f"{a.steps} steps, the join at step {a.fault_step}, the kill once the spare follows "
            f"(at most {a.follow_wait:.0f} s later); memcpy {res['link']['memcpy_gbs']:.1f} GB/s measured in the same "
            f"run; median step {res['models'][0]['median_step_s'] or 0:.2f} s). Peaks are each "
            "process's "
            "peak RSS (`VmHWM`); *plain* is the example alone in one process; pauses and "
            "downtimes are the longest gap between a survivor's commits across the event, less "
            "the median step.\n\n"
            "| model | plain peak | member / plain | members after a join / before | joiner / "
            "member | rank 0 with a following spare / plain | promoted spare / plain | state "
            "received by the joiner | pause of the members (join) | rank-0 kill with a spare |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n\n"
            + "".join(f"* {join_line(r['model'], r)}\n" for r in res["models"]
                      if "join_median_step_s" in r))


SCENARIOS = ("plain", "ref", "join", "kill0")


def run(a: argparse.Namespace) -> int:
    scenarios = [x.strip() for x in a.scenarios.split(",") if x.strip()]
    if bad := [x for x in scenarios if x not in SCENARIOS]:
        raise SystemExit(f"--scenarios: unknown {', '.join(bad)} (of {', '.join(SCENARIOS)})")
    link = {"memcpy_gbs": memcpy_gbs(), "tcp_gbs": tcp_gbs()}
    print(f"link: memcpy {link['memcpy_gbs']:.2f} GB/s, loopback TCP {link['tcp_gbs']:.2f} GB/s",
          flush=True)
    models = []
    names = ([f"mlp{a.depth}x{a.width}"] if a.shape == "mlp"
             else [m.strip() for m in a.models.split(",") if m.strip()])
    with tempfile.TemporaryDirectory(prefix="ceaseless-size-") as tmp:
        root = Path(a.work_dir or tmp)
        for model in names:
            runs: dict[str, Any] = {}
            if "plain" in scenarios:
                runs["plain"] = plain_peak(a, model, root / f"{model}-plain")
                print(f"{model} plain: peak {runs['plain']['peak_rss'] / 1e9:.2f} GB", flush=True)
            for sc in ("ref", "join", "kill0"):
                if sc in scenarios:
                    runs[sc] = asyncio.run(cluster_run(a, model, root / f"{model}-{sc}", sc))
                    print(f"{model} {sc}: done (final step {runs[sc]['final_step']})",
                          flush=True)
            r: dict[str, Any] = {"model": model}
            if all(sc in runs for sc in SCENARIOS):
                r = analyse(model, runs["plain"], runs["ref"], runs["join"], runs["kill0"], link)
            if "join" in runs:
                r.update(join_figures(runs["join"]))
                print(join_line(model, r), flush=True)
            r["runs"] = runs
            print(json.dumps({k: v for k, v in r.items() if k != "runs"}, indent=1), flush=True)
            models.append(r)
    res = {"config": config(a), "machine": machine(), "link": link, "models": models}
    if not all(sc in scenarios for sc in SCENARIOS):  # a subset: no table to write
        if a.write_doc:
            raise SystemExit("--write-doc needs every scenario")
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1, default=str))
        return 0
    return emit(res, markdown(res, a), HEADING, a.json, a.write_doc)


if __name__ == "__main__":
    raise SystemExit(main(__name__))
