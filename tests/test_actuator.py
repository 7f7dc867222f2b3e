"""The local actuator's stop, with real child processes (issue 41 item 8b): it answers once
the pod's process has exited, SIGKILL included, since a release names its freed pods then."""

from __future__ import annotations

import sys

import pytest

from schemas.messages import Role

from harness import until


async def test_stop_answers_after_the_process_exited_even_when_it_ignores_sigterm(bus, tmp_path):
    from services.actuator.local import LocalActuator

    mark = tmp_path / "ignoring"
    script = ("import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)")
    act = LocalActuator(bus, [sys.executable, "-c", script, str(mark)], {}, tmp_path / "logs",
                        restart_fallback=False, replace=False)
    await act.attach()
    try:
        (pod,) = await act.start(Role.spare, 1)
        proc = act.procs[pod]
        await until(mark.exists, 30, "the pod ignoring SIGTERM")  # so SIGKILL ends it
        assert await act.stop(pod, grace_s=0.2)
        assert proc.returncode == -9, proc.returncode  # exited, by SIGKILL, when stop answered
    finally:
        await act.shutdown(grace_s=1.0)


async def test_a_deposed_scalers_command_is_refused(bus, tmp_path):
    """Commands carry the sending scaler's lease term (issue 42): one of an older term than
    one acted on is refused (a deposed scaler's); one without a term (an older sender, an
    operator's tool) is acted on as before."""
    from schemas.messages import ActuatorAction, ActuatorCommand, ActuatorReply
    from services.actuator.local import LocalActuator

    act = LocalActuator(bus, [sys.executable, "-c", "import time; time.sleep(60)"], {},
                        tmp_path / "logs", restart_fallback=False, replace=False)
    await act.attach()

    async def start(term):
        return await bus.request(bus.subjects.actuator, ActuatorCommand(
            action=ActuatorAction.start, role=Role.spare, term=term), ActuatorReply, timeout=10)
    try:
        assert (await start(2)).ok
        old = await start(1)
        assert not old.ok and "deposed" in old.error and act.scaler.ignored == 1
        assert len(act.procs) == 1
        assert (await start(None)).ok and len(act.procs) == 2
    finally:
        await act.shutdown(grace_s=1.0)


async def test_a_pod_on_an_emulated_host_is_forked_into_its_namespace(bus, tmp_path):
    """`up --hosts` (issue 42): a pod placed on a host is forked from the zygote into the
    host's network namespace with the host's gloo address, not exec'd through `ip netns
    exec` (which paid every import again: a replacement spare took 20-50 s to start on the
    loaded machine, and a fault meanwhile found "no live spare" and shrank the job)."""
    import json
    import os

    from harness import REPO
    from ops.emulated import HostRun
    from ops.hosts import Hosts, Unavailable
    from ops.placement import place
    from services.actuator.local import LocalActuator
    from services.actuator.prefork import ForkedPod, Prefork

    try:
        hosts = Hosts.make(2)
    except Unavailable as e:
        pytest.skip(str(e))
    run = HostRun(hosts, place(hosts.names(), 1, [], 0, 1, 1), tmp_path)
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    z = act = None
    try:
        if hosts.mode != "netns":
            pytest.skip(f"no namespaces here: {hosts.why}")
        z = await Prefork.start({**os.environ, **env}, ["json"], tmp_path / "zygote.log")
        assert z is not None, (tmp_path / "zygote.log").read_text()
        act = LocalActuator(bus, [sys.executable, "-m", "tests.helpers.prefork_pod", "sleep"],
                            env, tmp_path / "logs", restart_fallback=False, replace=False)
        act.prefork, act.where = z, run.where
        await act.attach()
        (pod,) = await act.start(Role.spare, 1)
        assert isinstance(act.procs[pod], ForkedPod), "exec'd, not forked"
        log = act.log_path(pod)
        await until(lambda: log.exists() and log.read_text().strip(), 20, "the pod's line")
        seen = json.loads(log.read_text().splitlines()[0])
        host = hosts[run.pods[pod]]
        assert seen["netns"] == f"net:[{os.stat(f'/run/netns/{host.netns}').st_ino}]"
        assert seen["gloo"] == host.addr and seen["pid"] == act.procs[pod].pid
    finally:
        if act is not None:
            await act.shutdown(grace_s=1.0)
        if z is not None:
            await z.close()
        await run.close()
