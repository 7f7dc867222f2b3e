"""Fault injection inside the training process (tests, demos, ``ceaseless inject``).

``exception`` and ``stall`` (and any action with ``at_step``) arrive from the bus through
the runtime and run here, on the training thread, before the gradient sync of their step;
``kill``/``hang`` without a step are signals the supervisor sends. Only in jobs started
with injection allowed (``ceaseless up --allow-inject``).
"""

from __future__ import annotations

import os
import signal
import threading
from schemas.messages import Inject, InjectAction
from plumbing import logs

from .config import AgentConfig
from .ports import InjectRuntime

log = logs.get("agent")


def accepts(inj: Inject, cfg: AgentConfig, rank: int | None) -> bool:
    """An injection this pod runs itself (the supervisor executes kill / hang / resume
    without a step: signals); refused, with a warning, unless the job allows injection."""
    if inj.action == InjectAction.resume or (
            inj.action not in (InjectAction.exception, InjectAction.stall, InjectAction.nan,
                               InjectAction.preempt, InjectAction.slow,
                               InjectAction.bitflip)
            and inj.at_step is None):
        return False
    if (inj.pod is not None and inj.pod != cfg.pod) or (inj.rank is not None and inj.rank != rank):
        return False
    if not cfg.allow_inject:
        log.warning("injection refused: this job does not allow injection",
                    action=inj.action.value)
        return False
    log.info("injection received", action=inj.action.value, at_step=inj.at_step)
    return True


class InjectedFault(RuntimeError):
    """Raised by an injected ``exception`` (tests and demos)."""


class Injector:
    def __init__(self, cfg: AgentConfig | None) -> None:
        self._pending: list[Inject] = []
        self.nan_now = False  # an injected NaN for the step being synchronised
        self.slow = 1.0       # an injected slowness: each step's compute times this
        self.bitflip: str | None = None  # a parameter to flip a bit of ("": the first)
        self.absent_at = _test_absent_step(cfg)

    def before_sync(self, rt: InjectRuntime, s: int) -> None:
        """Run the injections due at step ``s`` (raise, stop, block or die)."""
        self._pending.extend(rt.take_injections())
        keep = []
        for inj in self._pending:
            if inj.at_step is not None and inj.at_step > s:
                keep.append(inj)
                continue
            if inj.action == InjectAction.exception:
                self._pending = keep
                raise InjectedFault(f"injected exception at step {s}")
            if inj.action == InjectAction.hang:
                log.warning("injected hang: stopping this process (SIGSTOP)", step=s)
                os.kill(os.getpid(), signal.SIGSTOP)
            if inj.action == InjectAction.stall:
                # the training thread blocks for good; heartbeats go on (the runtime's thread)
                log.warning("injected stall: the training thread blocks from here", step=s)
                rt.injected_stall = True
                threading.Event().wait()
            if inj.action == InjectAction.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if inj.action == InjectAction.slow:
                self.slow = inj.factor or 2.0
                log.warning("injected slowness: each step's compute from here", step=s,
                            factor=self.slow)
            if inj.action == InjectAction.bitflip:
                self.bitflip = inj.tensor or ""
            if inj.action == InjectAction.nan:
                log.warning("injected NaN: this rank's loss and gradients of the step", step=s)
                self.nan_now = True
        self._pending = keep

    def flip_bit(self, modules: list) -> None:
        """An injected bit flip, if due: bit 20 of the first element of the named parameter
        (of the first registered module; the first parameter when unnamed): a changed value,
        still finite, that only a comparison of the replicas finds."""
        name, self.bitflip = self.bitflip, None
        if name is None or not modules:
            return
        params = dict(modules[0].named_parameters())
        p = params.get(name) if name else next(iter(params.values()), None)
        if p is None:
            log.warning("bit flip: no such parameter", tensor=name)
            return
        import torch

        wide = p.element_size() == 4  # fp32: a mantissa bit; bf16/fp16: one too
        from .state import local  # sharded: this rank's shard of it

        with torch.no_grad():
            w = local(p).detach().view(-1)[:1].view(torch.int32 if wide else torch.int16)
            w.bitwise_xor_(1 << 20 if wide else 1 << 4)
        log.warning("injected bit flip", tensor=name or "(first)")

    def take_nan(self) -> bool:
        """An injected NaN is due in this step's sync (once)."""
        due, self.nan_now = self.nan_now, False
        return due

    def absent(self, s: int) -> bool:
        """Test hook (``CEASELESS_TEST_ABSENT=<pod>:<step>``): stay out of step ``s``'s
        collective while alive, as issue 24's member did (once)."""
        if self.absent_at != s:
            return False
        self.absent_at = None
        return True


def _test_absent_step(cfg: AgentConfig | None) -> int | None:
    spec = os.environ.get("CEASELESS_TEST_ABSENT", "")
    if cfg is None or not cfg.allow_inject or ":" not in spec:
        return None
    pod, _, step = spec.rpartition(":")
    return int(step) if pod == cfg.pod and step.isdigit() else None
