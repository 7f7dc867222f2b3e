"""``Session``: the training loop's view of Ceaseless.

The session owns membership, the process group of the current generation, the gradient
all-reduce (abortable), commits, and in-process recovery with peer-to-peer state handoff.
Without ``CEASELESS_*`` variables it runs single-process, so the same script works under
plain ``python``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from opentelemetry import trace

from schemas import micro_batch_range, num_micro_batches
from schemas.batching import lr_factor_at
from schemas.messages import AgentState, InjectAction, Recovery, ReportKind, Role
from services.common import logs

from .config import FALLBACK_EXIT_CODE, AgentConfig
from .shadow_roles import END_WAIT_S, ShadowFollower, ShadowLeader, why_not
from .train_state import TrainState

log = logs.get("agent")
tracer = trace.get_tracer("ceaseless.agent")


class InjectedFault(RuntimeError):
    """Raised by an injected ``exception`` (tests and demos)."""


class JobStateLost(RuntimeError):
    """No member holds the committed state: training cannot go on."""


@dataclass
class _Incident:
    """Timestamps of one in-process recovery, for the recovery report and its spans."""

    notice: float                      # when this rank noticed (abort flag, peer error)
    last_commit: float | None
    reason: str
    generation: int = 0
    incident: str | None = None
    plan_ctx: Any = None
    t_plan: float = 0.0
    t_group: float = 0.0
    t_sync: float = 0.0
    t_data: float = 0.0
    restore_step: int = -1
    bytes_received: int = 0
    bytes_sent: int = 0
    role: str = "survivor"
    attempts: int = 1
    promoted: bool = False             # a spare entering: nothing to abort, no abort span
    planned: bool = False              # an elastic transition at a step boundary: no abort
    resumed: bool = False              # the step in flight was finished, not discarded


@dataclass
class _Stats:
    step_times: deque = field(default_factory=lambda: deque(maxlen=50))
    losses: dict[int, float] = field(default_factory=dict)
    # (step, wall time) of every commit, in order: benchmarks measure gaps from it
    commits: deque = field(default_factory=lambda: deque(maxlen=100_000))
    lost_steps: int = 0


def init(global_batch_size: int, seed: int = 0, **overrides: Any) -> "Session":
    """A started Session without a ``with`` block (no re-indented script): closed when the
    interpreter exits. ``s = agent.init(global_batch_size=64)`` is
    ``with agent.Session.from_env(64) as s:`` around the rest of the script."""
    import atexit

    s = Session.from_env(global_batch_size, seed=seed, **overrides)
    s.__enter__()
    atexit.register(s.__exit__, None, None, None)
    return s


def _refuse_foreign_launcher() -> None:
    """Without Ceaseless' environment the session runs single-process. Under torchrun (or any
    launcher that starts several ranks) that would be N independent jobs, each training the
    whole batch alone and writing the same files: refuse, saying what to run instead."""
    world = os.environ.get("WORLD_SIZE", "")
    if os.environ.get("TORCHELASTIC_RUN_ID") or (world.isdigit() and int(world) > 1):
        raise RuntimeError(
            f"this Ceaseless script runs under a launcher (WORLD_SIZE={world or '?'}, "
            f"RANK={os.environ.get('RANK', '?')}) without Ceaseless' environment: each process "
            "would train alone. Launch it with `ceaseless up -- python SCRIPT ...` (or the "
            "compose stack), not torchrun; to run one process, unset WORLD_SIZE/RANK.")


def _export_ranks(rank: int | None, world_size: int | None) -> None:
    """``RANK`` / ``WORLD_SIZE`` (and one process per pod: ``LOCAL_RANK`` 0 of 1) as
    torchrun sets them, kept true across generations; absent while not a member."""
    if rank is None:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")


def _test_absent_step(cfg: AgentConfig | None) -> int | None:
    """``CEASELESS_TEST_ABSENT=<pod>:<step>`` (with injection allowed): this pod stays out of
    that step's all-reduce while staying alive (tests of the monitor's absent-member rule)."""
    spec = os.environ.get("CEASELESS_TEST_ABSENT", "")
    if cfg is None or not cfg.allow_inject or ":" not in spec:
        return None
    pod, _, step = spec.rpartition(":")
    return int(step) if pod == cfg.pod and step.isdigit() else None


def _checkpoint_env() -> tuple[Any, str | None]:
    """``CEASELESS_CHECKPOINT_DIR`` (+ ``_EVERY``, default 200 steps, ``_KEEP``, default 3):
    rank 0 writes last-resort checkpoints there; ``CEASELESS_RESUME_FROM``: a checkpoint
    (or a directory of them: the newest) every pod starts from."""
    env = os.environ.get
    ckpt = None
    if env("CEASELESS_CHECKPOINT_DIR"):
        from .checkpoint import Checkpointer

        try:
            every = int(env("CEASELESS_CHECKPOINT_EVERY") or 200)
            keep = int(env("CEASELESS_CHECKPOINT_KEEP") or 3)
            minutes = float(env("CEASELESS_CHECKPOINT_MINUTES") or 0)
        except ValueError as e:
            raise ValueError(f"CEASELESS_CHECKPOINT_EVERY / _KEEP / _MINUTES: {e}") from None
        ckpt = Checkpointer(env("CEASELESS_CHECKPOINT_DIR"), every, keep,
                            interval_s=minutes * 60 if minutes > 0 else None)
    return ckpt, env("CEASELESS_RESUME_FROM") or None


def _seed(seed: int, step: int, k: int | str) -> None:
    """Seed torch (CPU and every CUDA device), numpy's global generator and ``random`` from
    (seed, step, k): ``k`` a micro-batch index (its samples' randomness, whichever rank
    computes it) or "step" (the start of the step: whatever the script draws before or
    between its micro-batches is the same on every rank and after any fault)."""
    h = hashlib.blake2b(f"{seed}:{step}:{k}".encode(), digest_size=8).digest()
    v = int.from_bytes(h, "little") & ((1 << 63) - 1)
    torch.manual_seed(v)
    random.seed(v)
    np.random.seed(v & 0xFFFFFFFF)


class Session:
    def __init__(self, global_batch_size: int, seed: int = 0,
                 config: AgentConfig | None = None) -> None:
        if global_batch_size <= 0:
            raise ValueError("global_batch_size must be positive")
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.cfg = config
        self.state = TrainState()               # registered objects, committed step, loss
        # Honest ranks: in a job, a pod that is not a member (a spare, a pod before its
        # first plan, a released one) has no rank. Single-process: rank 0 of 1.
        self.rank: int | None = 0 if config is None else None
        self.world_size: int | None = 1 if config is None else None
        self._joined: bool | None = None        # join()'s outcome, once known
        self.generation = 0
        self.current_step: int | None = None
        self.grad_norm: float | None = None     # of the last step(max_grad_norm=...), pre-clip
        self.skipped = False                    # the last step's update was skipped (fp16 inf/nan)
        self._sync: Any = None                  # GradSync (overlapped gradient all-reduce)
        self._batch_checked = 0                 # the generation whose batch was checked
        self._backwards_left: int | None = None  # this step's backwards still to come
        self.total: int | None = None
        self.group: Any = None
        self.runtime: Any = None
        self.stats = _Stats()
        self._micro_batch_size: int | None = None
        self._loss_acc: torch.Tensor | None = None
        self._interrupted = False
        self._incident: _Incident | None = None
        self._last_commit_time: float | None = None
        self._t_first_commit: float | None = None
        self._useful_s = 0.0                    # wall time in steps no incident interrupted
        self._seen_generation = 0
        self._pending_inject: list = []
        self._orders: dict[int, Any] = {}
        self._entered = False
        self._finished = False
        self._released = False
        self._lr_from = 1.0
        self._lr_start = 0
        self._plan: Any = None
        # shadow spares (agent/shadow.py): rank 0's streams to the spares, a spare's stream
        self._leader: Any = None    # ShadowLeader (rank 0), ShadowFollower (a spare): set
        self._follower: Any = None  # up in __enter__ (agent/shadow_roles.py)
        self._entered_in_step = False   # a resume entered the new generation, then gave up
        # a failed attempt (a resume's _enter, a timed-out all-reduce): the next wait for a
        # plan is bounded by the recovery timeout
        self._failed_attempt = False
        self._absent_at = _test_absent_step(config)
        # last-resort checkpoints (agent/checkpoint.py), from the environment in both modes
        self._ckpt, self._resume_from = _checkpoint_env()
        self._ckpt_handled: str | None = None   # the last checkpoint request answered
        self._backend_override = config.backend if config is not None else None
        if config is not None:  # the override, else gloo until a registered model says
            from .collectives import choose_backend

            config.backend = choose_backend(None, self._backend_override)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, global_batch_size: int, seed: int = 0, **overrides: Any) -> "Session":
        cfg = AgentConfig.from_env()
        if cfg is not None:
            for k, v in overrides.items():
                setattr(cfg, k, v)
        else:
            _refuse_foreign_launcher()
        return cls(global_batch_size, seed=seed, config=cfg)

    # the training state's figures, as the script reads them
    @property
    def objs(self) -> dict[str, Any]:
        return self.state.objs

    @property
    def device(self) -> torch.device:
        """Where the registered model lives (its first parameter or buffer; CPU without)."""
        return self.state.device

    @property
    def last_committed(self) -> int:
        return self.state.last_committed

    @last_committed.setter
    def last_committed(self, v: int) -> None:
        self.state.last_committed = v

    @property
    def loss(self) -> float | None:
        """The global mean loss of the last committed step."""
        return self.state.loss

    @loss.setter
    def loss(self, v: float | None) -> None:
        self.state.loss = v

    @property
    def lr_factor(self) -> float:
        return self.state.lr_factor

    @property
    def distributed(self) -> bool:
        return self.cfg is not None

    @property
    def is_member(self) -> bool:
        """True while this pod is a member of the job (has a rank); always in one process."""
        return self.rank is not None

    def _not_member(self) -> None:
        self.rank = self.world_size = None
        if self.cfg is not None:
            _export_ranks(None, None)

    @property
    def pod(self) -> str:
        return self.cfg.pod if self.cfg else "local"

    def __enter__(self) -> "Session":
        self._entered = True
        if self.cfg is not None:
            logs.configure("agent", os.environ.get("CEASELESS_LOG_LEVEL", "info"))
            try:
                from services.common import telemetry

                telemetry.init("agent", run_dir=self.cfg.run_dir, job=self.cfg.job, pod=self.cfg.pod)
            except Exception as e:
                log.warning("telemetry disabled", error=str(e)[:200])
            from .runtime import Runtime

            self.runtime = Runtime(self.cfg)
            self._leader = ShadowLeader(self.runtime, self.cfg, self.state)
            self._follower = ShadowFollower(self.runtime, self.cfg, self.state)
            self.runtime.start()
            self.runtime.update(now=True, state=AgentState.waiting)
            self._install_sigterm()
            # Import now (heartbeats already run), not on a promoted spare's critical path.
            from . import collectives, state, store  # noqa: F401
        return self

    def _install_sigterm(self) -> None:
        """SIGTERM to a pod that is not a member (a spare being released) is a clean leave:
        exit 0, no fault. A member keeps the default (it dies; the job recovers)."""
        import threading

        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the script handles SIGTERM itself, or we cannot install handlers

        def on_term(signum: int, frame: Any) -> None:
            rt = self.runtime
            if rt is not None and rt.hb.get("rank") is None and not self._finished:
                log.info("SIGTERM while not a member: leaving", pod=self.pod)
                rt.update(now=True, state=AgentState.leaving)
                raise SystemExit(0)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        signal.signal(signal.SIGTERM, on_term)

    def __exit__(self, exc_type, exc, tb) -> None:
        rt = self.runtime
        if rt is not None:
            if exc is not None and not isinstance(exc, (SystemExit, KeyboardInterrupt)):
                if rt.hb.get("state") == AgentState.done:
                    # after the loop (the job's training is done): the script's own failure,
                    # its exit code says so; not a fault to recover from
                    log.warning("exception after training finished", error=f"{exc_type.__name__}: {exc}")
                else:
                    rt.report_sync(ReportKind.exception, f"{exc_type.__name__}: {exc}")
                    rt.update(state=AgentState.leaving)
            rt.stop()
        try:
            from services.common import telemetry

            telemetry.shutdown()
        except Exception:
            pass

    def register(self, **objs: Any) -> None:
        """Register the training state: anything with ``state_dict()``/``load_state_dict()``."""
        self.state.register(**objs)
        if self.cfg is not None:
            self._resolve_backend()

    def _resolve_backend(self) -> None:
        """The job's backend follows the model (issue 19): gloo for a CPU model on any
        machine, NCCL for a CUDA model with a GPU per pod, gloo staging CUDA tensors through
        host memory when pods share a GPU; CEASELESS_BACKEND overrides. A pod that cannot
        run the chosen backend is refused here, naming the pod and the device, never left
        to hang in its first collective."""
        from .collectives import choose_backend

        dev = self.device
        backend = choose_backend(dev, self._backend_override)
        if backend == "nccl":
            if not torch.cuda.is_available():
                raise RuntimeError(
                    f"pod {self.pod}: backend nccl needs a CUDA device and this pod has none "
                    f"(model on {dev}, CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            if dev.type == "cuda":
                torch.cuda.set_device(dev)  # the group binds the model's device
        log.info("backend", backend=backend, device=str(dev), override=self._backend_override,
                 gpu_shared=os.environ.get("CEASELESS_GPU_SHARED"))
        self.cfg.backend = backend
        if self.runtime is not None:  # `ceaseless status` shows it
            gpus = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.runtime.update(device=(f"{dev} [GPU {gpus}]" if dev.type == "cuda" and gpus
                                        else str(dev))[:64])

    # ------------------------------------------------------------------ registered state
    def param_sha256(self) -> str:
        """sha256 over every registered module's state_dict tensors (exact)."""
        return self.state.param_sha256()

    # ------------------------------------------------------------------ the loop
    def steps(self, total: int, start: int | None = None) -> Iterator[int]:
        """Yield the steps this pod computes, from the last committed one on. Survives faults:
        after a recovery it continues at ``restore_step + 1``. A spare blocks until it is
        promoted and returns without yielding if the job finishes first.

        ``start``: the script restored its own checkpoint of step ``start - 1`` (model,
        optimizer, scheduler): the count, the data positions (a function of the step) and
        the learning-rate ramp continue from ``start``, not from 0."""
        if not self._entered:
            raise RuntimeError("use the session as a context manager: `with Session(...) as s:`")
        self.total = total
        self._start_at(start)
        self._resume_checkpoint()
        if not self.distributed:
            yield from self._local_steps(total)
            return
        if not self.join():
            return
        while True:
            s = self.last_committed + 1
            if s >= total:
                break
            planned = self._planned_transition(s)
            if planned is None:
                # Announce the step, then look again: a planned plan stored meanwhile is
                # either seen here or sees this step (and aborts it, runtime._adopt_plan).
                self.runtime.begin_step(s)
                planned = self._planned_transition(s)
            if planned is not None:
                self.runtime.end_step()
                if not self._transition(planned):
                    self._leave(released=self._released)
                    return
                continue
            self.current_step = s
            self._interrupted = False
            _seed(self.seed, s, "step")
            yield s
            self.runtime.end_step()
            if self._leader.generation and self.last_committed == s:
                self._leader.confirm(s)
            self._requested_checkpoint()
            if self.last_committed != s:
                if not self._interrupted:
                    raise RuntimeError("call s.step() exactly once per step")
                if self._entered_in_step:  # already in the new generation
                    self._entered_in_step = False
                    continue
                if not self._recover():
                    self._leave(released=self._released)
                    return
        self._finish()

    def _resume_checkpoint(self) -> None:
        """``CEASELESS_RESUME_FROM`` (``ceaseless up --resume``): every pod loads the
        checkpoint before its first plan; in the job's first generation rank 0's state is the
        one the members start from, as at step 0. Once: a recovery never reads it."""
        path, self._resume_from = self._resume_from, None
        if path is None or self.last_committed >= 0:
            return
        from . import checkpoint

        found = checkpoint.resolve(path)
        if found is None:
            raise FileNotFoundError(f"CEASELESS_RESUME_FROM={path}: no complete checkpoint "
                                    "there (a step-N directory with a manifest.json)")
        step = checkpoint.load(found, self.state)
        log.info("resumed from a checkpoint", path=str(found), step=step)

    def _start_at(self, start: int | None) -> None:
        if start is None:
            return
        if start < 0:
            raise ValueError(f"start must be >= 0 (got {start})")
        if self._joined is not None and self.last_committed != start - 1:
            raise RuntimeError("s.join() ran before the start step was known: pass the same "
                               "start to s.join(start=...) and s.steps(..., start=...)")
        if self.last_committed == -1:
            self.state.last_committed = start - 1  # what the script's own checkpoint holds

    def join(self, start: int | None = None) -> bool:
        """Block until this pod is a member of the job; True once it is (``s.rank`` is then
        its rank). A spare waits here, following the job, until it is promoted; False when
        the job finished (or released this pod) first: the pod is not a member, ``s.rank``
        is None and ``s.steps()`` yields nothing. ``s.steps()`` calls it; call it yourself
        before the loop for setup that needs the rank (``if s.join() and s.rank == 0:
        wandb.init(...)``). Single-process: True at once."""
        if not self._entered:
            raise RuntimeError("use the session as a context manager: `with Session(...) as s:`")
        self._start_at(start)
        self._resume_checkpoint()
        if not self.distributed:
            return True
        if self._joined is None:
            self._joined = self._recover(first=True)
            if not self._joined:
                self._leave(released=self._released)
        return self._joined

    def _planned_transition(self, s: int) -> Any:
        """A planned plan that applies from step ``s`` (or earlier: a late arrival)."""
        p = self.runtime.plan
        if p is not None and p.apply_step is not None and p.generation > self.generation \
                and s >= p.apply_step:
            return p
        return None

    def _transition(self, plan: Any) -> bool:
        """Enter ``plan`` at this step boundary: stay (a member: rebuild the group, no
        abort, nothing recomputed), go back to the spare pool, or leave (slot released).
        False when this pod leaves the job."""
        rt, pod = self.runtime, self.cfg.pod
        if plan.rank_of(pod) is not None:
            self._incident = _Incident(notice=time.time(), last_commit=self._last_commit_time,
                                       reason=f"planned: {plan.reason}"[:200], planned=True)
            return self._recover()
        log.info("leaving at a planned transition", generation=plan.generation,
                 step=self.last_committed, spare=pod in plan.spares, reason=plan.reason)
        self._close_group()
        self._not_member()
        self._seen_generation = plan.generation
        if pod in plan.spares:
            rt.update(now=True, generation=plan.generation, rank=None, role=Role.spare,
                      state=AgentState.waiting)
            self._follower.follow(plan)
            return self._recover(first=True)
        self._released = True
        return False

    def _local_steps(self, total: int) -> Iterator[int]:
        while self.last_committed + 1 < total:
            s = self.last_committed + 1
            self.current_step = s
            _seed(self.seed, s, "step")
            yield s
            if self.last_committed != s:
                raise RuntimeError("call s.step() exactly once per step")
        self._final_checkpoint()
        self._write_result()

    def batches(self, dataset: Any, micro_batch_size: int) -> Iterator[Any]:
        """This rank's share of the current step's global batch, one micro-batch at a time.
        Micro-batch ``k`` of step ``s`` holds the same samples and draws the same randomness
        whichever rank computes it."""
        if self.current_step is None:
            raise RuntimeError("batches() is called inside `for step in s.steps(...)`")
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError("s.batches() needs a map-style dataset (__len__ and __getitem__): "
                            "the samples of a step are a pure function of the step, so that "
                            "any rank can compute any micro-batch after a fault; an "
                            "IterableDataset cannot be repositioned. Use s.micro_batches(m) "
                            "and draw the samples yourself")
        order = self._order(dataset)
        for k in self.micro_batches(micro_batch_size):
            yield _collate(dataset, order.indices(self.current_step, k, micro_batch_size))

    def micro_batches(self, micro_batch_size: int) -> Iterator[int]:
        """The indices ``k`` of this rank's micro-batches of the current step (of
        ``global_batch_size / micro_batch_size``), each with the global RNGs (torch and
        CUDA, numpy, ``random``) seeded from (seed, step, k): a script that draws its own
        samples gets the same ones whichever rank computes micro-batch ``k``."""
        s = self.current_step
        if s is None:
            raise RuntimeError("micro_batches() is called inside `for step in s.steps(...)`")
        m = micro_batch_size
        M = num_micro_batches(self.global_batch_size, m)
        self._micro_batch_size = m
        abort = self.runtime.abort if self.distributed and self.runtime is not None else None
        self._check_batch(m, M)
        ks = micro_batch_range(M, self.world_size, self.rank)
        if self._backwards_left is None and self.last_committed < s:
            # the step's gradient loop (not an evaluation loop after s.step())
            self._backwards_left = len(ks)
            sync = self._grad_sync()
            if sync is not None and not ks:  # nothing to compute: the buckets are final
                sync.arm(self.group, self._solo_aware()["op_timeout_s"])
        for k in ks:
            if abort is not None and abort.is_set():
                # A newer plan: this step will be discarded anyway (s.step() sees the same
                # flag), so stop computing it now instead of finishing every micro-batch.
                return
            _seed(self.seed, s, k)
            if self.runtime is not None:
                self.runtime.progress()  # the stall watchdog: a micro-batch is progress
            yield k

    def _check_batch(self, m: int, M: int) -> None:
        """Once per generation: the plan's batch arithmetic (``ceaseless up``'s flags, which
        the scaler sizes the job by) should be this script's; say so when it is not, and
        when some ranks get no micro-batch (correct, but idle)."""
        p = self._plan
        if p is None or self._batch_checked == p.generation:
            return
        self._batch_checked = p.generation
        if (p.global_batch_size, p.micro_batch_size) != (self.global_batch_size, m):
            log.warning("the job was planned for another batch: pass the script's to "
                        "`ceaseless up` (--global-batch-size, --micro-batch-size)",
                        script=[self.global_batch_size, m],
                        plan=[p.global_batch_size, p.micro_batch_size])
        if M < self.world_size:
            log.warning("fewer micro-batches than members: some ranks compute nothing",
                        micro_batches=M, world_size=self.world_size)

    def _order(self, dataset: Any) -> Any:
        key = id(dataset)
        if key not in self._orders:
            from .order import order_for

            self._orders[key] = order_for(dataset, self.global_batch_size, self.seed)
        return self._orders[key]

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's mean loss, scaled by m / B so that the sum over all
        micro-batches of all ranks is the mean over the global batch."""
        if self._micro_batch_size is None:
            raise RuntimeError("call s.backward() on losses of micro-batches from s.batches()")
        rt = self.runtime
        if self.distributed and rt is not None and rt.abort.is_set():
            return  # a newer plan: s.step() discards this step, skip the backward's compute
        scale = self._micro_batch_size / self.global_batch_size
        scaled = loss * scale
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
                sync.arm(self.group, self._solo_aware()["op_timeout_s"])
        self.state.scale_loss(scaled).backward()  # fp16: times the GradScaler's scale
        if self.runtime is not None:
            self.runtime.progress()
        d = scaled.detach().reshape(1).to(torch.float64)
        self._loss_acc = d if self._loss_acc is None else self._loss_acc + d

    def step(self, max_grad_norm: float | None = None,
             grad_hook: Callable[[list[torch.nn.Parameter]], None] | None = None) -> bool:
        """Gradient sync, optimizer and scheduler step, commit. Returns False when the step was
        discarded because of a fault (``s.steps()`` then recovers and repeats nothing).

        On the synchronised gradient (the global batch's mean, the same on every rank):
        ``max_grad_norm`` clips it by its global L2 norm (``s.grad_norm`` holds the norm
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
        params = self.state.params()
        loss_t = self._loss_acc if self._loss_acc is not None else torch.zeros(1, dtype=torch.float64)
        if self.distributed:
            self._injections(s)
            from .collectives import Aborted, CollectiveTimeout, PeerError

            rt = self.runtime
            if self._absent_at == s:
                # Test hook (CEASELESS_TEST_ABSENT=<pod>:<step>): behave as issue 24's member
                # did, alive but out of the collective, waiting for a plan nobody sends.
                self._absent_at = None
                return self._discard("test hook: staying out of the collective")
            pre = rt.claim_collective(self.generation)
            if pre is not None:
                if not self._resume_in_place(s, pre):
                    return False
                rt.enter_collective()
            if rt.abort.is_set():
                rt.end_collective()
                return self._discard("a newer plan arrived")
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            sync = self._grad_sync()
            try:
                if sync is not None:
                    for p, g in zip(params, grads):
                        if p.grad is None:
                            p.grad = g
                    solo = self._solo_aware()
                    sync.finish(self.group, [loss_t], rt.abort, solo["op_timeout_s"],
                                slice_s=self.cfg.collective_slice,
                                timeout_s=self.cfg.collective_timeout, extend=solo["extend"])
                else:
                    self.group.allreduce_(grads + [loss_t], rt.abort,
                                          slice_s=self.cfg.collective_slice,
                                          timeout_s=self.cfg.collective_timeout,
                                          **self._solo_aware())
            except Aborted:
                return self._discard("aborted: a newer plan arrived")
            except PeerError as e:
                rt.report_sync(ReportKind.peer_error, str(e)[:500], timeout=0.5)
                if isinstance(e, CollectiveTimeout):
                    # Every peer that could fail it looked alive: the monitor's absent-member
                    # rule plans around whoever stayed out. Should no plan come, wait for one
                    # only as long as a failed attempt does, then leave: never for ever.
                    self._failed_attempt = True
                return self._discard(f"peer error: {str(e)[:200]}")
            finally:
                rt.end_collective()
            for p, g in zip(params, grads):
                if p.grad is None:
                    p.grad = g
        skip = self.state.unscale(params)  # fp16 GradScaler: unscaled; skip on inf/nan
        self.skipped = skip
        self._synced(params, max_grad_norm, grad_hook, skip)
        # what spares replay: the gradients after the clip and the hook (which may replace
        # them), taken before zero-grad drops them; only when a spare follows
        stream = self._leader is not None and self._leader.streaming
        sent = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params] \
            if stream else None
        f = self._lr_at(s)
        self.state.update(f, skip)
        self._zero_grad()
        self._commit(s, float(loss_t.item()), time.perf_counter() - t0)
        if sent is not None:
            self._leader.offer(s, sent, f, skip)
        return True

    def _synced(self, params: list[torch.nn.Parameter], max_grad_norm: float | None,
                grad_hook: Callable[[list[torch.nn.Parameter]], None] | None,
                skip: bool = False) -> None:
        """What a script does between the gradient sync and the update, done for it (not on
        a step the GradScaler skips: its gradients are not finite)."""
        self.grad_norm = None
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive (got {max_grad_norm})")
        if skip:
            self.grad_norm = math.inf if max_grad_norm is not None else None
            return
        if max_grad_norm is not None:
            with_grad = [p for p in params if p.grad is not None]
            if with_grad:
                self.grad_norm = float(torch.nn.utils.clip_grad_norm_(with_grad, max_grad_norm))
        if grad_hook is not None:
            grad_hook(params)

    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> bool:
        """Reduce ``tensor`` in place over the members (``op``: "sum" or "mean"), e.g. an
        evaluation loss. One process: unchanged (a mean over one). Abortable like the
        gradient sync: False when a fault interrupted it (the tensor is then unchanged and
        the step will be discarded by ``s.step()``); True when reduced."""
        if op not in ("sum", "mean"):
            raise ValueError(f"op must be 'sum' or 'mean' (got {op!r})")
        if not self.distributed:
            return True
        if not self.is_member or self.group is None:
            raise RuntimeError(f"pod {self.pod} is not a member: nothing to reduce with")
        from .collectives import Aborted, PeerError

        rt = self.runtime
        work = tensor.detach().clone()
        sync = self._grad_sync()
        if sync is not None and sync.armed:
            # the gradient buckets first, on every rank, whatever its share (same order)
            sync.flush(self.group, self._solo_aware()["op_timeout_s"])
        try:
            self.group.allreduce_([work], rt.abort, slice_s=self.cfg.collective_slice,
                                  timeout_s=self.cfg.collective_timeout, **self._solo_aware())
        except (Aborted, PeerError) as e:
            log.info("user all-reduce interrupted", error=str(e)[:200])
            rt.interrupt()  # no-op without a newer plan; the step is lost either way
            return False
        if op == "mean":
            work /= self.world_size
        with torch.no_grad():
            tensor.copy_(work)
        return True

    @contextlib.contextmanager
    def solo(self, max_s: float | None = None) -> Iterator[None]:
        """Work on this member alone for longer than the collective timeout (a rank-0
        evaluation, a save), without the peers failing: ``with s.solo(): evaluate()``.

        Until the block ends (at most ``max_s``; default and ceiling
        ``CEASELESS_SOLO_MAX``, 3600 s) the peers' collectives wait for this member instead
        of timing out, and the monitor does not call it absent; after the block they allow
        it the ordinary collective timeout again. A block that overruns its bound is a hang
        like any other: the member is replaced (so a real hang is never hidden for longer
        than the bound you chose). Do not call collectives (``s.all_reduce``) inside; in one
        process, and on a pod that is not a member, it does nothing."""
        limit = self.cfg.solo_max if self.cfg is not None else 3600.0
        if max_s is not None:
            if not 0 < max_s <= limit:
                raise ValueError(f"s.solo(max_s={max_s}): must be in (0, {limit:g}] s "
                                 "(the ceiling is CEASELESS_SOLO_MAX)")
            limit = max_s
        rt = self.runtime
        if not self.distributed or rt is None or not self.is_member:
            yield
            return
        g = self.generation
        until = time.time() + limit
        rt.progress()
        rt.update(now=True, solo_until=until)
        rt.put_solo(g, until)
        log.info("working alone", generation=g, step=self.last_committed, max_s=limit)
        try:
            yield
        finally:
            rt.progress()  # back: the stall watchdog counts from here, not from before
            rt.update(now=True, solo_until=None)
            rt.put_solo(g, until, ended=time.time())

    def _solo_aware(self) -> dict[str, Any]:
        """Arguments of a member's all-reduce: its wait extends while a peer works alone
        (``solo``), and the backend's own timeout outlasts the longest solo."""
        rt, g, ct = self.runtime, self.generation, self.cfg.collective_timeout
        noted: list[str] = []

        def extend() -> float | None:
            info = rt.solo_of(g)
            if not info:
                return None
            now_w, now_m = time.time(), time.monotonic()
            bound = (info["ended"] or info["until"]) + ct
            nxt = bound if info["ended"] else min(now_w + ct, bound)
            if nxt <= now_w:
                return None
            if not noted:
                noted.append(info["pod"])
                log.info("waiting for a peer that works alone", peer=info["pod"],
                         until=round(info["until"], 3), ended=info["ended"])
            return now_m + (nxt - now_w)

        return {"extend": extend, "op_timeout_s": ct + self.cfg.solo_max}

    def _resume_in_place(self, s: int, pre: Any) -> bool:
        """A fault plan arrived while this step was computed and kept our rank (prejoin.py):
        enter its generation keeping the gradients. False: the step is discarded (recovery
        then goes on the ordinary way, or is already done)."""
        rt = self.runtime
        rank, world = self.rank, self.world_size
        self._incident = _Incident(notice=min(pre.plan_at, time.time()),
                                   last_commit=self._last_commit_time, reason="resumed in place",
                                   resumed=True)
        ok = pre.wait(self.cfg.recovery_timeout)
        plan = rt.plan
        if not ok or plan is None or plan.generation != pre.generation or rt.abort.is_set():
            rt.interrupt()
            self._incident.resumed = False
            return self._discard(f"not resumed in place: {pre.why or 'a newer plan'}")
        from .collectives import Aborted, PeerError

        try:
            self._enter(plan, rt.plan_ctx, first=False, keep_grads=True)
        except (Aborted, PeerError, TimeoutError, RuntimeError) as e:
            log.warning("resuming in place failed", generation=plan.generation,
                        error=f"{type(e).__name__}: {str(e)[:300]}")
            self._close_group()
            self._failed_attempt = True  # like a failed _enter: wait for a newer plan
            return self._discard("resuming in place failed")
        if (self.last_committed, self.rank, self.world_size) != (s - 1, rank, world):
            self._entered_in_step = True  # in the new generation, but the work is stale
            return self._discard("state changed while resuming")
        log.info("step resumed in the new generation", step=s, generation=plan.generation)
        return True

    # ------------------------------------------------------------------ commit / discard
    def _lr_at(self, s: int) -> float:
        p = self._plan
        if p is None:
            return 1.0
        return lr_factor_at(s, self._lr_start, self._lr_from, p.lr_factor, p.lr_warmup_steps)

    def _zero_grad(self) -> None:
        self.state.zero_grad()
        self._loss_acc = None
        self._backwards_left = None
        if self._sync is not None:
            self._sync.disarm()

    def _grad_sync(self) -> Any:
        """The overlapped gradient sync of this member (None: off, one process, or no
        group); rebuilt when the registered parameters change."""
        if not (self.distributed and self.cfg.overlap and self.group is not None
                and self.is_member):
            return None
        params = self.state.params()
        if self._sync is None or [id(p) for p in self._sync.params] != [id(p) for p in params]:
            from .grad_sync import GradSync

            if self._sync is not None:
                self._sync.close()
            self._sync = GradSync(params, self.group.bucket_bytes)
        return self._sync

    def _discard(self, reason: str) -> bool:
        self._zero_grad()
        self._interrupted = True
        if self.runtime is not None:
            self.runtime.end_step()  # nothing left to resume in place
        if self._incident is None:
            now = time.time()
            rt = self.runtime
            # Told by a newer plan: the abort phase starts when the plan arrived, so the
            # time spent finishing the current micro-batch is in it, not in a gap.
            told = rt.abort_at if rt is not None and rt.abort.is_set() and rt.abort_at else now
            self._incident = _Incident(notice=min(now, told), last_commit=self._last_commit_time,
                                       reason=reason)
        log.info("step discarded", step=self.current_step, reason=reason)
        return False

    def _commit(self, s: int, loss: float, sync_s: float) -> None:
        now = time.time()
        if self._last_commit_time is not None and self._incident is None:
            self.stats.step_times.append(now - self._last_commit_time)
            self._useful_s += now - self._last_commit_time  # a step with no incident in it
        if self._t_first_commit is None:
            self._t_first_commit = now
        self.last_committed = s
        self.loss = loss
        self.stats.losses[s] = loss
        if self._ckpt is not None and self.rank == 0:
            self._ckpt.after_commit(s, self.state)
        if self.runtime is not None:
            self.runtime.note_commit()
        self.stats.commits.append((s, now))
        self._last_commit_time = now
        if self.runtime is not None:
            st = self.stats.step_times
            self.runtime.update(step=s, digest=self.state.digest(), state=AgentState.training,
                                loss=loss, step_time=(sorted(st)[len(st) // 2] if st else None))
            if self._incident is not None:
                self._report_recovery(now)
        self._record_metrics(now)

    def _record_metrics(self, now: float) -> None:
        try:
            from services.common import telemetry

            inst = telemetry.instruments()
            st = self.stats.step_times
            if st:
                inst.record_steps_per_second(1.0 / max(1e-9, sorted(st)[len(st) // 2]))
            wall = now - (self._t_first_commit or now)
            if wall > 0:
                inst.record_goodput(min(1.0, self._useful_s / wall))
        except Exception:  # metrics are an aid, never a reason to stop training
            pass

    # ------------------------------------------------------------------ injections
    def _injections(self, s: int) -> None:
        rt = self.runtime
        self._pending_inject.extend(rt.take_injections())
        keep = []
        for inj in self._pending_inject:
            if inj.at_step is not None and inj.at_step > s:
                keep.append(inj)
                continue
            if inj.action == InjectAction.exception:
                self._pending_inject = keep
                raise InjectedFault(f"injected exception at step {s}")
            if inj.action == InjectAction.hang:
                log.warning("injected hang: stopping this process (SIGSTOP)", step=s)
                os.kill(os.getpid(), signal.SIGSTOP)
            if inj.action == InjectAction.stall:
                # the training thread blocks for good; heartbeats go on (the runtime's thread)
                log.warning("injected stall: the training thread blocks from here", step=s)
                threading.Event().wait()
            if inj.action == InjectAction.kill:
                os.kill(os.getpid(), signal.SIGKILL)
        self._pending_inject = keep

    # ------------------------------------------------------------------ recovery
    def _recover(self, first: bool = False) -> bool:
        """Wait for a plan that includes this pod and enter its generation. Returns False
        when the job finished while this pod was not a member."""
        from .collectives import Aborted, PeerError
        from .state import StateMismatch

        rt = self.runtime
        if self._incident is None and not first:
            self._incident = _Incident(notice=time.time(), last_commit=self._last_commit_time,
                                       reason="interrupted")
        attempts = 0
        wait_s: float | None = None  # after a failed attempt: how long a newer plan may take
        if self._failed_attempt:  # resuming in place failed (same as a failed _enter)
            self._failed_attempt = False
            attempts, wait_s = 1, self.cfg.recovery_timeout
        while True:
            rt.update(now=True, state=AgentState.waiting if first else AgentState.recovering)
            plan_and_ctx = self._await_plan(wait_s)
            if plan_and_ctx == "timeout":
                # Our attempt failed but nobody planned a new generation (e.g. every peer
                # is alive): waiting longer would deadlock. Leave; the exit is a fault the
                # control plane handles (a spare takes this rank, or the world shrinks).
                rt.report_sync(ReportKind.recovery_failed,
                               f"no plan after generation {self.generation} in {wait_s:.0f}s")
                self._fallback(f"recovery attempt failed and no newer plan came in {wait_s:.0f}s")
            if plan_and_ctx is None:
                return False
            plan, ctx = plan_and_ctx
            try:
                self._enter(plan, ctx, first)
                return True
            except JobStateLost as e:
                log.error("state lost: training cannot go on", reason=str(e))
                rt.report_sync(ReportKind.recovery_failed, str(e))
                self._close_group()
                raise
            except (Aborted, PeerError, TimeoutError, RuntimeError) as e:
                attempts += 1
                kind = type(e).__name__
                log.warning("recovery attempt failed", attempt=attempts, generation=plan.generation,
                            error=f"{kind}: {str(e)[:300]}")
                self._close_group()
                if isinstance(e, StateMismatch):
                    rt.report_sync(ReportKind.digest_mismatch, str(e))
                elif isinstance(e, PeerError):  # the monitor checks who stopped heartbeating
                    rt.report_sync(ReportKind.peer_error, str(e)[:500], timeout=0.5)
                if not isinstance(e, Aborted):  # aborted = a newer plan is already here
                    wait_s = self.cfg.recovery_timeout
                if attempts >= self.cfg.max_attempts:
                    rt.report_sync(ReportKind.recovery_failed,
                                   f"{attempts} in-process attempts failed: {kind}: {e}")
                    self._fallback(f"in-process recovery failed {attempts} times ({kind}: {e})")
                if self._incident is not None:
                    self._incident.attempts += 1

    def _await_plan(self, timeout: float | None = None) -> tuple[Any, Any] | str | None:
        """The next plan that includes this pod (plan, trace context); None when the job
        finished without us; "timeout" when ``timeout`` passed with no newer plan."""
        rt = self.runtime
        deadline = None if timeout is None else time.monotonic() + timeout
        pod = self.cfg.pod
        while True:
            def ready():
                p = rt.plan
                if p is not None and p.generation > max(self.generation, self._seen_generation):
                    return ("plan", p, rt.plan_ctx)
                if rt.done is not None and (p is None or p.rank_of(pod) is None):
                    return ("done", None, None)
                return None

            def ready_or_shadow():
                got = ready()
                if got is None and self._follower.ready():
                    return ("shadow", None, None)
                return got

            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = rt.wait(ready_or_shadow, left)
            if got is None:
                return "timeout"
            kind, plan, ctx = got
            if kind == "shadow":
                self._follower.apply(1)  # one at a time: a plan is noticed between items
                continue
            if kind == "done":
                self._follower.stop(quiet=True)
                return None
            if plan.rank_of(pod) is not None:
                return plan, ctx  # a following spare drains its stream in _enter
            self._seen_generation = plan.generation
            if self.generation > 0 and pod in plan.fenced:
                # We were a member and the plan dropped us (fenced, e.g. after a hang).
                rt.report_sync(ReportKind.fenced, f"not in plan {plan.generation}")
                self._fallback(f"fenced: pod {pod} is not in plan generation {plan.generation}")
            self._not_member()
            if self.generation > 0 and pod not in plan.spares:
                # Dropped without being fenced: a planned shrink released our slot (we saw
                # the plan only after an error in the old group).
                self._released = True
                return None
            rt.update(now=True, generation=plan.generation, rank=None, role=Role.spare,
                      state=AgentState.waiting)
            self._follower.follow(plan)

    def _enter(self, plan: Any, plan_ctx: Any, first: bool, keep_grads: bool = False) -> None:
        from .collectives import Aborted, AbortableGroup, make_group_abortable
        from .state import recv_state, send_state
        from .store import NatsStore

        rt = self.runtime
        g = plan.generation
        inc = self._incident
        if inc is None and first and g > 1:
            # A spare promoted into a running job: its part starts when the plan arrived
            # (nothing to abort; its rendezvous includes noticing the plan).
            inc = self._incident = _Incident(notice=min(rt.plan_at or time.time(), time.time()),
                                             last_commit=None, reason="promoted", promoted=True)
        if inc is not None:
            inc.t_plan, inc.generation, inc.incident, inc.plan_ctx = (
                inc.notice if inc.promoted or inc.planned else time.time(), g, plan.incident,
                plan_ctx)
        rt.join(g, plan.world_size)
        self._close_group()
        self.generation = g
        self.rank = plan.rank_of(self.cfg.pod)
        self.world_size = plan.world_size
        _export_ranks(self.rank, self.world_size)
        def report() -> None:  # the broker takes this step and digest for the generation
            rt.update(now=True, generation=g, rank=self.rank, role=Role.worker,
                      step=self.last_committed, digest=self.state.digest(),
                      state=AgentState.recovering)

        # rendezvous: ranks come from the plan; the store lives on NATS
        store = NatsStore(rt.store_kv, rt.loop, prefix=f"g{g}.", timeout=self.cfg.store_timeout)
        snap: list[Any] = []
        meanwhile: Callable[[], None] | None = None
        pre = rt.take_prejoin(g)
        if pre is not None:
            pass  # the runtime reported the generation and is building the group (prejoin.py)
        elif self._follower.following:
            # A spare that followed the job: apply what already arrived (cheaper than a
            # transfer) while the peers connect, then report the step it holds.
            def meanwhile() -> None:
                self._follower.settle()
                self._follower.stop()
                report()
        else:
            report()
            # A member holding committed state (or anyone at generation 1, where rank 0 is
            # the source) is likely a source: copy the state while the peers connect.
            if self.last_committed >= 0 or g == 1:
                meanwhile = lambda: snap.append(self.state.snapshot())  # noqa: E731
        if pre is not None and (pre.rank, pre.world_size) == (self.rank, self.world_size):
            pg = pre.wait_group(rt.abort, self.cfg.collective_slice)
        else:
            if pre is not None:
                pre.drop()
            pg = make_group_abortable(store, self.rank, self.world_size, rt.abort,
                                      timeout_s=self.cfg.collective_timeout,
                                      backend=self.cfg.backend,
                                      slice_s=self.cfg.collective_slice, meanwhile=meanwhile)
        self.group = AbortableGroup(pg)
        if inc is not None:
            inc.t_group = time.time()
        # state_sync: the broker names sources and recipients
        def transfer_ready():
            if g in rt.lost:
                return ("lost", rt.lost[g])
            if g in rt.transfers:
                return ("transfer", rt.transfers[g])
            if rt.abort.is_set():
                return ("abort", None)
            return None

        got = rt.wait(transfer_ready, self.cfg.recovery_timeout)
        if got is None:
            raise TimeoutError(f"no transfer plan for generation {g} in {self.cfg.recovery_timeout}s")
        kind, val = got
        if kind == "abort":
            raise Aborted(f"plan {rt.plan.generation} superseded {g} during rendezvous")
        if kind == "lost":
            raise JobStateLost(val.reason)
        transfer, _tctx = val
        received = sent = 0
        held = None  # the committed state this rank holds as a FlatState, if it has one
        if self.rank in transfer.sources:
            st = held = recv_state(self.group, self.rank, transfer.sources[self.rank], rt.abort)
            self.state.restore(st, transfer.restore_step)
            received = st.nbytes
            if self.last_committed != transfer.restore_step:
                raise RuntimeError(f"received state of step {self.last_committed}, "
                                   f"expected {transfer.restore_step}")
        else:
            if self.last_committed != transfer.restore_step:
                raise RuntimeError(f"transfer plan restores step {transfer.restore_step} but this "
                                   f"rank holds step {self.last_committed} and receives nothing")
            mine = {r: srcs for r, srcs in transfer.sources.items() if self.rank in srcs}
            if snap:
                held = snap[0]
            if mine:
                st = held = held or self.state.snapshot()
                sent = send_state(self.group, st, self.rank, mine, rt.abort) or 0
        if not keep_grads:
            self._zero_grad()
        # the learning-rate ramp of this generation starts from the restored factor
        self._plan, self._lr_from, self._lr_start = plan, self.lr_factor, transfer.restore_step + 1
        if inc is not None:
            inc.t_sync = time.time()
            inc.restore_step = transfer.restore_step
            inc.bytes_received, inc.bytes_sent = received, sent
            inc.role = "recipient" if received else ("source" if sent else "survivor")
        if self.rank == 0 and why_not(self.cfg, self.state) is None:  # spares may ask later
            if plan.spares and held is None:
                held = self.state.snapshot()
            self._leader.lead(plan, held)
        # data_resume: the loader position is a pure function of the step
        if inc is not None:
            inc.t_data = time.time()
        rt.update(now=True, step=self.last_committed, digest=self.state.digest(),
                  state=AgentState.training)
        log.info("joined generation", generation=g, rank=self.rank, world_size=self.world_size,
                 restore_step=transfer.restore_step, received=received, sent=sent)

    def _close_group(self) -> None:
        if self._leader is not None:
            self._leader.end()
        if self.group is not None:
            try:
                self.group.close()
            except Exception:
                pass
            self.group = None

    def _report_recovery(self, first_step_end: float) -> None:
        inc, self._incident = self._incident, None
        if inc is None or self.runtime is None or not inc.t_plan:
            return
        phases = {
            # resumed: nothing was aborted; the step in flight was finished meanwhile
            ("finish_step" if inc.resumed else "abort"): max(0.0, inc.t_plan - inc.notice),
            "rendezvous": max(0.0, inc.t_group - inc.t_plan),
            "state_sync": max(0.0, inc.t_sync - inc.t_group),
            "data_resume": max(0.0, inc.t_data - inc.t_sync),
            "first_step": max(0.0, first_step_end - inc.t_data),
        }
        downtime = (first_step_end - inc.last_commit) if inc.last_commit else None
        msg = Recovery(incident=inc.incident or f"gen-{inc.generation}", generation=inc.generation,
                       pod=self.cfg.pod, rank=self.rank, phases=phases,
                       restore_step=inc.restore_step, lost_steps=0,
                       bytes_received=inc.bytes_received, downtime=downtime,
                       ts=first_step_end)
        self.runtime.publish(self.runtime.bus.subjects.recovery, msg, ctx=inc.plan_ctx)
        recover = self._trace_recovery(inc, phases, first_step_end)
        if downtime is not None:
            try:
                from services.common import telemetry

                telemetry.instruments().record_recovery(downtime, 0, role=inc.role)
            except Exception:
                pass
        with trace.use_span(recover, end_on_exit=False):  # the log line carries its trace id
            log.info("recovered", **{k: round(v, 4) for k, v in phases.items()},
                     downtime=downtime and round(downtime, 4), generation=inc.generation,
                     incident=inc.incident)

    def _trace_recovery(self, inc: _Incident, phases: dict[str, float], end: float) -> Any:
        ns = lambda t: int(t * 1e9)  # noqa: E731
        attrs = {"ceaseless.job": self.cfg.job, "ceaseless.pod": self.cfg.pod,
                 "ceaseless.rank": self.rank, "ceaseless.generation": inc.generation,
                 "ceaseless.world_size": self.world_size,
                 "ceaseless.incident": inc.incident or "",
                 "ceaseless.restore_step": inc.restore_step, "ceaseless.lost_steps": 0,
                 "ceaseless.role": inc.role}
        parent = tracer.start_span("recover", context=inc.plan_ctx, start_time=ns(inc.notice),
                                   attributes=attrs)
        pctx = trace.set_span_in_context(parent)
        t = inc.notice
        if inc.planned:
            parent.set_attribute("ceaseless.planned", True)
        for name, dur in phases.items():
            if name == "abort" and (inc.promoted or inc.planned):
                t += dur
                continue
            span = tracer.start_span(name, context=pctx, start_time=ns(t), attributes=attrs)
            if name == "state_sync":
                span.set_attribute("ceaseless.bytes", inc.bytes_received + inc.bytes_sent)
                if dur > 0:
                    span.set_attribute("ceaseless.throughput_mbps",
                                       (inc.bytes_received + inc.bytes_sent) / dur / 1e6)
            t += dur
            span.end(end_time=ns(t))
        parent.end(end_time=ns(end))
        return parent

    def _fallback(self, why: str) -> None:
        log.error("leaving: the supervisor restarts this pod as a spare", reason=why)
        print(f"ceaseless: {why}; exiting with {FALLBACK_EXIT_CODE} (restart as spare)",
              file=sys.stderr, flush=True)
        if self.runtime is not None:
            self.runtime.update(state=AgentState.leaving)
            self.runtime.stop()
        os._exit(FALLBACK_EXIT_CODE)

    # ------------------------------------------------------------------ end of job
    def _requested_checkpoint(self) -> None:
        """Rank 0, at a step boundary: `ceaseless up` asked for a checkpoint (it is being
        stopped): write the committed state now and wait for it."""
        rt, c = self.runtime, self._ckpt
        req = rt.checkpoint_request if rt is not None else None
        if c is None or req is None or req == self._ckpt_handled:
            return
        self._ckpt_handled = req
        if self.rank != 0 or self.last_committed < 0:
            return
        # `up` waits for a manifest newer than its request: start the write and go on (a
        # training-thread wait would look absent to the peers); a save still running will
        # finish after the request and do as well
        started = self.last_committed in c.saved or c.save(self.last_committed, self.state)
        log.info("checkpoint on request", step=self.last_committed, request=req,
                 started=bool(started))

    def _final_checkpoint(self) -> None:
        """At the end of the job (rank 0): the final state too, then wait for the writes."""
        c = self._ckpt
        if c is None or self.rank != 0:
            return
        c.wait(300)  # a periodic save of this very step may still be running
        if self.last_committed >= 0 and self.last_committed not in c.saved:
            c.save(self.last_committed, self.state)
        if not c.wait(300):
            log.warning("a checkpoint was still being written at exit", dir=str(c.dir))

    def _finish(self) -> None:
        self._finished = True
        self._leader.end(final=True)  # END to the spares first: they leave as the job ends
        rt = self.runtime
        rt.update(now=True, state=AgentState.done)  # (a long final write is no stall)
        self._final_checkpoint()
        rt.put_done(self.last_committed, self.generation)
        self._write_result()

    def _leave(self, released: bool = False) -> None:
        # job done: rank 0 ends the stream (END) before it reports done; wait for that
        self._follower.stop(quiet=True, drain_s=0.0 if released else END_WAIT_S)
        self._not_member()  # the user's `if s.rank == 0: save()` after the loop: not here
        if released:
            log.info("slot released by a planned shrink; leaving", step=self.last_committed,
                     generation=self._seen_generation, exit_now=self.cfg.exit_on_release)
        else:
            log.info("job finished before this pod was promoted; leaving")
        self.runtime.update(now=True, state=AgentState.done)
        if released and self.cfg.exit_on_release:
            # The slot is reclaimed: free it now (exit 0) instead of after the interpreter's
            # teardown (about 0.5 s with torch loaded), as a scheduler killing it would.
            self.runtime.stop()
            try:
                from services.common import telemetry

                telemetry.shutdown()
            except Exception:
                pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def _write_result(self) -> None:
        run_dir = self.cfg.run_dir if self.cfg else os.environ.get("CEASELESS_RUN_DIR")
        if not run_dir:
            return
        out = Path(run_dir) / "results"
        out.mkdir(parents=True, exist_ok=True)
        res = {"pod": self.pod, "rank": self.rank, "generation": self.generation,
               "world_size": self.world_size, "final_step": self.last_committed,
               "param_sha256": self.param_sha256(),
               "losses": {str(k): v for k, v in sorted(self.stats.losses.items())},
               "commits": [[k, round(t, 6)] for k, t in self.stats.commits]}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            res["cuda_max_memory_allocated"] = torch.cuda.max_memory_allocated()
        if os.environ.get("CEASELESS_SAVE_PARAMS") == "1":  # exact values, for comparisons
            params = {f"{n}.{k}": t.detach().cpu().clone()
                      for n, o in sorted(self.objs.items()) if isinstance(o, torch.nn.Module)
                      for k, t in o.state_dict().items()}
            tmp_pt = out / f".{self.pod}.pt.tmp"
            torch.save(params, tmp_pt)
            tmp_pt.replace(out / f"{self.pod}.pt")
        tmp = out / f".{self.pod}.json.tmp"
        tmp.write_text(json.dumps(res))
        tmp.replace(out / f"{self.pod}.json")


def _collate(dataset: Any, idx: Any) -> Any:
    fast = getattr(dataset, "batch", None)
    if callable(fast):
        return fast(idx)
    from torch.utils.data import default_collate

    return default_collate([dataset[int(i)] for i in idx])
