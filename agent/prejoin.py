"""Joining the next generation while the current step is still being computed.

When a fault plan arrives while this pod computes a step, keeps its rank and world size,
and a spare takes the failed rank, the survivors' work on that step is still good: the
gradients they are accumulating come from the committed state, and the failed rank's
micro-batches can be computed by its replacement (a micro-batch holds the same samples and
randomness whichever rank computes it). So instead of aborting, the runtime starts a
``Prejoin`` in a helper thread: it heartbeats the new generation (the state broker needs
every member's report), builds the new process group, and waits for the broker's transfer
plan. If the restore step is the one this pod holds and this pod is not a recipient, the
training thread finishes its micro-batches and, at its collective, enters the new
generation keeping its gradients: it sends the committed state to the promoted spare if the
broker named it a source (its parameters and optimizer state are still the committed step's:
nothing changes them before the update; a spare that followed the job, ``agent/shadow.py``,
needs nothing), then all-reduces in the new group: the survivors lose nothing. Otherwise the
prejoin sets the abort flag and recovery goes the ordinary way (with the group already
built). Building that group gives up only for a plan newer than its own (``_Superseded``),
not for the step's abort flag, which a failed collective of the old generation (the
script's own all-reduce) may set meanwhile.

All of resuming in place lives here: whether a plan qualifies (``can_resume``, asked by
``membership.plan_arrival``), the background join (``Prejoin``), and the training thread's
side at the end of its step (``resume_in_place``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from schemas.messages import AgentState, Plan, Role
from plumbing import logs

from .collectives import Aborted, _park, make_group_abortable
from .ports import PrejoinRuntime, Resumer

log = logs.get("agent")


class _Superseded:
    """``is_set()`` once a plan newer than ``generation`` arrived (what a prejoin's build
    gives up for)."""

    def __init__(self, rt: PrejoinRuntime, generation: int) -> None:
        self._rt, self._g = rt, generation

    def is_set(self) -> bool:
        p = self._rt.plan
        return p is not None and p.generation > self._g


class Prejoin:
    def __init__(self, rt: PrejoinRuntime, plan: Plan, rank: int, step: int,
                 digest: str | Callable[[], str], backend: str) -> None:
        self.generation = plan.generation
        self.plan_at = rt.plan_at
        self.rank, self.world_size, self.step = rank, plan.world_size, step
        self.group_ready = threading.Event()  # the group is built (or failed)
        self.done = threading.Event()         # and the transfer plan is known (or failed)
        self.pg: Any = None
        self.error: BaseException | None = None
        self.resumable = False
        self.why = ""
        self._rt, self._digest, self._backend = rt, digest, backend
        self._dropped = False
        threading.Thread(target=self._run, name=f"prejoin-g{plan.generation}",
                         daemon=True).start()

    def _run(self) -> None:
        rt, cfg, g = self._rt, self._rt.cfg, self.generation
        try:
            d = self._digest() if callable(self._digest) else self._digest
            rt.update(now=True, generation=g, rank=self.rank, role=Role.worker, step=self.step,
                      digest=d, state=AgentState.recovering)
            store = rt.stores.rendezvous(f"g{g}.")
            # Not the step's abort flag: a failed collective of the old generation (the
            # script's own all-reduce) sets it, and this group is for the new plan; only a
            # plan newer than this one makes building it pointless.
            self.pg = make_group_abortable(store, self.rank, self.world_size,
                                           _Superseded(rt, g),
                                           timeout_s=cfg.collective_timeout, backend=self._backend,
                                           slice_s=cfg.collective_slice)
        except BaseException as e:  # noqa: BLE001 -- handed to the training thread
            self.error = e
        finally:
            self.group_ready.set()
            if self._dropped:
                self._park()
        try:
            if self.error is None:
                got = rt.wait_transfer(g, cfg.recovery_timeout)
                t = got.transfer if got is not None else None
                if t is None:
                    self.why = "no transfer plan" if not got else "aborted or state lost"
                elif t.restore_step != self.step:
                    self.why = f"the job restores step {t.restore_step}, not {self.step}"
                elif self.rank in t.sources:
                    self.why = "this rank needs the state first"
                else:
                    self.resumable = True
            else:
                self.why = f"{type(self.error).__name__}: {str(self.error)[:200]}"
        finally:
            if not self.resumable:
                rt.interrupt()  # stop the step: recover the ordinary way
            self.done.set()
            rt.notify()

    def drop(self) -> None:
        """Nobody will use this group: park it (now or once built), not destroyed here (the
        destructor would join threads stuck on a dead peer): ``reap`` frees it."""
        self._dropped = True
        if self.group_ready.is_set():
            self._park()

    def _park(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            _park(pg)

    def wait_group(self, abort: threading.Event, slice_s: float) -> Any:
        """The built process group (raises what building it raised; Aborted on ``abort``)."""
        while not self.group_ready.wait(slice_s):
            if abort.is_set():
                raise Aborted("rendezvous abandoned: abort requested")
        if self.error is not None:
            raise self.error
        return self.pg

    def wait(self, timeout: float) -> bool:
        """Training thread, at the end of its step: True if it may all-reduce in the new
        group what it computed."""
        if not self.done.wait(timeout):
            self.why = f"no transfer plan in {timeout:.0f}s"
            return False
        return self.resumable


def resume_in_place(m: Resumer, s: int, pre: Prejoin) -> bool:
    """Training thread, at the collective of step ``s``: a fault plan arrived while the
    step was computed and kept our rank (``pre``); enter its generation keeping the
    gradients. False: the step is discarded (``m.discard``; recovery then goes on the
    ordinary way, or the pod is already in the new generation and repeats the step)."""
    from .collectives import Aborted, PeerError
    from .handoff import enter
    from .vocab import Phase

    rt, cfg = m.rt, m.cfg
    rank, world = m.rank, m.world_size
    m.timeline.incident = None  # this incident starts here (as the step does)
    inc = m.timeline.open("resumed in place", notice=min(pre.plan_at, time.time()),
                          resumed=True)
    ok = pre.wait(cfg.recovery_timeout)
    newest = m.newest_plan()
    plan = newest.plan if newest is not None else None
    if not ok or plan is None or plan.generation != pre.generation or rt.abort.is_set():
        rt.interrupt()
        inc.resumed = False
        return m.discard(f"not resumed in place: {pre.why or 'a newer plan'}")
    try:
        enter(m, plan, newest.ctx, first=False, keep_grads=True)
    except (Aborted, PeerError, TimeoutError, RuntimeError) as e:
        log.warning("resuming in place failed", generation=plan.generation,
                    error=f"{type(e).__name__}: {str(e)[:300]}")
        m.close_group()
        # like a failed attempt at entering: the wait for a newer plan is bounded
        return m.discard("resuming in place failed", Phase.FAILED)
    if (m.state.last_committed, m.rank, m.world_size) != (s - 1, rank, world):
        return m.discard("state changed while resuming", Phase.REDO)  # in, but stale
    log.info("step resumed in the new generation", step=s, generation=plan.generation)
    return True
