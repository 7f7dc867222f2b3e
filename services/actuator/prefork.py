"""Pods forked from a process that imported torch already (``zygote.py``), for `up`.

``Prefork.start`` starts this run's own zygote (its preload runs while the bus and the
services come up); ``Prefork.connect`` uses a shared one instead (``CEASELESS_ZYGOTE``, a
unix socket: the test suite's, so that a cluster starts without the imports too).
``Prefork.spawn`` forks a pod and returns a ``ForkedPod``, which the local actuator uses as it
would an ``asyncio.subprocess.Process`` (``pid``, ``wait``, ``send_signal``).

A pod is forked only when its command is ``python -m MODULE`` or ``python SCRIPT.py`` with
this interpreter and its environment is the zygote's but for keys that no import reads
(``handles``): per-pod keys (``PER_POD_KEYS``), keys the fork applies itself or that are read
when used (``APPLIED_IN_FORK``) and a ``PYTHONPATH`` with the same entries. Anything else --
another interpreter, an environment that could change what an import does -- is exec'd as
before. A pod on an emulated host (`up --hosts`) is forked into that host's network namespace
(``spawn(netns=...)``) instead of being exec'd by ``ip netns exec``. If the zygote fails to start or dies, every later pod is exec'd; the pods it forked
keep running and are still killed by pid, but their exit codes are unknown (reported as
-SIGKILL).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

from plumbing import logs

log = logs.get("actuator")

# Environment keys that may differ between a pod and the zygote: read by the agent at run
# time, never by an import (a GPU's visibility is read when CUDA initialises, in the pod).
PER_POD_KEYS = ("CEASELESS_", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES",
                "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
# Keys the fork applies itself (zygote.py: torch.set_num_threads, unbuffered stdout/stderr),
# or that are read when used, not when imported (breakpoint() reads PYTHONBREAKPOINT; Ray sets
# it in the process that called ray.init).
APPLIED_IN_FORK = frozenset({"OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONBREAKPOINT"})
START_TIMEOUT_S = 120.0   # the preload (import torch) on a loaded machine
FORK_TIMEOUT_S = 30.0     # a fork's reply; after it the pod is exec'd instead
UNKNOWN_EXIT = -signal.SIGKILL
READY = "ready"  # the zygote's first line: its preload is done


class ForkedPod:
    """A pod forked by the zygote: the part of ``asyncio.subprocess.Process`` the actuator
    uses."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._done = asyncio.get_running_loop().create_future()

    def _exited(self, code: int) -> None:
        if not self._done.done():
            self.returncode = code
            self._done.set_result(code)

    async def wait(self) -> int:
        return await asyncio.shield(self._done)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)


class Prefork:
    def __init__(self, reader: asyncio.StreamReader, send: Callable[[bytes], None],
                 env: dict[str, str], proc: asyncio.subprocess.Process | None = None,
                 close: Callable[[], None] | None = None, where: str = "") -> None:
        self.proc = proc      # this run's own zygote; None: a shared one
        self.env = env        # the zygote's environment, from its greeting
        self.where = where    # the shared zygote's socket
        self._reader = reader
        self._send = send
        self._close = close
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._pods: dict[int, ForkedPod] = {}
        # exits read before `spawn` resumed with its reply (both can come in one read)
        self._early: dict[int, int] = {}
        # requests given up on (the pod was exec'd instead): a fork that still comes of one
        # is killed, and its exit dropped. Bounded: an id leaves when its reply arrives.
        self._abandoned: set[int] = set()
        self._unwanted: set[int] = set()
        self._closing = False
        self.alive = True
        self._task = asyncio.create_task(self._read())

    @classmethod
    async def start(cls, env: dict[str, str], preload: list[str], log_path: Path,
                    run_dir: Path | None = None) -> "Prefork | None":
        """The zygote, ready to fork, or None (logged) if it could not start."""
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        argv = [sys.executable, "-m", "services.actuator.zygote", "--requests", str(req_r),
                "--replies", str(rep_w), "--preload", ",".join(preload),
                *(["--run-dir", str(run_dir)] if run_dir else [])]
        out = open(log_path, "ab")
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env=env, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
                pass_fds=(req_r, rep_w), start_new_session=True)
        except OSError as e:
            log.warning("prefork: zygote not started; pods are exec'd", error=str(e))
            for fd in (req_r, req_w, rep_r, rep_w):
                os.close(fd)
            return None
        finally:
            out.close()
        os.close(req_r)
        os.close(rep_w)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(rep_r, "rb", 0))
        try:
            line = await asyncio.wait_for(reader.readline(), START_TIMEOUT_S)
            ready = json.loads(line) if line else {}
        except (asyncio.TimeoutError, ValueError):
            ready = {}
        if ready.get("event") != READY:
            log.warning("prefork: zygote did not start; pods are exec'd",
                        log=str(log_path), exit_code=proc.returncode)
            _kill(proc)
            transport.close()
            os.close(req_w)
            return None
        log.info("prefork: zygote ready", pid=proc.pid, preload=preload)
        return cls(reader, lambda b: _write_all(req_w, b), ready.get("env") or env, proc=proc,
                   close=lambda: os.close(req_w))

    @classmethod
    async def connect(cls, path: str) -> "Prefork | None":
        """A shared zygote (``zygote.py --listen PATH``), or None (logged) if none answers."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(path, limit=1 << 20), 10)
            line = await asyncio.wait_for(reader.readline(), 10)
            ready = json.loads(line) if line else {}
        except (OSError, asyncio.TimeoutError, ValueError) as e:
            log.warning("prefork: no zygote at CEASELESS_ZYGOTE", path=path, error=str(e))
            return None
        if ready.get("event") != READY or not isinstance(ready.get("env"), dict):
            writer.close()
            log.warning("prefork: CEASELESS_ZYGOTE did not greet as a zygote", path=path)
            return None
        log.info("prefork: shared zygote", path=path, pid=ready.get("pid"))
        return cls(reader, writer.write, ready["env"], close=writer.close, where=path)

    def handles(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether a pod with this command and environment can be forked (module doc)."""
        if not self.alive or len(argv) < 2:
            return False
        if os.path.realpath(argv[0]) != os.path.realpath(sys.executable):
            return False
        module = argv[1] == "-m" and len(argv) >= 3
        script = argv[1].endswith(".py") and os.path.isfile(argv[1])
        return (module or script) and not self.differs(env)

    def differs(self, env: dict[str, str]) -> list[str]:
        """The keys of ``env`` that keep a pod from forking: it and the zygote disagree on
        them, and an import may read them."""
        out = []
        for k in sorted(set(env) | set(self.env)):
            if k.startswith(PER_POD_KEYS) or k in APPLIED_IN_FORK:
                continue
            if k == "PYTHONPATH":
                if _entries(env.get(k)) != _entries(self.env.get(k)):
                    out.append(k)
            elif env.get(k) != self.env.get(k):
                out.append(k)
        return out

    async def spawn(self, argv: list[str], env: dict[str, str], log_path: Path,
                    cwd: str | None = None, netns: str | None = None) -> ForkedPod:
        """Fork a pod (``handles`` said yes); raises OSError if the zygote cannot. A request
        not answered within ``FORK_TIMEOUT_S`` is given up (the caller execs the pod): the
        zygote refuses it once expired, and a fork that still comes of it is killed, so that
        one pod id never has two processes. ``netns``: the network namespace (a name of
        ``ip netns``, an emulated host's) the pod is forked into, where ``ip netns exec``
        would have started it."""
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        req = {"id": rid, "argv": argv, "env": env, "log": str(log_path),
               "cwd": cwd or os.getcwd(), "expires": time.time() + FORK_TIMEOUT_S,
               **({"netns": netns} if netns else {})}
        try:
            self._send((json.dumps(req) + "\n").encode())
            reply = await asyncio.wait_for(fut, FORK_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as e:
            if self._pending.pop(rid, None) is not None and self.alive:
                self._abandoned.add(rid)
            raise OSError(f"prefork: the zygote did not fork: {e!r}") from None
        if "error" in reply:
            raise OSError(f"prefork: {reply['error']}")
        pod = ForkedPod(reply["pid"])
        self._pods[pod.pid] = pod
        if pod.pid in self._early:
            pod._exited(self._early.pop(pod.pid))
        return pod

    async def _read(self) -> None:
        try:
            while line := await self._reader.readline():
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if "exit" in msg:
                    pod = self._pods.pop(msg["exit"], None)
                    if msg["exit"] in self._unwanted:
                        self._unwanted.discard(msg["exit"])
                    elif pod is None:
                        self._early[msg["exit"]] = msg["code"]
                    else:
                        pod._exited(msg["code"])
                elif "id" in msg and (fut := self._pending.pop(msg["id"], None)) is not None:
                    if not fut.done():
                        fut.set_result(msg)
                elif "id" in msg and msg["id"] in self._abandoned:
                    self._abandoned.discard(msg["id"])
                    if isinstance(msg.get("pid"), int):
                        self._kill_unwanted(msg["pid"])
        finally:
            self._lost()

    def _kill_unwanted(self, pid: int) -> None:
        """A fork of a request given up on: its pod runs exec'd already; this one goes."""
        log.warning("prefork: a fork came after its request was given up; killed", pid=pid)
        if self._early.pop(pid, None) is not None:
            return  # it has exited already
        self._unwanted.add(pid)
        for kill in (os.kill, os.killpg):  # itself, then what it started in its session
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _lost(self) -> None:
        """The zygote is gone: nothing more forks; the exits of its pods cannot be known.
        Each still-running pod is waited for by polling its pid."""
        if self.alive and not self._closing:
            log.warning("prefork: the zygote is gone; later pods are exec'd",
                        exit_code=self.proc.returncode if self.proc else None,
                        shared=self.where or None)
        self.alive = False
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(OSError("the zygote is gone"))
        self._pending.clear()
        for pod in list(self._pods.values()):
            asyncio.create_task(_poll_exit(pod))
        self._pods.clear()

    async def close(self) -> None:
        """Done with the zygote (the pods it forked are the actuator's to stop first): this
        run's own one exits; a shared one goes on serving others."""
        self._closing = True
        self.alive = False
        if self._close is not None:
            try:
                self._close()
            except OSError:
                pass
        if self.proc is not None:
            try:
                await asyncio.wait_for(self.proc.wait(), 5)
            except asyncio.TimeoutError:
                _kill(self.proc)
        self._task.cancel()


def _entries(path: str | None) -> list[str]:
    """A PYTHONPATH's entries as the interpreter uses them: in order, each once."""
    return list(dict.fromkeys(p for p in (path or "").split(os.pathsep) if p))


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


async def _poll_exit(pod: ForkedPod) -> None:
    while pod.returncode is None:
        try:
            os.kill(pod.pid, 0)
        except ProcessLookupError:
            pod._exited(UNKNOWN_EXIT)
            return
        except PermissionError:
            pass
        await asyncio.sleep(0.5)


def _kill(proc: Any) -> None:
    try:
        proc.kill()
    except ProcessLookupError:
        pass
