"""The job's backend, from where the registered model lives."""

from __future__ import annotations

import os

import torch

from plumbing import logs

from .collectives import choose_backend
from .groups import bind_device, gloo_address

log = logs.get("agent")


def resolve_backend(dev: torch.device, override: str | None, pod: str) -> tuple[str, str]:
    """The backend follows the model: gloo for a CPU model on any machine, NCCL for a CUDA
    model with a GPU per pod, gloo staging CUDA tensors through host memory when pods share
    a GPU; ``CEASELESS_BACKEND`` (``override``) wins. A pod that cannot run the chosen
    backend is refused here, naming the pod and the device, never left to hang in its first
    collective. Returns (backend, the device as ``ceaseless status`` shows it)."""
    backend = choose_backend(dev, override)
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"pod {pod}: backend nccl needs a CUDA device and this pod has none "
                f"(model on {dev}, CUDA_VISIBLE_DEVICES={gpus!r})")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)  # the group binds the model's device
            bind_device(dev)  # ... from any thread (helper threads build groups)
    log.info("backend", backend=backend, device=str(dev), override=override,
             gpu_shared=os.environ.get("CEASELESS_GPU_SHARED"),
             gloo="%s=%s" % gloo_address())  # every pod's pair groups are gloo
    label = f"{dev} [GPU {gpus}]" if dev.type == "cuda" and gpus else str(dev)
    return backend, label[:64]


def cuda_broken(dev: torch.device) -> str | None:
    """Why the CUDA context of ``dev`` cannot be trusted after an abort (None: it works, or
    ``dev`` is not CUDA). A peer's death can leave a sticky CUDA error (an illegal access in
    an aborted kernel): every later launch fails, so the pod must leave and be replaced, not
    carry it into the next generation (issue 30). Runs a synchronize and a small kernel."""
    if dev.type != "cuda":
        return None
    try:
        torch.cuda.synchronize(dev)
        probe = torch.ones(8, device=dev).mul_(2).sum()
        if float(probe.item()) != 16.0:
            return f"a probe kernel on {dev} computed {float(probe.item())}, expected 16"
    except Exception as e:  # noqa: BLE001 - the reason is what matters
        return f"{type(e).__name__}: {str(e)[:300]}"
    return None
