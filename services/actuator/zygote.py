"""The prefork server's own process: imports torch once, then forks every pod from itself.

``python -m services.actuator.zygote --preload torch,agent.session`` imports the modules
named, says ``ready`` and serves ``prefork.py``'s requests: JSON lines on ``--requests`` (an
inherited fd), answers and exit reports on ``--replies``. A pod is a fork that becomes
``python -m MODULE ARGS`` (a new session, its log as stdout and stderr, its own environment,
working directory and ``sys.argv``); its exit status goes back as ``{"exit": pid, "code":
c}`` with a signal's code negative, as ``subprocess`` reports it.

Why: a training pod pays ~2 CPU-seconds before its first line runs (``import torch``, and
``torch._dynamo``, which the first optimizer imports), more on a GPU node; a replacement
spare forked from here starts in milliseconds. Safe because this process never starts a
thread, never initialises CUDA (checked before each fork) and imports only what the pods
would import themselves, under the same environment (``prefork.py`` forks only pods whose
environment differs from this one's in the per-pod keys).

Single-threaded on purpose: a fork copies only the calling thread.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import os
import selectors
import signal
import sys
import traceback
from typing import Any

from .prefork import READY


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.actuator.zygote")
    ap.add_argument("--requests", type=int, required=True, help="fd to read requests from")
    ap.add_argument("--replies", type=int, required=True, help="fd to write replies to")
    ap.add_argument("--preload", default="torch", help="modules to import, comma-separated")
    ap.add_argument("--run-dir", default="", help="the run this serves (shows in ps)")
    a = ap.parse_args(argv)
    for name in filter(None, a.preload.split(",")):
        try:
            importlib.import_module(name)
        except Exception as e:  # the pod imports it itself, and reports the error there
            print(f"zygote: not preloaded: {name}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
    Zygote(a.requests, a.replies).serve()


class Zygote:
    def __init__(self, rfd: int, wfd: int) -> None:
        self.rfd, self.wfd = rfd, wfd
        self.sig_r, self.sig_w = os.pipe()
        os.set_blocking(self.sig_w, False)
        os.set_blocking(self.sig_r, False)
        self.sel = selectors.DefaultSelector()
        self.children: set[int] = set()

    def send(self, msg: dict[str, Any]) -> None:
        os.write(self.wfd, (json.dumps(msg) + "\n").encode())

    def serve(self) -> None:
        # SIGCHLD wakes the loop through the wakeup fd; the handler itself does nothing
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.sig_w)
        self.sel.register(self.rfd, selectors.EVENT_READ)
        self.sel.register(self.sig_r, selectors.EVENT_READ)
        self.send({"event": READY, "pid": os.getpid()})
        buf = b""
        while True:
            for key, _ in self.sel.select():
                if key.fd == self.sig_r:
                    try:
                        os.read(self.sig_r, 4096)
                    except BlockingIOError:
                        pass
                    continue
                data = os.read(self.rfd, 65536)
                if not data:  # `up` closed its end: it is done with us; pods keep running
                    return
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    self.handle(line)
            self.reap()

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.children.discard(pid)
            self.send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def handle(self, line: bytes) -> None:
        try:
            req = json.loads(line)
            rid = req["id"]
        except (ValueError, KeyError, TypeError) as e:
            print(f"zygote: bad request {line[:200]!r}: {e}", file=sys.stderr, flush=True)
            return
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():  # a fork would inherit it
            self.send({"id": rid, "error": "CUDA is initialised in the zygote"})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as e:
            self.send({"id": rid, "error": f"fork: {e}"})
            return
        if pid == 0:
            code = 70
            try:
                self._become(req)
                code = run_module(req["argv"][2], req["argv"][3:])
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.children.add(pid)
        self.send({"id": rid, "pid": pid})

    def _become(self, req: dict[str, Any]) -> None:
        """In the child: what a fresh ``python`` started by ``subprocess`` would be."""
        os.setsid()
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                  signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sel.close()
        for fd in (self.rfd, self.wfd, self.sig_r, self.sig_w):
            os.close(fd)
        out = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        nul = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nul, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(nul)
        env: dict[str, str] = req["env"]
        unbuffered = bool(env.get("PYTHONUNBUFFERED"))
        sys.stdout = sys.__stdout__ = _stream(1, unbuffered, line=False)
        sys.stderr = sys.__stderr__ = _stream(2, unbuffered, line=True)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(env)
        # `python -m` puts the working directory first on the path
        sys.path[0] = os.getcwd()
        torch = sys.modules.get("torch")
        threads = env.get("OMP_NUM_THREADS", "")
        if torch is not None and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


def _stream(fd: int, unbuffered: bool, line: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True, errors="backslashreplace")
    return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=line,
                            errors="backslashreplace" if line else "strict")


def run_module(module: str, args: list[str]) -> int:
    """``python -m module args`` in this process: its exit code, as the interpreter's."""
    import atexit
    import runpy
    import threading
    import types

    sys.modules["__main__"] = types.ModuleType("__main__")  # not the zygote's globals
    sys.argv = [module, *args]  # runpy replaces argv[0] with the module's file
    code = 0
    try:
        runpy._run_module_as_main(module, alter_argv=True)  # what `python -m` calls
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT  # the interpreter ends by the signal itself
    except BaseException:
        traceback.print_exc()
        code = 1
    # what the interpreter does on its way out: wait for non-daemon threads, atexit, flush
    try:
        threading._shutdown()  # type: ignore[attr-defined]
    except BaseException:
        traceback.print_exc()
    atexit._run_exitfuncs()
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:
            pass
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


def _exit_code(c: object) -> int:
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    print(c, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
