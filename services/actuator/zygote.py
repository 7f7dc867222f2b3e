"""The prefork server's own process: imports torch once, then forks every pod from itself.

``python -m services.actuator.zygote --preload torch,agent.session`` imports the modules
named, greets with ``{"event": "ready", "env": ...}`` (its environment: which pods it may
fork) and serves ``prefork.py``'s requests as JSON lines: from one `up` over two inherited
pipes (``--requests``/``--replies``; it ends with that `up`), or from every `up` that
connects to a unix socket (``--listen PATH``; `up` uses it when ``CEASELESS_ZYGOTE=PATH``,
as the test suite does: a cluster then starts without paying for the imports either). A pod
is a fork that becomes ``python -m MODULE ARGS`` or ``python SCRIPT ARGS`` (a new session, its log as stdout and stderr,
its own environment, working directory and ``sys.argv``); its exit status goes back to the
`up` that asked for it as ``{"exit": pid, "code": c}``, a signal's code negative, as
``subprocess`` reports it. A request may name a network namespace (``"netns"``, a name of
``ip netns``: an emulated host's, `up --hosts`): the pod is forked inside it, as ``ip netns
exec`` would have started it there, and the zygote itself stays where it started.

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
import ctypes
import importlib
import io
import json
import os
import select
import selectors
import signal
import socket
import sys
import time
import traceback
from typing import Any

from .prefork import READY

NETNS_DIR = "/run/netns"  # where `ip netns add` keeps its namespaces (by name)
CLONE_NEWNET = 0x40000000


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m services.actuator.zygote")
    ap.add_argument("--requests", type=int, help="fd to read one owner's requests from")
    ap.add_argument("--replies", type=int, help="fd to write that owner's replies to")
    ap.add_argument("--listen", metavar="PATH",
                    help="serve every `up` that connects to this unix socket instead "
                         "(CEASELESS_ZYGOTE=PATH); runs until it is stopped")
    ap.add_argument("--preload", default="torch", help="modules to import, comma-separated")
    ap.add_argument("--run-dir", default="", help="the run this serves (shows in ps)")
    a = ap.parse_args(argv)
    if (a.listen is None) == (a.requests is None or a.replies is None):
        ap.error("either --requests and --replies, or --listen")
    started_with = dict(os.environ)
    for name in filter(None, a.preload.split(",")):
        try:
            importlib.import_module(name)
        except Exception as e:  # the pod imports it itself, and reports the error there
            print(f"zygote: not preloaded: {name}: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
    z = Zygote(started_with)
    if a.listen:
        z.listen(a.listen)
    else:
        z.add(_Client(a.requests, a.replies), owner=True)
    z.serve()


class _Client:
    """One `up`: where its requests come from and its replies (and its pods' exits) go."""

    def __init__(self, rfd: int, wfd: int, sock: socket.socket | None = None) -> None:
        self.rfd, self.wfd, self.sock = rfd, wfd, sock
        self.buf = b""
        self.open = True

    def fds(self) -> set[int]:
        return {self.rfd, self.wfd}


class Zygote:
    def __init__(self, started_with: dict[str, str] | None = None) -> None:
        # The environment the pods must match is the one this process started with; what the
        # preload's imports set in it (torch sets TORCHINDUCTOR_CACHE_DIR) each pod gets too,
        # as its own imports would have set it.
        self.env = dict(os.environ) if started_with is None else started_with
        self.set_by_imports = {k: v for k, v in os.environ.items() if self.env.get(k) != v}
        self.sig_r, self.sig_w = os.pipe()
        os.set_blocking(self.sig_w, False)
        os.set_blocking(self.sig_r, False)
        self.sel = selectors.DefaultSelector()
        self.clients: dict[int, _Client] = {}
        self.owner: _Client | None = None  # private mode: the zygote ends with its `up`
        self.listener: socket.socket | None = None
        self.children: dict[int, _Client] = {}
        self._serving = False
        self.home_ns: int | None = None  # this process's own network namespace, once needed

    def listen(self, path: str) -> None:
        """Serve at ``path``, which appears only once it accepts: whoever waits for it to
        exist (the test suite's fixture) may connect at once. Bound under another name and
        renamed (a connect between bind and listen was refused)."""
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        tmp = f"{path}.{os.getpid()}.tmp"
        self.listener.bind(tmp)
        self.listener.listen(64)
        os.rename(tmp, path)

    def add(self, c: _Client, owner: bool = False) -> None:
        self.clients[c.rfd] = c
        if owner:
            self.owner = c
        if self._serving:
            self.sel.register(c.rfd, selectors.EVENT_READ)
        self.send(c, {"event": READY, "pid": os.getpid(), "env": self.env})

    def send(self, c: _Client, msg: dict[str, Any]) -> None:
        if not c.open:
            return
        try:
            _write_all(c.wfd, (json.dumps(msg) + "\n").encode())
        except OSError:  # that `up` is gone; its pods still run, their ends go unreported
            self.drop(c)

    def drop(self, c: _Client) -> None:
        if not c.open:
            return
        c.open = False
        self.clients.pop(c.rfd, None)
        try:
            self.sel.unregister(c.rfd)
        except (KeyError, ValueError):
            pass
        if c.sock is not None:
            c.sock.close()
        else:
            for fd in c.fds():
                os.close(fd)

    def serve(self) -> None:
        # SIGCHLD wakes the loop through the wakeup fd; the handler itself does nothing
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.sig_w)
        self.sel.register(self.sig_r, selectors.EVENT_READ)
        for fd in self.clients:
            self.sel.register(fd, selectors.EVENT_READ)
        if self.listener is not None:
            self.sel.register(self.listener.fileno(), selectors.EVENT_READ)
        self._serving = True
        while True:
            for key, _ in self.sel.select():
                if key.fd == self.sig_r:
                    try:
                        os.read(self.sig_r, 4096)
                    except BlockingIOError:
                        pass
                elif self.listener is not None and key.fd == self.listener.fileno():
                    conn, _ = self.listener.accept()
                    conn.setblocking(True)
                    self.add(_Client(conn.fileno(), conn.fileno(), conn))
                elif (c := self.clients.get(key.fd)) is not None:
                    self.read(c)
            if self.owner is not None and not self.owner.open:
                return  # `up` closed its end: it is done with us; its pods keep running
            self.reap()

    def read(self, c: _Client) -> None:
        try:
            data = os.read(c.rfd, 65536)
        except OSError:
            data = b""
        if not data:
            self.drop(c)
            return
        c.buf += data
        while b"\n" in c.buf and c.open:
            line, c.buf = c.buf.split(b"\n", 1)
            self.handle(c, line)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            c = self.children.pop(pid, None)
            if c is not None:
                self.send(c, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})

    def handle(self, c: _Client, line: bytes) -> None:
        try:
            req = json.loads(line)
            rid = req["id"]
        except (ValueError, KeyError, TypeError) as e:
            print(f"zygote: bad request {line[:200]!r}: {e}", file=sys.stderr, flush=True)
            return
        expires = req.get("expires")
        if isinstance(expires, (int, float)) and time.time() > expires:
            # its `up` gave up waiting and exec'd the pod: a fork now would be a second
            # process with the same pod id
            self.send(c, {"id": rid, "error": "the request expired before it was read"})
            return
        if _cuda_touched():  # a fork would inherit a CUDA context it cannot use
            self.send(c, {"id": rid, "error": "CUDA is initialised in the zygote"})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = self.fork_in(req.get("netns"))
        except OSError as e:
            self.send(c, {"id": rid, "error": f"fork: {e}"})
            return
        if pid == 0:
            code = 70
            try:
                self._become(req)
                code = run(req["argv"][1:])
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        self.children[pid] = c
        self.send(c, {"id": rid, "pid": pid})

    def fork_in(self, netns: Any) -> int:
        """``os.fork()``; with ``netns`` (a name of ``ip netns``) the child is born in that
        network namespace. Entered here around the fork, not in the child, so that one that
        cannot be entered is an error reply (the pod is exec'd instead) rather than a pod
        that fails; left again at once (single-threaded: the namespace is this thread's)."""
        if not netns:
            return os.fork()
        if not isinstance(netns, str) or "/" in netns or netns in (".", ".."):
            raise OSError(f"not a network namespace name: {netns!r}")
        if self.home_ns is None:
            self.home_ns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        fd = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
        try:
            _setns(fd)
        finally:
            os.close(fd)
        try:
            pid = os.fork()
        except OSError:
            self._home()
            raise
        if pid:
            self._home()
        return pid

    def _home(self) -> None:
        """Back to this process's own namespace; a zygote that cannot get back must not
        fork another pod into the wrong one: it ends (`up` then execs its pods)."""
        try:
            _setns(self.home_ns)  # type: ignore[arg-type]
        except OSError as e:
            print(f"zygote: cannot return to its network namespace: {e}; exiting",
                  file=sys.stderr, flush=True)
            os._exit(1)

    def _become(self, req: dict[str, Any]) -> None:
        """In the child: what a fresh ``python`` started by ``subprocess`` would be."""
        os.setsid()
        signal.set_wakeup_fd(-1)
        for s in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1,
                  signal.SIGUSR2):
            signal.signal(s, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.sel.close()
        for c in list(self.clients.values()):
            self.drop(c)
        if self.listener is not None:
            self.listener.close()
        for fd in (self.sig_r, self.sig_w, *([self.home_ns] if self.home_ns is not None else [])):
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
        for k, v in self.set_by_imports.items():
            os.environ.setdefault(k, v)
        # `python -m` puts the working directory first on the path, `python script.py` the
        # script's own directory
        argv = req["argv"]
        sys.path[0] = (os.getcwd() if argv[1] == "-m"
                       else os.path.dirname(os.path.realpath(argv[1])))
        torch = sys.modules.get("torch")
        threads = env.get("OMP_NUM_THREADS", "")
        if torch is not None and threads.isdigit() and int(threads) > 0:
            torch.set_num_threads(int(threads))


def _write_all(fd: int, data: bytes) -> None:
    """Every byte: a write to a pipe or socket may write part of them (a signal, SIGCHLD
    here, interrupting a write larger than the pipe's buffer), and a reply cut short would
    merge with the next line."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # a non-blocking end that is full: wait until it drains
            select.select([], [fd], [])


def _setns(fd: int) -> None:
    """Enter the network namespace open at ``fd`` (``os.setns`` from Python 3.12)."""
    if hasattr(os, "setns"):
        os.setns(fd, CLONE_NEWNET)
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def _cuda_touched() -> bool:
    """Whether this process initialised CUDA: torch's lazy init, or any query that loaded the
    driver (``torch.cuda.is_available()`` does)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        with open("/proc/self/maps") as f:
            return any("libcuda.so" in line for line in f)
    except OSError:
        return False


def _stream(fd: int, unbuffered: bool, line: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, write_through=True, errors="backslashreplace")
    return io.TextIOWrapper(io.BufferedWriter(raw), line_buffering=line,
                            errors="backslashreplace" if line else "strict")


def run(args: list[str]) -> int:
    """``python ARGS`` in this process (``-m MODULE ...`` or ``SCRIPT ...``): its exit code,
    as the interpreter's."""
    import atexit
    import runpy
    import threading
    import types

    sys.modules["__main__"] = types.ModuleType("__main__")  # not the zygote's globals
    code = 0
    try:
        if args[0] == "-m":
            sys.argv = args[1:]  # runpy replaces argv[0] with the module's file
            runpy._run_module_as_main(args[1], alter_argv=True)  # what `python -m` calls
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        _excepthook()
        code = -signal.SIGINT  # the interpreter ends by the signal itself
    except BaseException:
        _excepthook()
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


def _excepthook() -> None:
    """Through sys.excepthook, as the interpreter does: a script's (or the agent's) hook
    reports the exception before the process ends. ``sys.last_*`` first, as the
    interpreter sets them (the agent reads them at exit when a later hook did not chain)."""
    tp, v, tb = sys.exc_info()
    sys.last_type, sys.last_value, sys.last_traceback = tp, v, tb
    try:
        sys.excepthook(tp, v, tb)
    except BaseException:
        traceback.print_exc()


def _exit_code(c: object) -> int:
    if c is None:
        return 0
    if isinstance(c, int):
        return c & 0xFF
    print(c, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
