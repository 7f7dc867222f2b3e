"""Run a few worker processes for distributed tests: JSON lines out, kill by PID always."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dist_worker.py")
MARK = "@@ "


class Worker:
    def __init__(self, rank: int, proc: subprocess.Popen) -> None:
        self.rank = rank
        self.proc = proc
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.log: list[str] = []
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.log.append(line)
            if line.startswith(MARK):
                try:
                    self.events.put(json.loads(line[len(MARK):]))
                except ValueError:
                    pass

    def expect(self, event: str, timeout: float = 60.0) -> dict:
        """The next message with ``event`` (others before it are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"rank {self.rank}: no {event!r} in {timeout}s; log:\n"
                                   + "\n".join(self.log[-40:]))
            try:
                msg = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    self._t.join(1)
                    if self.events.empty():
                        raise RuntimeError(f"rank {self.rank} exited {self.proc.returncode} "
                                           f"before {event!r}; log:\n" + "\n".join(self.log[-40:]))
                continue
            if msg.get("event") == "error":
                raise RuntimeError(f"rank {self.rank} failed: {msg.get('error')}\n"
                                   + "\n".join(self.log[-40:]))
            if msg.get("event") == event:
                return msg

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)


class Group:
    """``world`` workers running ``scenario`` with a shared JSON config (+ rank)."""

    def __init__(self, scenario: str, world: int, cfg: dict, ranks: list[int] | None = None
                 ) -> None:
        self.workers: list[Worker] = []
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for r in ranks if ranks is not None else range(world):
            c = dict(cfg, rank=r, world_size=world)
            p = subprocess.Popen([sys.executable, str(WORKER), scenario, json.dumps(c)],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 env=env, cwd=str(ROOT), start_new_session=True)
            self.workers.append(Worker(r, p))

    def __getitem__(self, i: int) -> Worker:
        return self.workers[i]

    def expect_all(self, event: str, timeout: float = 60.0, ranks=None) -> list[dict]:
        ws = self.workers if ranks is None else [self.workers[r] for r in ranks]
        return [w.expect(event, timeout) for w in ws]

    def kill(self) -> None:
        for w in self.workers:
            if w.proc.poll() is None:
                try:
                    os.kill(w.proc.pid, signal.SIGCONT)
                    os.kill(w.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for w in self.workers:
            try:
                w.proc.wait(10)
            except subprocess.TimeoutExpired:
                pass

    def __enter__(self) -> "Group":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def nats_cfg(nats_server, job: str = "test") -> dict:
    return {"url": nats_server.url, "creds": str(nats_server.creds_path), "job": job}
