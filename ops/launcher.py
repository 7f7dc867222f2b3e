"""Run a `ceaseless up` cluster as a child process and watch it over the bus.

Used by the end-to-end tests and the benchmarks: everything it starts is recorded in the
run dir's ``pids.txt`` and cleaned up by PID (never by name).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from schemas.messages import Heartbeat, HeartbeatBatch, Plan, PlanRef
from plumbing.bus import Bus, Credentials, Envelope
from plumbing.plan_wire import PLAN_MODELS, resolve
from services.actuator.local import proc_start

REPO = Path(__file__).resolve().parent.parent


class Cluster:
    def __init__(self, run_dir: Path, workers: int, spares: int, steps: int,
                 extra: list[str] | None = None, cmd: list[str] | None = None,
                 timeout: float = 240.0, replace: bool = False, shard_size: int = 1) -> None:
        self.run_dir = run_dir
        self.argv = [sys.executable, "-m", "ops.cli", "up", "--run-dir", str(run_dir),
                     "--workers", str(workers), "--spares", str(spares), "--steps", str(steps),
                     "--quiet", "--timeout", str(timeout),
                     # Tests compare against fault-free runs of the full world size: on a
                     # loaded machine the first plan must not start without a slow worker.
                     "--start-timeout", "120",
                     # Replacement pods are `up`'s default; runs that compare plans and world
                     # sizes with a fixed pool of spares opt in (replace=True).
                     *([] if replace else ["--no-replace"]),
                     *(["--shard-size", str(shard_size)] if shard_size > 1 else []),
                     *(extra or [])]
        if cmd:
            self.argv += ["--", *cmd]
        self.proc: subprocess.Popen | None = None
        self.bus: Bus | None = None
        self.hb: dict[str, Heartbeat] = {}
        self.plans: list[Plan] = []          # the attached job's (since the last restart)
        self.all_plans: list[Plan] = []      # every plan seen, across restarts
        self.timeout = timeout
        self.attached_dir: Path | None = None  # the job dir whose bus we are connected to
        self._closing: set[asyncio.Future] = set()  # old buses closing in the background
        # called with the bus after every (re)attach: extra subscriptions
        self.on_attach: list[Callable[[Bus], Awaitable[None]]] = []

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> "Cluster":
        self.run_dir.mkdir(parents=True, exist_ok=True)
        out = open(self.run_dir / "up.out", "wb")
        # without pytest's per-test variable: no pod reads it, and it would keep the pods from
        # forking from a shared zygote (CEASELESS_ZYGOTE: its environment must be theirs)
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO, env=env)
        out.close()
        info_path = self.run_dir / "cluster.json"
        deadline = time.monotonic() + 30
        while not info_path.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"ceaseless up exited early: {self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError("cluster.json did not appear")
            await asyncio.sleep(0.05)
        await self._attach(self.run_dir)
        return self

    async def _attach(self, job_dir: Path) -> None:
        info = json.loads((job_dir / "cluster.json").read_text())
        from plumbing.tlsgen import client_options

        self.bus = await Bus.connect(info["nats_url"], info["job"], "test-harness",
                                     Credentials.load(info["creds"]),
                                     **client_options(info.get("tls_ca")))
        self.attached_dir = job_dir
        await self.bus.subscribe(self.bus.subjects.heartbeat(), Heartbeat, self._on_hb)
        # pods with CEASELESS_HOST: their host's relay sends them in one message (issue 45)
        await self.bus.subscribe(self.bus.subjects.heartbeats(), HeartbeatBatch, self._on_batch)
        await self.bus.subscribe(self.bus.subjects.plan, PLAN_MODELS, self._on_plan)
        for cb in self.on_attach:
            await cb(self.bus)

    def job_dir(self) -> Path:
        """The directory of the job `up` runs now: the run dir, or after a total loss the
        restart it started (``restart-N/``, nested: a restart's own restart is inside it),
        once its ``cluster.json`` is there."""
        d = self.run_dir
        while True:
            subs = [p for p in _restarts(d) if (p / "cluster.json").exists()]
            if not subs:
                return d
            d = subs[-1]

    async def reattach(self, job_dir: Path | None = None) -> bool:
        """Follow `up` to the job it restarted after a total loss: a new nats-server (new
        port, new credentials), plans from generation 1 again, pod ids reused. Drops the
        old bus and the old job's view (heartbeats, plans; ``all_plans`` keeps them).
        False if there is nothing new to attach to."""
        job_dir = job_dir or self.job_dir()
        if job_dir == self.attached_dir:
            return False
        # The old bus is closed in the background and the new one connected within a time
        # limit: the soak (seed 5150, the 17th restart) lost its harness for good when one
        # of these hung with no bus left (every later request an AttributeError). A failed
        # attach raises and leaves no half-attached bus; the caller tries again.
        old, self.bus = self.bus, None
        if old is not None:
            self._closing.add(asyncio.ensure_future(_close_quietly(old)))
            self._closing = {t for t in self._closing if not t.done()}
        self.hb, self.plans = {}, []
        try:
            await asyncio.wait_for(self._attach(job_dir), ATTACH_TIMEOUT)
        except BaseException:
            half, self.bus, self.attached_dir = self.bus, None, None
            if half is not None:
                self._closing.add(asyncio.ensure_future(_close_quietly(half)))
            raise
        return True

    async def __aexit__(self, *exc: Any) -> None:
        await self._close_bus()
        self.cleanup()

    async def _close_bus(self) -> None:
        bus, self.bus = self.bus, None
        if bus is not None:
            await _close_quietly(bus)

    def cleanup(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        # Anything `up` started that is still alive (it records every child's pid).
        for name, pid in self.live():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def pids(self) -> list[tuple[str, int]]:
        """Every child `up` recorded, in this run dir and in its restarts (restart-N/,
        nested), oldest first."""
        return [(name, pid) for name, pid, _ in recorded(self.run_dir)]

    def live(self) -> list[tuple[str, int]]:
        """The recorded children that are still running (the same processes, not a later
        one that reuses a pid)."""
        return [(n, pid) for n, pid, start in recorded(self.run_dir)
                if _ours(pid, str(self.run_dir), start)]

    def output(self) -> str:
        try:
            return (self.run_dir / "up.out").read_text()[-4000:]
        except OSError:
            return ""

    def pod_tails(self, lines: int = 8, width: int = 240) -> str:
        """The last ``lines`` lines of every pod's log (for a failed test's message: what a
        pod that never came back was doing, gone with the temporary directory otherwise)."""
        out = []
        for log in sorted((self.run_dir / "logs").glob("*.log")):
            try:
                tail = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"--- {log.name}")
            out.extend(line[:width] for line in tail)
        return "\n".join(out)

    # ------------------------------------------------------------------ observation
    async def _on_hb(self, h: Heartbeat, env: Envelope) -> None:
        self.hb[h.pod] = h

    async def _on_batch(self, batch: HeartbeatBatch, env: Envelope) -> None:
        for h in batch.beats:
            self.hb[h.pod] = h

    async def _on_plan(self, msg: Plan | PlanRef, env: Envelope) -> None:
        p = msg if isinstance(msg, Plan) else await resolve(
            await self.bus.kv(), msg, self.plans[-1] if self.plans else None)
        self.plans.append(p)
        self.all_plans.append(p)

    async def wait_for(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if self.proc.poll() is not None:
                raise AssertionError(f"cluster exited ({self.proc.returncode}) while waiting for "
                                     f"{what}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.output()}")
            await asyncio.sleep(0.02)

    async def inject_ahead(self, action: Any, rank: int, ahead: int = 4, tries: int = 5,
                           timeout: float = 30.0) -> int:
        """Inject ``action`` into rank ``rank`` at a step ``ahead`` of the one its last
        heartbeat said, and wait for the pod's answer: the step it accepted. A step that
        passed before the injection arrived (a loaded machine: the heartbeat lags the
        steps) is refused by the pod; then again, further ahead. A bare publish vanished so
        in CI (the job ran fault-free)."""
        from schemas.messages import Decision, Inject

        answers: asyncio.Queue = asyncio.Queue()

        async def on(d: Decision, _e: Envelope) -> None:
            answers.put_nowait(d)
        sub = await self.bus.subscribe(self.bus.subjects.decision, Decision, on)
        try:
            for k in range(tries):
                h = self.member(rank)
                at = (h.step if h is not None else 0) + ahead * (k + 1)
                inj = Inject(action=action, rank=rank, at_step=at)
                await self.bus.publish(self.bus.subjects.inject, inj)
                deadline = time.monotonic() + timeout
                while True:
                    try:
                        d = await asyncio.wait_for(answers.get(),
                                                   max(0.01, deadline - time.monotonic()))
                    except asyncio.TimeoutError:
                        raise AssertionError(f"no answer to the injection {inj}") from None
                    if d.request_id == inj.request_id:
                        break
                if d.accepted:
                    return at
            raise AssertionError(f"injection refused {tries} times, last: {d.reason}")
        finally:
            await sub.unsubscribe()

    def member(self, rank: int) -> Heartbeat | None:
        for h in self.hb.values():
            if h.rank == rank and h.role.value == "worker" and h.state.value == "training":
                return h
        return None

    async def wait_rank_step(self, rank: int, step: int, timeout: float = 120) -> Heartbeat:
        return await self.wait_for(
            lambda: (h := self.member(rank)) is not None and h.step >= step and h,
            timeout, f"rank {rank} at step {step}")

    async def wait_spares(self, n: int, timeout: float = 120) -> None:
        """Wait until ``n`` spares heartbeat: a fault before they register shrinks instead."""
        if n > 0:
            await self.wait_for(
                lambda: sum(1 for h in self.hb.values() if h.role.value == "spare") >= n,
                timeout, f"{n} spares registered")

    async def finish(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout or self.timeout)
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"cluster did not finish:\n{self.output()}")
            await asyncio.sleep(0.1)
        await self._close_bus()  # the server is gone with `up`: no reconnect noise
        return self.proc.returncode

    def summary(self) -> dict:
        return json.loads((self.run_dir / "summary.json").read_text())


ATTACH_TIMEOUT = 20.0  # connect + subscribe to a restarted job's new server


async def _close_quietly(bus: Bus) -> None:
    """Close a bus, at most 3 s, whatever it raises: a closing client must not hold up its
    owner (nats-py's drain can outlive a cancelled wait on a lost server)."""
    task = asyncio.ensure_future(bus.close())
    done, _ = await asyncio.wait({task}, timeout=3)
    if not done:
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        pass  # retrieved: no "exception was never retrieved" noise


def job_dirs(run_dir: Path) -> list[Path]:
    """``run_dir`` and every restart `up` made in it after a total loss (``restart-N/``,
    a restart's own restarts nested inside it), oldest first."""
    out, todo = [], [run_dir]
    while todo:
        d = todo.pop(0)
        out.append(d)
        todo += _restarts(d)
    return out


def _restarts(d: Path) -> list[Path]:
    found = [p for p in d.glob("restart-*") if p.name[len("restart-"):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len("restart-"):]))


def recorded(run_dir: Path) -> list[tuple[str, int, str | None]]:
    """(name, pid, start) of every child `up` recorded in ``run_dir`` and its restarts
    (``pids.txt``, services/actuator/local.py ``record_pid``), oldest first."""
    out = []
    for d in job_dirs(run_dir):
        p = d / "pids.txt"
        if not p.exists():
            continue
        for line in p.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1].isdigit():
                start = parts[2] if len(parts) > 2 and parts[2] != "-" else None
                out.append((parts[0], int(parts[1]), start))
    return out


def _ours(pid: int, marker: str, start: str | None = None) -> bool:
    """True if ``pid`` is alive and belongs to this run (guards against pid reuse): the
    process started at ``start`` (as recorded) or, without one, a process whose command line
    or environment names ``marker`` (a pod forked from a shared zygote names neither)."""
    if start is not None:
        return proc_start(pid) == start
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        env = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return marker in cmd or marker in env
