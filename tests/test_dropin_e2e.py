"""Issue 31: the DDP drop-in. ``examples/porting/ceaseless_train.py`` (the torchrun + DDP
script with its imports, its launcher check and its loop condition changed) under a real
``ceaseless up --workers 2 --spares 1`` with no batch flags: SIGKILL of a worker, then of rank
0, ends bitwise equal to the fault-free run, with 0 committed steps lost; the diff stays
within 12 lines; the "before" and the "after" both run under plain python."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from harness import REPO, Cluster, log_events

pytestmark = [pytest.mark.timeout(420)]
ITERS = 40
BEFORE, AFTER = "examples/porting/ddp_train.py", "examples/porting/ceaseless_train.py"


def _cmd(out, *extra: str) -> list[str]:
    return [sys.executable, AFTER, "--max-iters", str(ITERS), "--eval-interval", "10",
            "--out-dir", str(out), *extra]


def _same_checkpoints(a, b) -> None:
    """Rank 0's own checkpoints (model, optimizer, GradScaler, iter_num) equal bit for bit."""
    import torch

    x, y = (torch.load(p / "out" / "ckpt.pt", map_location="cpu") for p in (a, b))
    assert x["iter_num"] == y["iter_num"] == ITERS
    assert x["scaler"] == y["scaler"]  # scale and growth tracker: put back after a discard

    def same(u, v):
        if isinstance(u, torch.Tensor):
            return torch.equal(u, v)
        if isinstance(u, dict):
            return u.keys() == v.keys() and all(same(u[k], v[k]) for k in u)
        if isinstance(u, (list, tuple)):
            return len(u) == len(v) and all(same(p, q) for p, q in zip(u, v))
        return u == v

    assert same(x["model"], y["model"]) and same(x["optimizer"], y["optimizer"])


def _kill(c: Cluster, rank: int) -> str:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, signal.SIGKILL)
    return h.pod


async def _run(tmp_path, name, spares, fault=None, extra=(), up=None):
    run = tmp_path / name
    async with Cluster(run, 2, spares, ITERS, cmd=_cmd(run / "out", *extra), replace=True,
                       extra=up) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        assert code == 0, c.output()
        return c.summary(), run


_REF: list = []  # (summary, run dir) of the fault-free run: once per test process


async def _reference(tmp_path_factory):
    """The fault-free run (no flags), shared by this file's tests (it was run by three)."""
    if not _REF:
        ref, ref_dir = await _run(tmp_path_factory.mktemp("dropin"), "ref", 0)
        assert ref["final_step"] == ITERS - 1 and ref["lost_steps"] == 0
        assert (ref_dir / "out" / "ckpt.pt").exists()  # rank 0's own checkpoint at the end
        _REF.append((ref, ref_dir))
    return _REF[0]


async def test_dropin_survives_kills_of_a_worker_and_of_rank0_bitwise(tmp_path,
                                                                       tmp_path_factory):
    ref, ref_dir = await _reference(tmp_path_factory)

    killed: list[str] = []

    async def fault(c):
        await c.wait_rank_step(1, 8)
        killed.append(_kill(c, 1))
        await c.wait_for(lambda: any(h.rank == 1 and h.pod != killed[0] and h.step >= 16
                                     for h in c.hb.values()), 180, "rank 1 replaced, training")
        await c.wait_spares(1)  # the replacement spare is up
        killed.append(_kill(c, 0))

    s, run = await _run(tmp_path, "faults", 1, fault)
    assert killed[1] == "w0"
    assert s["final_step"] == ITERS - 1 and s["lost_steps"] == 0, s
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    _same_checkpoints(ref_dir, run)  # saved by the promoted spare, now rank 0


async def test_a_step_computed_again_gets_its_own_first_batch_and_scaler_state(tmp_path,
                                                                              monkeypatch):
    """The redo path: rank 1 raises just before its gradient sync (an injected exception) while
    rank 0 waits in the all-reduce, so rank 0 cannot resume in place: its step is discarded
    and computed again. The script had already prefetched the next step's first batch and
    run its GradScaler's step and update (fp16): the drop-in skips that update, puts the
    scale back and gives the step its own first micro-batch. Bitwise equal to the fault-free
    run (resuming in place is off: rank 0, if slower, could still be computing)."""
    from schemas.messages import InjectAction

    monkeypatch.setenv("CEASELESS_RESUME_IN_PLACE", "0")  # the pods inherit it

    fp16 = ("--dtype", "float16")
    ref, ref_dir = await _run(tmp_path, "ref", 0, extra=fp16)

    async def fault(c):
        await c.wait_rank_step(1, 8)
        await c.inject_ahead(InjectAction.exception, rank=1)  # answered: it will happen

    s, run = await _run(tmp_path, "faults", 1, fault, extra=fp16)
    assert s["final_step"] == ITERS - 1 and s["lost_steps"] == 0, s
    assert [i["kind"] for i in s["incidents"]] == ["exception"], s["incidents"]
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    _same_checkpoints(ref_dir, run)
    assert log_events(run, "w0", "step discarded"), "rank 0 was expected to compute step 12 again"
    assert log_events(run, "w0", "a step computed again: its first micro-batch is the one the "
                      "failed attempt used, not the batch the script carried over")


def test_port_is_at_most_12_lines_and_both_run_in_one_process(tmp_path):
    diff = subprocess.run(["diff", "-U0", BEFORE, AFTER], cwd=REPO, capture_output=True,
                          text=True).stdout
    changed = [x for x in diff.splitlines()
               if x[:1] in "+-" and not x.startswith(("+++", "---"))]
    assert 0 < len(changed) <= 12, diff
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CEASELESS_") and k not in ("RANK", "WORLD_SIZE")}
    for script in (BEFORE, AFTER):
        r = subprocess.run([sys.executable, script, "--max-iters", "3", "--eval-interval", "2",
                            "--out-dir", str(tmp_path / script.split("/")[-1])],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "saved" in r.stdout


SOLO_TIMEOUTS = ["--stall-timeout", "2.5", "--fault-timeout", "1.5"]


def _script(*args: str) -> list[str]:
    return [sys.executable, "tests/helpers/dropin_script.py", "--iters", "10", *args]


async def test_rank0_work_inside_dist_solo_is_no_fault(tmp_path, monkeypatch):
    """Issue 41 (5a): the drop-in's form of s.solo. Rank 0 sleeps three collective timeouts
    inside `with dist.solo(max_s=...)` (CEASELESS_COLLECTIVE_TIMEOUT=3 set alone: the
    recovery timeout follows it): the peer's gradient all-reduce waits for it, nobody is
    declared, and the result is bitwise the run without the sleep."""
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", "3")
    runs = {}
    for name, extra in (("ref", ()), ("solo", ("--rank0-sleep", "9", "--rank0-at", "4",
                                               "--solo-max", "30"))):
        async with Cluster(tmp_path / name, 2, 0, 10, extra=SOLO_TIMEOUTS,
                           cmd=_script(*extra), replace=True) as c:
            assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
            runs[name] = c.summary()
    s, ref = runs["solo"], runs["ref"]
    assert s["incidents"] == [] and s["final_step"] == 9 and s["lost_steps"] == 0, s
    assert s["param_sha256"] == ref["param_sha256"]
    assert log_events(tmp_path / "solo", "w0", "working alone")
    assert log_events(tmp_path / "solo", "w1", "waiting for a peer that works alone")


async def test_a_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, tmp_path_factory,
                                                             monkeypatch):
    """Issue 41 (5b): resuming from the script's own checkpoint (`--resume`, its iter_num) at
    iteration 20 ends bitwise equal to the run of 40 in one go, with and without a fault in
    the resumed run's first step (rank 1 alive but out of step 20's all-reduce: declared,
    replaced by the spare; rank 0 computes step 20 again). The script draws the resumed
    step's first batch before its loop, before the session knows the step."""
    half = ITERS // 2
    ref, ref_dir = await _reference(tmp_path_factory)
    first, first_dir = await _run(tmp_path, "first", 0, extra=("--max-iters", str(half)))
    assert first["final_step"] == half - 1
    import shutil

    def resumed(name: str) -> None:
        (tmp_path / name / "out").mkdir(parents=True)
        shutil.copy(first_dir / "out" / "ckpt.pt", tmp_path / name / "out" / "ckpt.pt")

    resumed("resumed")
    s, run = await _run(tmp_path, "resumed", 0, extra=("--resume",))
    assert s["final_step"] == ITERS - 1 and s["incidents"] == [], s
    _same_checkpoints(ref_dir, run)

    resumed("fault")
    monkeypatch.setenv("CEASELESS_TEST_ABSENT", f"w1:{half}")  # the pods inherit it
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", "3")
    monkeypatch.setenv("CEASELESS_RESUME_IN_PLACE", "0")  # rank 0 computes the step again

    async def nothing(c):
        pass  # the hook is the fault

    s, run = await _run(tmp_path, "fault", 1, nothing,
                        extra=("--resume",), up=["--stall-timeout", "2.5", "--fault-timeout", "1.5"])
    assert [(i["pod"], i["kind"]) for i in s["incidents"]] == [("w1", "hang")], s["incidents"]
    assert s["final_step"] == ITERS - 1 and s["lost_steps"] == 0, s
    _same_checkpoints(ref_dir, run)
    assert [e["step"] for e in log_events(run, "w0", "step discarded")] == [half]


async def test_verify_every_finds_a_flipped_bit_and_rolls_back(tmp_path, tmp_path_factory):
    """Issue 41 (5c): `--verify-every` for the drop-in (before, every drop-in run warned that it
    was not done). One bit of rank 1's parameters flipped at step 12, verification every 5
    steps: at step 14 the digests disagree, both ranks restore the copy verified at step 9,
    `dist.iteration` returns step 10 again (computed once without its update to draw its
    first batch, the script holding a later step's), and the run ends bitwise equal to the
    fault-free one."""
    from schemas.messages import Inject, InjectAction

    ref, ref_dir = await _reference(tmp_path_factory)

    async def flip(c):
        await c.wait_rank_step(1, 3)
        await c.bus.publish(c.bus.subjects.inject,
                            Inject(action=InjectAction.bitflip, rank=1, at_step=12))

    s, run = await _run(tmp_path, "flip", 0, flip, up=["--verify-every", "5"])
    assert s["final_step"] == ITERS - 1, s
    for pod in ("w0", "w1"):
        back = log_events(run, pod, "rolled back to the last verified copy")
        assert [(e["step"], e["verified"]) for e in back] == [(14, 9)], back
        assert log_events(run, pod, "state verified")
    _same_checkpoints(ref_dir, run)
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
