"""Issue 33: the README's patterns together (``agent.init``, ``s.on_rank0``, ``s.join(start=k)``
then ``s.steps(total, start=k)``, rank-0 work in ``s.solo``, ``max_grad_norm=0.0``) under a
real ``ceaseless up``, through SIGKILL of a worker and of rank 0, with and without spares."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from harness import Cluster

pytestmark = [pytest.mark.timeout(300)]
TOTAL, START = 40, 3


def _cmd() -> list[str]:
    return [sys.executable, "-m", "tests.helpers.patterns_script", str(TOTAL), str(START)]


def _events(run_dir) -> list[dict]:
    p = run_dir / "patterns" / "events.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def _kill(c: Cluster, rank: int) -> str:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, signal.SIGKILL)
    return h.pod


async def _run(tmp_path, name, workers, spares, fault=None):
    async with Cluster(tmp_path / name, workers, spares, TOTAL, cmd=_cmd()) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        assert code == 0, c.output()
        return c.summary(), _events(tmp_path / name)


async def test_patterns_survive_kills_of_a_worker_and_of_rank0_with_spares(tmp_path):
    """Two workers, two spares: SIGKILL rank 1, then rank 0. Each promoted spare passes
    s.join(start)/s.steps(start) (it used to die at promotion: "s.join() ran before the start
    step was known"), the spare that takes rank 0 runs the rank-0 set-up before its first
    rank-0 step, and the job ends bitwise equal to the fault-free run."""
    ref, ref_events = await _run(tmp_path, "ref", 2, 0)
    assert ref["final_step"] == TOTAL - 1
    assert [(e["pod"], e["event"]) for e in ref_events] == [
        ("w0", "setup"), ("w0", "joined as rank 0"), ("w0", "teardown")]

    killed: list[str] = []

    async def fault(c):
        await c.wait_rank_step(1, START + 6)
        killed.append(_kill(c, 1))
        await c.wait_for(lambda: any(h.rank == 1 and h.pod != killed[0] and h.step >= START + 14
                                     for h in c.hb.values()), 120, "rank 1 replaced, training")
        killed.append(_kill(c, 0))

    s, events = await _run(tmp_path, "faults", 2, 2, fault)
    assert killed[1] == "w0"
    assert s["final_step"] == TOTAL - 1 and s["lost_steps"] == 0
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    setups = [e for e in events if e["event"] == "setup"]
    assert [e["pod"] for e in setups][0] == "w0" and len(setups) == 2, events
    new0 = setups[1]["pod"]
    assert new0.startswith("s") and setups[1]["rank"] == 0, events
    metrics = (tmp_path / "faults" / "patterns" / f"metrics-{new0}.log").read_text().split()
    assert int(metrics[0]) > START + 14  # the new rank 0 logged from where it took over
    assert (tmp_path / "faults" / "patterns" / "saved").read_text() == new0
    assert any(e["pod"] == new0 and e["event"] == "teardown" for e in events), events


async def test_rank0_setup_follows_rank0_without_a_spare(tmp_path):
    """No spare: SIGKILL rank 0; w1 becomes rank 0, runs the set-up (it used to raise
    NameError at its next rank-0 line and the job ended "training state lost") and the job
    finishes on one rank."""
    async def fault(c):
        await c.wait_rank_step(0, START + 6)
        assert _kill(c, 0) == "w0"

    s, events = await _run(tmp_path, "nospare", 2, 0, fault)
    assert s["final_step"] == TOTAL - 1 and s["lost_steps"] == 0
    assert [(e["pod"], e["event"]) for e in events if e["event"] == "setup"] == [
        ("w0", "setup"), ("w1", "setup")], events
    assert (tmp_path / "nospare" / "patterns" / "saved").read_text() == "w1"
