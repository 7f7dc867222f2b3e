"""One step's gradient work, between the script's backward passes and the commit.

The micro-batch accounting (the loss scaled by m / B, backwards counted so that the
overlapped sync arms on this rank's last one), the gradient all-reduce of a member
(a strategy chosen per generation, ``reduction.py``: overlapped ``GradSync``, one fused
call, or sharded; abortable; a fault plan may resume it in the new group, ``prejoin.py``),
then what a script does before ``optimizer.step()`` (fp16 unscale and skip, global-norm
clip, the user's hook) and the update. The commit itself is
the session's. In one process the all-reduce is skipped and the rest is the same.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Any, Callable

import torch

from schemas.messages import ReportKind
from plumbing import logs

from .config import AgentConfig
from .ports import Faults, StepMember, StepRuntime
from .reduction import Reduction, choose
from .train_state import TrainState
from .vocab import Phase

log = logs.get("agent")
Hook = Callable[[list[torch.nn.Parameter]], None]


class Stepper:
    def __init__(self, global_batch_size: int, state: TrainState,
                 cfg: AgentConfig | None = None, rt: StepRuntime | None = None,
                 m: StepMember | None = None, injector: Faults | None = None) -> None:
        self.B, self.state, self.cfg, self.rt, self.m = global_batch_size, state, cfg, rt, m
        self.inject = injector
        self.grad_norm: float | None = None
        self.skipped = False
        # the last step's non-finite guard: None (finite), else the ranks whose local loss was
        # not finite ([] when only the sum or the gradient's norm was)
        self.nonfinite: list[int] | None = None
        self.compute_times: deque[float] = deque(maxlen=5)  # this member's own, recent steps
        from .verify import Verifier

        self.verify = Verifier(cfg.verify_every if cfg is not None else 0,
                               cfg.on_nonfinite if cfg is not None else "skip")
        self.micro_batch_size: int | None = None
        self._plain_update: float | None = None  # this step's lr factor, if finishable
        self._norm_read = math.nan  # the clip's norm, read with the loss (read_loss)
        self._ahead_read: list[float] = []
        self._backwards_left: int | None = None  # this step's backwards still to come
        self._loss_acc: torch.Tensor | None = None
        self._sync: Any = None                   # GradSync (overlapped gradient all-reduce)
        # the gradient reduction of the joined generation (reduction.py), and what it is for
        self._reduce: Reduction | None = None
        self._reduce_for: tuple | None = None
        # the DDP drop-in: a discarded step keeps the script's gradients (its own
        # GradScaler.step needs them; the update is skipped by the drop-in's hook instead)
        self.zero_on_discard = True
        # the DDP drop-in: the parameters as of the wrap, fixed as DDP fixes them (issue 44:
        # walking the modules for them three times a step); None: the state's, every step
        self.param_list: list[torch.nn.Parameter] | None = None

    # ------------------------------------------------------------------ micro-batches
    def micro_batches(self, m: int, ks: range, gradient_loop: bool) -> None:
        """This rank computes micro-batches ``ks`` of ``m`` samples; ``gradient_loop``: the
        step's own loop (not an evaluation loop after ``s.step()``)."""
        self.micro_batch_size = m
        if gradient_loop and self.state.pending is not None:
            # a step computed anew in the generation that discarded it (no handoff came
            # between): its kept gradients would be summed into this one's
            self.zero_grad()
            if self.rt is not None:
                self.rt.update(pending_step=None)
        if gradient_loop and self._backwards_left is None:
            self._backwards_left = len(ks)
            sync = self._grad_sync()
            if sync is not None and not ks:  # nothing to compute: the buckets are final
                sync.arm(self.m.group, self.collective_args()["op_timeout_s"])

    def backward(self, loss: torch.Tensor) -> None:
        if self.micro_batch_size is None:
            raise RuntimeError("call s.backward() on losses of micro-batches from s.batches()")
        rt = self.rt
        if rt is not None and rt.abort.is_set():
            return  # a newer plan: s.step() discards this step, skip the backward's compute
        scaled = loss * (self.micro_batch_size / self.B)
        sync = self._grad_sync()
        if sync is not None and self._backwards_left is not None:
            # Counted, not told by the batch loop's position (a prefetching wrapper reads
            # one ahead): the gradients are final after this rank's last backward.
            if self._backwards_left <= 0:
                raise RuntimeError(
                    "s.backward() called more often than this rank has micro-batches: with "
                    "the gradient sync overlapped with the backward (CEASELESS_OVERLAP=1, the "
                    "default) call it once per micro-batch (add the losses first), or set "
                    "CEASELESS_OVERLAP=0")
            self._backwards_left -= 1
            if self._backwards_left == 0:  # post buckets as they fill during this one
                sync.arm(self.m.group, self.collective_args()["op_timeout_s"])
        self.state.scale_loss(scaled).backward()  # fp16: times the GradScaler's scale
        if rt is not None:
            rt.progress()
        d = scaled.detach().reshape(1).to(torch.float64)
        self._loss_acc = d if self._loss_acc is None else self._loss_acc + d

    # ------------------------------------------------------------------ the step
    def step(self, s: int, max_grad_norm: float | None, grad_hook: Hook | None,
             lr_factor: float, stream: bool) -> tuple[float, tuple | None] | None:
        """Sync, unscale, clip, hook, update, zero-grad: (the step's global loss, what spares
        replay when ``stream``: the gradients and the optimizers' hyper-parameters), or None
        when the step was discarded."""
        params = self.params()
        loss_t = self._loss_acc if self._loss_acc is not None else torch.zeros(1, dtype=torch.float64)
        # what finishing this step later needs (read only if its sync fails: _keep_pending)
        self._plain_update = lr_factor if not max_grad_norm and grad_hook is None else None
        red = self._sync_gradients(s, params, loss_t) if self.m is not None else loss_t
        if red is None:
            return None
        # read with the loss (one host sync): fp16's finite check (the gradients unscaled),
        # then the clip's norm
        finite = self.state.unscale_ahead(params)
        norm = self._norm_ahead(params, max_grad_norm)
        loss = self.read_loss(s, red, [t for t in (norm, finite) if t is not None])
        self.guard(s, loss)
        got = iter(self._ahead_read)
        self._norm_read = next(got) if norm is not None else math.nan
        skip = finite is not None and not next(got)  # fp16 GradScaler: skip on inf/nan
        if self.nonfinite is not None and not skip:
            skip = True  # not the scaler's: the guard's, on every rank alike
        self._synced(params, max_grad_norm, grad_hook, skip, norm)
        if not skip and self.grad_norm is not None and not math.isfinite(self.grad_norm):
            skip, self.nonfinite = True, []  # a finite loss, a non-finite gradient
            log.warning("non-finite gradient: the step's update is skipped on every rank",
                        step=s, grad_norm=self.grad_norm)
        self.skipped = skip
        if self._shard_failed():  # the clip's norm went over the shard group
            return None
        # what spares replay: the gradients after the clip and the hook (which may replace
        # them), taken before zero-grad drops them; only when a spare follows
        sent = ([p.grad if p.grad is not None else torch.zeros_like(p) for p in params],
                self.state.hypers()) if stream else None
        self.verify.before_update()  # the verified copy in flight (CUDA) is complete first
        self.state.update(lr_factor, skip)
        self.zero_grad()
        return loss, sent

    def read_loss(self, s: int, red: torch.Tensor, ahead: list[torch.Tensor] | None = None
                  ) -> float:
        """The step's global loss from the reduced vector (loss, then per rank a not-finite
        flag); a loss or a rank's local loss that is not finite sets ``nonfinite`` (the ranks
        whose was): the step's update is skipped, the same on every rank, since every rank
        holds the same reduced bits. ``ahead``: device scalars (the clip's norm, fp16's
        finite check) read in the same transfer, their values left in ``_ahead_read``."""
        vec, n = red.reshape(-1), red.numel()
        if ahead:  # float64 holds a float32/bf16 norm and a bool exactly
            vec = torch.cat([vec.to(torch.float64)] + [
                t.reshape(1).to(vec.device, torch.float64) for t in ahead])
        vals = vec.tolist()
        vals, self._ahead_read = vals[:n], vals[n:]
        bad = [r for r, v in enumerate(vals[1:]) if v != 0]
        self.nonfinite = None
        if bad or not math.isfinite(vals[0]):
            self.nonfinite = bad
            log.warning("non-finite loss: the step's update is skipped on every rank",
                        step=s, ranks=bad, loss=vals[0])
        return vals[0]

    def guard(self, s: int, loss: float) -> None:
        """The loss-spike guard (a loss over ``loss_spike`` x the median of the last committed
        ones), and a step skipped before that is computed again after a rollback: skipped
        again. Both read only what every rank holds alike (the reduced loss, the state)."""
        if self.nonfinite is not None:
            return
        sk = self.state.skipped
        if sk and s <= sk[-1] and s in sk:
            self.nonfinite = []
            log.warning("a skipped step computed again (after a rollback): skipped again", step=s)
            return
        spike = self.cfg.loss_spike if self.cfg is not None else 0.0
        med = self.state.loss_median() if spike else None
        if med is not None and med > 0 and loss > spike * med:
            self.nonfinite = []
            log.warning("loss spike: the step's update is skipped on every rank", step=s,
                        loss=loss, median=med, factor=spike)

    def _sync_gradients(self, s: int, params: list[torch.nn.Parameter],
                        loss_t: torch.Tensor) -> torch.Tensor | None:
        """The gradient all-reduce of a member, with the loss and one not-finite flag per
        rank (the reduced vector is returned); None: the step is discarded (a newer plan, a
        peer error, or not resumed in the new generation)."""
        from .collectives import Aborted, CollectiveTimeout, PeerError

        m, rt = self.m, self.rt
        self.inject.before_sync(rt, s)
        self.inject.flip_bit(self.state.modules())
        self._computed(rt)
        if self.inject.absent(s):
            # behave as issue 24's member did, alive but out of the collective
            return self.discard("test hook: staying out of the collective") or None
        pre = rt.claim_collective(m.generation)
        if pre is not None:
            from .prejoin import resume_in_place

            if not resume_in_place(m, s, pre):
                return self.discard(None) or None
            rt.enter_collective()
        if rt.abort.is_set():
            rt.end_collective()
            return self.discard("a newer plan arrived") or None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if self.inject.take_nan():
            for g in grads:
                g.mul_(math.nan)
            loss_t = loss_t * math.nan
        # which ranks' local loss is not finite travels with the sum (no extra collective)
        flags = torch.zeros(m.world_size, dtype=torch.float64, device=loss_t.device)
        flags[m.rank] = (~torch.isfinite(loss_t)).sum()
        loss_t = torch.cat([loss_t.reshape(-1).to(torch.float64), flags])
        reduction = self._reduction()
        args = self.collective_args()
        try:
            if not reduction.reduce(s, params, grads, loss_t, rt.abort, args):
                return None  # the shard group failed: discarded (it said why)
        except Aborted:
            self._keep_pending(s, reduction, params, grads)
            return self.discard("aborted: a newer plan arrived") or None
        except PeerError as e:
            self._keep_pending(s, reduction, params, grads)
            rt.report_sync(ReportKind.peer_error, str(e)[:500], timeout=0.5)
            # A timeout with every peer looking alive: the monitor's absent-member rule
            # plans around whoever stayed out. Should no plan come, wait for one only as
            # long as a failed attempt does, then leave: never for ever.
            return self.discard(f"peer error: {str(e)[:200]}",
                                Phase.FAILED if isinstance(e, CollectiveTimeout) else None) or None
        finally:
            rt.end_collective()
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g
        return loss_t

    def _keep_pending(self, s: int, reduction: Reduction, params: list[torch.nn.Parameter],
                      grads: list[torch.Tensor]) -> None:
        """Sharded: the step's gradients were summed across the replicas (the position
        group) and only the loss sum after it failed here: other members may have committed
        the step, and this shard position's may all be here. Keep the gradients and say so
        (``Heartbeat.pending_step``): the broker may have this member finish the step at the
        handoff (``agent/rollforward.py``) instead of losing the position's state."""
        # only a plain update can be finished without the peers (a clip's norm and an fp16
        # scaler's check are collectives, a hook's code unknown)
        if (getattr(reduction, "positioned", None) != s or self._plain_update is None
                or self.state.scaler() is not None):
            return
        for p, g in zip(params, grads):
            if p.grad is None:
                p.grad = g
        self.state.pending = (s, self._plain_update)
        self.rt.update(pending_step=s)

    def _computed(self, rt: StepRuntime) -> None:
        """This member's own compute of the step, from its start to the sync (the straggler
        rule's input; an injected slowness stretches it here)."""
        took = time.monotonic() - rt.step_began
        if self.inject.slow > 1.0:
            time.sleep(took * (self.inject.slow - 1.0))
            took *= self.inject.slow
        self.compute_times.append(took)

    def median_compute(self) -> float | None:
        ct = sorted(self.compute_times)
        return ct[len(ct) // 2] if ct else None

    def _norm_ahead(self, params: list[torch.nn.Parameter],
                    max_grad_norm: float | None) -> torch.Tensor | None:
        """The clip's global norm of the synchronised gradient, begun on the device before
        the loss is read so that one read carries both (issue 43: ``float`` of the norm after
        the read was a second host sync a step); fp16: of the gradients unscaled already
        (``unscale_ahead``). The clip then uses it: the same operations as
        ``clip_grad_norm_`` (``get_total_norm`` + ``clip_grads_with_norm_``), bitwise. None
        (the norm is taken after the read, as before): no clip; sharded or any tensor
        subclass (a DTensor's norm is a collective over the shard group); a torch without
        ``get_total_norm`` (before 2.6)."""
        if max_grad_norm is None or not max_grad_norm > 0:
            return None
        grads = [p.grad for p in params if p.grad is not None]
        if (not grads or any(type(g) is not torch.Tensor for g in grads)
                or not hasattr(torch.nn.utils, "get_total_norm")):
            return None
        return torch.nn.utils.get_total_norm(grads, 2.0)

    def _synced(self, params: list[torch.nn.Parameter], max_grad_norm: float | None,
                grad_hook: Hook | None, skip: bool = False,
                norm: torch.Tensor | None = None) -> None:
        """What a script does between the gradient sync and the update, done for it (not on
        a step the GradScaler skips: its gradients are not finite). ``norm``: the clip's
        norm taken ahead (``_norm_ahead``), its value read with the loss."""
        self.grad_norm = None
        if max_grad_norm is not None and not max_grad_norm >= 0:
            raise ValueError(f"max_grad_norm must be >= 0 (got {max_grad_norm}); 0 or None: "
                             "no clipping")
        if max_grad_norm == 0:  # nanoGPT's `grad_clip = 0.0`: clipping off
            max_grad_norm = None
        if skip:
            self.grad_norm = math.inf if max_grad_norm is not None else None
            return
        if max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            if with_grad and norm is not None:
                torch.nn.utils.clip_grads_with_norm_(with_grad, max_grad_norm, norm)
                self.grad_norm = self._norm_read
            elif with_grad:
                self.grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm))
        if grad_hook is not None:
            grad_hook(params)

    # ------------------------------------------------------------------ the script's own
    def all_reduce(self, tensor: torch.Tensor, op: str) -> bool:
        """``s.all_reduce`` of a member (the session checked the arguments)."""
        from .collectives import Aborted, PeerError

        rt, m, cfg = self.rt, self.m, self.cfg
        work = tensor.detach().clone()
        sync = self._grad_sync()
        if sync is not None and sync.armed:
            # the gradient buckets first, on every rank, whatever its share (same order)
            sync.flush(m.group, self.collective_args()["op_timeout_s"])
        try:
            m.group.allreduce_([work], rt.abort, slice_s=cfg.collective_slice,
                               timeout_s=cfg.collective_timeout, **self.collective_args())
        except (Aborted, PeerError) as e:
            log.info("user all-reduce interrupted", error=str(e)[:200])
            rt.interrupt()  # no-op without a newer plan; the step is lost either way
            return False
        if op == "mean":
            work /= m.world_size
        with torch.no_grad():
            tensor.copy_(work)
        return True

    def _shard_failed(self) -> bool:
        """Sharded: a collective of FSDP's (in the forward, backward or the clip) failed or
        was abandoned this step: the step is discarded (the shard group said why)."""
        sh = self.m.sharding if self.m is not None else None
        if sh is None or sh.group.failure is None:
            return False
        if self.rt.abort.is_set():
            self.discard("aborted: a newer plan arrived")
        else:
            self.rt.report_sync(ReportKind.peer_error, sh.group.failure[:500], timeout=0.5)
            self.discard(f"peer error in the shard group: {sh.group.failure[:200]}",
                         Phase.FAILED)
        return True

    def collective_args(self) -> dict[str, Any]:
        from .solo import collective_args

        return collective_args(self.rt, self.m.generation, self.cfg.collective_timeout,
                               self.cfg.solo_max)

    # ------------------------------------------------------------------ per-step state
    def zero_grad(self) -> None:
        self.state.zero_grad()
        self._loss_acc = None
        self._backwards_left = None
        if self._sync is not None:
            self._sync.disarm()

    def discard(self, reason: str | None, phase: Phase | None = None) -> bool:
        """The step is thrown away (None: membership already recorded why). Sharded: FSDP2's
        state of the abandoned iteration goes too (``sharded.reset_iteration``)."""
        if self.m is not None and self.m.sharding is not None:
            from .sharded import reset_iteration

            reset_iteration(self.state.modules())
        if self.zero_on_discard and self.state.pending is None:
            self.zero_grad()
        else:
            self._loss_acc = self._backwards_left = None
            if self._sync is not None:
                self._sync.disarm()
        if reason is not None:
            self.m.discard(reason, phase or Phase.INTERRUPTED)
        return False

    def _reduction(self) -> Reduction:
        """The gradient reduction of this member's generation: chosen again only when the
        generation, its group or the sharding changed (``reduction.choose``)."""
        m = self.m
        key = (m.generation, id(m.group), id(m.sharding), m.is_member)
        if self._reduce is None or self._reduce_for != key:
            self._reduce = choose(m, self.cfg, self._grad_sync, self._shard_failed,
                                  self.inject.summed)
            self._reduce_for = key
        return self._reduce

    def params(self) -> list[torch.nn.Parameter]:
        return self.param_list if self.param_list is not None else self.state.params()

    def _grad_sync(self) -> Any:
        """The overlapped gradient sync of this member (None: off, one process, or no
        group); rebuilt when the registered parameters change."""
        m = self.m
        if m is None or not self.cfg.overlap or m.group is None or not m.is_member:
            return None
        params = self.params()
        if self._sync is not None and params is self.param_list and \
                self._sync.params_of is params:
            return self._sync  # the drop-in's fixed list, the sync built for it
        if self._sync is None or [id(p) for p in self._sync.params] != [id(p) for p in params]:
            from .grad_sync import GradSync

            if self._sync is not None:
                self._sync.close()
            self._sync = GradSync(params, m.group.bucket_bytes)
        self._sync.params_of = params
        return self._sync
