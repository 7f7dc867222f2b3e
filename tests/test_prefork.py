"""Pods forked from a zygote (services/actuator/prefork.py, zygote.py): a real zygote process,
real forks; a forked pod must be what `exec` would have started, and every failure of the
zygote must leave pods startable (exec) and their ends reported."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from harness import REPO, until
from services.actuator import prefork as pf
from services.actuator.prefork import Prefork

POD = [sys.executable, "-m", "tests.helpers.prefork_pod"]
pytestmark = pytest.mark.timeout(60)


# once: the environment of a pod must equal the zygote's (pytest changes PYTEST_CURRENT_TEST)
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _env(**kw: str) -> dict[str, str]:
    return {**ENV, **kw}


@pytest.fixture
async def zygote(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    z = await Prefork.start(_env(), ["json", "numpy", "tests.helpers.sets_env"],
                            tmp_path / "zygote.log", tmp_path)
    assert z is not None, (tmp_path / "zygote.log").read_text()
    try:
        yield z
    finally:
        await z.close()


def _first(log: Path) -> dict:
    return json.loads(log.read_text().splitlines()[0])


async def test_a_forked_pod_is_what_exec_would_start(zygote, tmp_path):
    # what the preload set in the zygote's environment does not keep pods from forking (torch
    # sets TORCHINDUCTOR_CACHE_DIR when imported: every `up` exec'd its pods), and each pod
    # has it, as its own import would have set it
    assert zygote.handles(POD, _env()) and "SET_BY_IMPORT" not in zygote.env
    log = tmp_path / "w0.log"
    pod = await zygote.spawn([*POD, "late-thread"], _env(CEASELESS_POD="w0"), log)
    assert await asyncio.wait_for(pod.wait(), 20) == 0 and pod.returncode == 0
    seen = _first(log)
    assert seen["argv"][0].endswith("prefork_pod.py") and seen["argv"][1:] == ["late-thread"]
    assert seen["pid"] == pod.pid and seen["sid"] == pod.pid  # its own session, as exec'd
    assert seen["cwd"] == str(REPO) and seen["path0"] == str(REPO)
    assert seen["pod"] == "w0" and seen["main"] == "__main__" and seen["set_by_import"] == "1"
    assert not seen["zygote_globals"]  # a fresh __main__, not the zygote's
    rest = log.read_text().splitlines()[1:]
    # the interpreter's way out: non-daemon threads first, then atexit
    assert rest == ["thread finished", "atexit ran"], rest


async def test_forked_pods_draw_their_own_random_numbers(zygote, tmp_path):
    pods = [await zygote.spawn([*POD, "exit", "0"], _env(), tmp_path / f"{i}.log")
            for i in range(2)]
    for p in pods:
        assert await asyncio.wait_for(p.wait(), 20) == 0
    a, b = (_first(tmp_path / f"{i}.log") for i in range(2))
    assert a["np_random"] is not None
    assert a["random"] != b["random"] and a["np_random"] != b["np_random"]


async def test_a_script_pod_runs_as_python_script_would(zygote, tmp_path):
    script = REPO / "tests" / "helpers" / "prefork_pod.py"
    log = tmp_path / "s.log"
    assert zygote.handles([sys.executable, str(script)], _env())
    pod = await zygote.spawn([sys.executable, str(script), "exit", "0"], _env(), log)
    assert await asyncio.wait_for(pod.wait(), 20) == 0
    seen = _first(log)
    assert seen["argv"] == [str(script), "exit", "0"] and seen["main"] == "__main__"
    assert seen["path0"] == str(script.parent)  # the script's directory, as `python x.py`


@pytest.mark.parametrize("args,code", [(["exit", "3"], 3), (["raise"], 1), (["exit", "0"], 0),
                                       (["hook-raise"], 1)])
async def test_exit_codes_are_the_interpreters(zygote, tmp_path, args, code):
    log = tmp_path / "p.log"
    pod = await zygote.spawn([*POD, *args], _env(), log)
    assert await asyncio.wait_for(pod.wait(), 20) == code
    if args == ["raise"]:
        assert "RuntimeError: the script failed" in log.read_text()
    if args == ["hook-raise"]:  # the drop-in reports a script's exception from its hook
        assert "hook saw RuntimeError: the script failed" in log.read_text()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
async def test_a_signalled_pod_reports_the_signal_and_its_output_was_unbuffered(
        zygote, tmp_path, sig):
    log = tmp_path / "p.log"
    pod = await zygote.spawn([*POD, "sleep"], _env(), log)
    await until(lambda: log.exists() and "sleeping" in log.read_text(), 20, "the unflushed line in the log")
    pod.send_signal(sig)
    assert await asyncio.wait_for(pod.wait(), 20) == -sig
    with pytest.raises(ProcessLookupError):
        pod.send_signal(signal.SIGKILL)


async def test_only_same_interpreter_modules_with_the_same_environment_are_forked(zygote):
    env = _env()
    assert zygote.handles(POD, env)
    # per-pod keys may differ: read by the agent, not by an import
    assert zygote.handles(POD, {**env, "CEASELESS_POD": "s3", "CUDA_VISIBLE_DEVICES": "1"})
    # what the fork applies itself, and the same path entries written twice
    assert zygote.handles(POD, {**env, "OMP_NUM_THREADS": "3", "PYTHONUNBUFFERED": "",
                                "PYTHONBREAKPOINT": "0"})
    assert zygote.handles(POD, {**env, "PYTHONPATH": os.pathsep.join([str(REPO)] * 2)})
    assert not zygote.handles(POD, {**env, "PYTHONPATH": "/elsewhere"})
    assert not zygote.handles(POD, {**env, "TORCH_LOGS": "+dynamo"})
    assert not zygote.handles(["/usr/bin/python3.9", *POD[1:]], env)
    assert not zygote.handles([sys.executable, "tests/helpers/no_such_script.py"], env)
    assert not zygote.handles([sys.executable, "-c", "print(1)"], env)
    assert not zygote.handles(["ip", "netns", "exec", "a", *POD], env)


async def test_a_pod_is_forked_into_the_network_namespace_it_names(zygote, tmp_path):
    """An emulated host's pod (`up --hosts`, issue 42) is forked into the host's namespace,
    as `ip netns exec` would have started it; the zygote stays in its own; a namespace that
    cannot be entered is an error (the actuator execs the pod instead), no pod."""
    from ops.hosts import Hosts, Unavailable

    try:
        hosts = Hosts.make(1)
    except Unavailable as e:
        pytest.skip(str(e))
    try:
        if hosts.mode != "netns":
            pytest.skip(f"no namespaces here: {hosts.why}")
        ns = hosts.hosts[0].netns
        theirs = f"net:[{os.stat(f'/run/netns/{ns}').st_ino}]"
        ours = os.readlink("/proc/self/ns/net")
        assert theirs != ours
        log = tmp_path / "w0.log"
        pod = await zygote.spawn([*POD, "exit", "0"], _env(), log, netns=ns)
        assert await asyncio.wait_for(pod.wait(), 20) == 0
        assert _first(log)["netns"] == theirs
        assert os.readlink(f"/proc/{zygote.proc.pid}/ns/net") == ours
        home = tmp_path / "w1.log"
        pod = await zygote.spawn([*POD, "exit", "0"], _env(), home)
        assert await asyncio.wait_for(pod.wait(), 20) == 0 and _first(home)["netns"] == ours
        for bad in ("ceaseless-no-such-namespace", "../net"):
            with pytest.raises(OSError, match="fork"):
                await zygote.spawn([*POD, "exit", "0"], _env(), tmp_path / "x.log", netns=bad)
        assert zygote.alive and not (tmp_path / "x.log").exists()
    finally:
        hosts.destroy()


async def test_when_the_zygote_dies_its_pods_still_end_and_nothing_more_forks(zygote, tmp_path):
    pod = await zygote.spawn([*POD, "sleep"], _env(), tmp_path / "p.log")
    os.kill(zygote.proc.pid, signal.SIGKILL)
    await until(lambda: not zygote.alive, 10, "the zygote's loss noticed")
    assert not zygote.handles(POD, _env())
    with pytest.raises(OSError):
        await zygote.spawn([*POD, "exit", "0"], _env(), tmp_path / "q.log")
    os.kill(pod.pid, signal.SIGKILL)  # an orphan now: its exit code is unknown, its end not
    assert await asyncio.wait_for(pod.wait(), 20) == pf.UNKNOWN_EXIT


async def test_a_zygote_that_cannot_start_means_exec(tmp_path, monkeypatch):
    monkeypatch.setattr(pf.sys, "executable", "/bin/false")
    assert await Prefork.start(_env(), [], tmp_path / "z.log", tmp_path) is None


async def test_a_shared_zygote_serves_every_up_that_connects(tmp_path, monkeypatch):
    """`zygote.py --listen` (CEASELESS_ZYGOTE): each client gets its own pods' ends, and one
    client leaving does not stop it."""
    monkeypatch.chdir(REPO)
    sock = tmp_path / "z.sock"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.actuator.zygote", "--listen", str(sock),
        "--preload", "json", env=ENV, cwd=REPO, start_new_session=True)
    try:
        await until(lambda: sock.exists(), 30, "the zygote's socket")
        a, b = await Prefork.connect(str(sock)), await Prefork.connect(str(sock))
        assert a is not None and b is not None and a.proc is None
        assert a.env["PYTHONPATH"] == str(REPO) and a.handles(POD, _env())
        pa = await a.spawn([*POD, "exit", "3"], _env(), tmp_path / "a.log")
        pb = await b.spawn([*POD, "exit", "4"], _env(), tmp_path / "b.log")
        assert await asyncio.wait_for(pa.wait(), 20) == 3
        assert await asyncio.wait_for(pb.wait(), 20) == 4
        await a.close()
        pc = await b.spawn([*POD, "exit", "5"], _env(), tmp_path / "c.log")
        assert await asyncio.wait_for(pc.wait(), 20) == 5
        assert proc.returncode is None  # still serving
        await b.close()
        assert await Prefork.connect(str(tmp_path / "nothing.sock")) is None
    finally:
        proc.kill()
        await proc.wait()


def test_a_shared_zygotes_socket_appears_only_once_it_accepts(tmp_path, monkeypatch):
    """Whoever waits for the socket to exist connects at once: bound and listening before
    it has its name (seen: "Connection refused" between the zygote's bind and listen)."""
    import socket

    from services.actuator.zygote import Zygote

    sock = tmp_path / "z.sock"
    real = socket.socket.listen
    at_listen = []

    def listen(self, *a):
        at_listen.append(sock.exists())
        return real(self, *a)

    monkeypatch.setattr(socket.socket, "listen", listen)
    z = Zygote({})
    try:
        z.listen(str(sock))
        assert at_listen == [False] and sock.exists()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(str(sock))
    finally:
        z.listener.close()


def _children(pid: int) -> list[int]:
    """The live (or not yet reaped) children of a process."""
    try:
        return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


async def _given_up(zygote, monkeypatch, log: Path, clock_ahead: float = 0.0) -> None:
    """A request the zygote does not answer in time (it is stopped): spawn gives up on it.
    ``clock_ahead``: the request says it expires that much later (a zygote that read it just
    before its expiry and answered after `up` gave up)."""
    import time
    import types

    with monkeypatch.context() as mp:
        mp.setattr(pf, "FORK_TIMEOUT_S", 0.5)
        mp.setattr(pf, "time", types.SimpleNamespace(time=lambda: time.time() + clock_ahead))
        os.kill(zygote.proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(OSError, match="did not fork"):
                await zygote.spawn([*POD, "sleep"], _env(CEASELESS_POD="w1"), log)
        finally:
            os.kill(zygote.proc.pid, signal.SIGCONT)
    # the zygote serves in order: once a later pod's exit is back, the first request's reply
    # has been read too
    later = await zygote.spawn([*POD, "exit", "0"], _env(), log.with_name("later.log"))
    assert await asyncio.wait_for(later.wait(), 20) == 0


@pytest.mark.parametrize("clock_ahead", [0.0, 600.0], ids=["expired", "forked-late"])
async def test_a_request_given_up_on_never_becomes_a_second_process(zygote, tmp_path,
                                                                    monkeypatch, clock_ahead):
    """Issue 41 (9f): `up` gave up on a fork after 30 s and exec'd the pod; the zygote then
    read the queued request and forked it too: two processes with one pod id, one untracked.
    An expired request is refused; a fork that still comes of one (read just in time,
    answered too late) is killed."""
    log = tmp_path / "w1.log"
    try:
        await _given_up(zygote, monkeypatch, log, clock_ahead)
        await until(lambda: not _children(zygote.proc.pid), 10, "no pod left of the request")
        if not clock_ahead:
            assert not log.exists()  # never forked
    finally:
        for pid in _children(zygote.proc.pid):
            os.kill(pid, signal.SIGKILL)


def test_the_zygotes_messages_go_whole_through_a_write_cut_short(tmp_path):
    """Issue 41 (9f): the zygote's replies were one os.write: a write larger than the socket's
    buffer that a signal interrupts (SIGCHLD, as pods end) writes part of it and returns,
    and the rest of the line was lost. Here the main thread's send is interrupted by a
    signal while the reader has not read yet."""
    import socket
    import threading

    from services.actuator.zygote import Zygote, _Client

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    z = Zygote(started_with={})
    c = _Client(a.fileno(), a.fileno(), a)
    msg = {"event": "ready", "env": {"BIG": "x" * (1 << 22)}}
    main = threading.get_ident()
    got: list[bytes] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: None)  # interrupts, no SA_RESTART

    def read() -> None:
        import select

        select.select([b], [], [], 30)  # the sender is blocked on a full buffer now
        signal.pthread_kill(main, signal.SIGUSR1)
        buf = b""
        b.settimeout(10)
        try:
            while not buf.endswith(b"\n"):
                chunk = b.recv(1 << 16)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass
        got.append(buf)

    t = threading.Thread(target=read)
    t.start()
    try:
        z.send(c, msg)
        a.shutdown(socket.SHUT_WR)  # what was not sent stays unsent: the reader ends
        t.join(30)
    finally:
        signal.signal(signal.SIGUSR1, old)
        a.close()
        b.close()
    assert got and json.loads(got[0]) == msg
