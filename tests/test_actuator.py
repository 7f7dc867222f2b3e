"""The local actuator's stop, with real child processes (issue 41 item 8b): it answers once
the pod's process has exited, SIGKILL included, since a release names its freed pods then."""

from __future__ import annotations

import sys

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
