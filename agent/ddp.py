"""The drop-in for torchrun + DDP scripts: the script keeps its loop (issue 31).

    import agent.ddp as dist                  # was: import torch.distributed as dist
    from agent.ddp import DistributedDataParallel as DDP
    ddp = dist.is_launched()                  # torchrun or `ceaseless up`
    ...
    while (iter_num := dist.iteration(iter_num)) < max_iters:   # was: while iter_num < max_iters:

Everything else stays the script's: ``init_process_group`` and the ``RANK`` / ``WORLD_SIZE``
/ ``LOCAL_RANK`` it reads after it, ``loss.backward()`` (or ``scaler.scale(loss).backward()``),
``require_backward_grad_sync`` / ``no_sync()``, ``clip_grad_norm_``, ``scaler.unscale_`` /
``step`` / ``update``, ``optimizer.step()`` / ``zero_grad()``, ``param_group['lr'] = ...``,
``dist.all_reduce`` of an evaluation and rank-0 code (``with dist.solo(max_s=...)`` around
rank-0 work longer than the collective timeout). Under torchrun every name here is
torch's own (``DistributedDataParallel`` is torch's DDP, ``iteration(i)`` returns ``i``);
in one process (no launcher) the script never calls them.

Under ``ceaseless up`` (docs/porting.md):

* ``init_process_group`` starts the session and waits until this pod is a member: a spare
  waits there until it is promoted. The world size is fixed for the job (the script divides
  its batch by it once); the ranks it exports stay true for the life of the process.
* ``DistributedDataParallel(model)`` registers the model, with the optimizers, the enabled
  GradScaler and the LR schedulers found over its parameters, and joins the job: rank 0's
  state at the start, the job's committed state for a promoted spare (DDP's own broadcast
  at construction, made fault-tolerant).
* Its backward hooks all-reduce the gradient buckets during the last micro-batch's backward
  (``require_backward_grad_sync``), as DDP does, abortable; when the backward returns the
  gradients are the mean over the ranks.
* ``iteration(i)`` is the step boundary: it commits the step just computed and returns the
  step to compute now: ``i``, or after a fault the same step again (the update of a
  discarded step is skipped, the GradScaler's and schedulers' state put back).
* Randomness: every training forward is seeded from (seed, step, rank, micro-batch), and
  after it the RNGs are seeded for the next micro-batch's data (the next step's first one
  after the last forward): a batch the script draws (or prefetches) is the same whichever
  process computes it, a promoted spare included. ``CEASELESS_SEED`` (default 0) is the seed.
* Resumed from the script's own checkpoint (the first ``iteration(i)`` names ``i > 0``) with
  the first batch drawn before the loop: that step is computed once without its sync or
  update, to draw its first batch from its own seed, then for real (bitwise, as if never
  interrupted).
* A step computed again after a fault gets the inputs of its own first micro-batch even
  when the script carried a batch drawn in the failed attempt (a prefetch) into it, as long
  as the forward computes the loss (it returns it); otherwise that is refused, not trained on.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as _torch_dist

from plumbing import logs

from .dropin import DropIn

log = logs.get("agent")
_dropin: "DropIn | None" = None
ReduceOp = _torch_dist.ReduceOp
DATA_STREAM = 1 << 62  # micro_seed's indices of the data seeds (the forwards' are below)


def is_launched() -> bool:
    """True when started by a launcher: torchrun (``RANK`` set) or ``ceaseless up``."""
    return int(os.environ.get("RANK", -1)) != -1 or bool(os.environ.get("CEASELESS_NATS_URL"))


def active() -> "DropIn | None":
    return _dropin


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` for a script that may run under Ceaseless.
    Under ``ceaseless up``: wait until this pod is a member (a spare until it is promoted;
    it exits 0 if the job ends first), then set ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (0:
    a pod has one GPU, its ``CUDA_VISIBLE_DEVICES``) and ``LOCAL_WORLD_SIZE`` as torchrun
    does. Elsewhere: torch's own."""
    global _dropin
    from .config import AgentConfig

    cfg = AgentConfig.from_env()
    if cfg is None:
        _torch_dist.init_process_group(backend=backend, **kwargs)
        return
    if _dropin is not None:
        raise RuntimeError("init_process_group was already called")
    from .session import Session

    # Spares join cold (they wait here, before the script built a model to follow into);
    # a fused loss with the gradients, not the Session's scaled backward.
    cfg = cfg.with_overrides(shadow_spares=False)
    s = Session(1, seed=int(os.environ.get("CEASELESS_SEED", "0")), config=cfg)
    s.__enter__()
    got = s.m.await_member()
    if got is None:  # the job ended (or released this pod) before it was needed
        s.m.leave()
        s.__exit__(None, None, None)
        log.info("the job finished before this spare was promoted; exiting")
        sys.exit(0)
    from .membership import export_ranks

    rank, world = got
    export_ranks(rank, world)
    _dropin = DropIn(s, rank, world)  # closed at exit (agent/closing.py)


def destroy_process_group(group: Any = None) -> None:
    """The end of the job: the last step committed, the result written, the session closed."""
    if _dropin is None:
        if _torch_dist.is_initialized():
            _torch_dist.destroy_process_group(group)
        return
    _dropin.close()


def is_initialized() -> bool:
    return _dropin is not None or _torch_dist.is_initialized()


def get_rank(group: Any = None) -> int:
    return _dropin.rank if _dropin is not None else _torch_dist.get_rank(group)


def get_world_size(group: Any = None) -> int:
    return _dropin.world_size if _dropin is not None else _torch_dist.get_world_size(group)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Any:
    """``torch.distributed.all_reduce`` (SUM or AVG). Under Ceaseless it is abortable: when a
    fault interrupts it the tensor keeps its own value and the step is computed again."""
    if _dropin is None:
        return _torch_dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    if group is not None or async_op:
        raise NotImplementedError("agent.ddp.all_reduce: the default group, synchronous")
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise NotImplementedError(f"agent.ddp.all_reduce: SUM or AVG (got {op})")
    _dropin.s.all_reduce(tensor, "mean" if op == ReduceOp.AVG else "sum")
    return None


def barrier(group: Any = None) -> None:
    if _dropin is None:
        _torch_dist.barrier(group)
        return
    all_reduce(torch.zeros(1, device=_dropin.s.device))


def solo(max_s: float | None = None) -> Any:
    """``with dist.solo(max_s=600): evaluate(); save()``: work on this rank alone for longer
    than the collective timeout (a rank-0 evaluation, a checkpoint) without the peers
    failing: until the block ends (at most ``max_s``; default and ceiling
    ``CEASELESS_SOLO_MAX``) the peers' gradient all-reduce waits for this rank, and the
    monitor does not call it hung. A block that overruns its bound is a hang (the rank is
    replaced). No collectives inside. Without Ceaseless (torchrun, one process): nothing."""
    if _dropin is None:
        import contextlib

        return contextlib.nullcontext()
    return _dropin.s.solo(max_s=max_s)


def iteration(i: int) -> int:
    """The step boundary: commit the step just computed and return the step to compute now:
    ``i`` (the script's counter), the same step again after a fault discarded it, or the
    job's next step for a promoted spare. The first call names where the script starts
    (its own checkpoint's ``iter_num``). Without Ceaseless: ``i``."""
    return i if _dropin is None else _dropin.iteration(i)


def register(**objs: Any) -> None:
    """Register training state the drop-in does not find by itself (anything with
    ``state_dict``/``load_state_dict``), before the model is wrapped."""
    if _dropin is not None:
        _dropin.extra.update(objs)


class DistributedDataParallel(torch.nn.Module):
    """DDP for a script that may run under Ceaseless: torch's own DDP elsewhere. The
    arguments are DDP's; under Ceaseless the device follows the module."""

    def __new__(cls, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _dropin is None:
            return torch.nn.parallel.DistributedDataParallel(module, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                 output_device: Any = None, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        check_devices(module, device_ids, output_device)
        self.module = module
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        _dropin.attach(module)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _dropin.forward(self, args, kwargs)

    def no_sync(self) -> Any:
        import contextlib

        @contextlib.contextmanager
        def off() -> Any:
            old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
            try:
                yield
            finally:
                self.require_backward_grad_sync = old

        return off()


def check_devices(module: torch.nn.Module, device_ids: Any, output_device: Any) -> None:
    """DDP's ``device_ids`` / ``output_device`` under Ceaseless. For a CPU module they are
    ignored, logged (a CUDA script run on the CPU passes ``device_ids=[local_rank]``, which
    torch's DDP refuses there); for a CUDA module they must name the module's device (each
    pod sees its own GPU as ``cuda:0``)."""
    given = [d for d in (list(device_ids or []) + [output_device]) if d is not None]
    if not given:
        return
    devs = {p.device for p in module.parameters()} or {torch.device("cpu")}
    if all(d.type == "cpu" for d in devs):
        log.info("DDP(device_ids=...) ignored: the module is on the CPU (gloo)",
                 device_ids=[str(d) for d in device_ids or []],
                 output_device=None if output_device is None else str(output_device))
        return
    if len(list(device_ids or [])) > 1 or len(devs) > 1:
        raise ValueError("agent.ddp: DistributedDataParallel over one device per process "
                         f"(device_ids {device_ids}, module on {sorted(map(str, devs))})")
    (dev,) = devs
    for d in given:
        want = torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
        if want.type == "cuda" and want.index is None:
            want = torch.device("cuda", torch.cuda.current_device())
        if want != dev:
            raise ValueError(f"agent.ddp: device_ids/output_device name {want}, the module is "
                             f"on {dev} (under ceaseless up a pod sees its own GPU as "
                             "cuda:0: LOCAL_RANK is 0)")


def __getattr__(name: str) -> Any:  # the rest of torch.distributed (ReduceOp, Backend, ...)
    return getattr(_torch_dist, name)

