"""Issue 44: ``examples/frameworks/hf_after.py`` (the Hugging Face Trainer, its import line
changed) under a real ``ceaseless up --workers 2 --spares 1`` with no batch flags: SIGKILL of
rank 1 during an evaluation, then, once its replacement trains and a new spare is up, of rank
0 during a checkpoint's save (its weights written, the rest not): 0 lost steps and the final
parameters bitwise equal to the fault-free run's. The promoted spares receive the model, the
optimizer, the LR scheduler and the Trainer's progress, and start on the job's next batch (the
run spans two epochs; 2 micro-batches a step, clipped; an evaluation on every rank and a
checkpoint by rank 0 every 8 steps: each equal to the fault-free run's, the one rank 0 died
saving written again by the spare that became rank 0)."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from harness import Cluster, log_events  # noqa: E402

pytestmark = [pytest.mark.timeout(420)]
STEPS = 32  # 256 samples / 4 per micro-batch / 2 micro-batches / 2 ranks: 16 steps an epoch
AFTER = "examples/frameworks/hf_after.py"


def _kill(c: Cluster, rank: int) -> str:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, signal.SIGKILL)
    return h.pod


def _load(path):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def _same(a, b) -> bool:
    """Equal bit for bit: tensors by value and dtype, the rest by ==."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _said(run, pod: str, what: str) -> list[int]:
    """The steps after which ``pod`` printed ``what`` (the example's own lines)."""
    path = run / "logs" / f"{pod}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [int(m) for m in re.findall(re.escape(what) + r" (\d+)", text)]


async def _run(tmp_path, name, spares, fault=None):
    run = tmp_path / name
    cmd = [sys.executable, AFTER, "--max-steps", str(STEPS), "--out", str(run / "sha"),
           "--output-dir", str(run / "hf"), "--eval-steps", "8", "--save-steps", "8",
           # time to kill rank 1 in an evaluation, rank 0 in a save after rank 1's
           # replacement trained (the reference needs none)
           *(["--step-sleep", "0.25", "--save-sleep", "1"] if fault else [])]
    async with Cluster(run, 2, spares, STEPS, cmd=cmd, replace=True) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c, run)
        code = await c.finish()
        assert code == 0, c.output()
        return c.summary(), run


async def test_hf_trainer_survives_kills_in_an_evaluation_and_in_a_save_bitwise(tmp_path):
    ref, ref_dir = await _run(tmp_path, "ref", 0)
    assert ref["final_step"] == STEPS - 1 and ref["lost_steps"] == 0, ref

    killed: list[str] = []

    async def fault(c, run):
        # rank 1 while it evaluates (the example sleeps in each evaluation batch)
        w1 = (await c.wait_for(lambda: c.member(1), 120, "rank 1 training")).pod
        seen = len(_said(run, w1, "evaluating after step"))
        await c.wait_for(lambda: len(_said(run, w1, "evaluating after step")) > seen, 120,
                         "rank 1 evaluating")
        at = c.member(1).step
        killed.append(_kill(c, 1))
        await c.wait_for(lambda: any(h.rank == 1 and h.pod != killed[0] and h.step >= at + 3
                                     for h in c.hb.values()), 180, "rank 1 replaced, training")
        await c.wait_spares(1)  # the replacement spare is up
        # rank 0 inside a checkpoint's save (the example sleeps there), before the last one
        seen = len(_said(run, "w0", "saving a checkpoint at step"))
        await c.wait_for(lambda: len(_said(run, "w0", "saving a checkpoint at step")) > seen,
                         120, "rank 0 saving a checkpoint")
        assert _said(run, "w0", "saving a checkpoint at step")[-1] < STEPS, "too late"
        killed.append(_kill(c, 0))

    s, run = await _run(tmp_path, "faults", 1, fault)
    assert killed[1] == "w0"
    assert s["final_step"] == STEPS - 1 and s["lost_steps"] == 0, s
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    # the script's own digest, written by the spare that became rank 0
    assert (run / "sha").read_text() == (ref_dir / "sha").read_text()
    # both promoted spares received the Trainer's progress (and skipped the done batches)
    spares = [p.stem for p in sorted((run / "logs").glob("s*.log"))]
    got = [p for p in spares if log_events(run, p, "hf: trainer progress received")]
    assert len(got) >= 2, got
    # every checkpoint as the fault-free run wrote it, the one rank 0 died saving written
    # again by its successor
    lost = _said(run, "w0", "saving a checkpoint at step")[-1]
    assert any(log_events(run, p, "hf: a checkpoint lost with rank 0 written again")
               for p in spares), f"step {lost}'s checkpoint not written again"
    names = sorted(p.name for p in (ref_dir / "hf").iterdir() if p.name.startswith("checkpoint-"))
    assert sorted(p.name for p in (run / "hf").iterdir()
                  if p.name.startswith("checkpoint-")) == names
    for ckpt in names:
        assert (run / "hf" / ckpt / "trainer_state.json").exists(), ckpt  # its last file
        assert (run / "hf" / ckpt / "model.safetensors").read_bytes() == \
            (ref_dir / "hf" / ckpt / "model.safetensors").read_bytes(), ckpt
        for name in ("optimizer.pt", "scheduler.pt"):
            assert _same(_load(run / "hf" / ckpt / name), _load(ref_dir / "hf" / ckpt / name)), \
                (ckpt, name)
