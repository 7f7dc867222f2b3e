"""GPU placement (services/actuator/gpus.py) and the backend choice (agent/collectives.py):
pure logic, no GPU needed. The CUDA paths themselves run in tests/test_cuda.py (skipped
without CUDA) and on the GPU machine (docs/benchmarks.md, "GPU")."""

from __future__ import annotations

import pytest
import torch

from agent.collectives import choose_backend
from services.actuator.gpus import SHARED_ENV, GpuAssigner, NoFreeGpu, visible_gpus


def test_one_gpu_per_pod_when_there_are_enough():
    g = GpuAssigner(["0", "1", "2", "3"], expected=3)
    assert g.mode == "exclusive" and g.warning is None
    envs = [g.assign(p) for p in ("w0", "w1", "s0")]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1", "2"]
    assert {e[SHARED_ENV] for e in envs} == {"0"}
    g.release("w1")  # w1 exited: its GPU goes to the next pod
    assert g.assign("s1")["CUDA_VISIBLE_DEVICES"] == "1"
    assert g.assign("s2")["CUDA_VISIBLE_DEVICES"] == "3"
    with pytest.raises(NoFreeGpu, match="no free GPU for pod s3"):
        g.assign("s3")


def test_shared_when_too_few_and_several_per_pod():
    g = GpuAssigner(["0"], expected=3)
    assert g.mode == "shared" and "share" in g.warning
    assert [g.assign(p) for p in ("w0", "w1")] == [
        {"CUDA_VISIBLE_DEVICES": "0", SHARED_ENV: "1", "LOCAL_RANK": "0"}] * 2
    g2 = GpuAssigner(["0", "1", "2", "3"], expected=2, per_pod=2)
    assert g2.mode == "exclusive"
    assert [g2.assign(p)["CUDA_VISIBLE_DEVICES"] for p in ("a", "b")] == ["0,1", "2,3"]


def test_no_gpu_and_bad_requests():
    assert GpuAssigner([], expected=4).assign("w0") == {}
    assert GpuAssigner(["0"], expected=4, per_pod=0).assign("w0") == {}
    with pytest.raises(ValueError, match="no GPU"):
        GpuAssigner([], expected=1, per_pod=1)
    with pytest.raises(ValueError, match="only 1 GPU"):
        GpuAssigner(["0"], expected=1, per_pod=2)
    with pytest.raises(ValueError, match=">= 0"):
        GpuAssigner(["0"], expected=1, per_pod=-1)


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert visible_gpus() == ["2", "3"]


def test_backend_follows_the_tensors():
    # a CPU model is gloo on any machine (the demo on a GPU workstation)
    assert choose_backend(torch.device("cpu")) == "gloo"
    assert choose_backend(None) == "gloo"
    # CUDA tensors: NCCL with a GPU per pod (when the build has NCCL), gloo when shared
    assert choose_backend("cuda:0", shared_gpu=True) == "gloo"
    expect = "nccl" if torch.distributed.is_nccl_available() else "gloo"
    assert choose_backend("cuda:0", shared_gpu=False) == expect
    # the override wins; a bad one is refused
    assert choose_backend("cpu", override="NCCL") == "nccl"
    with pytest.raises(ValueError, match="unknown backend"):
        choose_backend("cpu", override="mpi")


def test_shared_flag_from_the_environment(monkeypatch):
    monkeypatch.setenv(SHARED_ENV, "1")
    assert choose_backend("cuda:0") == "gloo"



def test_a_cpu_model_has_no_cuda_context_to_check():
    """Issue 30: the CUDA health check after an abort is a no-op for a CPU model (the CUDA
    probe itself runs in tests/test_cuda.py on a GPU machine)."""
    import torch

    from agent.device import cuda_broken

    assert cuda_broken(torch.device("cpu")) is None
