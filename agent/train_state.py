"""``TrainState``: the registered training state and everything done to it.

The objects the script registered (modules, optimizers, schedulers, anything with
``state_dict()``), the committed step, its global loss and the learning-rate factor, and
the operations on them that members, promoted spares and spares following the job all run
the same way: the update, zero-grad, the digest and exact checksums, snapshot and restore.
Device-aware: the model may live on a GPU; snapshots go to host memory (issue 19). It knows
nothing of process groups, plans or the bus (issue 18: the Session's first part out).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from typing import Any, Callable, Iterable

import numpy as np
import torch


HYPER_KEYS = ("lr", "weight_decay", "momentum", "dampening", "eps")
MAX_SKIPPED = 10_000
SPIKE_WINDOW, SPIKE_MIN = 50, 10  # the loss-spike guard's median: of up to 50 losses, from 10


class TrainState:
    def __init__(self) -> None:
        self.objs: dict[str, Any] = {}
        self.last_committed = -1
        self.loss: float | None = None          # global mean loss of the last committed step
        # learning-rate factor (the plan's lr_factor, ramped over lr_warmup_steps): part of
        # the state, so a replacement continues the same ramp
        self.lr_factor = 1.0
        # sharded models: (replica, shard position) of this rank's shards; None unsharded
        self.shard: tuple[int, int] | None = None
        # steps whose update the non-finite guard skipped (the last MAX_SKIPPED): part of
        # the state, so the job's list survives the pod that saw them
        self.skipped: list[int] = []
        # the last committed losses the update was not skipped at (the loss-spike guard's
        # median): part of the state, so every rank (a promoted spare too) decides alike
        self.recent_losses: list[float] = []
        self.new_skip = False  # the last commit's step was skipped for the first time
        # sharded: (step, lr factor) of the step after ``last_committed`` whose gradients are
        # summed in ``.grad`` while its last collective failed here (``agent/rollforward.py``
        # may finish it); the gradients' lifetime: ``zero_grad`` ends it
        self.pending: tuple[int, float] | None = None
        # fp16: (scaler, scale, growth tracker) as last set on it (``_scale_state``)
        self._scale_seen: tuple[Any, float, int] | None = None
        from .digests import DigestSlot, Sampler

        # the heartbeat's digest: begun at each commit, read a step later (agent/digests.py),
        # from views of the state kept between commits
        self._sampler = Sampler()
        self.digests = DigestSlot(self.digest_begin)
        # called before the update or a restore changes the registered state: rank 0 holds
        # them back while a spare's first state is sent from the live tensors
        # (``ShadowLeader.hold``, ``shared``)
        self.before_change: Callable[[], None] | None = None

    # ------------------------------------------------------------------ what is registered
    def register(self, **objs: Any) -> None:
        for name, obj in objs.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"{name!r} has no state_dict()/load_state_dict()")
            self.objs[name] = obj
        self._scale_seen = None

    def modules(self) -> list[torch.nn.Module]:
        return [o for o in self.objs.values() if isinstance(o, torch.nn.Module)]

    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for o in self.objs.values() if isinstance(o, torch.optim.Optimizer)]

    def schedulers(self) -> list[Any]:
        return [o for o in self.objs.values()
                if isinstance(o, torch.optim.lr_scheduler.LRScheduler)]

    def params(self) -> list[torch.nn.Parameter]:
        """Trainable parameters of every registered module, each once, in order."""
        return _once(p for m in self.modules() for p in m.parameters() if p.requires_grad)

    def buffers(self) -> list[torch.Tensor]:
        return _once(b for m in self.modules() for b in m.buffers())

    @property
    def device(self) -> torch.device:
        """Where the registered model lives (its first parameter or buffer; CPU without)."""
        for m in self.modules():
            for t in m.parameters():
                return t.device
            for t in m.buffers():
                return t.device
        return torch.device("cpu")

    def scaler(self) -> Any:
        """The registered, enabled ``torch.amp.GradScaler`` (fp16 training), or None."""
        found = [o for o in self.objs.values()
                 if isinstance(o, torch.amp.GradScaler) and o.is_enabled()]
        if len(found) > 1:
            raise ValueError("register one GradScaler (it scales the loss of every optimizer)")
        return found[0] if found else None

    def replayable(self) -> str | None:
        """Why a spare could not replay this state's updates (None: it can)."""
        for name, o in self.objs.items():
            if not isinstance(o, (torch.nn.Module, torch.optim.Optimizer,
                                  torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)):
                return (f"registered object {name!r} is not a module, optimizer, scheduler "
                        "or GradScaler")
        return None

    # ------------------------------------------------------------------ fp16 loss scaling
    # Not GradScaler.unscale_/step/update: those keep per-optimizer stages that only the
    # process that ran backward has, and a spare replays updates from rank 0's gradients. So
    # the scaler scales the loss (its public ``scale``); the unscale, the inf/nan check and
    # the scale's growth/backoff (GradScaler's documented rule) are done here, identically
    # by members and by spares, and its state moves by ``state_dict``/``load_state_dict``.
    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        sc = self.scaler()
        return loss if sc is None else sc.scale(loss)

    def unscale_ahead(self, params: list[torch.nn.Parameter]) -> torch.Tensor | None:
        """fp16: whether every synchronised gradient is finite, a device bool read with the
        step's loss (no host sync of its own: issue 43), then the gradients divided by the
        loss scale (its host copy: ``_scale_state``). None without a scaler or gradients. A
        gradient that is not finite skips the step's update (its unscaled values go
        nowhere). Every rank decides the same without another collective: the gradients are
        the all-reduce's result, the same bits on every rank, and an inf/nan in any rank's
        share is in the sum."""
        sc = self.scaler()
        if sc is None:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return None
        finite = torch.stack([torch.isfinite(g).all().to(grads[0].device) for g in grads]).all()
        torch._foreach_mul_(grads, 1.0 / self._scale_state(sc)[0])  # a power of two: exact
        return finite

    def _scale_state(self, sc: Any) -> tuple[float, int]:
        """The scaler's scale and growth tracker on the host, as ``_scale_after`` last set them
        (reading them from the scaler, its ``state_dict``, is a host sync each); read from it
        once after a registration or a restore (``_scale_seen`` is cleared there). The script
        calls nothing of the scaler itself (``Session.step``), so nothing else changes them."""
        seen = self._scale_seen
        if seen is None or seen[0] is not sc:
            sd = sc.state_dict()
            seen = self._scale_seen = (sc, float(sd["scale"]), int(sd["_growth_tracker"]))
        return seen[1], seen[2]

    def _scale_after(self, skipped: bool) -> None:
        """GradScaler.update's rule: back off on a skipped step, grow after
        ``growth_interval`` good ones (in float32, like the scaler's own tensor: numpy's
        float32 rounds as torch's does), on the host copy of the scale: no host sync."""
        sc = self.scaler()
        if sc is None:
            return
        value, tracker = self._scale_state(sc)
        scale = np.float32(value)
        if skipped:
            scale, tracker = scale * np.float32(sc.get_backoff_factor()), 0
        else:
            tracker += 1
            if tracker == sc.get_growth_interval():
                with np.errstate(over="ignore"):
                    grown = scale * np.float32(sc.get_growth_factor())
                if np.isfinite(grown):
                    scale = grown
                tracker = 0
        sc.load_state_dict({"scale": float(scale), "growth_factor": sc.get_growth_factor(),
                            "backoff_factor": sc.get_backoff_factor(),
                            "growth_interval": sc.get_growth_interval(),
                            "_growth_tracker": tracker})
        self._scale_seen = (sc, float(scale), tracker)

    # ------------------------------------------------------------------ the update
    def hypers(self) -> list[float]:
        """The optimizers' numeric hyper-parameters (``HYPER_KEYS`` of every param group, in
        order): what a script may set between steps (``param_group['lr'] = ...``), sent to
        spares with each step so that they update with the same values."""
        return [float(g[k]) for opt in self.optimizers() for g in opt.param_groups
                for k in HYPER_KEYS if isinstance(g.get(k), (int, float))
                and not isinstance(g.get(k), bool)]

    def set_hypers(self, values: list[float]) -> None:
        it = iter(values)
        for opt in self.optimizers():
            for g in opt.param_groups:
                for k in HYPER_KEYS:
                    if isinstance(g.get(k), (int, float)) and not isinstance(g.get(k), bool):
                        v = next(it)
                        if float(g[k]) != v:  # as set on rank 0 (its type: float)
                            g[k] = v

    def update(self, f: float, skip: bool = False) -> None:
        """Optimizer and scheduler step with the learning rate scaled by ``f`` (the plan's
        ramp); ``skip`` (fp16: a gradient was not finite): no optimizer step, the loss scale
        backs off. Spares that follow the job run exactly this on rank 0's gradients."""
        if self.before_change is not None:
            self.before_change()
        for opt in ([] if skip else self.optimizers()):
            if f != 1.0:  # scale around the update only: schedulers keep their own lr
                saved = [g["lr"] for g in opt.param_groups]
                for g in opt.param_groups:
                    g["lr"] = g["lr"] * f
                opt.step()
                for g, lr in zip(opt.param_groups, saved):
                    g["lr"] = lr
            else:
                opt.step()
        self.lr_factor = f
        with warnings.catch_warnings():
            if skip:  # the schedule goes on over skipped steps, as in PyTorch's AMP recipe
                warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler")
            for sch in self.schedulers():
                sch.step()
        self._scale_after(skip)

    def note_commit(self, s: int, loss: float, skipped: bool) -> None:
        """The guards' record of a committed step: skipped (once), or its loss."""
        # a step skipped for the first time (not one computed again after a rollback): what
        # the "rollback" policy goes back for (agent/verify.py)
        self.new_skip = skipped and s not in self.skipped[-1:]
        if self.new_skip:
            self.skipped = (self.skipped + [s])[-MAX_SKIPPED:]
        elif not skipped and math.isfinite(loss):  # a skipped step's loss is no baseline
            self.recent_losses = (self.recent_losses + [float(loss)])[-SPIKE_WINDOW:]

    def loss_median(self) -> float | None:
        r = sorted(self.recent_losses)
        return r[len(r) // 2] if len(r) >= SPIKE_MIN else None

    def _extra(self) -> dict[str, Any]:
        return {"step": self.last_committed, "loss": self.loss, "lr_factor": self.lr_factor,
                "skipped": list(self.skipped), "recent_losses": list(self.recent_losses)}

    def zero_grad(self) -> None:
        self.pending = None
        for opt in self.optimizers():
            opt.zero_grad(set_to_none=True)
        for m in self.modules():
            m.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------ checks
    def digest(self) -> str:
        """Cheap digest of every registered object's state (``digests.covered``: every
        module's parameters, every optimizer's state, other objects' tensors), a sample
        taken on the device: what the broker takes the majority of to choose sources."""
        from .digests import covered, digest

        tensors = covered(self.objs)
        return digest(tensors) if tensors else ""

    def digest_begin(self) -> Any:
        """``digest()`` begun on the device, read later (``digests.PendingDigest``); None
        where ``digest()`` is "". Must cover what ``digest()`` covers (tests/test_digests)."""
        from .digests import covered

        tensors = covered(self.objs)
        return self._sampler.begin(tensors) if tensors else None

    def param_sha256(self) -> str:
        """sha256 over every registered module's state_dict tensors (exact)."""
        from .state import local

        h = hashlib.sha256()
        for name, m in sorted(((n, o) for n, o in self.objs.items()
                               if isinstance(o, torch.nn.Module)), key=lambda x: x[0]):
            for k, t in m.state_dict().items():
                t = local(t)  # FSDP2: this rank's shard
                h.update(f"{name}.{k}".encode())
                # reshape: a 0-dim tensor (BatchNorm's num_batches_tracked) has no byte view
                h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                         .numpy().tobytes())
        return h.hexdigest()

    # ------------------------------------------------------------------ copies
    def snapshot(self, reuse: Any = None, non_blocking: bool = False) -> Any:
        """A copy of the committed state (FlatState), with what a recipient restores too.
        CUDA state goes to pinned host memory: a second full copy of model + optimizer on
        the GPU would cost what the user's batch needs (issue 19). ``reuse``: an older copy
        whose buffers are written over (the verifier's: no allocation per verification)."""
        from .state import snapshot

        return snapshot(self.objs, self._extra(), to_host=True, reuse=reuse,
                        non_blocking=non_blocking)

    def describe(self) -> Any:
        """The committed state by reference (a ``TensorState`` of the live tensors): what a
        source sends from, with no copy. Valid until the state next changes."""
        from .state import describe

        return describe(self.objs, self._extra())

    def shared(self) -> Any:
        """The committed state as a stream sends it while training goes on (a spare's first
        state): ``describe()``'s live tensors, which only the update and a restore change
        (``before_change`` holds them back until the stream sent them), except the module
        buffers, copied (the next forward changes them; small). No copy of the parameters
        or the optimizer state (issue 43: a snapshot made rank 0 1.5x)."""
        st = self.describe()
        bufs = {b.data_ptr() for b in self.buffers() if b.numel()}
        st.tensors = [t.clone() if t.numel() and t.data_ptr() in bufs else t
                      for t in st.tensors]
        return st

    def destinations(self, skeleton: dict[str, Any]) -> Any:
        """Where a received state's tensors go: the registered objects' own tensors where
        they fit (``state.destinations``)."""
        from .state import destinations

        return destinations(self.objs, skeleton, self.device)

    def restore(self, st: Any, default_step: int = -1) -> int:
        """Load a FlatState or TensorState (a snapshot, a transfer); returns its step."""
        if self.before_change is not None:
            self.before_change()
        self._sampler.forget()  # its views would keep the replaced tensors' storage alive
        extra = st.restore(self.objs) or {}
        self._scale_seen = None  # the scaler's state was loaded: read it again
        self.last_committed = int(extra.get("step", default_step))
        self.loss = extra.get("loss")
        self.lr_factor = float(extra.get("lr_factor", 1.0))
        self.skipped = [int(x) for x in extra.get("skipped", [])][-MAX_SKIPPED:]
        self.recent_losses = [float(x) for x in extra.get("recent_losses", [])][-SPIKE_WINDOW:]
        return self.last_committed

    def forget(self) -> None:
        """Hold no committed step (a spare whose copy stopped matching the job's)."""
        self.last_committed, self.loss, self.lr_factor = -1, None, 1.0
        self.skipped, self.recent_losses = [], []


def _once(tensors: Iterable[torch.Tensor]) -> list[Any]:
    """Each tensor once (shared between modules: tied weights), in first-seen order."""
    seen: set[int] = set()
    return [t for t in tensors if not (id(t) in seen or seen.add(id(t)))]
