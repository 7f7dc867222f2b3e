"""Sharded models (FSDP2) inside a replica: a process group whose backend follows the generation.

FSDP2 (``torch.distributed.fsdp.fully_shard``) binds a ``DeviceMesh``, and through it one
``ProcessGroup`` object, when the model is sharded; Ceaseless builds new process groups at
every generation. ``SwappableGroup`` reconciles the two: one ``ProcessGroup`` of fixed name,
rank and size (this pod's shard position in its replica: a replacement takes the same
position, so neither changes), registered with c10d (as the default group: ``DeviceMesh``
asks for one) so that a mesh and FSDP2 accept it. At each generation ``swap`` registers the
new generation's backend (gloo or NCCL, built by ``groups.make_group`` over the generation's
store) on the same object; FSDP2's all-gathers and reduce-scatters go to it from then on,
without rebuilding the model, its parameters or the optimizer. The previous backend is
handed back to the caller (to abort and park: it may be stuck on a dead peer).

With it, ``agent/state.py`` snapshots and restores sharded state (a ``DTensor`` is stored as
this rank's local shard, rebuilt on the objects' mesh), so a rank holds and sends 1/k of
the model and optimizer. These are the building blocks for issue 21 (FSDP2 inside each
replica, replicas recovering and resizing each other); the session does not use them yet.
Verified on CPU over gloo (torch 2.13, ``tests/test_sharded.py``): training across a swap
is bitwise the training without one, with the old backend aborted, and a restored snapshot
replays the same steps exactly. Not verified: NCCL (no multi-GPU machine here).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_TYPES = {"gloo": dist.ProcessGroup.BackendType.GLOO,
          "nccl": dist.ProcessGroup.BackendType.NCCL}


class SwappableGroup:
    """One process group for the life of the process; its backend is replaced per generation.

    ``rank``/``size``: this pod's shard index and the shard count of its replica.
    ``device_type``: "cpu" (gloo) or "cuda" (NCCL). The first ``swap`` must come before the
    mesh is used. Only one per process: it becomes c10d's default group (do not call
    ``init_process_group`` in a Ceaseless script).
    """

    def __init__(self, rank: int, size: int, device_type: str = "cpu",
                 name: str = "ceaseless-shard") -> None:
        if not 0 <= rank < size:
            raise ValueError(f"shard rank {rank} outside 0..{size - 1}")
        if c10d.is_initialized():
            raise RuntimeError("a default process group exists already (init_process_group?): "
                               "a Ceaseless script must not create its own")
        self.rank, self.size, self.device_type, self.name = rank, size, device_type, name
        self.backend: Any = None
        # the group's own store is never used for collectives (each backend has its
        # generation's store): a local one keeps it independent of the bus
        self.pg = dist.ProcessGroup(dist.HashStore(), rank, size)
        self.pg._set_group_name(name)
        torch._C._distributed_c10d._register_process_group(name, self.pg)
        w = c10d._world
        w.pg_map[self.pg] = (device_type, None)
        w.pg_names[self.pg] = name
        w.pg_group_ranks[self.pg] = {i: i for i in range(size)}
        w.pg_backend_config[self.pg] = f"{device_type}:{'nccl' if device_type == 'cuda' else 'gloo'}"
        c10d._update_default_pg(self.pg)
        self._mesh: Any = None

    def swap(self, store: dist.Store, timeout_s: float = 30.0, backend: str | None = None) -> Any:
        """Connect the ranks of the new generation over ``store`` (a fresh prefix per
        generation) and route the group's collectives to them. Returns the previous backend
        (None the first time) for the caller to abort and park."""
        from .groups import make_group

        backend = backend or ("nccl" if self.device_type == "cuda" else "gloo")
        new = make_group(store, self.rank, self.size, timeout_s, backend)
        old, self.backend = self.backend, new
        dev = torch.device(self.device_type)
        self.pg._register_backend(dev, _TYPES[backend], new)
        self.pg._set_default_backend(_TYPES[backend])
        self.pg._set_group_name(self.name)  # (names the new backend too: the mesh finds it)
        return old

    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` ("shard") to pass to ``fully_shard(module, mesh=...)``."""
        if self.backend is None:
            raise RuntimeError("swap() in a backend before the mesh is used")
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.pg, self.device_type,
                                               mesh_dim_names=("shard",))
        return self._mesh
