"""torchft baseline of ``bench recovery`` (systems ``torchftMS``, MS = the lighthouse's heartbeat
timeout in ms): one process per replica group (group world size 1), torchft's ``Manager``
with a gloo ``ProcessGroupGloo``, its lighthouse (``torchft_lighthouse``) on 127.0.0.1.

Needs ``torchft-nightly`` (``pip install --no-deps torchft-nightly==2026.10.26``; its other
requirements, opentelemetry-api/sdk/exporter-otlp-proto-http, are already Ceaseless' own);
it is never a requirement of Ceaseless itself.

The worker trains the same model, data, global batch, micro-batches, AdamW and scheduler as
``examples/train_gpt.py``. Each step: ``start_quorum`` (synchronous), this replica's share of
the micro-batches (``micro_batch_range`` over the quorum's participants, so the global batch
stays the same when a replica is gone), one flat-buffer ``manager.allreduce`` (AVG) of the
gradients, ``should_commit``; on commit the optimizer and scheduler step and the worker
appends ``step wall-time participants`` to ``<dir>/commits/replica<R>.txt``.

The orchestrator (:func:`run_once`) SIGKILLs one replica once it has committed the fault
step; the survivors go on without it (torchft has no spare). From the survivors' commit
files: **downtime** = longest gap between commits around the kill minus the median step time,
**kill -> next step**, **back at step**, and **steps recomputed** (steps committed twice;
torchft discards the failed step rather than rolling back, so this is expected to be 0).

With ``replace`` (systems ``torchftMShttp`` / ``torchftMSpg``) the orchestrator starts a new
process for the killed replica group right after the kill (what torchelastic does for a
replica group), with the same replica id; it joins the quorum and heals from a survivor over
torchft's checkpoint transport, ``HTTPTransport`` (the default) or ``PGTransport`` (over the
replica process group). Extra figures: **kill -> full size** (the first step committed with
every replica again), **heal** (kill -> the replacement's first commit) and **join stall**
(when the survivors ran a smaller quorum first: their longest commit gap until the quorum was
full again, minus the step time: the cost of the heal to the replicas that serve it).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[2]
# torchft's collective timeout (ProcessGroupGloo and Manager) in every benchmark that runs it
TORCHFT_TIMEOUT = 10.0


def available() -> str | None:
    """None if torchft imports; else why not."""
    try:
        import torchft  # noqa: F401
        from torchft._torchft import LighthouseServer  # noqa: F401
    except Exception as e:  # ImportError, or a binary built for another torch
        return f"{type(e).__name__}: {e}"
    return None


# ---------------------------------------------------------------------------- the worker
def worker(a: argparse.Namespace) -> None:
    import logging
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torchft import Manager, ProcessGroupGloo

    from agent.data.order import order_for
    from examples.train_gpt import build_model, load_dataset, seq_len_of
    from schemas.batching import micro_batch_range, num_micro_batches

    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(a.threads)
    d = Path(a.dir)
    (d / "commits").mkdir(parents=True, exist_ok=True)
    name = f"replacement{a.replica}" if a.replacement else f"replica{a.replica}"
    log = open(d / "commits" / f"{name}.txt", "a", buffering=1)
    log.write(f"# pid {os.getpid()}\n")
    dataset, vocab = load_dataset(a.data, seq_len_of(a.model))
    torch.manual_seed(a.seed)
    net = build_model(a.model, vocab, dropout=0.1)
    opt = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, a.steps))

    def state_dict():
        return {"model": net.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}

    def load_state_dict(st):
        net.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        sched.load_state_dict(st["scheduler"])

    store = dist.TCPStore("127.0.0.1", a.store_port, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout))
    transport = None  # torchft's default: HTTPTransport
    if a.transport == "pg":
        from torchft.checkpointing.pg_transport import PGTransport

        transport = PGTransport(pg, timeout=timedelta(seconds=a.pg_timeout),
                                device=torch.device("cpu"))
    manager = Manager(pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
                      checkpoint_transport=transport,
                      min_replica_size=a.min_replicas, use_async_quorum=False,
                      rank=0, world_size=1, store_addr="127.0.0.1", store_port=a.store_port,
                      lighthouse_addr=a.lighthouse, replica_id=f"replica{a.replica}",
                      hostname="127.0.0.1", timeout=timedelta(seconds=a.pg_timeout),
                      quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))
    B, m = a.global_batch_size, a.micro_batch_size
    M = num_micro_batches(B, m)
    order = order_for(dataset, B, a.seed)
    params = [p for p in net.parameters()]
    while manager.current_step() < a.steps:
        opt.zero_grad(set_to_none=False)
        manager.start_quorum()
        s = manager.current_step()
        world, rank = manager.num_participants(), manager.participating_rank()
        mine = list(micro_batch_range(M, world, rank if rank is not None else 0))
        net.train()
        for k in mine:
            x, y = dataset.batch(order.indices(s, k, m))
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
            # the AVG all-reduce divides by the participants: scale so the result is the
            # mean over the global batch
            (loss * (m * world / B)).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        manager.allreduce(flat).wait()
        if manager.should_commit():
            off = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[off:off + n].view_as(p))
                off += n
            opt.step()
            sched.step()
            log.write(f"{s} {time.time():.6f} {world}\n")
    log.close()
    manager.shutdown(wait=False)
    del store


# ---------------------------------------------------------------------------- orchestrator
def read_commits(d: Path, prefix: str = "replica") -> dict[int, dict[str, Any]]:
    out = {}
    for f in sorted((d / "commits").glob(f"{prefix}[0-9]*.txt")):
        rec: dict[str, Any] = {"pid": None, "commits": []}
        for ln in f.read_text().splitlines():
            p = ln.split()
            if len(p) >= 3 and p[0] == "#" and p[1] == "pid":
                rec["pid"] = int(p[2])
            elif len(p) == 3 and p[0] != "#":
                try:
                    rec["commits"].append((int(p[0]), float(p[1]), int(p[2])))
                except ValueError:
                    pass
        out[int(f.stem[len(prefix):])] = rec
    return out


def starter(d: Path, env: dict[str, str], procs: list[subprocess.Popen]
            ) -> Callable[[list[str], str], subprocess.Popen]:
    """``start(cmd, name)``: run ``cmd`` with its output in ``d/<name>.out``, appended to
    ``procs`` and to ``d/torchft.pids`` (the tests clean up by PID)."""
    def start(cmd: list[str], name: str) -> subprocess.Popen:
        out = open(d / f"{name}.out", "wb")
        p = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL)
        out.close()
        procs.append(p)
        with open(d / "torchft.pids", "a") as f:
            f.write(f"{name} {p.pid}\n")
        return p
    return start


def run_once(d: Path, a: argparse.Namespace, heartbeat_ms: int, data: Path, fault_step: int,
             victim: int, timeout: float, replace: str | None = None) -> dict[str, Any]:
    """One run; ``replace`` = ``"http"`` or ``"pg"``: restart the killed replica group right
    after the kill, healing over that checkpoint transport (None: not replaced)."""
    from services.common.natsserver import free_port

    d.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen] = []
    lh_port = free_port()
    start = starter(d, env, procs)

    lh_bin = str(Path(sys.executable).parent / "torchft_lighthouse")
    t_kill = None
    deadline = time.monotonic() + timeout
    try:
        start([lh_bin, "--bind", f"127.0.0.1:{lh_port}", "--min_replicas",
               str(max(1, a.workers - 1)), "--join_timeout_ms", "60000", "--quorum_tick_ms",
               "100", "--heartbeat_timeout_ms", str(heartbeat_ms)], "lighthouse")
        def cmd(r: int, *extra: str) -> list[str]:
            return [sys.executable, "-m", "bench.baselines.torchft_bench", "worker", "--dir", str(d),
                    "--replica", str(r), "--steps", str(a.steps), "--model", a.model,
                    "--data", str(data), "--global-batch-size", str(a.global_batch_size),
                    "--micro-batch-size", str(a.micro_batch_size), "--min-replicas",
                    str(max(1, a.workers - 1)), "--lighthouse", f"http://127.0.0.1:{lh_port}",
                    "--store-port", str(free_port()), "--pg-timeout",
                    str(getattr(a, "torchft_timeout", TORCHFT_TIMEOUT)),
                    "--transport", replace or "http",
                    *extra]

        workers = [start(cmd(r), f"replica{r}") for r in range(a.workers)]
        while t_kill is None:
            if any(p.poll() is not None for p in workers):
                raise RuntimeError(f"a torchft replica exited before the fault: see {d}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"torchft: replica {victim} did not reach step {fault_step}")
            recs = read_commits(d)
            # every replica in the quorum (the full global batch) and the victim at the step
            v = recs.get(victim)
            full = len(recs) == a.workers and all(
                any(c[2] == a.workers for c in rec["commits"]) for rec in recs.values())
            if (full and v and v["commits"] and v["pid"]
                    and v["commits"][-1][0] >= fault_step and v["commits"][-1][2] == a.workers):
                t_kill = time.time()
                os.kill(v["pid"], signal.SIGKILL)
                break
            time.sleep(0.01)
        repl = start(cmd(victim, "--replacement"), f"replacement{victim}") if replace else None
        for r, p in enumerate(workers):
            if r == victim:
                continue
            p.wait(max(1.0, deadline - time.monotonic()))
            if p.returncode != 0:
                raise RuntimeError(f"torchft replica {r} exited {p.returncode}: see {d}")
        if repl is not None:
            # a replacement that had not joined when the survivors finished waits for a
            # quorum that never comes: reported as not healed, not as a failed run
            try:
                repl.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:  # by PID
            if p.poll() is None:
                p.kill()
                p.wait(5)
    res = analyse(d, t_kill, victim, heartbeat_ms, replaced=bool(replace))
    if replace:
        res |= analyse_replacement(d, t_kill, victim, res)
    res["replaced"] = replace
    return res


def analyse_replacement(d: Path, t_kill: float, victim: int, res: dict[str, Any]
                        ) -> dict[str, Any]:
    """Figures of the replacement: kill -> its first commit (heal), kill -> the first step
    with every replica again and, when a smaller quorum ran before the replacement joined,
    the survivors' longest commit gap from their first recovered step to their first step at
    full size (what serving the heal cost them) minus their median step time. A replacement
    that joined while the survivors still waited on the dead replica has no join stall."""
    recs = read_commits(d)
    full, pre_kill = res["participants_before"], res["pre_kill_step"]
    mine = read_commits(d, "replacement").get(victim, {"commits": []})["commits"]
    stalls, back_full = [], []
    for r, rec in recs.items():
        if r == victim:
            continue
        cs = [c for c in rec["commits"] if c[1] >= t_kill and c[0] > pre_kill]
        k = next((i for i, c in enumerate(cs) if c[2] == full), None)
        if k is None:
            continue
        back_full.append(cs[k][1])
        if k > 0:  # its first recovered step ran without the replacement
            stalls.append(max(b[1] - a[1] for a, b in zip(cs, cs[1:k + 1]))
                          - res["median_step_s"])
    return {"heal_s": (mine[0][1] - t_kill) if mine else None,
            "full_size_s": (min(back_full) - t_kill) if back_full else None,
            "join_stall_s": max(stalls) if stalls else None,
            "replacement_steps": len(mine)}


def analyse(d: Path, t_kill: float, victim: int, heartbeat_ms: int,
            replaced: bool = False) -> dict[str, Any]:
    """The survivors' figures. The recovered job's first step is the first commit by a
    smaller quorum or, when the replica is restarted (``replaced``), the first commit after
    the kill whatever its quorum: a replacement that joins before the survivors give up on the
    dead one (gloo's timeout) goes straight back to full size."""
    from bench.common import window_gap

    recs = read_commits(d)
    full = max(c[2] for rec in recs.values() for c in rec["commits"])
    # the highest step committed anywhere before the kill (the victim's included)
    pre_kill = max(c[0] for rec in recs.values() for c in rec["commits"] if c[1] < t_kill)
    gaps, to_step, back, meds, redone = [], [], [], [], 0
    for r, rec in recs.items():
        cs = rec["commits"]
        if r == victim:
            continue
        before = [c for c in cs if c[1] < t_kill]
        # the recovered job's first step: the first commit by the smaller quorum
        # (steps up to pre_kill committed after the kill are the step in flight, which the
        # victim had already committed)
        after = [c for c in cs if c[1] >= t_kill and (c[0] > pre_kill if replaced
                                                      else c[2] < full)]
        if not before or not after:
            continue
        meds.append(statistics.median(b[1] - a[1] for a, b in zip(cs, cs[1:])))
        gaps.append((window_gap([(c[0], c[1]) for c in cs], t_kill, after[0][1])
                     or after[0][1] - before[-1][1]) - meds[-1])
        to_step.append(after[0][1] - t_kill)
        steps = [c[0] for c in cs]
        redone = max(redone, len(steps) - len(set(steps)))
        nxt = [c[1] for c in cs if c[0] > pre_kill and c[1] >= t_kill]
        if nxt:
            back.append(nxt[0] - t_kill)
    if not gaps:
        raise RuntimeError(f"torchft: no survivor committed on both sides of the kill in {d}")
    return {"heartbeat_ms": heartbeat_ms, "rank": victim, "pre_kill_step": pre_kill,
            "downtime_s": max(gaps), "kill_to_step_s": max(to_step),
            "back_at_step_s": max(back) if back else None, "recomputed_steps": redone,
            "median_step_s": statistics.median(meds), "participants_before": full,
            "final_step": max(c[0] for rec in recs.values() for c in rec["commits"]),
            "run_dir": str(d)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("worker", help="one replica group (one process)")
    w.add_argument("--dir", required=True)
    w.add_argument("--replica", type=int, required=True)
    w.add_argument("--steps", type=int, default=30)
    w.add_argument("--model", default="small")
    w.add_argument("--data", required=True)
    w.add_argument("--global-batch-size", type=int, default=32)
    w.add_argument("--micro-batch-size", type=int, default=4)
    w.add_argument("--lr", type=float, default=3e-3)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--threads", type=int, default=1)
    w.add_argument("--min-replicas", type=int, default=1)
    w.add_argument("--lighthouse", required=True)
    w.add_argument("--store-port", type=int, required=True)
    w.add_argument("--pg-timeout", type=float, default=TORCHFT_TIMEOUT)
    w.add_argument("--transport", choices=("http", "pg"), default="http",
                   help="torchft's checkpoint transport for healing (default: http)")
    w.add_argument("--replacement", action="store_true",
                   help="this process replaces a killed replica group (own commit file)")
    worker(p.parse_args(argv))


if __name__ == "__main__":
    main()
