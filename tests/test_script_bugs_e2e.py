"""Issue 33: a bug in the script is not a fault to recover from. The same failure at the same
step on a second pod stops the job (exit 1) within seconds, with the script's error in
`ceaseless up`'s output, instead of burning pod after pod until "training state lost"."""

from __future__ import annotations

import json
import sys
import time

import pytest

from harness import Cluster

pytestmark = [pytest.mark.timeout(240)]


def _cmd(total: int, bad: int, how: str, api: str = "session") -> list[str]:
    return [sys.executable, "-m", "tests.helpers.buggy_script", str(total), str(bad), how, api]


async def test_a_script_raising_on_every_rank_stops_the_job_with_its_error(tmp_path):
    """Every rank raises the same ValueError at step 6; a spare and replacements are there
    to be burnt. `up` exits 1 (not 2, "state lost") with the error and the line of the
    script that raised it in its own output, the summary names the verdict, no pod beyond
    the first ones was started, and it does not try to resume."""
    t0 = time.monotonic()
    async with Cluster(tmp_path / "raise", 2, 1, 40, replace=True,
                       extra=["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2",
                              "--", *_cmd(40, 6, "raise")]) as c:
        code = await c.finish(timeout=120)
        out = c.output()
    took = time.monotonic() - t0
    assert code == 1, out
    assert took < 120, took
    assert "ValueError: the batch of step 6 has the wrong shape" in out, out
    assert "buggy_script.py" in out and "check_batch" in out, out  # its traceback
    assert "raised the same error at step 6" in out, out
    assert "--resume" in out and "restarting from" not in out, out
    s = json.loads((tmp_path / "raise" / "summary.json").read_text())
    assert s["job_failed"]["kind"] == "script_error" and s["job_failed"]["step"] == 5, s
    assert len(set(s["job_failed"]["pods"])) == 2
    assert not (tmp_path / "raise" / "restart-1").exists()


@pytest.mark.parametrize("api,how,forked", [
    ("init", "raise", True), ("init", "raise", False), ("dropin", "raise", False),
    ("dropin", "setup", True), ("session", "setup", False), ("lightning", "raise", False)])
async def test_the_same_error_on_every_rank_stops_the_job_whatever_the_api(
        tmp_path, api, how, forked):
    """Issue 41: under ``agent.init`` (no ``with`` block: its exception was never reported,
    every pod a crash, "training state lost"), the drop-in, Lightning's strategy (issue 44)
    and ``with Session``, pods forked
    from the zygote or exec'd, every rank raising the same error at step 12 (``raise``) or
    in its set-up once a member, before the first step (``setup``: the reports were dropped
    as stale, pods cycled and the job shrank) stops the job: exit 1 within 2 minutes, the
    error and its traceback in `up`'s output, and no spare raises it (none was promoted)."""
    run = tmp_path / f"{api}-{how}"
    t0 = time.monotonic()
    async with Cluster(run, 2, 1, 30, replace=True,
                       extra=[*([] if forked else ["--no-prefork"]),
                              "--", *_cmd(30, 12, how, api)]) as c:
        code = await c.finish(timeout=120)
        out = c.output()
    took = time.monotonic() - t0
    error, where = (("ValueError: the batch of step 12 has the wrong shape", "check_batch")
                    if how == "raise" else
                    ("FileNotFoundError: the data set's index is missing", "load_index"))
    assert code == 1, out
    assert took < 120, took
    assert error in out and "buggy_script.py" in out and where in out, out  # its traceback
    assert ("zygote.py" in out) == forked, out  # the pods were forked (or exec'd) indeed
    s = json.loads((run / "summary.json").read_text())
    assert s["job_failed"]["kind"] == "script_error", s
    assert s["job_failed"]["step"] == (11 if how == "raise" else -1), s
    spares = [p for p in (run / "logs").glob("s*.log") if error in p.read_text()]
    assert not spares, f"spares promoted into the error: {spares}"


async def test_a_repeated_hang_at_the_same_step_stops_the_job_with_the_solo_hint(
        tmp_path, monkeypatch):
    """Rank 0 works 600 s at the top of step 8 without s.solo (collective timeout 3 s): it
    is found hung and the spare takes rank 0, which hangs at the same step. That second
    hang stops the job (exit 1) with the step and the hint to use s.solo, instead of
    replacing rank 0 again and again."""
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", "3")
    async with Cluster(tmp_path / "hang", 2, 1, 40, replace=True,
                       extra=["--stall-timeout", "2.5", "--fault-timeout", "1.5",
                              "--", *_cmd(40, 8, "hang")]) as c:
        code = await c.finish(timeout=150)
        out = c.output()
    assert code == 1, out
    assert "step 8 stood still" in out and "s.solo" in out, out
    s = json.loads((tmp_path / "hang" / "summary.json").read_text())
    assert s["job_failed"]["kind"] == "repeated_hang" and s["job_failed"]["step"] == 7, s
    assert [i["kind"] for i in s["incidents"]][:2] == ["hang", "hang"], s["incidents"]
