"""Which GPUs each pod sees (``ceaseless up --gpus-per-pod``), as ``CUDA_VISIBLE_DEVICES``
(one process per pod: ``LOCAL_RANK`` 0, its first visible device).

One GPU per pod is the normal case: each pod gets devices of its own, NCCL can be used.
When the machine has fewer GPUs than pods (a workstation, our tests), pods share them round
robin and get ``CEASELESS_GPU_SHARED=1``: the agent then carries CUDA tensors over gloo,
since NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). A pod's devices are
free again when it exits, so a replacement or a restarted spare takes them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field

SHARED_ENV = "CEASELESS_GPU_SHARED"


def visible_gpus() -> list[str]:
    """The GPUs this process may hand out: ``CUDA_VISIBLE_DEVICES`` if set (empty: none),
    else every GPU ``nvidia-smi -L`` lists (none without it). No torch import: ``up`` starts
    fast."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, ln in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]


class NoFreeGpu(RuntimeError):
    """Every GPU is held by a running pod (one GPU per pod)."""


@dataclass
class GpuAssigner:
    """``per_pod`` None: one GPU per pod when there are enough for ``expected`` pods, else
    shared. 0: pods see no GPU. ``mode`` says what was chosen: none | exclusive | shared."""

    devices: list[str]
    expected: int
    per_pod: int | None = None
    mode: str = field(init=False)
    warning: str | None = field(init=False, default=None)
    _free: list[str] = field(init=False)
    _held: dict[str, list[str]] = field(init=False, default_factory=dict)
    _next: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.per_pod is not None and self.per_pod < 0:
            raise ValueError("--gpus-per-pod must be >= 0")
        n = len(self.devices)
        if self.per_pod == 0 or n == 0:
            if self.per_pod:
                raise ValueError(f"--gpus-per-pod {self.per_pod}: this machine has no GPU "
                                 "(CUDA_VISIBLE_DEVICES / nvidia-smi)")
            self.mode = "none"
        else:
            k = self.per_pod or 1
            if k > n:
                raise ValueError(f"--gpus-per-pod {k}: only {n} GPU(s) visible")
            if n >= k * self.expected:
                self.mode = "exclusive"
            else:
                self.mode = "shared"
                self.warning = (f"{self.expected} pods on {n} GPU(s): pods share GPUs "
                                "(CUDA tensors go over gloo; NCCL needs a GPU per pod)")
            self.per_pod = k
        self._free = list(self.devices)

    def assign(self, pod: str) -> dict[str, str]:
        """The environment for ``pod``'s process (empty in mode none)."""
        if self.mode == "none":
            return {}
        k = self.per_pod or 1
        if self.mode == "exclusive":
            # The job's backend follows the mode (every pod must agree), so a pod that
            # finds no free GPU is not started on a shared one: NCCL would refuse it.
            if len(self._free) < k:
                raise NoFreeGpu(f"no free GPU for pod {pod}: {len(self.devices)} GPU(s), "
                                f"{k} per pod, all held by {sorted(self._held)}")
            got, self._free = self._free[:k], self._free[k:]
            self._held[pod] = got
            return {"CUDA_VISIBLE_DEVICES": ",".join(got), SHARED_ENV: "0", "LOCAL_RANK": "0"}
        n = len(self.devices)
        got = [self.devices[(self._next + i) % n] for i in range(k)]
        self._next = (self._next + k) % n
        return {"CUDA_VISIBLE_DEVICES": ",".join(got), SHARED_ENV: "1", "LOCAL_RANK": "0"}

    def release(self, pod: str) -> None:
        for d in self._held.pop(pod, []):
            if d not in self._free:
                self._free.append(d)
        self._free.sort(key=self.devices.index)
