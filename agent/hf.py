"""The Hugging Face ``transformers.Trainer`` on the DDP drop-in (issue 44).

    from agent.hf import Trainer   # was: from transformers import Trainer

Under torchrun and in one process it is the ``transformers.Trainer`` (nothing overridden does
anything). Under ``ceaseless up`` it drives ``agent.ddp`` (docs/porting.md, "The drop-in"), not
a second recovery path:

* the constructor is ``agent.ddp.init_process_group``: a spare waits there (inside
  ``Trainer(...)``) until it is promoted. Accelerate sees one process (no torch process group
  to hang on a dead peer, no collective of its own); the Trainer's ``args`` see the job's
  rank and world size (``process_index``, ``world_size``: rank 0 saves and logs) and the
  train DataLoader is sharded by them as Accelerate shards it under torchrun;
* the model is wrapped in the drop-in's ``DistributedDataParallel`` after the Trainer created
  the optimizer and the LR scheduler: it registers them with the Trainer's progress
  (``TrainerState`` as of the last step end) and joins the job; a promoted spare receives
  model, optimizer, scheduler and progress, and its first epoch skips the batches the job
  already did (the Trainer's own ``resume_from_checkpoint`` fast-forward);
* ``training_step`` is the micro-batch: the first of an optimizer step calls
  ``agent.ddp.iteration`` (the commit of the step before, or the recovery), the last one's
  backward synchronises the gradients; a step discarded by a fault is computed again there,
  all its micro-batches, before the Trainer clips and steps.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Iterator

import torch
import transformers
from transformers import Trainer as _HFTrainer
from transformers import TrainerCallback

from plumbing import logs

from . import ddp

log = logs.get("agent")
JOB_STATE = "<ceaseless: the job's state>"  # a resume_from_checkpoint that names no files
_PROGRESS = ("global_step", "epoch", "total_flos", "num_input_tokens_seen", "best_metric",
             "best_global_step", "best_model_checkpoint")
_LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
# the Trainer's own points this module drives (transformers 5.x); checked at import
_NEEDS = ("_run_epoch", "_prepare_for_training", "_load_rng_state", "training_step",
          "get_train_dataloader")

_missing = [n for n in _NEEDS if not hasattr(_HFTrainer, n)]
if _missing:
    raise ImportError(f"agent.hf: transformers {transformers.__version__} has no Trainer."
                      f"{', '.join(_missing)}; install ceaseless[hf] (transformers 5.x)")


class _Ranks:
    """``args.distributed_state`` as the Trainer's arguments see it under ``ceaseless up``: the
    job's rank and world size; everything else (the device, ``wait_for_everyone``: nothing to
    wait for in one process) is Accelerate's own single-process state."""

    def __init__(self, real: Any, rank: int, world: int) -> None:
        self.real, self.rank, self.world = real, rank, world

    @property
    def num_processes(self) -> int:
        return self.world

    @property
    def process_index(self) -> int:
        return self.rank

    @property
    def local_process_index(self) -> int:
        return self.rank  # the pods of a job count as one node: rank 0 logs and saves

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.rank == 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "real":
            raise AttributeError(name)
        return getattr(self.__dict__["real"], name)


class _Progress:
    """The Trainer's progress as training state: its ``TrainerState`` counters at each step end
    (a few scalars) and its log history up to that step; what a promoted spare receives is
    applied once the model is wrapped (``received``)."""

    def __init__(self, trainer: "Trainer") -> None:
        self.trainer = trainer
        self.snap: dict[str, Any] | None = None
        self.received: dict[str, Any] | None = None

    def take(self) -> None:
        st = self.trainer.state
        snap = {f: getattr(st, f, None) for f in _PROGRESS}
        snap["current_flos"] = float(self.trainer.current_flos)
        self.snap = snap

    def digest_tensors(self) -> list:
        """None of this state is a tensor (``digests.covered``): its ``state_dict`` copies the
        log history, which grows with the run; walked at every commit (issue 44)."""
        return []

    def state_dict(self) -> dict[str, Any]:
        if self.snap is None:
            return {"progress": None, "log_history": []}
        g = self.snap["global_step"]
        return {"progress": dict(self.snap),
                "log_history": [dict(e) for e in self.trainer.state.log_history
                                if e.get("step", 0) <= g]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("progress") is not None:
            self.received = sd


class _Snapshot(TrainerCallback):
    def __init__(self, progress: _Progress) -> None:
        self.progress = progress

    def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.progress.take()  # a job resumed from the script's checkpoint: its step

    def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.progress.take()


@contextlib.contextmanager
def _one_process_env() -> Iterator[None]:
    """Accelerate reads ``WORLD_SIZE`` / ``LOCAL_RANK`` to decide it is distributed and then
    builds a torch process group; under ``ceaseless up`` it must see one process."""
    saved = {k: os.environ.pop(k) for k in _LAUNCHER_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


class Trainer(_HFTrainer):
    """``transformers.Trainer`` that survives faults under ``ceaseless up`` (module docstring)."""

    def __init__(self, model: Any = None, args: Any = None, *a: Any, **kw: Any) -> None:
        from .config import AgentConfig

        self._on = AgentConfig.from_env() is not None
        self._shard: tuple[int, int] | None = None  # (rank, world) of the train DataLoader
        self._resume_step: int | None = None  # a promoted spare's first step
        self._open = False  # an optimizer step's first micro-batch called iteration()
        self._batch: list[Any] = []  # its micro-batches, computed again after a fault
        self._added: Any = None  # the losses returned for them so far (the Trainer's log)
        self._trained = False
        if not self._on:
            super().__init__(model, args, *a, **kw)
            return
        if args is None:
            from transformers import TrainingArguments

            args = TrainingArguments(output_dir="tmp_trainer")
        train_dataset = kw.get("train_dataset", a[1] if len(a) > 1 else None)
        refuse_unsupported(args, train_dataset)  # before any process group
        with _one_process_env():
            _ = args.device  # Accelerate's state: one process
        if ddp.active() is None:
            ddp.init_process_group()  # a spare waits here until promoted
        rank, world = ddp.get_rank(), ddp.get_world_size()
        args.distributed_state = _Ranks(args.distributed_state, rank, world)
        self._shard = (rank, world)
        with _one_process_env():
            super().__init__(model, args, *a, **kw)
        self._progress = _Progress(self)
        self.add_callback(_Snapshot(self._progress))

    # ------------------------------------------------------------------ the job
    def train(self, *a: Any, **kw: Any) -> Any:
        if not self._on:
            return super().train(*a, **kw)
        if self._trained:
            raise NotImplementedError("agent.hf: one trainer.train() per process under "
                                      "ceaseless up (the job ends with it)")
        self._trained = True
        out = super().train(*a, **kw)
        ddp.destroy_process_group()  # the last step committed, the job done
        return out

    def _prepare_for_training(self, max_steps: int, train_dataloader: Any,
                              resume_from_checkpoint: Any) -> Any:
        model, loader = super()._prepare_for_training(max_steps, train_dataloader,
                                                      resume_from_checkpoint)
        if not self._on:
            return model, loader
        opt = getattr(self.optimizer, "optimizer", self.optimizer)  # Accelerate's wrapper
        sched = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)
        objs: dict[str, Any] = {"hf_progress": self._progress, "optimizer": opt}
        if isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
            objs["lr_scheduler"] = sched
        ddp.register(**objs)
        wrapped = ddp.DistributedDataParallel(model)  # joins the job
        self.model_wrapped = wrapped
        self._apply_received()
        return wrapped, loader

    def _apply_received(self) -> None:
        got, self._progress.received = self._progress.received, None
        if got is None:
            return
        p = got["progress"]
        for f in _PROGRESS:
            setattr(self.state, f, p[f])
        self.current_flos = p["current_flos"]
        self.state.log_history = list(got["log_history"])
        self._resume_step = self.state.global_step
        log.info("hf: trainer progress received", global_step=self.state.global_step,
                 epoch=self.state.epoch)
        self._write_lost_checkpoint()

    def _write_lost_checkpoint(self) -> None:
        """A spare that became rank 0 writes again the checkpoint rank 0 died writing (or
        before writing it): the Trainer saves at the step the job is at (``save_steps``) and
        that checkpoint's last file, its ``trainer_state.json``, is not there. The Trainer
        writes a checkpoint's files one by one in place: a part may be there."""
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

        a, st = self.args, self.state
        if not (a.should_save and a.save_strategy == SaveStrategy.STEPS and st.save_steps > 0
                and st.global_step > 0 and st.global_step % st.save_steps == 0):
            return
        folder = os.path.join(self._get_output_dir(trial=None),
                              f"{PREFIX_CHECKPOINT_DIR}-{st.global_step}")
        if os.path.exists(os.path.join(folder, TRAINER_STATE_NAME)):
            return
        self.control.should_save = True  # as the Trainer's control was when rank 0 saved
        try:
            self._save_checkpoint(self.model_wrapped, trial=None)
        finally:
            self.control.should_save = False  # as on_save leaves it
        log.info("hf: a checkpoint lost with rank 0 written again", path=folder,
                 step=st.global_step)

    # ------------------------------------------------------------------ data
    def get_train_dataloader(self) -> Any:
        if self._shard is None:
            return super().get_train_dataloader()
        acc = self.accelerator
        acc.prepare_data_loader = functools.partial(_sharded, acc, self._shard,
                                                    self.args.seed)
        try:
            return super().get_train_dataloader()
        finally:
            del acc.prepare_data_loader  # the evaluation's is every rank's whole set

    def _run_epoch(self, *a: Any, **kw: Any) -> Any:
        g = self._resume_step
        if g is None or a:
            return super()._run_epoch(*a, **kw)
        e, within = divmod(g, kw["num_update_steps_per_epoch"])
        if kw["epoch"] < e:
            return None  # done by the job before this pod joined it
        self._resume_step = None
        if kw["epoch"] == e:  # the Trainer's fast-forward, from the job's state
            kw.update(epochs_trained=e, resume_from_checkpoint=JOB_STATE,
                      steps_trained_in_current_epoch=within * self.args.gradient_accumulation_steps)
            log.info("hf: data resumed inside the epoch", epoch=e, skipped_steps=within)
        return super()._run_epoch(*a, **kw)

    def _load_rng_state(self, checkpoint: Any) -> None:
        if checkpoint == JOB_STATE:
            return  # every forward is seeded by (seed, step, rank, micro-batch)
        super()._load_rng_state(checkpoint)

    # ------------------------------------------------------------------ the step
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        d = ddp.active()
        if not self._on or d is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if not self._open:  # an optimizer step's first micro-batch
            self._begin(d)
            self._open, self._batch, self._added = True, [], None
        self._batch.append(inputs)
        last = bool(self.accelerator.gradient_state.sync_gradients)
        model.require_backward_grad_sync = last
        loss = super().training_step(model, inputs, num_items_in_batch)
        if not last:
            self._added = loss if self._added is None else self._added + loss
            return loss
        self._open = False
        if d.synced:
            self._batch = []
            return loss
        while not d.synced:  # discarded by a fault: the same step again, same batches
            self._begin(d)
            model.zero_grad(set_to_none=True)
            total = None
            for j, x in enumerate(self._batch):
                model.require_backward_grad_sync = j == len(self._batch) - 1
                out = super().training_step(model, x, num_items_in_batch)
                total = out if total is None else total + out
        self._batch = []
        # the Trainer adds what each call returns: its log counts the step once
        return total if self._added is None else total - self._added

    def _begin(self, d: Any) -> None:
        t = d.iteration(self.state.global_step)
        if t != self.state.global_step:
            raise RuntimeError(f"the job's step {t} is not the Trainer's global step "
                               f"{self.state.global_step}")


def _sharded(acc: Any, shard: tuple[int, int], seed: int, data_loader: Any,
             device_placement: Any = None, slice_fn_for_dispatch: Any = None) -> Any:
    """``Accelerator.prepare_data_loader`` with the job's rank and world size (Accelerate
    itself sees one process): each rank its batches of the epoch's order, as under torchrun;
    the order seeded by ``args.data_seed`` or ``args.seed`` on every pod alike."""
    from accelerate.data_loader import prepare_data_loader

    rank, world = shard
    cfg = acc.dataloader_config
    data_seed = cfg.data_seed if cfg.data_seed is not None else seed
    dl = prepare_data_loader(
        data_loader, acc.device, num_processes=world, process_index=rank,
        split_batches=acc.split_batches,
        put_on_device=acc.device_placement if device_placement is None else device_placement,
        rng_types=list(acc.rng_types or []), dispatch_batches=False,
        even_batches=acc.even_batches, use_seedable_sampler=acc.use_seedable_sampler,
        data_seed=data_seed, non_blocking=acc.non_blocking,
        use_stateful_dataloader=acc.use_stateful_dataloader)
    acc._dataloaders.append(dl)
    return dl


def refuse_unsupported(args: Any, train_dataset: Any = None) -> None:
    """What the Trainer under ``ceaseless up`` does not do yet: refused before any process
    group, saying what to do (docs/porting.md, "Hugging Face Trainer")."""
    def no(what: str, todo: str) -> None:
        raise NotImplementedError(f"agent.hf.Trainer under ceaseless up: {what} is not "
                                  f"supported yet: {todo}")

    if getattr(args, "deepspeed", None) or getattr(args, "fsdp", None):
        no("DeepSpeed / FSDP", "train data-parallel (no deepspeed=, no fsdp=), or run them "
           "under torchrun")
    if getattr(args, "parallelism_config", None) is not None:
        no("parallelism_config (tensor / context / sequence parallel)",
           "train data-parallel only")
    if getattr(args, "fp16", False):
        no("fp16 (a GradScaler)", "use bf16=True or fp32")
    if getattr(args, "auto_find_batch_size", False):
        no("auto_find_batch_size", "set per_device_train_batch_size")
    if getattr(args, "load_best_model_at_end", False):
        no("load_best_model_at_end", "load the best checkpoint after the job")
    if getattr(args, "ignore_data_skip", False):
        no("ignore_data_skip=True", "a promoted spare must skip the batches the job did")
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in ("random", "sequential"):
        no(f"train_sampling_strategy={strategy!r}", "use 'random' or 'sequential'")
    acc = getattr(args, "accelerator_config", None)
    grad_acc = getattr(acc, "gradient_accumulation_kwargs", None) or {}
    if grad_acc.get("sync_each_batch"):
        no("sync_each_batch", "the gradients are synchronised on the last micro-batch")
    if getattr(acc, "dispatch_batches", None):
        no("dispatch_batches", "every rank loads its own batches")
    if getattr(acc, "use_seedable_sampler", True) is False:
        no("use_seedable_sampler=False", "the epoch's order must be the same on every pod (a "
           "promoted spare's included): leave it on")
    if train_dataset is not None and (isinstance(train_dataset, torch.utils.data.IterableDataset)
                                      or not hasattr(train_dataset, "__len__")):
        no("an iterable train dataset (no length)", "use a map-style dataset: a promoted "
           "spare skips to the job's batch by index")
