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
    with s:
        assert s.join() and (s.rank, s.world_size, s.is_member) == (0, 1, True)


def _clean_env(monkeypatch):
    for k in [k for k in os.environ if k.startswith("CEASELESS_")]:
        monkeypatch.delenv(k)


def _train(s, model, opt, data, total, start=None, **step_kw):
    import torch

    for _ in s.steps(total=total, start=start):
        for x, y in s.batches(data, micro_batch_size=4):
            s.backward(torch.nn.functional.mse_loss(model(x), y))
        assert s.step(**step_kw)


def test_one_process_ranks_are_none_before_join_as_in_a_job(monkeypatch):
    """Issue 33: s.rank before the loop was 0 alone and None under `ceaseless up`, so
    `master_process = s.rank == 0` worked alone and silently differed in the cluster. Now
    it is None in both until s.join() (and reading it then warns, pointing at on_rank0)."""
    import torch

    import agent

    _clean_env(monkeypatch)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    with agent.Session(global_batch_size=8) as s:
        s.register(model=model, optimizer=opt)
        with pytest.warns(UserWarning, match="on_rank0"):
            assert s.rank is None
        assert (s.world_size, s.is_member) == (None, False)
        _train(s, model, opt, data, 2)
        assert (s.rank, s.world_size, s.is_member) == (0, 1, True)


def test_one_process_on_rank0_sets_up_at_join_and_tears_down_at_exit(monkeypatch):
    """s.on_rank0(setup, teardown): alone, set-up once when the loop starts (the pod is
    rank 0), teardown once when the session closes; bad calls refused."""
    import torch

    import agent

    _clean_env(monkeypatch)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    calls = []
    with agent.Session(global_batch_size=8) as s:
        s.register(model=model, optimizer=opt)
        s.on_rank0(lambda: calls.append(("setup", s.rank, s.last_committed)),
                   lambda: calls.append(("teardown", s.rank)))
        with pytest.raises(RuntimeError, match="already"):
            s.on_rank0(lambda: None)
        assert calls == []
        _train(s, model, opt, data, 3)
        assert calls == [("setup", 0, -1)]
    assert calls == [("setup", 0, -1), ("teardown", 0)]
    with pytest.raises(ValueError, match="setup or a teardown"):
        agent.Session(global_batch_size=8).on_rank0()


def test_one_process_join_and_steps_with_a_start_and_clip_zero(monkeypatch):
    """s.join(start=k) then s.steps(start=k) (the README's patterns together) continue from
    k; starts that disagree are refused with both named; s.step(max_grad_norm=0.0) is
    clipping off (nanoGPT's grad_clip = 0.0), bit for bit the same as no argument."""
    import torch

    import agent

    _clean_env(monkeypatch)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    params = []
    for kw in ({}, {"max_grad_norm": 0.0}, {"max_grad_norm": None}):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with agent.Session(global_batch_size=8) as s:
            s.register(model=model, optimizer=opt)
            assert s.join(start=5)
            seen = []
            for step in s.steps(total=8, start=5):
                seen.append(step)
                for x, y in s.batches(data, micro_batch_size=4):
                    s.backward(torch.nn.functional.mse_loss(model(x) * 100, y))
                assert s.step(**kw)
            assert seen == [5, 6, 7]
            params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert all(torch.equal(params[0], p) for p in params[1:])
    with agent.Session(global_batch_size=8) as s:
        s.register(model=model, optimizer=opt)
        assert s.join(start=3)
        with pytest.raises(RuntimeError, match=r"s.join\(start=3\) and s.steps\(start=4\)"):
            next(iter(s.steps(total=8, start=4)))
    with agent.Session(global_batch_size=8) as s:
        s.register(model=model, optimizer=opt)
        with pytest.raises(ValueError, match=">= 0"):
            _train(s, model, opt, data, 1, max_grad_norm=-1.0)


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


def test_fp16_grad_scaler_matches_pytorchs_own_recipe(monkeypatch):
    """fp16 with a registered GradScaler, one process: s.backward scales, s.step unscales,
    skips the steps whose gradient overflowed and moves the scale, exactly as PyTorch's AMP
    recipe (scale, backward, unscale_, clip, step, update) does by hand: the same skipped
    steps, scales and parameters, bit for bit."""
    import torch

    import agent

    for k in [k for k in os.environ if k.startswith("CEASELESS_")]:
        monkeypatch.delenv(k)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(),
                                    torch.nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        # 2**12 overflows fp16 gradients at first: the scaler backs off, then grows (every 2)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        return model, opt, scaler

    data = torch.randn(10, 4, 2, 8) * 3  # step, micro-batch, samples, features
    target = torch.randn(10, 4, 2, 1)

    def loss_of(model, s, k):
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(data[s, k])
        return torch.nn.functional.mse_loss(out.float(), target[s, k])

    model, opt, scaler = build()
    mine = []
    with agent.Session(global_batch_size=8) as sess:
        sess.register(model=model, optimizer=opt, scaler=scaler)
        for s in sess.steps(total=10):
            for k in sess.micro_batches(2):
                sess.backward(loss_of(model, s, k))
            sess.step(max_grad_norm=5.0)
            mine.append((sess.skipped, scaler.get_scale()))

    ref_model, ref_opt, ref_scaler = build()
    ref = []
    for s in range(10):
        for k in range(4):
            ref_scaler.scale(loss_of(ref_model, s, k) * (2 / 8)).backward()
        ref_scaler.unscale_(ref_opt)
        grads = [p.grad for p in ref_model.parameters()]
        skipped = not all(bool(torch.isfinite(g).all()) for g in grads)
        if not skipped:
            torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 5.0)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad(set_to_none=True)
        ref.append((skipped, ref_scaler.get_scale()))
    assert mine == ref, (mine, ref)
    assert any(sk for sk, _ in mine) and not all(sk for sk, _ in mine)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)
