"""Sharded models (FSDP2) inside a replica; replicas sum gradients and recover each other.

A job of R replicas of k ranks (``Plan.shard_size`` k): rank ``r`` is shard ``i = r % k`` of
replica ``j = r // k``. The script shards its model with FSDP2 on ``Session.mesh`` (or
``Session.shard``), a 1-D mesh over this pod's replica. Three groups per generation:

* the **shard group** (``ShardGroup``, the k ranks of the replica): FSDP2's all-gathers and
  reduce-scatters. FSDP2 binds one ``ProcessGroup`` object when the model is sharded, and
  Ceaseless builds new groups every generation: ``ShardGroup`` is one ``ProcessGroup``
  (a Python subclass, registered with c10d as the default group, so ``DeviceMesh`` and
  ``fully_shard`` accept it) that forwards every collective to the current generation's
  backend. It also keeps faults out of the script: FSDP2's collectives run inside the
  script's forward and backward, where an exception would end the process; a collective
  that fails, times out or is abandoned (a newer plan: the abort flag) is recorded and
  returned as done (its output is garbage), later ones return at once, and ``Session.step``
  discards the step (``failure``). A pod keeps its shard position for life (its model was
  sharded for it), so the group's rank and size never change.
* the **position group** (the R ranks holding shard ``i``, an ``AbortableGroup``): the
  gradient sum across replicas of this shard (FSDP2 sums inside the replica, its divide
  factor set to 1).
* the generation's **world group** (all ranks, as unsharded): the loss, ``s.all_reduce``
  and the state handoff, whose sources the broker picks among the same shard position.

Not verified: NCCL (no multi-GPU machine here); the NCCL path waits with ``Work.wait``
(stream order) and relies on the communicator abort, the gloo path waits in slices.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from schemas.messages import Plan
from plumbing import logs

from .config import AgentConfig
from .ports import Entrant, Placement

log = logs.get("agent")
_TYPES = {"gloo": dist.ProcessGroup.BackendType.GLOO,
          "nccl": dist.ProcessGroup.BackendType.NCCL}
# the collectives c10d's functions call on a group (torch 2.13); each goes to the backend
_OPS = ("all_gather_single", "all_gather_single_coalesced", "allgather", "allgather_coalesced",
        "allgather_into_tensor_coalesced", "allreduce", "allreduce_coalesced", "barrier",
        "broadcast", "gather", "reduce", "reduce_scatter", "reduce_scatter_single",
        "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced", "scatter",
        "alltoall", "all_to_all_single", "_allgather_base", "_reduce_scatter_base")


def _check_torch() -> None:
    """The parts of torch this needs (tested with 2.13): a clear error instead of a crash
    deep inside FSDP2 on an older one."""
    from torch.distributed.fsdp import FSDPModule

    need = [n for n in ("set_gradient_divide_factor", "set_force_sum_reduction_for_comms",
                        "reset_iter_state")
            if not hasattr(FSDPModule, n)]
    if not hasattr(dist.ProcessGroup, "all_gather_single"):
        need.append("ProcessGroup.all_gather_single")
    try:
        from torch._C._distributed_c10d import FakeProcessGroup

        FakeProcessGroup.Options().error_on_collective = True
    except (ImportError, AttributeError):
        need.append("FakeProcessGroup.Options.error_on_collective")
    if need:
        raise RuntimeError(f"sharded models need a newer torch than {torch.__version__} "
                           f"(tested with 2.13; missing: {', '.join(need)})")


class _Done(dist.Work):
    """The stand-in for a collective of a failed generation: complete, output untouched."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False


class _Guarded(dist.Work):
    """A collective of the shard group: ``wait`` gives up on abort, failure or timeout and
    records why in the group instead of raising into the script's forward/backward."""

    def __init__(self, group: "ShardGroup", work: Any, what: str) -> None:
        super().__init__()
        self._g, self._w, self._what = group, work, what
        self._gen = group.generation

    def wait(self, timeout: Any = None) -> bool:
        self._g._wait(self._w, self._what, self._gen)
        return True

    def is_completed(self) -> bool:
        try:
            return bool(self._w.is_completed()) or self._g.failure is not None
        except Exception:
            return True

    def get_future(self) -> Any:
        return self._w.get_future()


def _make_op(name: str) -> Callable[..., Any]:
    def op(self: "ShardGroup", *args: Any, **kwargs: Any) -> Any:
        return self._call(name, args, kwargs)
    op.__name__ = name
    return op


class ShardGroup(dist.ProcessGroup):
    """The process group FSDP2 is bound to: rank ``rank`` of ``size`` (this pod's shard
    position in its replica), its collectives forwarded to the generation's backend.

    Only one per process: it becomes c10d's default group (do not call
    ``init_process_group`` in a Ceaseless script). Before the first generation a
    placeholder backend refuses every collective (sharding the model needs none)."""

    def __init__(self, rank: int, size: int, device_type: str = "cpu",
                 name: str = "ceaseless-shard") -> None:
        if not 0 <= rank < size:
            raise ValueError(f"shard rank {rank} outside 0..{size - 1}")
        if c10d.is_initialized():
            raise RuntimeError("a default process group exists already (init_process_group?): "
                               "a Ceaseless script must not create its own")
        _check_torch()
        from torch._C._distributed_c10d import FakeProcessGroup

        super().__init__(rank, size)
        self._rank, self._size, self.device_type, self._name = rank, size, device_type, name
        self._lock = threading.Lock()
        self.generation = 0
        self._inner: Any = None        # the generation's plain ProcessGroup (its backend)
        self._ag: Any = None           # AbortableGroup over the same backend: waits, abort
        self._abort: threading.Event | None = None
        self._timeout_s, self._slice_s = 30.0, 0.05
        self._extend: Callable[[], float | None] | None = None
        self.failure: str | None = None
        opts = FakeProcessGroup.Options()
        opts.error_on_collective = True
        self._inner = self._plain(FakeProcessGroup._create_internal(rank, size, opts), "gloo",
                                  f"{name}-unjoined")
        torch._C._distributed_c10d._register_process_group(name, self)
        w = c10d._world
        w.pg_map[self] = (device_type, None)
        w.pg_names[self] = name
        w.pg_group_ranks[self] = {i: i for i in range(size)}
        w.pg_backend_config[self] = f"{device_type}:{'nccl' if device_type == 'cuda' else 'gloo'}"
        c10d._update_default_pg(self)
        self._mesh: Any = None

    # what c10d and DeviceMesh ask of a group
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def name(self) -> str:  # type: ignore[override]
        return "nccl" if self.device_type == "cuda" else "gloo"

    def _get_backend(self, device: Any) -> Any:  # type: ignore[override]
        return self._inner._get_backend(device)

    def _plain(self, backend: Any, kind: str, name: str) -> dist.ProcessGroup:
        pg = dist.ProcessGroup(dist.HashStore(), self._rank, self._size)
        pg._register_backend(torch.device(self.device_type), _TYPES[kind], backend)
        pg._set_default_backend(_TYPES[kind])
        pg._set_group_name(name)
        return pg

    # ------------------------------------------------------------------ generations
    def swap(self, backend: Any, generation: int, abort: threading.Event, *,
             timeout_s: float = 30.0, slice_s: float = 0.05,
             extend: Callable[[], float | None] | None = None, kind: str | None = None) -> Any:
        """Route the group's collectives to ``backend`` (built by ``groups.make_group`` over
        the generation's store, this pod at rank ``self.rank()``) from now on, and clear the
        failure. Returns the previous generation's ``AbortableGroup`` (None the first time)
        for the caller to close."""
        from .collectives import AbortableGroup

        kind = kind or ("nccl" if self.device_type == "cuda" else "gloo")
        with self._lock:
            old = self._ag
            self._inner = self._plain(backend, kind, f"{self._name}-g{generation}")
            self._ag = AbortableGroup(backend, slice_s=slice_s, timeout_s=timeout_s)
            self._abort, self._timeout_s, self._slice_s = abort, timeout_s, slice_s
            self._extend = extend
            self.generation, self.failure = generation, None
        return old

    def fail(self, why: str) -> None:
        """Give up on this generation's backend (a newer plan): collectives return at once."""
        with self._lock:
            if self.failure is None:
                self.failure = why
            ag = self._ag
        if ag is not None:
            ag.abort()

    def close(self) -> None:
        with self._lock:
            ag, self._ag = self._ag, None
        if ag is not None:
            ag.close()

    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` ("shard") to pass to ``fully_shard(module, mesh=...)``."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self, self.device_type, mesh_dim_names=("shard",))
        return self._mesh

    # ------------------------------------------------------------------ collectives
    def _call(self, name: str, args: tuple, kwargs: dict) -> Any:
        if self.generation == 0:
            raise RuntimeError("the sharded model is used before this pod joined the job: "
                               "run it inside `for step in s.steps(...)`")
        if self.failure is not None:
            return _Done()
        try:
            work = getattr(self._inner, name)(*args, **kwargs)
        except Exception as e:
            self._failed(f"{name} could not start: {str(e)[:300]}")
            return _Done()
        return _Guarded(self, work, name)

    def _wait(self, work: Any, what: str, generation: int) -> None:
        from .collectives import Aborted, PeerError

        ag = self._ag
        if self.failure is not None or generation != self.generation or ag is None:
            return
        try:
            if ag.backend == "nccl":
                work.wait()  # stream order; an abort of the communicator ends it
            else:
                ag.wait_all([work], self._abort, f"FSDP {what}", timeout_s=self._timeout_s,
                            extend=self._extend)
        except (Aborted, PeerError) as e:
            self._failed(str(e)[:300])
        except Exception as e:
            self._failed(f"FSDP {what} failed: {str(e)[:300]}")

    def _failed(self, why: str) -> None:
        if self.failure is None:
            log.info("shard group failed: the step will be discarded", reason=why)
        self.fail(why)


for _name in _OPS:
    setattr(ShardGroup, _name, _make_op(_name))


class Sharding:
    """This pod's place in a sharded job: its shard position (fixed once known), the shard
    group FSDP2 uses and the position group for the cross-replica gradient sum."""

    def __init__(self, shard_size: int, position: int, device_type: str = "cpu",
                 backend: str = "gloo") -> None:
        self.k, self.position = shard_size, position
        self.group = ShardGroup(position, shard_size, device_type)
        self.pos_group: Any = None  # AbortableGroup of the generation (R ranks)
        self.backend_kind = backend  # the world group's choice (groups.choose_backend)

    def check(self, plan: Plan, rank: int) -> None:
        if plan.shard_size != self.k:
            raise RuntimeError(f"plan {plan.generation} has shard size {plan.shard_size}, this "
                               f"pod's model is sharded {self.k} ways (`ceaseless up "
                               "--shard-size` and the script must agree)")
        if rank % self.k != self.position:
            raise RuntimeError(f"plan {plan.generation} moves this pod from shard position "
                               f"{self.position} to {rank % self.k}: a member keeps its "
                               "position (a bug in the scaler)")

    def build(self, store_for: Callable[[str], Any], plan: Plan, rank: int,
              abort: threading.Event, cfg: AgentConfig) -> Any:
        """Start building this generation's shard and position groups (background threads);
        returns a ``finish()`` that waits for both (abort-aware) and installs them."""
        from .groups import _Background, make_group

        k, g = self.k, plan.generation
        j, i = divmod(rank, k)
        R = plan.world_size // k
        kind = self.backend_kind
        # FSDP's ops carry no timeout of ours: the backend's outlasts the longest solo (as
        # the world group's per-op timeout does); our sliced waits give up at the collective
        # timeout, extended while a peer works alone (``Session.solo``)
        t = cfg.collective_timeout + cfg.solo_max
        shard_job = _Background(lambda: make_group(store_for(f"g{g}.s{j}."), i, k, t, kind),
                                f"shard-group-r{rank}")
        pos_job = _Background(lambda: make_group(store_for(f"g{g}.p{i}."), j, R, t, kind),
                              f"pos-group-r{rank}")

        def finish(extend: Callable[[], float | None] | None = None) -> None:
            from .collectives import AbortableGroup, Aborted

            deadline = time.monotonic() + cfg.collective_timeout
            for job in (shard_job, pos_job):
                while not job.done.wait(cfg.collective_slice):
                    if abort.is_set() or time.monotonic() > deadline:
                        shard_job.abandon()
                        pos_job.abandon()
                        if abort.is_set():
                            raise Aborted(f"rendezvous of the shard groups of generation {g} "
                                          "abandoned: abort requested")
                        raise TimeoutError(f"the shard groups of generation {g} did not "
                                           f"connect in {cfg.collective_timeout:.0f}s")
                if job.error is not None:
                    raise job.error
            old = self.group.swap(shard_job.result, g, abort,
                                  timeout_s=cfg.collective_timeout,
                                  slice_s=cfg.collective_slice, extend=extend, kind=kind)
            if old is not None:
                old.close()
            self.close_pos()
            self.pos_group = AbortableGroup(pos_job.result, slice_s=cfg.collective_slice,
                                            timeout_s=cfg.collective_timeout, bucket_bytes=max(1, int(cfg.bucket_mb * 2**20)))

        def abandon() -> None:
            shard_job.abandon()
            pos_job.abandon()
        finish.abandon = abandon  # type: ignore[attr-defined]
        return finish

    def close_pos(self) -> None:
        if self.pos_group is not None:
            try:
                self.pos_group.close()
            except Exception:
                pass
            self.pos_group = None


def reset_iteration(modules: list[torch.nn.Module]) -> None:
    """After a discarded step: FSDP2's per-iteration state back to a step's start on every
    rank alike (``FSDPModule.reset_iter_state`` on each root; in-flight works of a failed
    generation return at once). A step abandoned mid-way leaves it where that rank was: a
    forward whose backward was skipped (a newer plan arrived) keeps the root's parameters
    unsharded, so this rank's next forward skips the root's all-gather, while a shard peer
    that ran its backward (or a promoted spare) does it: the shard group's collectives no
    longer match (gloo: "Received data size doesn't match expected size", the process
    aborted: two such lost both holders of a shard once)."""
    from torch.distributed.fsdp import FSDPModule

    for mod in modules:
        for sub in mod.modules():
            # the root holds every state of its tree (None: never run, nothing to reset)
            if isinstance(sub, FSDPModule) and sub._get_fsdp_state()._is_root:
                sub.reset_iter_state()


def gradient_divide_factor_one(modules: list[torch.nn.Module]) -> int:
    """FSDP2 averages gradients over the replica by default; Ceaseless' loss is already
    scaled to the global batch (``s.backward``), so inside a replica they are summed, as
    across replicas. Returns how many FSDP modules there are."""
    from torch.distributed.fsdp import FSDPModule

    n = 0
    for mod in modules:
        for sub in mod.modules():
            if isinstance(sub, FSDPModule):
                sub.set_gradient_divide_factor(1.0)
                # a plain SUM (gloo has no PREMUL_SUM; a factor of 1 needs no scaling)
                sub.set_force_sum_reduction_for_comms(True)
                n += 1
    return n



class EarlyJoin:
    """A spare promoted into a running sharded job: the generation's groups connect while
    the script shards its model and builds its optimizer (the survivors would otherwise
    wait for both in the rendezvous). Started by ``Session.mesh`` once the position is
    known; ``handoff.enter`` takes it over. Only for a promotion (generation > 1), where
    the pod holds nothing: it reports step -1 at once, as it would at ``enter``."""

    def __init__(self, m: Entrant, plan: Plan, rank: int, backend: str) -> None:
        from schemas.messages import AgentState, Role

        from .groups import _Background, make_group

        rt, cfg = m.rt, m.cfg
        g, W = plan.generation, plan.world_size
        self.generation, self.rank, self.world_size, self.backend = g, rank, W, backend
        rt.update(now=True, generation=g, rank=rank, role=Role.worker, step=-1, digest="",
                  state=AgentState.recovering)
        store = rt.stores.rendezvous(f"g{g}.")
        self._world = _Background(
            lambda: make_group(store, rank, W, cfg.collective_timeout, backend),
            f"early-world-r{rank}")
        self.finish = m.sharding.build(rt.stores.rendezvous, plan, rank, rt.abort, cfg)

    def world_group(self, abort: threading.Event, slice_s: float) -> Any:
        from .collectives import Aborted

        while not self._world.done.wait(slice_s):
            if abort.is_set():
                self.abandon()
                raise Aborted("rendezvous abandoned: abort requested")
        if self._world.error is not None:
            self.finish.abandon()
            raise self._world.error
        return self._world.result

    def abandon(self) -> None:
        self._world.abandon()
        self.finish.abandon()


# ---------------------------------------------------------------------------- the session's
def replica_mesh(m: Placement, shard_size: int, device: str | None, override: str | None) -> Any:
    """``Session.mesh``: the pod's replica mesh, placing the pod first (a spare waits for
    its first plan, ``Membership.await_position``; None if the job ended first)."""
    if m.sharding is None:
        pos = m.await_position()
        if pos is None:
            return None
        from .groups import choose_backend

        # the model's device (s.shard saw it), else where a model would go; the backend
        # is chosen as the world group's will be (pods sharing a GPU: gloo)
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        backend = choose_backend(dev, override)
        m.sharding = Sharding(shard_size, pos, dev, backend)
        m.start_early_join(backend)
    return m.sharding.group.mesh()


def shard_modules(model: torch.nn.Module, blocks: tuple[torch.nn.Module, ...], mesh: Any,
                  fsdp_kwargs: dict[str, Any]) -> torch.nn.Module:
    """``Session.shard``: FSDP2 on each block, then on the model (unchanged without a mesh:
    the job finished, or released this pod, before it was placed)."""
    if mesh is None:
        return model
    from torch.distributed.fsdp import fully_shard

    for b in blocks:
        fully_shard(b, mesh=mesh, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **fsdp_kwargs)
    return model


def check_registered(m: Placement, shard_size: int, modules: list[torch.nn.Module]) -> None:
    """Before joining a sharded job: the registered model is sharded on ``s.mesh``, and
    FSDP2 sums inside the replica (``gradient_divide_factor_one``)."""
    from .vocab import Phase

    if m.phase in (Phase.FINISHED, Phase.RELEASED):
        return  # the job ended before this pod was placed: nothing was sharded
    if m.sharding is None or not gradient_divide_factor_one(modules):
        raise ValueError(f"the job is sharded (shard size {shard_size}) but no registered "
                         "module is: shard the model with s.shard(model, ...) (or "
                         "fully_shard(..., mesh=s.mesh)) and register it before the loop")
