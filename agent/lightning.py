"""PyTorch Lightning on the DDP drop-in (issue 44): ``Trainer(strategy=CeaselessStrategy())``.

    from agent.lightning import CeaselessStrategy as DDPStrategy   # was: from lightning... import DDPStrategy
    # or, once this module was imported: Trainer(strategy="ceaseless")

Under torchrun and in one process it is Lightning's own ``DDPStrategy``. Under ``ceaseless up``
it drives ``agent.ddp`` (docs/porting.md, "The drop-in"), not a second recovery path:

* the constructor is ``agent.ddp.init_process_group``: a spare waits there (inside
  ``Trainer(...)``) until it is promoted; its rank and world size come from the job;
* ``setup`` creates the optimizers before the model is wrapped, so the drop-in's
  ``DistributedDataParallel`` registers them with their LR schedulers and the loop's progress
  (``fit_loop.state_dict()`` as of the last batch end or validation, and the callbacks' state,
  ModelCheckpoint's included): a promoted spare receives model, optimizer, schedulers, loop
  position and callbacks, not ``ckpt_path``'s (Lightning would load it over them); a spare
  that becomes rank 0 writes again the checkpoint rank 0 died saving;
* the step is the window of micro-batches one optimizer step takes (``accumulate_grad_batches``;
  agent/lightning_window.py): its first ``training_step`` calls ``agent.ddp.iteration`` (commit
  the step before, or recover), the last one's backward synchronises the gradients; a step
  discarded by a fault is computed again in ``optimizer_step``, every micro-batch with its own
  batch, before the update; the loop's progress is taken at the windows' ends;
* the train DataLoader skips, at the start of an epoch, the batches the restored loop already
  did (a promoted spare starts at the job's next batch; a mid-epoch ``ckpt_path=`` resume at
  the checkpoint's).

``Trainer(strategy="ceaseless")`` needs this module imported first: Lightning 2.x resolves a
strategy name in ``StrategyRegistry`` inside ``Trainer.__init__`` (``_AcceleratorConnector``)
before it loads the only entry points it reads (``lightning.pytorch.callbacks_factory``,
callbacks), so an installed package cannot add the name without being imported.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Iterator

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer import call
from lightning.pytorch.trainer.states import TrainerFn

from plumbing import logs

from . import ddp, lightning_fabric
from .lightning_loops import loop_state
from .lightning_window import Window

log = logs.get("agent")
NAME = "ceaseless"


class CeaselessEnvironment(ClusterEnvironment):
    """The job's rank and world size, as ``agent.ddp.init_process_group`` exported them (one
    process per pod, created by ``ceaseless up``)."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return "127.0.0.1"  # unused: the session builds the process groups

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return ddp.active() is not None

    def world_size(self) -> int:
        return ddp.get_world_size()

    def set_world_size(self, size: int) -> None:
        pass  # the job's, not the Trainer's devices x nodes

    def global_rank(self) -> int:
        return ddp.get_rank()

    def set_global_rank(self, rank: int) -> None:
        pass

    def local_rank(self) -> int:
        return 0  # a pod has one device (CUDA_VISIBLE_DEVICES)

    def node_rank(self) -> int:
        return 0


class _LoopState:
    """The fit loop's progress as training state: a snapshot at each batch end (counters
    only), loaded into the loop of a promoted spare."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.snap: dict | None = None
        self.skip = 0  # batches of the current epoch done before a received snapshot
        self.epoch = 0  # ... and that epoch
        self.epoch_start = False  # snap is a last batch's, as the next epoch's start
        self.at_batch_end: dict | None = None  # snap as of the batch's end, unchanged
        self.received = False  # a promoted spare's: the job's progress, not a fresh loop's
        # the callbacks' state with the snapshot (ModelCheckpoint's files, best scores...),
        # and each ModelCheckpoint's last save (global step, file), which it keeps outside
        # its state_dict: what a spare that becomes rank 0 writes again if it is missing
        self.callbacks: dict = {}
        self.saved: dict[str, tuple[int, str]] = {}

    def take(self, last: bool = False, batch_end: bool = True) -> None:
        # every batch end: a fresh dict of counters (``fit_loop.state_dict()``, made for
        # less: lightning_loops.py), not deep-copied again (a third of the integration's own
        # time per step) unless the train DataLoader keeps a state of its own (a stateful
        # loader's, by reference)
        snap = loop_state(self.trainer.fit_loop)
        if any("combined_loader" in v for k, v in snap.items()
               if k.endswith("state_dict") and isinstance(v, dict)):
            snap = copy.deepcopy(snap)
        if batch_end:  # as a checkpoint written at the batch's end has it (never changed)
            self.at_batch_end = copy.deepcopy(snap) if last else snap
        if last:
            # the epoch's last batch: stored as the next epoch's start, as Lightning's loop
            # has it there (restarting from a last batch's end, Lightning runs into that
            # epoch again, or counts it twice)
            for scope in ("total", "current"):
                ep = snap["epoch_progress"][scope]
                n = ep["completed"] + 1
                ep.update(ready=n, started=n, processed=n, completed=n)
            bp = snap["epoch_loop.batch_progress"]
            bp["total"]["completed"] = bp["total"]["processed"]  # the batch's end is past
            bp["is_last_batch"] = False
            # what an epoch's start resets (_TrainingEpochLoop.reset, not restarting)
            opt = snap["epoch_loop.automatic_optimization.optim_progress"]["optimizer"]
            for p in (bp, snap["epoch_loop.scheduler_progress"], opt["step"], opt["zero_grad"]):
                _zero(p["current"])
            _zero(snap["epoch_loop.val_loop.batch_progress"]["total"])
            # the logging step, counted after this hook (a restart mid-epoch counts it)
            snap["epoch_loop.state_dict"]["_batches_that_stepped"] += 1
        self.snap, self.epoch_start = snap, last

    def take_callbacks(self) -> None:
        """At a step's start: what the callbacks did after the step before (its batch end,
        validation, the epoch's end)."""
        self.callbacks = copy.deepcopy(call._call_callbacks_state_dict(self.trainer))
        self.saved = {cb.state_key: (getattr(cb, "_last_global_step_saved", -1),
                                     cb._last_checkpoint_saved)
                      for cb in self.trainer.checkpoint_callbacks
                      if getattr(cb, "_last_checkpoint_saved", None)}

    def load_loop(self, snap: dict | None = None) -> None:
        fit_loop = self.trainer.fit_loop
        fit_loop.load_state_dict(copy.deepcopy(snap or self.snap))
        if snap is None and self.epoch_start:  # an epoch starts: no restart in the last one
            fit_loop.epoch_loop.restarting = False

    def from_checkpoint(self, ckpt: dict) -> None:
        """``ckpt_path=``: the loop Lightning restored (the checkpoint's) is also what a spare
        receives until the first step ends, and its train DataLoader resumes in the epoch."""
        fit = (ckpt.get("loops") or {}).get("fit_loop")
        if fit is not None:
            self.snap = copy.deepcopy(fit)
            self.callbacks = copy.deepcopy(ckpt.get("callbacks") or {})
            self._position()

    def digest_tensors(self) -> list:
        """What the heartbeat digest covers of this state (``digests.covered``): the tensors
        of the callbacks' state (ModelCheckpoint's scores); the loop's counters are none,
        and walking them at every commit cost as much as the rest of the digest."""
        from .digests import tensors_in

        return list(tensors_in(self.callbacks))

    def state_dict(self) -> dict:
        return {"fit_loop": self.snap, "epoch_start": self.epoch_start,
                "at_batch_end": self.at_batch_end, "callbacks": self.callbacks,
                "saved": self.saved}

    def _position(self) -> None:
        assert self.snap is not None
        ep = self.snap["epoch_progress"]["current"]
        if ep["processed"] > ep["completed"] or \
                self.snap["epoch_loop.batch_progress"].get("is_last_batch"):
            self.skip = 0  # taken at an epoch's end (a checkpoint's): the next one starts
        else:  # taken at a batch end: that batch is done too
            self.skip = int(self.snap["epoch_loop.batch_progress"]["current"]["processed"])
            self.epoch = int(ep["completed"])

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("fit_loop") is not None:
            self.snap = copy.deepcopy(sd["fit_loop"])
            self._position()
            self.received = True
            self.epoch_start = bool(sd.get("epoch_start"))
            self.at_batch_end = copy.deepcopy(sd.get("at_batch_end"))
            self.load_loop()
            self.callbacks = copy.deepcopy(sd.get("callbacks") or {})
            self.saved = dict(sd.get("saved") or {})
            call._call_callbacks_load_state_dict(self.trainer, {"callbacks": self.callbacks})
            for cb in self.trainer.checkpoint_callbacks:
                if cb.state_key in self.saved:
                    cb._last_global_step_saved, cb._last_checkpoint_saved = \
                        self.saved[cb.state_key]
            log.info("lightning: loop progress received",
                     global_step=self.trainer.global_step, epoch=self.trainer.current_epoch)


class _Snapshot(Callback):
    """The loop's progress at each step's end: the end of the last batch of an accumulation
    window (a step's first batch: the callbacks' state), or the validation after it."""

    def __init__(self, loops: _LoopState) -> None:
        self.loops, self.last = loops, False
        self.stepped = True  # the last batch end ended a step (not inside a window)

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if self.stepped:
            self.loops.take_callbacks()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.last = batch_idx + 1 >= trainer.num_training_batches
        self.stepped = self.last or not trainer.fit_loop._should_accumulate()
        if self.stepped:
            self.loops.take(self.last)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        # after the batch's validation: the state Lightning restarts from as from its own
        # checkpoint there (from the batch end before it, it counts the validation twice);
        # a validation inside a window (val_check_interval counts batches) is no step's end
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and \
                self.stepped:
            self.loops.take(self.last, batch_end=False)


class _SkipDone:
    """The train DataLoader, skipping in the epoch a promoted spare joins the batches the job
    already did (the loop's progress it received)."""

    def __init__(self, loader: Any, loops: _LoopState) -> None:
        self._loader, self._loops = loader, loops

    def __iter__(self) -> Any:
        done, self._loops.skip = self._loops.skip, 0
        if done:  # Lightning's restart gives the sampler another epoch than the job's
            for name in ("sampler", "batch_sampler"):
                set_epoch = getattr(getattr(self._loader, name, None), "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(self._loops.epoch)
        it = iter(self._loader)
        for _ in range(done):  # drawn and dropped: the epoch's order is the sampler's
            next(it)
        if done:
            log.info("lightning: data resumed inside the epoch", skipped_batches=done)
        return it

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_sampler, dataset, ...
        return getattr(self._loader, name)


class CeaselessStrategy(DDPStrategy):
    """``DDPStrategy`` that survives faults under ``ceaseless up`` (module docstring)."""

    strategy_name = NAME

    def __init__(self, **kwargs: Any) -> None:
        from .config import AgentConfig

        self._on = AgentConfig.from_env() is not None
        if self._on:
            if ddp.active() is None:
                ddp.init_process_group()  # a spare waits here until promoted
            kwargs.setdefault("cluster_environment", CeaselessEnvironment())
        super().__init__(**kwargs)
        self._loops: _LoopState | None = None
        self._window = Window()

    # ------------------------------------------------------------------ set-up
    def setup_environment(self) -> None:
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:  # before any process group: refused at once
            _refuse_unsupported(trainer)
        super().setup_environment()

    def setup_distributed(self) -> None:
        if not self._on:
            return super().setup_distributed()
        self._process_group_backend = self._get_process_group_backend()
        self.set_world_ranks()  # the session builds the process groups

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: Any) -> None:
        if not self._on:
            super().setup(trainer)
            if trainer.state.fn == TrainerFn.FITTING:
                _check_optimizers(self)
            return
        if trainer.state.fn != TrainerFn.FITTING:
            raise NotImplementedError(
                f"strategy='ceaseless': trainer.{trainer.state.fn}() under ceaseless up is not "
                "supported: run it under torchrun or in one process (strategy='ddp')")
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # the optimizers before the wrap: DistributedDataParallel registers them
        self.setup_optimizers(trainer)
        _check_optimizers(self)
        self._loops = _LoopState(trainer)
        trainer.callbacks.append(_Snapshot(self._loops))
        extra: dict[str, Any] = {"lightning_loops": self._loops}
        for i, opt in enumerate(self.optimizers):
            extra[f"optimizer{i}"] = opt
        for i, cfg in enumerate(self.lr_scheduler_configs):
            extra[f"lr_scheduler{i}"] = cfg.scheduler
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            extra["scaler"] = scaler
        ddp.register(**extra)
        self.model = ddp.DistributedDataParallel(self.model)  # joins the job
        self.setup_precision_plugin()
        connector = trainer._checkpoint_connector
        if self._loops.received:
            # the job's committed state arrived: not ckpt_path's, which Lightning's
            # restore_training_state would load over it next
            connector._loaded_checkpoint = {}
            if self.global_rank == 0:
                write_lost_checkpoint(trainer, self._loops)
        elif connector._loaded_checkpoint:
            self._loops.from_checkpoint(connector._loaded_checkpoint)

    def process_dataloader(self, dataloader: object) -> object:
        if not self._on or self._loops is None:
            return dataloader
        stage = self.lightning_module.trainer.state.stage
        if stage is None or stage.value != "train":
            return dataloader
        return _SkipDone(dataloader, self._loops)

    # ------------------------------------------------------------------ the step
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None,
                       **kwargs: Any) -> Any:
        d = ddp.active()
        if not self._on or d is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        # the window's last micro-batch; a step discarded by a fault computed again, whole
        out = self._window.finish(self.lightning_module.trainer, optimizer, closure,
                                  self.block_backward_sync)
        return super().optimizer_step(optimizer, lambda: out, model, **kwargs)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._on and self._loops is not None and ddp.active() is not None:
            self._window.on_training_step(self.lightning_module.trainer, args)
        return super().training_step(*args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """A micro-batch before a window's last: its backward accumulates, unsynchronised
        (Lightning's DDPStrategy only knows torch's DDP class)."""
        if self._on and isinstance(self.model, ddp.DistributedDataParallel):
            with self.model.no_sync():
                yield
        else:
            with super().block_backward_sync():
                yield

    def on_train_end(self) -> None:
        super().on_train_end()
        if self._on and ddp.active() is not None:
            ddp.destroy_process_group()  # the last step committed, the job done

    # ------------------------------------------------------------------ collectives
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not self._on:
            return super().barrier(*args, **kwargs)
        # nothing: the ranks meet at the gradient sync of every step

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not self._on:
            return super().broadcast(obj, src)
        return obj  # every rank computes the same (ModelCheckpoint's path)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        import torch

        d = ddp.active()
        if not self._on or not isinstance(tensor, torch.Tensor):
            return super().reduce(tensor, group, reduce_op)
        if d is None or d.step is None:
            # set-up (the DataLoader's length) and after the job: this rank's own value. A
            # spare runs Lightning's set-up alone, long after the members did
            return tensor
        op = str(reduce_op).lower()
        if op not in ("mean", "avg", "sum", "reduceop.sum", "reduceop.avg"):
            raise NotImplementedError(f"strategy='ceaseless': reduce {reduce_op} (mean or sum)")
        # summed in place, then divided out of place: Lightning syncs integer tensors too
        # (a metric's cumulated batch size) and expects a float mean, as torch's DDP gives
        out = tensor.detach().clone()
        if d.s.all_reduce(out, "sum") and "sum" not in op:
            out = out / d.world_size
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not self._on:
            return super().reduce_boolean_decision(decision, all)
        # the loops' decisions (should_stop, ...) are taken alike on every rank from the same
        # state: no collective the ranks, or a promoted spare, could call out of step
        return decision

    def teardown(self) -> None:
        if self._on and isinstance(self.model, ddp.DistributedDataParallel):
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(NAME, cls, description="DDP that survives faults under "
                                   "ceaseless up (agent.lightning)", override=True)


def _refuse_unsupported(trainer: Any) -> None:
    """What the strategy does not do yet: refused before the first step, saying what to do."""
    pl_module = trainer.lightning_module
    if pl_module is not None and not pl_module.automatic_optimization:
        raise NotImplementedError(
            "strategy='ceaseless': manual optimization (automatic_optimization = False) is not "
            "supported yet: use automatic optimization, or the DDP drop-in (agent.ddp) with "
            "your own loop")
    prec = str(trainer.precision)
    if prec.startswith("16") or prec.startswith("transformer-engine"):
        raise NotImplementedError(
            f"strategy='ceaseless': precision={prec!r} is not supported yet: use '32-true' or "
            "'bf16-mixed'")


def _zero(progress: dict) -> None:
    progress.update({k: 0 for k in ("ready", "started", "processed", "completed")
                     if k in progress})


def write_lost_checkpoint(trainer: Any, loops: _LoopState) -> None:
    """A spare that became rank 0 writes again the checkpoint rank 0 died writing: its
    ModelCheckpoint saved at the step the job's state is at, and the file is not there
    (Lightning writes a file whole or not at all: an fsspec transaction)."""
    from lightning.fabric.utilities.cloud_io import get_filesystem

    for cb in trainer.checkpoint_callbacks:
        step, path = loops.saved.get(cb.state_key, (None, None))
        if path and step == trainer.global_step and not get_filesystem(path).exists(path):
            loops.load_loop(loops.at_batch_end)  # the loop as rank 0 saved it
            try:
                trainer.save_checkpoint(path, getattr(cb, "save_weights_only", False))
            finally:
                loops.load_loop()
            log.info("lightning: a checkpoint lost with rank 0 written again", path=str(path),
                     step=step)


def _check_optimizers(strategy: CeaselessStrategy) -> None:
    if len(strategy.optimizers) != 1:
        raise NotImplementedError(
            f"strategy='ceaseless': {len(strategy.optimizers)} optimizers; one is supported "
            "(several need manual optimization, not supported yet)")


def register() -> None:
    """``Trainer(strategy="ceaseless")``: register the name (idempotent), and Fabric's."""
    if NAME not in StrategyRegistry:
        CeaselessStrategy.register_strategies(StrategyRegistry)
    lightning_fabric.register()  # Fabric's name: refused, saying what to do


register()
