"""``Session``: the training loop's view of Ceaseless (the public API, a thin layer).

The script's loop (``steps``, ``batches``, ``backward``, ``step``, ``all_reduce``, ``solo``)
over the parts that do the work: ``TrainState``, ``Membership``, ``Stepper``, ``Timeline``,
``Checkpoints`` and the result file, ``Injector``. Without ``CEASELESS_*`` variables it runs
single-process (the same script works under plain ``python``). docs/architecture.md, "Inside
the agent", shows who calls whom.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from typing import Any, Callable, Iterator

import torch

from schemas.messages import AgentState

from .closing import ExitCloser
from .config import AgentConfig, refuse_foreign_launcher
from .feed import BatchFeed
from .incident import Timeline
from .inject import InjectedFault, Injector
from .membership import Membership
from .outputs import Checkpoints, write_result
from .rank0 import Rank0Hooks
from .seeding import seed_all
from .stepper import Stepper
from .train_state import TrainState
from .vocab import DISCARDED, JobStateLost

__all__ = ["InjectedFault", "JobStateLost", "Session", "init"]


def init(global_batch_size: int, seed: int = 0, **overrides: Any) -> "Session":
    """A started Session without a ``with`` block (no re-indented script): closed when the
    interpreter exits. ``s = agent.init(global_batch_size=64)`` is
    ``with agent.Session.from_env(64) as s:`` around the rest of the script: an uncaught
    exception is reported as the ``with`` block reports it (agent/closing.py)."""
    s = Session.from_env(global_batch_size, seed=seed, **overrides)
    s.__enter__()
    ExitCloser(s.__exit__)
    return s


class Session:
    def __init__(self, global_batch_size: int, seed: int = 0,
                 config: AgentConfig | None = None) -> None:
        if global_batch_size <= 0:
            raise ValueError("global_batch_size must be positive")
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.cfg = config
        self.state = TrainState()         # registered objects, committed step, loss
        self.timeline = Timeline()        # commits, step times, the open incident
        self.runtime: Any = None          # Runtime (its thread, the bus), once entered
        self.m: Membership | None = None  # generation, rank, group, recovery
        self.current_step: int | None = None
        self.total: int | None = None
        self._entered = False
        self._joined: bool | None = None      # join()'s outcome, once known
        self._start: int | None = None        # the start given to the first join()/steps()
        self._loop_prepared = False           # _before_loop ran (start, resume) once
        self._rank0: Rank0Hooks | None = None  # s.on_rank0(...): set-up that follows rank 0
        self._rank_warned = False
        self._feed = BatchFeed(global_batch_size, seed, self.pod)
        self._inject = Injector(config)
        self._stepper = Stepper(global_batch_size, self.state)  # its parts once entered
        self._ckpt = Checkpoints()            # from the environment in both modes
        self._shard_device: str | None = None
        self._backend: str | None = None      # resolved from the registered model

    @classmethod
    def from_env(cls, global_batch_size: int, seed: int = 0, **overrides: Any) -> "Session":
        cfg = AgentConfig.from_env()
        if cfg is None:
            refuse_foreign_launcher()
        return cls(global_batch_size, seed=seed, config=cfg and cfg.with_overrides(**overrides))

    # ------------------------------------------------------------------ what the script reads
    objs = property(lambda self: self.state.objs)
    device = property(lambda self: self.state.device)  # the registered model's (else CPU)
    lr_factor = property(lambda self: self.state.lr_factor)
    distributed = property(lambda self: self.cfg is not None)
    pod = property(lambda self: self.cfg.pod if self.cfg else "local")
    stats = property(lambda self: self.timeline)
    grad_norm = property(lambda self: self._stepper.grad_norm,
                         doc="The last step(max_grad_norm=...)'s gradient norm, before the clip.")
    skipped = property(lambda self: self._stepper.skipped,
                       doc="The last step's update was skipped (fp16 inf/nan gradients, or "
                           "the non-finite guard's: then in s.state.skipped).")

    last_committed = property(lambda self: self.state.last_committed)
    loss = property(lambda self: self.state.loss)  # the last committed step's global mean
    # Honest ranks: None while not a member (a spare, before the first plan, released); in
    # one process too, None until join()/steps(), then 0 of 1, as in the cluster (issue 33).
    def _rank(self) -> int | None:
        if self.m is not None:
            return self.m.rank
        return 0 if self.cfg is None and self._joined else None

    def _ranks_read(self) -> None:
        if self._joined is None and not self._rank_warned and self._entered:
            self._rank_warned = True
            warnings.warn("s.rank / s.world_size read before s.join(): None until this pod "
                          "is a member, and a pod's rank can change after a fault. For "
                          "rank-0 set-up use s.on_rank0(setup, teardown); for a rank "
                          "before the loop, call s.join() first", stacklevel=3)

    @property
    def rank(self) -> int | None:
        """This pod's rank while it is a member, else None (before ``s.join()``, a spare, a
        released pod). It may change after a fault: read it where it is used."""
        self._ranks_read()
        return self._rank()

    @property
    def world_size(self) -> int | None:
        self._ranks_read()
        if self.m is not None:
            return self.m.world_size
        return 1 if self.cfg is None and self._joined else None

    generation = property(lambda self: self.m.generation if self.m else 0)
    group = property(lambda self: self.m.group if self.m else None)
    is_member = property(lambda self: self._rank() is not None,
                         doc="True while this pod is a member of the job (has a rank).")
    shard_size = property(lambda self: self.cfg.shard_size if self.cfg else 1,
                          doc="Ranks per replica (``ceaseless up --shard-size``); 1: unsharded.")

    @property
    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` ("shard") over this pod's replica, for
        ``fully_shard(module, mesh=s.mesh)``; None when the job is not sharded (shard size
        1, or one process). A pod learns its shard position from its first plan: a spare
        blocks here until it is promoted (None if the job ends first). Prefer ``s.shard``."""
        if self.shard_size == 1 or self.m is None:
            return None
        from .sharded import replica_mesh

        return replica_mesh(self.m, self.shard_size, self._shard_device,
                            self.cfg.backend)

    def shard(self, model: torch.nn.Module, *blocks: torch.nn.Module,
              **fsdp_kwargs: Any) -> torch.nn.Module:
        """Shard ``model`` with FSDP2 over this pod's replica: ``fully_shard`` on each of
        ``blocks`` (e.g. the transformer blocks), then on ``model`` (``fsdp_kwargs`` go to
        every call: ``mp_policy``, ``reshard_after_forward``...). Returns ``model``; unsharded
        jobs and one process get it back unchanged, so one script serves both. Call it
        before creating the optimizer and before ``s.register``. A spare waits here until it
        is promoted (its shard position is only known then)."""
        if self.shard_size == 1 or self.m is None:
            return model
        p = next(model.parameters(), None)
        if p is not None:
            self._shard_device = p.device.type
        from .sharded import shard_modules

        return shard_modules(model, blocks, self.mesh, fsdp_kwargs)

    def param_sha256(self) -> str:
        """sha256 over every registered module's state_dict tensors (exact)."""
        return self.state.param_sha256()

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> "Session":
        self._entered = True
        if self.cfg is not None:
            from .wiring import start

            self.runtime, self.m, self._stepper = start(self.cfg, self.state, self.timeline,
                                                        self.global_batch_size, self._inject,
                                                        self._backend)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._rank0_teardown()
        if self.runtime is not None:
            from .wiring import stop

            stop(self.runtime, exc_type, exc, tb)

    def register(self, **objs: Any) -> None:
        """Register the training state: anything with ``state_dict()``/``load_state_dict()``."""
        self.state.register(**objs)
        if self.cfg is not None:  # the job's backend follows the model (agent/device.py)
            from .device import resolve_backend

            self._backend, shown = resolve_backend(self.device, self.cfg.backend, self.pod)
            if self.m is not None:
                self.m.backend = self._backend
            if self.runtime is not None:  # `ceaseless status` shows it
                self.runtime.update(device=shown)

    # ------------------------------------------------------------------ the loop
    def steps(self, total: int, start: int | None = None) -> Iterator[int]:
        """Yield the steps this pod computes, from the last committed one on. Survives faults:
        after a recovery it continues at ``restore_step + 1``. A spare blocks until it is
        promoted and returns without yielding if the job finishes first.

        ``start``: the script restored its own checkpoint of step ``start - 1`` (model,
        optimizer, scheduler): the count, the data positions (a function of the step) and
        the learning-rate ramp continue from ``start``, not from 0."""
        self.total = total
        if not self.join(start):
            self._rank0_teardown()
            return
        if not self.distributed:
            yield from self._local_steps(total)
            return
        m, rt = self.m, self.runtime
        while self.last_committed + 1 < total:
            self._follow_rank0()  # a recovery or a scale change may have moved rank 0
            s = self.last_committed + 1
            planned = m.planned_transition(s)
            if planned is None:
                # Announce the step, then look again: a planned plan stored meanwhile is
                # either seen here or sees this step (and aborts it: membership.plan_arrival).
                rt.begin_step(s)
                planned = m.planned_transition(s)
            if planned is not None:
                rt.end_step()
                if not m.transition(planned):
                    self._rank0_teardown()  # before leave(): a released pod may exit there
                    return m.leave()
                continue
            self.current_step = s
            seed_all(self.seed, s, None)
            yield s
            rt.end_step()
            if m.leader.generation and self.last_committed == s:
                m.leader.confirm(s)
            self._ckpt.on_request(rt.checkpoint_request, self.rank, self.state)
            if self._stepper.verify.discarded(s, self.last_committed):
                if m.phase not in DISCARDED:
                    raise RuntimeError("call s.step() exactly once per step")
                if not m.after_discard():
                    self._rank0_teardown()  # before leave(): a released pod may exit there
                    return m.leave()
        m.finish()
        self._ckpt.final(self.rank, self.state)
        m.announce_done()  # after the final checkpoint: `up` stops the job on it
        self._write_result()

    def _before_loop(self, start: int | None) -> None:
        """Once per session (the first of ``join()`` / ``steps()``): the start step and
        ``CEASELESS_RESUME_FROM``. Later calls only check that they name the same start."""
        if not self._entered:
            raise RuntimeError("use the session as a context manager: `with Session(...) as s:`")
        if start is not None and start < 0:
            raise ValueError(f"start must be >= 0 (got {start})")
        if self._loop_prepared:
            # A promoted spare's last_committed is the job's step by now: compare the
            # starts the script gave, not the state (issue 33: that check killed spares).
            if (start or 0) != (self._start or 0):
                raise RuntimeError(f"s.join(start={self._start}) and s.steps(start={start}) "
                                   "disagree: pass the same start to both (or to neither)")
            return
        self._loop_prepared, self._start = True, start
        if start and self.last_committed == -1:
            self.state.last_committed = start - 1  # what the script's own checkpoint holds
        self._ckpt.resume(self.state)

    def join(self, start: int | None = None) -> bool:
        """Block until this pod is a member of the job; True once it is (``s.rank`` is then
        its rank). A spare waits here, following the job, until it is promoted; False when
        the job finished (or released this pod) first: the pod is not a member, ``s.rank``
        is None and ``s.steps()`` yields nothing. ``s.steps()`` calls it; call it yourself
        before the loop for set-up that needs the rank now (a rank can change after a
        fault: for rank-0 set-up prefer ``s.on_rank0``). ``start`` as in ``s.steps()``.
        Single-process: True at once."""
        self._before_loop(start)
        if not self.distributed:
            self._joined = True
            self._follow_rank0()
            return True
        if self._joined is None:
            if self.shard_size > 1:
                from .sharded import check_registered

                check_registered(self.m, self.shard_size, self.state.modules())
            self._joined = self.m.recover()
            if not self._joined:
                self.m.leave()
        self._follow_rank0()
        return self._joined

    def on_rank0(self, setup: Callable[[], Any] | None = None,
                 teardown: Callable[[], Any] | None = None, max_s: float = 300.0) -> None:
        """Rank-0 set-up that follows rank 0 (a logger, ``wandb.init``): ``setup()`` runs on
        whichever pod becomes rank 0, when it does (at ``s.join()``, or at the step boundary
        where a recovery or a scale change made it rank 0), ``teardown()`` when it stops
        being rank 0 and when the session closes while it is. Both run on the training
        thread between steps, inside ``s.solo(max_s)``. A ``setup`` that raises fails the pod
        like any error in the script; a ``teardown`` that raises is logged. One process:
        ``setup`` at ``s.join()`` (or ``s.steps()``), ``teardown`` at the end."""
        if self._rank0 is not None:
            raise RuntimeError("s.on_rank0 was already called: register one set-up (call "
                               "several functions from it)")
        self._rank0 = Rank0Hooks(setup, teardown, max_s)
        if self._joined:
            self._follow_rank0()

    def _solo_for(self, max_s: float) -> Any:
        return self.solo(max_s=min(max_s, self.cfg.solo_max) if self.cfg else None)

    def _follow_rank0(self) -> None:
        if self._rank0 is not None:
            self._rank0.follow(self._rank() == 0, self._solo_for, pod=self.pod,
                               generation=self.generation)

    def _rank0_teardown(self) -> None:
        if self._rank0 is not None:
            self._rank0.end(self._solo_for)

    def _local_steps(self, total: int) -> Iterator[int]:
        while self.last_committed + 1 < total:
            s = self.current_step = self.last_committed + 1
            seed_all(self.seed, s, None)
            yield s
            if self.last_committed != s:
                raise RuntimeError("call s.step() exactly once per step")
        self._ckpt.final(self.rank, self.state)
        self._write_result()

    def batches(self, dataset: Any, micro_batch_size: int) -> Iterator[Any]:
        """This rank's share of the current step's global batch, one micro-batch at a time.
        Micro-batch ``k`` of step ``s`` holds the same samples and draws the same randomness
        whichever rank computes it."""
        if self.current_step is None:
            raise RuntimeError("batches() is called inside `for step in s.steps(...)`")
        src = self._feed.source(dataset, micro_batch_size, self.current_step, self.rank,
                                self.world_size, self.m.plan if self.m is not None else None,
                                pin=self.device.type == "cuda")
        for k in self.micro_batches(micro_batch_size):
            yield src.get(self.current_step, k)

    def micro_batches(self, micro_batch_size: int) -> Iterator[int]:
        """The indices ``k`` of this rank's micro-batches of the current step (of
        ``global_batch_size / micro_batch_size``), each with the global RNGs (torch and
        CUDA, numpy, ``random``) seeded from (seed, step, k): a script that draws its own
        samples gets the same ones whichever rank computes micro-batch ``k``."""
        if (s := self.current_step) is None:
            raise RuntimeError("micro_batches() is called inside `for step in s.steps(...)`")
        return self._feed.micro_batches(
            s, micro_batch_size, rank=self.rank, world_size=self.world_size,
            plan=self.m.plan if self.m is not None else None, runtime=self.runtime,
            cfg=self.cfg, stepper=self._stepper, gradient_loop=self.last_committed < s,
            total=self.total)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, scaled by m / B so that the sum over all
        micro-batches of all ranks is the mean over the global batch."""
        self._stepper.backward(loss)

    def step(self, max_grad_norm: float | None = None,
             grad_hook: Callable[[list[torch.nn.Parameter]], None] | None = None) -> bool:
        """Gradient sync, optimizer and scheduler step, commit. Returns False when the step was
        discarded because of a fault (``s.steps()`` then recovers and repeats nothing).

        On the synchronised gradient (the global batch's mean, the same on every rank):
        ``max_grad_norm`` (0 or None: off) clips it by its global L2 norm (``s.grad_norm`` holds the norm
        before clipping, what one process computing the whole global batch gets, within
        rounding); then ``grad_hook(params)`` may change the gradients in place or replace
        them (anything else a script did before ``optimizer.step()``). Spares that follow the
        job receive the gradients after both, so they replay them exactly.

        fp16: register the ``torch.amp.GradScaler`` (``s.register(scaler=scaler)``) and call
        nothing of it yourself: ``s.backward`` scales the loss, ``s.step`` unscales the
        synchronised gradient (before the clip), skips the update when it is not finite (on
        every rank alike; ``s.skipped``) and moves the scale as ``GradScaler.update`` does.
        The scaler's state is part of the training state (transferred, followed by spares)."""
        s = self.current_step
        if s is None:
            raise RuntimeError("step() is called inside `for step in s.steps(...)`")
        t0 = time.perf_counter()
        leader = self.m.leader if self.m is not None else None
        f = self.m.lr_at(s) if self.m is not None else 1.0
        done = self._stepper.step(s, max_grad_norm, grad_hook, f,
                                  stream=leader is not None and leader.streaming)
        if done is None:
            return False
        loss, sent = done
        self._commit(s, loss, time.perf_counter() - t0, self._stepper.nonfinite is not None)
        if sent is not None:
            leader.offer(s, sent[0], f, self._stepper.skipped, sent[1])
        return True

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> bool:
        """Reduce ``tensor`` in place over the members (``op``: "sum" or "mean"), e.g. an
        evaluation loss; one process: unchanged. Abortable: False when a fault interrupted it
        (the tensor unchanged, the step discarded by ``s.step()``); True when reduced."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean' (got {op!r})")
        if not self.distributed:
            return True
        if not self.is_member or self.group is None:
            raise RuntimeError(f"pod {self.pod} is not a member: nothing to reduce with")
        return self._stepper.all_reduce(tensor, op)

    def solo(self, max_s: float | None = None) -> Any:
        """Work on this member alone for longer than the collective timeout (a rank-0
        evaluation, a save), without the peers failing: ``with s.solo(): evaluate()``.

        Until the block ends (at most ``max_s``; default and ceiling
        ``CEASELESS_SOLO_MAX``, 3600 s) the peers' collectives wait for this member instead
        of timing out, and the monitor does not call it absent. A block that overruns its
        bound is a hang like any other: the member is replaced. Do not call collectives
        (``s.all_reduce``) inside; in one process, and on a pod that is not a member, it
        does nothing."""
        from .solo import block

        limit = self.cfg.solo_max if self.cfg is not None else 3600.0
        if max_s is not None:
            if not 0 < max_s <= limit:
                raise ValueError(f"s.solo(max_s={max_s}): must be in (0, {limit:g}] s "
                                 "(the ceiling is CEASELESS_SOLO_MAX)")
            limit = max_s
        if self.runtime is None or not self.is_member:
            return contextlib.nullcontext()
        return block(self.runtime, self.generation, self.last_committed, limit)

    # ------------------------------------------------------------------ commit / discard
    def _commit(self, s: int, loss: float, sync_s: float, skipped: bool = False) -> None:
        self.state.note_commit(s, loss, skipped)  # the guards' (non-finite, spike) record
        now = time.time()
        self.timeline.commit(s, loss, now)
        self.state.last_committed, self.state.loss = s, loss
        self._ckpt.after_commit(self.rank, s, self.state)
        rt = self.runtime
        if rt is not None:
            rt.note_commit()
            rt.update(step=s, **self.state.digests.commit(s), state=AgentState.training, loss=loss
                      if math.isfinite(loss) else None, step_time=self.timeline.median_step(),
                      compute_time=self._stepper.median_compute())
            if self.timeline.incident is not None:
                self.timeline.close(rt, self.cfg, self.rank, self.world_size, now)
            self._stepper.verify.after_commit(s, self.state, self.m, rt, self.cfg,
                                              self.timeline.median_step())
        self.timeline.record_metrics(now)

    def _write_result(self) -> None:
        run_dir = self.cfg.run_dir if self.cfg else os.environ.get("CEASELESS_RUN_DIR")
        write_result(run_dir, self.pod, self.rank, self.generation, self.world_size,
                     self.state, self.timeline.losses, self.timeline.commits)

