"""The DDP drop-in's parts that need no cluster (issue 31): what it finds as training state,
the loss a forward returns, the carried-batch comparison, and that every name is torch's
own without Ceaseless. The cluster behaviour is in test_dropin_e2e.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import agent.ddp as dist
from agent.dropin import _loss_of, _same, discover


def _model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))


def test_discover_finds_the_optimizer_scaler_and_scheduler_over_the_model():
    import gc

    gc.collect()  # another test's scaler, unreachable but not yet collected
    m, other = _model(), _model()
    opt = torch.optim.AdamW(m.parameters())
    foreign = torch.optim.SGD(other.parameters(), lr=0.1)  # another model's: not ours
    sched = torch.optim.lr_scheduler.StepLR(opt, 10)
    torch.optim.lr_scheduler.StepLR(foreign, 10)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    off = torch.amp.GradScaler("cpu", enabled=False)  # disabled: no state to move
    found = discover(m, {})
    assert found["optimizer"] is opt and found["scaler"] is scaler
    assert found["scheduler"] is sched
    assert set(found) == {"optimizer", "scaler", "scheduler"}
    assert "optimizer" not in discover(m, {"mine": opt})  # registered by hand: not again
    del off


def test_discover_skips_an_optimizer_that_wraps_another():
    """Accelerate's ``AcceleratedOptimizer`` (the HF Trainer's) is an ``Optimizer`` over the
    same parameters: its inner optimizer is the state, found (or registered) once."""
    class Wrapper(torch.optim.Optimizer):  # as Accelerate's: no Optimizer.__init__
        def __init__(self, inner):
            self.optimizer = inner

        @property
        def param_groups(self):
            return self.optimizer.param_groups

    m = _model()
    opt = torch.optim.AdamW(m.parameters())
    wrapped = Wrapper(opt)
    assert discover(m, {})["optimizer"] is opt and "optimizer1" not in discover(m, {})
    assert "optimizer" not in discover(m, {"mine": opt})
    del wrapped


def test_two_enabled_scalers_are_refused():
    m = _model()
    torch.optim.AdamW(m.parameters())
    a = torch.amp.GradScaler("cpu", enabled=True)
    b = torch.amp.GradScaler("cpu", enabled=True)
    with pytest.raises(RuntimeError, match="more than one enabled GradScaler"):
        discover(m, {})
    del a, b


def test_the_loss_a_forward_returns():
    x = torch.randn(3, requires_grad=True)
    loss = (x * 2).sum()
    assert _loss_of(loss) is loss
    assert _loss_of((x, loss)) is loss  # nanoGPT: (logits, loss)
    assert _loss_of({"logits": x, "loss": loss}) is loss
    assert _loss_of(x) is None  # logits only: the loss is computed outside the model
    assert _loss_of((x, None)) is None


def test_same_inputs_by_value_not_identity():
    a = torch.arange(6).reshape(2, 3)
    assert _same((a, {"k": 1}), (a.clone(), {"k": 1}))
    assert not _same((a,), (a + 1,))
    assert not _same((a,), (a.float(),))  # same values, another dtype
    assert not _same((a, a), (a,))
    assert not _same({"x": a}, {"y": a})


def test_without_ceaseless_every_name_is_torchs_own(monkeypatch):
    monkeypatch.delenv("CEASELESS_NATS_URL", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not dist.is_launched()
    assert dist.iteration(7) == 7  # the loop's condition stays the script's
    assert dist.ReduceOp is torch.distributed.ReduceOp
    assert dist.Backend is torch.distributed.Backend  # the rest of torch.distributed
    monkeypatch.setenv("RANK", "0")
    assert dist.is_launched()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("CEASELESS_NATS_URL", "nats://127.0.0.1:4222")
    assert dist.is_launched()


def test_under_torchrun_the_wrapper_is_torchs_ddp(tmp_path):
    """One process with a gloo group, as torchrun would start it: DistributedDataParallel is
    torch's own class and all_reduce torch's (nothing of Ceaseless starts)."""
    code = (
        "import torch, agent.ddp as dist\n"
        "from agent.ddp import DistributedDataParallel as DDP\n"
        "dist.init_process_group(backend='gloo')\n"
        "m = DDP(torch.nn.Linear(2, 2))\n"
        "assert type(m) is torch.nn.parallel.DistributedDataParallel, type(m)\n"
        "t = torch.ones(2); dist.all_reduce(t); assert t.tolist() == [1.0, 1.0]\n"
        "assert dist.get_rank() == 0 and dist.get_world_size() == 1\n"
        "dist.destroy_process_group(); print('ok')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CEASELESS_")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="0")  # one process: the OS picks its store's port (no race)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def test_the_update_check_concerns_only_optimizers_over_the_models_parameters():
    """Issue 41 (9e): the drop-in's global optimizer pre-hook refused every optimizer it had
    not registered, even one over another module's parameters (a probe, an EMA head)."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from agent.dropin import DropIn

    hook_before = sys.excepthook
    m, other = _model(), _model()
    d = DropIn(None, 0, 1)
    sys.excepthook = hook_before  # DropIn chains the process's hook: not in a test
    d.module, d._params = m, {id(p) for p in m.parameters()}
    d._opts, d.synced = [torch.optim.SGD(m.parameters(), lr=0.1)], False  # a discarded step
    h = register_optimizer_step_pre_hook(d._pre_step)
    try:
        foreign = torch.optim.SGD(other.parameters(), lr=0.1)
        other(torch.randn(3, 4)).sum().backward()
        before = [p.detach().clone() for p in other.parameters()]
        foreign.step()  # another model's: updated as without Ceaseless
        assert any(not torch.equal(a, p) for a, p in zip(before, other.parameters()))
        d._opts[0].step()  # the registered one: no error (its update skipped)
        late = torch.optim.SGD(m.parameters(), lr=0.1)  # over the model, not registered
        with pytest.raises(RuntimeError, match="not part of the training state"):
            late.step()
    finally:
        h.remove()
        d.closed = True  # nothing for its atexit close to do (no session)


def test_device_ids_of_a_cpu_module_are_ignored_and_logged():
    """Issue 41 (5d): a CUDA script run on the CPU passes DDP(model,
    device_ids=[local_rank]); torch's DDP refuses that for a CPU module, the drop-in's
    ignores it and says so."""
    import structlog

    from agent.ddp import check_devices

    m = _model()
    with structlog.testing.capture_logs() as cap:
        check_devices(m, [0], None)
        check_devices(m, None, None)
    said = [e for e in cap if "device_ids" in e["event"]]
    assert len(said) == 1 and "ignored" in said[0]["event"] and said[0]["device_ids"] == ["0"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_ids_of_a_cuda_module_name_its_device():
    from agent.ddp import check_devices

    m = _model().to("cuda:0")
    check_devices(m, [0], 0)
    check_devices(m, [torch.device("cuda:0")], None)
    with pytest.raises(ValueError, match="device_ids"):
        check_devices(m, [0, 1], None)


class _NoFaults:
    """What ``DropIn.iteration`` reads of its Session when no plan changes the job: the real
    training state, a membership that plans nothing and a runtime that records nothing (the
    cluster's side: tests/test_lightning_e2e.py)."""

    def __init__(self, state) -> None:
        from types import SimpleNamespace

        self.state, self.seed, self.current_step = state, 0, None
        self.m = SimpleNamespace(planned_transition=lambda t: None, phase=None)
        self.runtime = SimpleNamespace(update=lambda **kw: None, begin_step=lambda t: None,
                                       end_step=lambda: None)

    last_committed = property(lambda self: self.state.last_committed)


def test_a_resumes_dry_first_attempt_puts_back_the_schedule_the_loop_starts_from():
    """Issue 44: Lightning wraps the model (the drop-in's attach, which keeps the small state a
    discarded attempt puts back: schedulers, hyper-parameters) before it loads ``ckpt_path``'s
    optimizer and LR schedulers. The resume's dry first attempt (the DataLoader drew from the
    global RNG before the loop) then put the attach-time schedule back: the resumed run's
    StepLR restarted at 0, its checkpoints' ``last_epoch`` 5 behind the fault-free run's and
    their parameters apart from step 10 on (test_lightning_e2e)."""
    from agent.dropin import DropIn, _rngs
    from agent.train_state import TrainState

    hook_before = sys.excepthook
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    # the checkpoint of step 4 (what ckpt_path= holds): five scheduled steps done
    src = torch.optim.AdamW(_model().parameters(), lr=0.01)
    src_sched = torch.optim.lr_scheduler.StepLR(src, step_size=3, gamma=0.5)
    for _ in range(5):
        src.step()
        src_sched.step()
    ck = {"opt": copy.deepcopy(src.state_dict()), "sched": copy.deepcopy(src_sched.state_dict())}
    state = TrainState()
    state.register(model=m, optimizer=opt, scheduler=sched)
    d = DropIn(_NoFaults(state), 0, 1)
    sys.excepthook = hook_before  # DropIn chains the process's hook: not in a test
    try:
        # attach (DDP(model)), as Lightning's strategy setup does it: before the restore
        d.module, d._opts, d._params = m, [opt], {id(p) for p in m.parameters()}
        d._rng_at_attach, d._saved = _rngs(), d._small_state()
        opt.load_state_dict(ck["opt"])  # then Lightning's restore_training_state
        sched.load_state_dict(ck["sched"])
        torch.rand(1)  # the DataLoader's iterator drew from the global RNG
        assert d.iteration(5) == 5 and d.dry  # the resume: a dry first attempt
        d._end_backward()  # its backward: no sync, no update
        assert d.synced is False
        assert d.iteration(5) == 5 and not d.dry  # the step again, for real
        assert sched.state_dict() == ck["sched"]
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in src.param_groups]
    finally:
        d.closed = True  # nothing for its atexit close to do (no session)
