"""Issue 44: ``examples/frameworks/lightning_after.py`` (PyTorch Lightning, the strategy line
changed) under a real ``ceaseless up --workers 2 --spares 1`` with no batch flags.

The fault-free run trains 40 steps, validating every 6 (``self.log(..., sync_dist=True)``)
and writing a ``ModelCheckpoint`` every 5. The faulty run resumes from its step-5
checkpoint (``ckpt_path=``, mid-epoch) and, once a spare is up, loses rank 1 (SIGKILL)
during a validation and then, once its replacement trained and a new spare is up, rank 0
during a checkpoint's save: 0 lost steps, the final parameters bitwise equal to the
fault-free run's, and every checkpoint equal to the fault-free run's, the one rank 0 died
saving written again by the spare that became rank 0. The promoted spares receive the
model, the optimizer, the LR scheduler, the fit loop's progress and ModelCheckpoint's state,
and start on the job's next batch (the run spans three epochs).

The plain kills of rank 1 and then rank 0, with gradient accumulation, are
tests/test_lightning_kills_e2e.py's (a reference of their own: accumulating over 2
micro-batches is another trajectory)."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

pytest.importorskip("lightning")

from harness import Cluster, log_events  # noqa: E402

pytestmark = [pytest.mark.timeout(420)]
STEPS = 40  # 256 samples / 8 per batch / 2 ranks: 16 steps an epoch
AFTER = "examples/frameworks/lightning_after.py"
RESUME = "epoch=0-step=5.ckpt"


def _kill(c: Cluster, rank: int) -> str:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, signal.SIGKILL)
    return h.pod


def _said(run, pod: str, what: str) -> list[int]:
    """The steps after which ``pod`` printed ``what`` (the example's own lines)."""
    path = run / "logs" / f"{pod}.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [int(m) for m in re.findall(re.escape(what) + r" (\d+)", text)]


async def _run(tmp_path, name, spares, fault=None, extra=()):
    run = tmp_path / name
    cmd = [sys.executable, AFTER, "--max-steps", str(STEPS), "--out", str(run / "sha"),
           "--ckpt-dir", str(run / "ck"), "--ckpt-every", "5", "--val-every", "6"]
    if fault is not None:  # time to kill rank 0 after rank 1's replacement (a sleep: same
        cmd += ["--step-sleep", "0.3"]  # numerics, so the reference runs without it)
    cmd += extra
    async with Cluster(run, 2, spares, STEPS, cmd=cmd, replace=True) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c, run)
        code = await c.finish()
        assert code == 0, c.output()
        return c.summary(), run


def _same(a, b, where: str, dirs: tuple[str, str]) -> None:
    """Checkpoint contents equal: tensors bit for bit, the rest == (the run's directory
    named as the reference's)."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}/{k}", dirs)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]", dirs)
    elif isinstance(a, str):
        assert a.replace(*dirs) == b, (where, a, b)
    else:
        assert a == b, (where, a, b)


_REF: list = []  # (summary, run dir) of the fault-free run: once per test process


async def _reference(tmp_path_factory):
    """The fault-free run (validation, checkpoints), shared by this file's tests."""
    if not _REF:
        ref, ref_dir = await _run(tmp_path_factory.mktemp("lightning"), "ref", 0)
        assert ref["final_step"] == STEPS - 1 and ref["lost_steps"] == 0, ref
        _REF.append((ref, ref_dir))
    return _REF[0]


async def test_lightning_survives_kills_in_validation_and_in_a_checkpoint_save_bitwise(
        tmp_path, tmp_path_factory):
    import torch

    ref, ref_dir = await _reference(tmp_path_factory)

    killed: list[str] = []

    async def fault(c, run):
        # rank 1 while it validates (the example sleeps in each validation batch)
        w1 = (await c.wait_for(lambda: c.member(1), 120, "rank 1 training")).pod
        seen = len(_said(run, w1, "validating after step"))
        await c.wait_for(lambda: len(_said(run, w1, "validating after step")) > seen, 120,
                         "rank 1 validating")
        at = c.member(1).step
        killed.append(_kill(c, 1))
        await _replaced(c, killed[0], at)
        # rank 0 while it saves a checkpoint (the example sleeps there), before the last one
        seen = len(_said(run, "w0", "saving a checkpoint at step"))
        await c.wait_for(lambda: len(_said(run, "w0", "saving a checkpoint at step")) > seen,
                         120, "rank 0 saving a checkpoint")
        assert _said(run, "w0", "saving a checkpoint at step")[-1] < STEPS, "too late"
        killed.append(_kill(c, 0))

    s, run = await _run(tmp_path, "faults", 1, fault,
                        ["--resume", str(ref_dir / "ck" / RESUME), "--save-sleep", "1"])
    assert killed[1] == "w0"
    assert s["final_step"] == STEPS - 1 and s["lost_steps"] == 0, s
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    # the script's own digest, written by the spare that became rank 0
    assert (run / "sha").read_text() == (ref_dir / "sha").read_text()
    # both promoted spares received the loop's progress (and skipped the done batches)
    spares = [p.stem for p in sorted((run / "logs").glob("s*.log"))]
    got = [p for p in spares if log_events(run, p, "lightning: loop progress received")]
    assert len(got) >= 2, got
    # every checkpoint after the resumed one, as the fault-free run wrote it; the one rank
    # 0 died saving (it never wrote it) written again by its successor
    lost = _said(run, "w0", "saving a checkpoint at step")[-1]
    assert any(log_events(run, p, "lightning: a checkpoint lost with rank 0 written again")
               for p in spares), f"step {lost}'s checkpoint not written again"
    names = sorted(p.name for p in (ref_dir / "ck").iterdir()
                   if int(p.stem.split("step=")[1]) > 5)
    assert sorted(p.name for p in (run / "ck").iterdir()) == names
    for name in names:
        _same(torch.load(run / "ck" / name, weights_only=False),
              torch.load(ref_dir / "ck" / name, weights_only=False), name,
              (str(run / "ck"), str(ref_dir / "ck")))


async def _replaced(c: Cluster, killed: str, at: int) -> None:
    await c.wait_for(lambda: any(h.rank == 1 and h.pod != killed and h.step >= at + 3
                                 for h in c.hb.values()), 180, "rank 1 replaced, training")
    await c.wait_spares(1)  # the replacement spare is up
