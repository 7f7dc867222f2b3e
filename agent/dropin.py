"""The machinery behind ``agent.ddp`` (the DDP drop-in): one ``DropIn`` per process.

It drives the same parts as ``Session.steps`` / ``Session.step`` (membership, the runtime's
step life, the stepper's abortable gradient reduction, the commit), from the points a DDP
script already has: the wrapped model's forward (micro-batch accounting, seeding, arming the
overlapped all-reduce on the micro-batch whose backward synchronises), the end of that
backward (autograd's final callback: wait for the sums, divide by the world size as DDP
does), the optimizer's step (a global pre-hook: the update of a discarded step is skipped)
and ``iteration(i)`` (the step boundary: commit, or recover and give the same step again).
"""

from __future__ import annotations

import copy
import gc
import sys
import warnings
from typing import Any

import torch

from plumbing import logs

from .closing import ExitCloser
from .seeding import seed_all
from .vocab import DISCARDED

log = logs.get("agent")
DATA_STREAM = 1 << 62  # micro_seed indices of the data seeds; a forward's are below


class DropIn:
    def __init__(self, s: Any, rank: int, world_size: int) -> None:
        self.s, self.rank, self.world_size = s, rank, world_size
        self.extra: dict[str, Any] = {}       # agent.ddp.register(...)
        self.module: torch.nn.Module | None = None
        self.closed = False
        # per step
        self.step: int | None = None          # what iteration() returned, until committed
        self.k = 0                            # training forwards of this step so far
        self.armed = False                    # the synchronising micro-batch ran its forward
        self.synced: bool | None = None       # the gradient sync: True done, False discarded
        self.loss_t: torch.Tensor | None = None
        self.loss = float("nan")              # the synced step's global mean loss
        self.nonfinite = False                # ... not finite: its update is skipped
        self._queued = False
        self._started = False
        # a step computed again: its first micro-batch's inputs (see _first_inputs)
        self.redo: int | None = None
        self.first: tuple[int, tuple, dict] | None = None
        self.loss_inside: bool | None = None
        self._warned_carry = False
        self.micro_batch_size: int | None = None
        # an attempt without sync or update that only draws the step's first batch again:
        # after a resume whose batch was drawn before the session knew the step, and after
        # the verifier's rollback (the script then holds a later step's batch)
        self.dry = False
        self._rng_at_attach: tuple | None = None
        self._info_sent = False
        self._opts: list[torch.optim.Optimizer] = []
        self._params: set[int] = set()        # ids of the model's parameters
        self._saved: Any = None               # small state put back after a discard
        self._hook: Any = None
        # closed by destroy_process_group, else at exit; the script's uncaught exception
        # reported at once (no "done" then), as `with Session` reports it
        self._exit = ExitCloser(self._close)

    # ------------------------------------------------------------------ set-up
    def attach(self, module: torch.nn.Module) -> None:
        """``DDP(model)``: register the model and what trains it, and join the job."""
        if self.module is not None:
            raise RuntimeError("agent.ddp: one DistributedDataParallel per process")
        _refuse_unsupported(module)
        found = discover(module, self.extra)
        s = self.s
        s.register(model=module, **found, **self.extra)
        self._opts = s.state.optimizers()
        self._params = {id(p) for p in module.parameters()}
        s._stepper.param_list = s.state.params()  # fixed at the wrap, as DDP's
        log.info("drop-in: training state registered",
                 objects={n: type(o).__name__ for n, o in s.state.objs.items()})
        if self._hook is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            self._hook = register_optimizer_step_pre_hook(self._pre_step)
        self.module = module
        if not s.join():
            self._leave()
        self._check_world()
        self._seed_data(s.last_committed + 1, 0)
        self._rng_at_attach = _rngs() if s.last_committed == -1 else None
        self._saved = self._small_state()

    def _check_world(self) -> None:
        m = self.s.m
        if (m.rank, m.world_size) != (self.rank, self.world_size):
            raise RuntimeError(
                f"the job's ranks changed (rank {self.rank} of {self.world_size} became "
                f"{m.rank} of {m.world_size}): the job shrank before rank 0 told the scaler to "
                "keep its world size (after the first step it waits for a replacement "
                "instead). A DDP script divides its batch by the world size once: start it "
                f"with `ceaseless up --min-replicas {self.world_size}`, or use the Session "
                "API (agent.Session) for an elastic job")

    def _leave(self) -> None:
        """Not a member any more (the job ended first, or this pod was released)."""
        self.s.m.leave()
        self.closed = True
        self.s.__exit__(None, None, None)
        sys.exit(0)

    # ------------------------------------------------------------------ the step boundary
    def iteration(self, i: int) -> int:
        s = self.s
        m, rt = s.m, s.runtime
        if self.module is None:
            raise RuntimeError("wrap the model (model = DDP(model)) before the training loop")
        if self.step is not None:
            self._end_step()
        elif not self._started and s.last_committed == -1 and i > 0:
            # the script restored its own checkpoint: step i - 1 is committed
            s.state.last_committed = i - 1
            rt.update(now=True, step=i - 1, digest=s.state.digests.note(i - 1, s.state.digest()))
            self.dry = self._rng_at_attach is not None and _rngs() != self._rng_at_attach
            if self.dry:
                log.info("resumed from the script's checkpoint with a batch drawn before the "
                         "loop: step computed once without its update, to draw that batch "
                         "from the step's own seed", step=i)
        first, self._rng_at_attach, self._started = not self._started, None, True
        while True:
            t = s.last_committed + 1
            planned = m.planned_transition(t)
            if planned is None:
                rt.begin_step(t)  # then look again (as Session.steps does)
                planned = m.planned_transition(t)
            if planned is None:
                break
            rt.end_step()
            if not m.transition(planned):
                self._leave()
            self._check_world()
        if first:  # a discarded (or dry) first attempt puts back the state the loop starts
            # from, not DDP(model)'s: Lightning loads ckpt_path's LR schedulers after the wrap
            self._saved = self._small_state()
        self.step, self.k, self.armed, self.synced, self.loss_t = t, 0, False, None, None
        self.nonfinite = False
        s.current_step = t
        seed_all(s.seed, t, None)
        return t

    def _end_step(self) -> None:
        s, t = self.s, self.step
        m, rt = s.m, s.runtime
        self.step = None
        if self.dry:
            self.dry = False
            rt.end_step()
            self._put_back()
            return
        if self.synced:
            s._commit(t, self.loss, 0.0, self.nonfinite)  # verified there, every N steps
            rt.end_step()
            self.redo = None
            if s.last_committed != t:
                # the verifier rolled the state back to its copy: the steps after it are
                # computed again, the first dry (the script holds a later step's batch)
                self.dry = True
                log.info("steps after the verified copy computed again; the first without "
                         "its update, to draw its batch", step=s.last_committed + 1)
            self._saved = self._small_state()
            self._script_info()
            s._ckpt.on_request(rt.checkpoint_request, s.rank, s.state)
            return
        rt.end_step()
        if m.phase not in DISCARDED:
            raise RuntimeError(
                f"step {t} ended without a gradient sync: the last micro-batch's backward "
                "must run with model.require_backward_grad_sync = True (outside no_sync()), "
                "once per iteration")
        self._put_back()
        self.redo = t
        if not m.after_discard():
            self._leave()
        self._check_world()

    # ------------------------------------------------------------------ forward / backward
    def forward(self, wrapper: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        module = self.module
        if not (torch.is_grad_enabled() and module.training):  # Lightning: eval() the module
            return module(*args, **kwargs)  # evaluation: not a micro-batch
        t = self.step
        if t is None:
            raise RuntimeError("a training forward outside a step: the loop's condition calls "
                               "dist.iteration(iter_num) (`while (iter_num := "
                               "dist.iteration(iter_num)) < max_iters:`)")
        if self.armed:
            raise RuntimeError("a training forward after the micro-batch whose backward "
                               "synchronises the gradients: set model.require_backward_grad_sync "
                               "= True on the last micro-batch only (or use no_sync())")
        j, self.k = self.k, self.k + 1
        if j == 0:
            args, kwargs = self._first_inputs(t, args, kwargs)
        rt = self.s.runtime
        rt.progress()  # the stall watchdog: a micro-batch is progress
        last = bool(wrapper.require_backward_grad_sync)
        if last:
            self._arm()
        seed_all(self.s.seed, t, (self.rank << 32) | j)
        out = module(*args, **kwargs)
        loss = _loss_of(out)
        if j == 0:
            self.loss_inside = loss is not None
        if loss is not None:
            d = loss.detach().reshape(1).to(torch.float64)
            self.loss_t = d if self.loss_t is None else self.loss_t + d
        if last:
            for o in _tensors(out):
                if o.requires_grad:
                    o.register_hook(self._queue_end)
        # the next micro-batch's data (the next step's first after the synchronising one;
        # after a dry attempt's, this step's first again)
        self._seed_data(t + (not self.dry), 0) if last else self._seed_data(t, j + 1)
        return out

    def _arm(self) -> None:
        self.armed = True
        st, m = self.s._stepper, self.s.m
        st.zero_on_discard = False
        if self.s.runtime.abort.is_set() or self.dry:
            return  # a newer plan: the sync will discard the step; a dry attempt: no sync
        sync = st._grad_sync()
        if sync is not None:
            sync.arm(m.group, st.collective_args()["op_timeout_s"], ahead=True)

    def _queue_end(self, grad: torch.Tensor) -> None:
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        """End of the synchronising backward: the gradients become the mean over the ranks
        (or the step is discarded: a fault; ``iteration`` then recovers)."""
        self._queued = False
        if self.synced is not None or self.step is None:
            return
        if self.dry:  # no gradient sync, no update: the attempt only draws the next batch
            self.synced = False
            return
        s = self.s
        params = s._stepper.params()
        dev = params[0].device if params else torch.device("cpu")
        loss_t = self.loss_t if self.loss_t is not None else torch.zeros(1, dtype=torch.float64,
                                                                         device=dev)
        st = s._stepper
        red = st._sync_gradients(self.step, params, loss_t)
        if red is not None:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, float(self.world_size))
            # the step's one host sync; a loss that is not finite skips the update on every
            # rank alike (the optimizer pre-hook), as the Session's guard does
            self.loss = st.read_loss(self.step, red) / (max(1, self.k) * self.world_size)
            if self.loss_t is None:  # the forward returns no loss: nothing to show
                self.loss = float("nan")
            else:
                st.guard(self.step, self.loss)  # the loss-spike guard
            self.nonfinite = st.nonfinite is not None
        self.synced = red is not None

    # ------------------------------------------------------------------ the update
    def _pre_step(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.module is None or self.closed:
            return
        if not any(opt is o for o in self._opts):
            if not self._over_model(opt):
                return  # another model's optimizer (a probe, a discriminator): not ours
            raise RuntimeError(
                f"{type(opt).__name__}.step(): this optimizer updates the model's parameters "
                "but is not part of the training state (created after the model was "
                "wrapped), so a replacement would not get its state: create it before "
                "DDP(model), or agent.ddp.register(name=optimizer) before")
        if self.synced and not self.nonfinite:
            self.s._stepper.verify.before_update()  # CUDA: the verified copy is complete
            return
        if self.step is not None and self.synced is None and self.s.m.phase not in DISCARDED:
            raise RuntimeError("optimizer.step() before the gradients were synchronised: the "
                               "last micro-batch's backward runs with "
                               "model.require_backward_grad_sync = True")
        for g in opt.param_groups:  # discarded or not finite: no update (None is skipped)
            for p in g["params"]:
                p.grad = None

    def _over_model(self, opt: torch.optim.Optimizer) -> bool:
        return any(id(p) in self._params for g in opt.param_groups for p in g["params"])

    def _small_state(self) -> Any:
        """What the script changes after the update of a step that may still be discarded:
        the GradScaler's scale and growth tracker (device tensors, no sync), the schedulers'
        state and the optimizers' hyper-parameters."""
        objs = self.s.state.objs.values()
        scalers = [(o, o._scale.clone() if o._scale is not None else None,
                    o._growth_tracker.clone() if o._growth_tracker is not None else None)
                   for o in objs if isinstance(o, torch.amp.GradScaler) and o.is_enabled()]
        scheds = [(o, copy.deepcopy(o.state_dict())) for o in self.s.state.schedulers()]
        hypers = [(g, {k: v for k, v in g.items() if k != "params"})
                  for o in self._opts for g in o.param_groups]
        return scalers, scheds, hypers

    def _put_back(self) -> None:
        scalers, scheds, hypers = self._saved or ([], [], [])
        for o, scale, tracker in scalers:
            if scale is not None and o._scale is not None:
                o._scale.copy_(scale)
            if tracker is not None and o._growth_tracker is not None:
                o._growth_tracker.copy_(tracker)
            o._per_optimizer_states.clear()
        for o, sd in scheds:
            o.load_state_dict(copy.deepcopy(sd))
        for g, h in hypers:
            g.update(h)

    # ------------------------------------------------------------------ randomness, inputs
    def _seed_data(self, step: int, j: int) -> None:
        seed_all(self.s.seed, step, DATA_STREAM | (self.rank << 32) | j)

    def _first_inputs(self, t: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The first micro-batch of a step computed again must be the step's own, not one a
        prefetching script drew in the failed attempt for the next step."""
        rec = self.first
        if self.redo == t and rec is not None and rec[0] == t and \
                not _same((args, kwargs), (rec[1], rec[2])):
            if not self.loss_inside:
                raise RuntimeError(
                    f"step {t} is computed again after a fault, but the script passed a first "
                    "micro-batch drawn in the failed attempt (a batch carried across steps: a "
                    "prefetch), and its model does not compute the loss, so the step's own "
                    "batch cannot be put back. Draw each micro-batch inside the step, or "
                    "return the loss from the model's forward (docs/porting.md)")
            if not self._warned_carry:
                self._warned_carry = True
                log.warning("a step computed again: its first micro-batch is the one the "
                            "failed attempt used, not the batch the script carried over",
                            step=t)
            args, kwargs = rec[1], rec[2]
        self.first = (t, args, kwargs)
        if self.micro_batch_size is None:
            x = next(iter(_tensors((args, kwargs))), None)
            self.micro_batch_size = int(x.shape[0]) if x is not None and x.dim() else 1
        return args, kwargs

    def _script_info(self) -> None:
        """Rank 0, after its first commit: the script's batch (KV ``script``)."""
        if self._info_sent or self.rank != 0:
            return
        self._info_sent = True
        from schemas.policy import SCRIPT_KEY, ScriptInfo

        mb = self.micro_batch_size or 1
        info = ScriptInfo(global_batch_size=mb * max(1, self.k) * self.world_size,
                          micro_batch_size=mb, pod=self.s.pod,
                          fixed_world_size=self.world_size)
        try:
            self.s.runtime.kv.put(SCRIPT_KEY, info.model_dump_json(exclude_none=True).encode())
        except Exception as e:  # informational: never fail a step on it
            log.warning("could not publish the script's batch", error=str(e)[:200])

    # ------------------------------------------------------------------ the end
    def close(self) -> None:
        """``destroy_process_group``: the last step committed and the job done; the session
        closed (at exit, or with the script's uncaught exception, ``_close`` is called)."""
        self._exit.close_now()

    def _close(self, *exc: Any) -> None:
        if self.closed:  # left (released, or the job ended before this pod was needed)
            return
        self.closed = True
        s, failed = self.s, exc[1] is not None
        try:
            if self.step is not None and not failed:
                if self.synced:
                    t = self.step
                    self.step = None
                    # the script left its loop: a rollback could not be computed again
                    s._stepper.verify.every, s._stepper.verify.on_nonfinite = 0, "skip"
                    s._commit(t, self.loss, 0.0, self.nonfinite)
                elif self.k:
                    log.error("the last step was discarded after the script left its loop: "
                              "call dist.iteration() in the loop's condition", step=self.step)
            s.runtime.end_step()
            if self.module is not None and s.m.is_member and not failed:
                s.m.finish()
                s._ckpt.final(s.rank, s.state)
                s.m.announce_done()
                s._write_result()
        finally:
            if self._hook is not None:
                self._hook.remove()
            s.__exit__(*exc)


def discover(module: torch.nn.Module, given: dict[str, Any]) -> dict[str, Any]:
    """The optimizers over ``module``'s parameters, the enabled GradScaler and the LR
    schedulers of those optimizers, as the script holds them (one pass over the objects the
    garbage collector tracks, once per process), minus what was registered by hand."""
    params, mine = {id(p) for p in module.parameters()}, {id(o) for o in given.values()}
    opts, scalers, scheds = [], [], []
    kinds = (torch.optim.Optimizer, torch.amp.GradScaler, torch.optim.lr_scheduler.LRScheduler)
    # only the candidates kept: a pair per object (~400k) set off gc passes, 0.7 s a start
    with warnings.catch_warnings():  # isinstance on deprecated torch aliases warns
        warnings.simplefilter("ignore")
        candidates = [o for o in gc.get_objects() if isinstance(o, kinds)]
    for o in candidates:
        if id(o) in mine:
            continue
        if isinstance(o, torch.optim.Optimizer):
            if isinstance(getattr(o, "optimizer", None), torch.optim.Optimizer):
                continue  # a wrapper (Accelerate's): the optimizer it wraps is the state
            if any(id(p) in params for g in o.param_groups for p in g["params"]):
                opts.append(o)
        elif isinstance(o, torch.amp.GradScaler):
            if o.is_enabled():
                scalers.append(o)
        elif isinstance(o, torch.optim.lr_scheduler.LRScheduler):
            scheds.append(o)
    if len(scalers) > 1:
        raise RuntimeError("more than one enabled GradScaler: register the one that trains "
                           "this model with agent.ddp.register(scaler=...)")
    found: dict[str, Any] = {}
    for i, o in enumerate(opts):
        found["optimizer" if i == 0 else f"optimizer{i}"] = o
    if scalers:
        found["scaler"] = scalers[0]
    for i, o in enumerate(x for x in scheds if any(x.optimizer is o for o in opts)):
        found["scheduler" if i == 0 else f"scheduler{i}"] = o
    return found


def _refuse_unsupported(module: torch.nn.Module) -> None:
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            raise NotImplementedError(
                f"agent.ddp: {name or 'the model'} is a {type(m).__name__}: its running "
                "statistics differ per rank (DDP broadcasts rank 0's every forward); the "
                "drop-in does not yet. Use the Session API or a normalisation without "
                "running statistics (LayerNorm, GroupNorm)")


def _rngs() -> tuple:
    """The host RNGs' states (torch's CPU generator, numpy's global one, ``random``): which
    of them the script drew from between two points. Once per process, at a resume."""
    import random

    import numpy as np

    np_state = np.random.get_state()
    return (torch.get_rng_state().numpy().tobytes(), np_state[1].tobytes(), np_state[2],
            random.getstate())


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def _loss_of(out: Any) -> torch.Tensor | None:
    """The loss a forward returned: a 0-dim floating tensor (alone, in a tuple, ``loss`` of
    a dict or an output object), else None."""
    def scalar(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()

    if scalar(out):
        return out
    if isinstance(out, (list, tuple)):
        return next((t for t in out if scalar(t)), None)
    cand = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    return cand if scalar(cand) else None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a is b or (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                          and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


