"""The Session without a cluster: single-process mode, and what it refuses."""

from __future__ import annotations

import os

import pytest


def test_a_script_under_torchrun_is_refused(monkeypatch):
    """Issue 23: a Ceaseless script under torchrun without Ceaseless' environment would run
    N independent single-process jobs; it is refused with what to do instead."""
    import agent

    for k in [k for k in os.environ if k.startswith("CEASELESS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="ceaseless up"):
        agent.Session.from_env(global_batch_size=8)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK")
    s = agent.Session.from_env(global_batch_size=8)  # one process: fine
    assert (s.rank, s.world_size, s.is_member) == (0, 1, True)


def test_one_process_clips_and_reduces_as_a_job_would(monkeypatch):
    """Single-process: s.step(max_grad_norm=...) clips (s.grad_norm is the norm before),
    a grad hook runs after it, s.all_reduce is the identity; bad arguments are refused."""
    import torch

    import agent

    for k in [k for k in os.environ if k.startswith("CEASELESS_")]:
        monkeypatch.delenv(k)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4) * 100, torch.randn(16, 1))
    seen = []
    with agent.Session(global_batch_size=8) as s:
        s.register(model=model, optimizer=opt)
        for _ in s.steps(total=2):
            for x, y in s.batches(data, micro_batch_size=4):
                s.backward(torch.nn.functional.mse_loss(model(x), y))
            grads = [p.grad.clone() for p in model.parameters()]
            norm = float(torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads])))
            assert s.step(max_grad_norm=1.0, grad_hook=lambda ps: seen.append(
                float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ps])))))
            assert abs(s.grad_norm - norm) <= 1e-4 * norm and norm > 1.0
            assert abs(seen[-1] - 1.0) < 1e-4  # the hook saw the clipped gradient
        t = torch.tensor([3.0])
        assert s.all_reduce(t) and float(t) == 3.0
        with pytest.raises(ValueError, match="op must be"):
            s.all_reduce(t, op="max")
    with pytest.raises(TypeError, match="map-style"):
        with agent.Session(global_batch_size=8) as s2:
            s2.register(model=model, optimizer=opt)
            for _ in s2.steps(total=1):
                next(iter(s2.batches(iter([1, 2, 3]), micro_batch_size=4)))


def test_init_without_a_with_block(tmp_path):
    """agent.init(): a session for a script that is not re-indented, closed at exit."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "s.py"
    script.write_text(
        "import torch, agent\n"
        "s = agent.init(global_batch_size=4)\n"
        "m = torch.nn.Linear(2, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "s.register(model=m, optimizer=o)\n"
        "d = torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 1))\n"
        "for step in s.steps(total=3):\n"
        "    for x, y in s.batches(d, micro_batch_size=2):\n"
        "        s.backward(torch.nn.functional.mse_loss(m(x), y))\n"
        "    s.step()\n"
        "print('done', s.last_committed, s.rank)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parent.parent)
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "done 2 0" in out.stdout
