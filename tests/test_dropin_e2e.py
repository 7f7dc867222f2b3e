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

from harness import REPO, Cluster

pytestmark = [pytest.mark.timeout(420)]
ITERS = 40
BEFORE, AFTER = "examples/porting/ddp_train.py", "examples/porting/ceaseless_train.py"


def _cmd(out) -> list[str]:
    return [sys.executable, AFTER, "--max-iters", str(ITERS), "--eval-interval", "10",
            "--out-dir", str(out)]


def _kill(c: Cluster, rank: int) -> str:
    h = c.member(rank)
    assert h is not None and h.pid
    os.kill(h.pid, signal.SIGKILL)
    return h.pod


async def _run(tmp_path, name, spares, fault=None):
    run = tmp_path / name
    async with Cluster(run, 2, spares, ITERS, cmd=_cmd(run / "out"), replace=True) as c:
        if fault is not None:
            await c.wait_spares(spares)
            await fault(c)
        code = await c.finish()
        assert code == 0, c.output()
        return c.summary(), run


async def test_dropin_survives_kills_of_a_worker_and_of_rank0_bitwise(tmp_path):
    ref, ref_dir = await _run(tmp_path, "ref", 0)
    assert ref["final_step"] == ITERS - 1 and ref["lost_steps"] == 0
    assert (ref_dir / "out" / "ckpt.pt").exists()  # rank 0's own checkpoint at the end

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
    assert (run / "out" / "ckpt.pt").exists()  # saved by the promoted spare, now rank 0


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
