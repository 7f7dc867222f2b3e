"""Ceaseless with the model on CUDA (issue 19). Skipped without CUDA; run on the GPU machine
(one H200 there: pods share it, so CUDA tensors go over gloo, and NCCL runs at world size
1; multi-GPU NCCL needs 2+ GPUs and skips below that)."""

from __future__ import annotations

import os
import signal
import sys

import pytest
import torch

from harness import Cluster, log_events, run_job

pytestmark = [pytest.mark.timeout(400),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
STEPS = 60
SLOW = ("--sleep", "0.03")  # per micro-batch, fault runs only: time to aim the kill; same numerics


def _example(*args: str) -> list[str]:
    return ["--", sys.executable, "-m", "examples.train_gpt", "--steps", str(STEPS), *args]


_events = log_events


async def test_cpu_example_on_a_gpu_machine_uses_gloo(tmp_path):
    """The README demo on a GPU workstation: the example's model is on the CPU, so the job
    is gloo whatever CUDA says (it used to pick NCCL and fail on the first collective)."""
    s = await run_job(tmp_path, "cpu", 2, 0, steps=STEPS, extra=_example())
    assert s["final_step"] == STEPS - 1 and s["param_sha256"]
    assert [r["backend"] for r in _events(tmp_path / "cpu", "w0", "backend")] == ["gloo"]


@pytest.mark.parametrize("victim", [1, 0])
async def test_cuda_model_on_a_shared_gpu_survives_a_kill_bitwise(tmp_path, victim):
    """2 workers + a spare, all on one GPU (shared: gloo carrying CUDA tensors through host
    memory): SIGKILL of rank ``victim``; the result equals the fault-free CUDA run bit for
    bit, and the spare followed the job on the GPU (received nothing when promoted)."""
    ref = await run_job(tmp_path, "ref", 2, 0, steps=STEPS, extra=_example("--device", "cuda"))
    assert ref["param_sha256"], ref

    async def fault(c):
        await c.wait_rank_step(victim, 8)
        await c.wait_for(lambda: any(h.role.value == "spare" and h.step >= 8
                                     for h in c.hb.values()), 60, "the spare to follow")
        h = c.member(victim)
        os.kill(h.pid, signal.SIGKILL)

    s = await run_job(tmp_path, "kill", 2, 1, fault, steps=STEPS,
                      extra=_example("--device", "cuda", *SLOW))
    assert s["final_step"] == STEPS - 1 and s["lost_steps"] == 0
    assert s["param_sha256"] == ref["param_sha256"], (s, ref)
    assert {r["backend"] for r in _events(tmp_path / "kill", "w0" if victim else "w1",
                                          "backend")} == {"gloo"}
    assert {r["device"] for r in _events(tmp_path / "kill", "s0", "backend")} == {"cuda:0"}
    if victim == 1:  # (rank 0's death can take its last confirmation with it)
        joined = [r for r in _events(tmp_path / "kill", "s0", "joined generation")
                  if r["generation"] == 2]
        assert joined and joined[0]["received"] == 0, joined


async def test_cuda_model_alone_on_its_gpu_uses_nccl(tmp_path):
    """One pod with a GPU of its own: NCCL (world size 1 here; the same path as one GPU per
    pod in a larger job)."""
    s = await run_job(tmp_path, "nccl", 1, 0, steps=STEPS, extra=_example("--device", "cuda"))
    assert s["final_step"] == STEPS - 1 and s["param_sha256"]
    assert [r["backend"] for r in _events(tmp_path / "nccl", "w0", "backend")] == ["nccl"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ GPUs (NCCL across pods)")
async def test_cuda_one_gpu_per_pod_survives_a_kill_over_nccl(tmp_path):
    ref = await run_job(tmp_path, "ref", 2, 0, steps=STEPS, extra=_example("--device", "cuda"))

    async def fault(c):
        await c.wait_rank_step(1, 8)
        os.kill(c.member(1).pid, signal.SIGKILL)

    n_spares = 1 if torch.cuda.device_count() >= 3 else 0
    s = await run_job(tmp_path, "kill", 2, n_spares, fault, steps=STEPS,
                      extra=_example("--device", "cuda", *SLOW))
    assert s["final_step"] == STEPS - 1 and s["lost_steps"] == 0
    if n_spares:
        assert s["param_sha256"] == ref["param_sha256"]


def test_a_working_cuda_context_passes_the_health_check_and_a_bound_device_is_used():
    """Issue 30: after an abort a pod checks its CUDA context before it re-enters (a probe
    kernel); a helper thread reads the bound device, not its own current device."""
    import threading

    from agent.device import cuda_broken
    from agent.groups import bind_device, cuda_device

    dev = torch.device("cuda", torch.cuda.device_count() - 1)
    assert cuda_broken(dev) is None
    torch.cuda.set_device(dev)
    bind_device(torch.device("cuda"))
    seen = []
    th = threading.Thread(target=lambda: seen.append(cuda_device()))
    th.start()
    th.join()
    assert seen == [dev]


def test_the_verified_copy_is_made_on_a_side_stream_and_waited_for():
    """Issue 32: the verified copy of CUDA state goes to pinned host memory on a side stream;
    the update after it waits for it on the device; a rollback restores what was copied."""
    from agent.train_state import TrainState
    from agent.verify import Verifier

    st = TrainState()
    model = torch.nn.Linear(256, 256).cuda()
    st.register(model=model)
    v = Verifier(1)
    copy = v._snapshot(st)
    assert v._pending is not None and all(b.is_pinned() for b in copy.buffers)
    want = model.weight.detach().clone()
    v.before_update()  # the training stream waits for the copy
    assert v._pending is None
    with torch.no_grad():
        model.weight.add_(1.0)  # the next update
    torch.cuda.synchronize()
    v.copy = copy
    st.restore(copy)
    assert torch.equal(model.weight, want)
    again = v._snapshot(st)  # written over in place
    assert [b.data_ptr() for b in again.buffers] == [b.data_ptr() for b in copy.buffers]


def test_a_steady_cuda_step_makes_at_most_one_host_sync(nats_server):
    """Issue 43 on a GPU: the heartbeat digest is begun on the device and read a step later,
    rank 0's ``state_word`` is read off the training thread: at most one host sync a steady
    step (the loss read), and every digest the heartbeat carried names its own step."""
    from test_host_syncs import run_session

    run_session(nats_server, "cuda")


def test_a_cuda_step_with_fp16_and_a_clip_makes_one_host_sync(nats_server):
    """Issue 43 on a GPU: the clip's norm and fp16's finite check come with the loss in one
    read, the scale moves on its host copy (the scaler's ``fill_``, no read)."""
    from test_host_syncs import run_session

    run_session(nats_server, "cuda", scaler={"init_scale": 2.0**127, "growth_interval": 2},
                max_grad_norm=0.05)


def test_an_nccl_wait_sleeps_on_an_event_and_still_aborts():
    """Issue 43: NCCL waits are a helper thread on a blocking CUDA event, not sleep polling;
    an abort set before the wait still abandons the group (Aborted), a world of one
    completes."""
    import threading

    import torch.distributed as dist

    from agent.collectives import AbortableGroup, Aborted, make_group

    store = dist.HashStore()
    pg = make_group(store, 0, 1, timeout_s=30.0, backend="nccl")
    g = AbortableGroup(pg, slice_s=0.05, timeout_s=30.0)
    t = torch.ones(1 << 20, device="cuda")
    for _ in range(3):
        g.allreduce_([t], None)
    assert torch.equal(t, torch.ones_like(t)) and g.usable
    abort = threading.Event()
    pending = g.allreduce_start([t])
    abort.set()  # the wait gives up on it (the communicator is aborted)
    with pytest.raises(Aborted):
        g.allreduce_finish(pending, abort)
    assert not g.usable


def test_the_digests_cover_cuda_state_on_its_device():
    """The majority digest and the transfer's exact digest of a CUDA model and its optimizer
    (Adam's step counters stay on the CPU): computed where the tensors are (the exact one
    equal to its value over host copies), and an optimizer-only difference changes both."""
    import copy

    from agent.digests import covered, exact
    from agent.train_state import TrainState

    def objs(dev: str) -> dict:
        torch.manual_seed(0)
        m = torch.nn.Linear(16, 8).to(dev)
        o = torch.optim.Adam(m.parameters(), lr=1e-2)
        m(torch.randn(4, 16, device=dev)).pow(2).mean().backward()
        o.step()
        return {"model": m, "opt": o}

    def both(o: dict) -> tuple[str, int]:
        ts = TrainState()
        ts.register(**o)
        return ts.digest(), int(exact(covered(o)))

    gpu = objs("cuda")
    assert {t.device.type for t in covered(gpu)} == {"cuda", "cpu"}  # the step counters
    d0, e0 = both(gpu)
    assert d0 and e0 == int(exact([t.cpu() for t in covered(gpu)]))
    other = copy.deepcopy(gpu)
    for st in other["opt"].state.values():
        st["exp_avg"].mul_(1.5)
    d1, e1 = both(other)
    assert d1 != d0 and e1 != e0
