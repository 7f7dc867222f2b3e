"""Issue 44 (the kills without validation or checkpoints; with them:
test_lightning_e2e.py): ``examples/frameworks/lightning_after.py`` (PyTorch Lightning, the strategy line
changed) under a real ``ceaseless up --workers 2 --spares 1`` with no batch flags: SIGKILL of
rank 1, then, once its replacement trains and a new spare is up, of rank 0: 0 lost steps and
the final parameters bitwise equal to the fault-free run's. Both runs accumulate gradients
over 2 micro-batches (``accumulate_grad_batches=2``), and the faulty run does not resume a
step in place (``CEASELESS_RESUME_IN_PLACE=0``): the survivor's step discarded by each kill
is computed again whole, each micro-batch with its own batch (agent/lightning_window.py;
with resuming in place, the default, the replacement computes the dead rank's window: that
path is test_lightning_e2e.py's, without accumulation). The promoted
spares receive the model, the optimizer, the LR scheduler and the fit loop's progress as of
a window's end, and start on the job's next batch (the run spans five epochs)."""

from __future__ import annotations

import os
import signal
import sys

import pytest

pytest.importorskip("lightning")

from harness import Cluster, log_events  # noqa: E402

pytestmark = [pytest.mark.timeout(420)]
STEPS = 40  # 256 samples / 8 per batch / 2 ranks: 16 batches, 8 steps an epoch
AFTER = "examples/frameworks/lightning_after.py"


def _kill(c: Cluster, rank: int) -> str:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, signal.SIGKILL)
    return h.pod


async def _run(tmp_path, name, spares, fault=None):
    run = tmp_path / name
    cmd = [sys.executable, AFTER, "--max-steps", str(STEPS), "--out", str(run / "sha"),
           "--accumulate", "2"]
    if fault is not None:  # time to kill rank 0 after rank 1's replacement trained (a sleep:
        cmd += ["--step-sleep", "0.3"]  # same numerics, so the reference runs without it)
    async with Cluster(run, 2, spares, STEPS, cmd=cmd, replace=True) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        assert code == 0, c.output()
        return c.summary(), run


async def test_lightning_survives_kills_of_a_worker_and_of_rank0_bitwise(tmp_path,
                                                                       monkeypatch):
    ref, ref_dir = await _run(tmp_path, "ref", 0)
    monkeypatch.setenv("CEASELESS_RESUME_IN_PLACE", "0")  # the faulty run's pods inherit it
    assert ref["final_step"] == STEPS - 1 and ref["lost_steps"] == 0, ref

    killed: list[str] = []

    async def fault(c):
        await c.wait_rank_step(1, 4)
        at = c.member(1).step
        killed.append(_kill(c, 1))
        await c.wait_for(lambda: any(h.rank == 1 and h.pod != killed[0] and h.step >= at + 3
                                     for h in c.hb.values()), 180, "rank 1 replaced, training")
        await c.wait_spares(1)  # the replacement spare is up
        killed.append(_kill(c, 0))

    s, run = await _run(tmp_path, "faults", 1, fault)
    assert killed[1] == "w0"
    assert s["final_step"] == STEPS - 1 and s["lost_steps"] == 0, s
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    # the script's own digest, written by the spare that became rank 0
    assert (run / "sha").read_text() == (ref_dir / "sha").read_text()
    # both promoted spares received the loop's progress (and skipped the done batches)
    got = [p.stem for p in sorted((run / "logs").glob("s*.log"))
           if log_events(run, p.stem, "lightning: loop progress received")]
    assert len(got) >= 2, got
    # the survivor of each kill computed its discarded step again (not resumed in place)
    assert not any(log_events(run, p, "step resumed in the new generation")
                   for p in ("w0", "w1")), "a step was resumed in place"
    assert log_events(run, "w0", "step discarded"), "rank 0 discarded no step"
