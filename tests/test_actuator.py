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
