"""The job's backend, from where the registered model lives."""

from __future__ import annotations

import os

import torch

from plumbing import logs

from .collectives import choose_backend
from .groups import gloo_address

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
    log.info("backend", backend=backend, device=str(dev), override=override,
             gpu_shared=os.environ.get("CEASELESS_GPU_SHARED"),
             gloo="%s=%s" % gloo_address())  # every pod's pair groups are gloo
    label = f"{dev} [GPU {gpus}]" if dev.type == "cuda" and gpus else str(dev)
    return backend, label[:64]
