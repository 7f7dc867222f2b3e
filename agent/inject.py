"""Fault injection inside the training process (tests, demos, ``ceaseless inject``).

``exception``, ``stall``, ``nan``, ``slow``, ``bitflip``, ``preempt`` (and any action with
``at_step``) arrive from the bus through the runtime (``Inbox``: each answered on
``decision``, accepted or refused with the reason) and run here, on the training thread,
before the gradient sync of their step; ``kill``/``hang`` without a step are signals the
supervisor sends. Only in jobs started with injection allowed (``ceaseless up``, not
``--no-inject``).
"""

from __future__ import annotations

import os
import signal
import threading
from schemas.messages import Decision, Heartbeat, Inject, InjectAction, Plan
from plumbing import logs

from .config import AgentConfig
from .ports import InjectRuntime

log = logs.get("agent")


def names(inj: Inject, pod: str, plan: Plan | None) -> bool:
    """``inj`` names this pod: by pod, or by its rank in the newest plan this pod holds. Not
    by the heartbeat's rank: that is set once the pod entered the plan (after rendezvous and
    handoff), and an injection sent as soon as the first plan is out named nobody (issue
    41)."""
    if inj.pod is not None:
        return inj.pod == pod
    return plan is not None and plan.pod_of(inj.rank) == pod


class Inbox:
    """The injections this pod accepted, until their step (the runtime's thread offers, the
    training thread takes: one lock). Every injection that names this pod is answered: a
    ``Decision`` (its ``request_id``) accepted or refused with the reason, never dropped."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self._lock = threading.Lock()
        self._pending: list[Inject] = []

    def offer(self, inj: Inject, plan: Plan | None, hb: Heartbeat) -> Decision | None:
        """The answer to ``inj`` (None: it is not this pod's); kept if accepted and due at a
        step (a preemption notice is the caller's, at once)."""
        if not inj.by_pod or not names(inj, self.cfg.pod, plan):
            return None
        why = self._refusal(inj, hb)
        if why is None and inj.action != InjectAction.preempt:
            with self._lock:
                self._pending.append(inj)
        rank = plan.rank_of(self.cfg.pod) if plan is not None else None
        who = self.cfg.pod if rank is None else f"{self.cfg.pod} (rank {rank})"
        when = "now" if inj.at_step is None else f"at step {inj.at_step}"
        return answer(inj, self.cfg.pod, why, f"{who} runs it {when}",
                      plan.generation if plan is not None else None)

    def _refusal(self, inj: Inject, hb: Heartbeat) -> str | None:
        if not self.cfg.allow_inject:
            return "this job does not allow injection"
        if inj.at_step is not None and inj.at_step <= hb.step:
            return f"step {inj.at_step} already passed ({self.cfg.pod} committed step {hb.step})"
        if inj.action == InjectAction.preempt and hb.rank is None:
            return f"{self.cfg.pod} is not a training member yet"
        return None

    def take(self, step: int) -> list[Inject]:
        """Training thread, before step ``step``'s sync: the injections due (their step has
        come, or none); the later ones stay."""
        due: list[Inject] = []
        keep: list[Inject] = []
        with self._lock:
            for i in self._pending:
                (due if i.at_step is None or i.at_step <= step else keep).append(i)
            self._pending = keep
        return due

    def left(self, step: int) -> list[Decision]:
        """At the pod's end: the refusal of every injection whose step never came."""
        with self._lock:
            left, self._pending = self._pending, []
        return [answer(i, self.cfg.pod, f"{self.cfg.pod} ended at step {step}, before step "
                       f"{i.at_step}", "", None) for i in left]


def answer(inj: Inject, pod: str, refusal: str | None, accepted: str,
           generation: int | None) -> Decision:
    """The injection's answer on ``decision``, logged here as well (the pod's log)."""
    if refusal is None:
        log.info("injection accepted", action=inj.action.value, at_step=inj.at_step,
                 request_id=inj.request_id)
    else:
        log.warning("injection refused", action=inj.action.value, at_step=inj.at_step,
                    reason=refusal, request_id=inj.request_id)
    return Decision(request_id=inj.request_id, accepted=refusal is None,
                    reason=f"inject {inj.action.value}: " + (refusal or accepted),
                    generation=generation, pods=[pod])


# the injections after which this process runs no more of the step: raise, block, die
_NO_RETURN = (InjectAction.exception, InjectAction.stall, InjectAction.kill)


class InjectedFault(RuntimeError):
    """Raised by an injected ``exception`` (tests and demos)."""


class Injector:
    def __init__(self, cfg: AgentConfig | None) -> None:
        self.nan_now = False  # an injected NaN for the step being synchronised
        self.slow = 1.0       # an injected slowness: each step's compute times this
        self.bitflip: str | None = None  # a parameter to flip a bit of ("": the first)
        self.absent_at = _test_absent_step(cfg)
        self.lose_sum_at = _test_step(cfg, "CEASELESS_TEST_LOSE_SUM")

    def before_sync(self, rt: InjectRuntime, s: int) -> None:
        """Run the injections due at step ``s`` (raise, stop, block or die)."""
        due = rt.take_injections(s)
        due.sort(key=lambda i: i.action in _NO_RETURN)  # what never returns comes last
        for k, inj in enumerate(due):
            if inj.at_step is not None and inj.at_step < s:  # passed while on its way
                rt.refuse_injection(inj, f"step {inj.at_step} passed before it was taken "
                                         f"(at step {s})")
                continue
            if inj.action in _NO_RETURN:
                for other in due[k + 1:]:
                    rt.refuse_injection(other, f"{inj.action.value} came first at step {s}")
            if inj.action == InjectAction.exception:
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

    def summed(self, s: int) -> None:
        """Test hook (``CEASELESS_TEST_LOSE_SUM=<pod>:<step>``), once the world's loss sum of
        step ``s`` (a sharded step's last collective) completed here: act as if it failed
        here (the result never arrived), while the other members commit the step. With a
        fault after it: a step that some members committed and some did not
        (``agent/rollforward.py``)."""
        if self.lose_sum_at == s:
            self.lose_sum_at = None
            from .vocab import PeerError

            raise PeerError(f"test hook: the loss sum of step {s} lost here")


def _test_absent_step(cfg: AgentConfig | None) -> int | None:
    return _test_step(cfg, "CEASELESS_TEST_ABSENT")


def _test_step(cfg: AgentConfig | None, var: str) -> int | None:
    """A test hook's step for this pod (``<var>=<pod>:<step>``; only with injection on)."""
    spec = os.environ.get(var, "")
    if cfg is None or not cfg.allow_inject or ":" not in spec:
        return None
    pod, _, step = spec.rpartition(":")
    return int(step) if pod == cfg.pod and step.isdigit() else None
