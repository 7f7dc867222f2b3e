"""Membership: which generation this pod is in, as what, and every move between them.

One state machine (``Phase``) replaces the flags the session used to keep; ``_to`` is the
only place the phase changes, and it refuses a move the table does not allow.

    OUTSIDE ──recover──▶ RECOVERING ──enter──▶ MEMBER ──step discarded──▶ INTERRUPTED
                          │  ▲   │                │  │                        │
                 named spare │   └─▶ FINISHED     │  └─collective timed out─▶ FAILED
                          ▼  │       RELEASED     │                           │
                         SPARE ◀──planned, spare──┘   (both) ──recover──▶ RECOVERING
    MEMBER ──resumed in place, but the step went stale──▶ REDO ──▶ MEMBER (step again)

Where "a plan arrives during a step" is decided: ``plan_arrival`` below (the runtime's
thread calls it the moment a plan arrives; a verdict of ABORT sets the abort flag that
``Session.step`` and every collective watch, RESUME starts ``prejoin.Prejoin``), and at a
step boundary ``Session.steps`` enters a planned plan through ``transition``. Entering a
generation (rendezvous and state handoff) is ``handoff.enter``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from typing import Any

from schemas.batching import lr_factor_at
from schemas.messages import AgentState, Plan, ReportKind, Role
from plumbing import logs

from .config import FALLBACK_EXIT_CODE, AgentConfig
from .device import cuda_broken
from .handoff import enter
from .incident import Timeline
from .ports import MembershipRuntime
from .prejoin import Prejoin
from .shadow_roles import END_WAIT_S, ShadowFollower, ShadowLeader
from .train_state import TrainState
from .vocab import _MOVES, Arrival, JobStateLost, Phase

log = logs.get("agent")


def export_ranks(rank: int | None, world_size: int | None) -> None:
    """``RANK`` / ``WORLD_SIZE`` (and one process per pod: ``LOCAL_RANK`` 0 of 1) as
    torchrun sets them, kept true across generations; absent while not a member."""
    if rank is None:
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            os.environ.pop(k, None)
        return
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                      LOCAL_WORLD_SIZE="1")


class Membership:
    """This pod's place in the job (training thread only, except ``phase`` reads)."""

    def __init__(self, cfg: AgentConfig, rt: MembershipRuntime, state: TrainState, timeline: Timeline) -> None:
        self.cfg, self.rt, self.state, self.timeline = cfg, rt, state, timeline
        # The backend in use: the user's choice, else gloo until a registered model says
        # (Session.register: agent/device.py)
        from .groups import choose_backend

        self.backend: str = choose_backend(None, cfg.backend)
        # Membership decides to join ahead; the runtime's thread starts it under its lock
        # when a plan arriving during a step may be resumed in place (vocab.plan_arrival).
        # the digest of ``step`` exactly (the heartbeat's may name an older step), read on
        # the prejoin's thread: it may wait for that step's copy from the device
        rt.start_prejoin = lambda plan, rank, step, _hb_digest: Prejoin(
            rt, plan, rank, step, lambda: state.digests.of(step), self.backend)
        self.phase = Phase.OUTSIDE
        self.rank: int | None = None
        self.world_size: int | None = None
        self.generation = 0
        self.group: Any = None              # AbortableGroup of the generation
        self.plan: Plan | None = None       # the plan of the joined generation
        self.seen_generation = 0            # the newest plan seen (joined or not)
        self._newest: Arrival | None = None  # the newest plan taken from the runtime's inbox
        self._lr_from, self._lr_start = 1.0, 0
        self.sharding: Any = None           # sharded.Sharding once the position is known
        from .preempt import Preemption

        # a preemption notice (SIGTERM, `ceaseless inject preempt`) reported to the scaler
        self.preemption = Preemption(lambda kind, why: rt.submit(rt.report(kind, why)))
        rt.on_preempt = lambda deadline_s: self.preemption.notice(deadline_s, "inject")
        self._arrival: Any = None           # a plan naming this pod, seen by await_position
        self.early: Any = None              # sharded.EarlyJoin of a promoted spare
        self.leader = ShadowLeader(rt, cfg, state)      # rank 0: streams to the spares
        self.follower = ShadowFollower(rt, cfg, state)  # a spare: follows rank 0
        # the handoff found replicas that disagreed (handoff.disagreed): (the restore step,
        # this member's own corruption report or None) until the verifier rolls back
        self.diverged: tuple[int, str | None] | None = None
        # a plan named this process a spare: a later plan that fences it means it was
        # declared lost (a restarted pod gets a new id: never fenced by an old plan)
        self._named_spare = False
        self._started = time.time()  # a fence decided after this is this process's

    # ------------------------------------------------------------------ the state machine
    def _to(self, new: Phase, why: str = "") -> None:
        if new not in _MOVES[self.phase]:
            raise RuntimeError(f"membership: {self.phase.value} -> {new.value} is not a valid "
                               f"move ({why or 'no reason'}); this is a bug in Ceaseless")
        log.debug("membership", frm=self.phase.value, to=new.value, why=why)
        self.phase = new

    @property
    def is_member(self) -> bool:
        return self.rank is not None

    def _not_member(self) -> None:
        self.rank = self.world_size = None
        export_ranks(None, None)

    def lr_at(self, s: int) -> float:
        """The learning-rate factor of step ``s`` (the plan's, ramped from the restored one)."""
        p = self.plan
        if p is None:
            return 1.0
        return lr_factor_at(s, self._lr_start, self._lr_from, p.lr_factor, p.lr_warmup_steps)

    # ------------------------------------------------------------------ a step
    def discard(self, reason: str, phase: Phase = Phase.INTERRUPTED) -> bool:
        """The step in flight is thrown away (returns False, the step's outcome). ``phase``:
        INTERRUPTED (recover), FAILED (recover, the wait for a plan bounded) or REDO (already
        in the new generation: repeat the step); a stronger one already set stays."""
        if self.phase is Phase.MEMBER or (self.phase is Phase.INTERRUPTED
                                          and phase is Phase.FAILED):
            self._to(phase, reason)
        self.rt.end_step()  # nothing left to resume in place
        if self.timeline.incident is None:
            now = time.time()
            # Told by a newer plan: the abort phase starts when the plan arrived, so the
            # time spent finishing the current micro-batch is in it, not in a gap.
            told = self.rt.abort_at if self.rt.abort.is_set() and self.rt.abort_at else now
            self.timeline.open(reason, notice=min(now, told))
        log.info("step discarded", step=self.state.last_committed + 1, reason=reason)
        return False

    def after_discard(self) -> bool:
        """Back at the step boundary after a discarded step: True when this pod goes on (a
        member again), False when it leaves the loop."""
        if self.phase is Phase.REDO:  # already in the new generation
            self._to(Phase.MEMBER, "repeat the step")
            return True
        return self.recover()

    def newest_plan(self) -> Arrival | None:
        """The newest plan the runtime delivered: its inbox is consumed here, once per plan
        (the training thread's only way to a plan)."""
        for a in self.rt.take_plans():
            if self._newest is None or a.plan.generation > self._newest.plan.generation:
                self._newest = a
        return self._newest

    def planned_transition(self, s: int) -> Plan | None:
        """A planned plan that applies from step ``s`` (or earlier: a late arrival)."""
        a = self.newest_plan()
        p = a.plan if a is not None else None
        if p is not None and p.apply_step is not None and p.generation > self.generation \
                and s >= p.apply_step:
            return p
        return None

    def transition(self, plan: Plan) -> bool:
        """Enter ``plan`` at this step boundary: stay (a member: rebuild the group, no
        abort, nothing recomputed), go back to the spare pool, or leave (slot released).
        False when this pod leaves the job."""
        pod = self.cfg.pod
        if plan.rank_of(pod) is not None:
            self.timeline.open(f"planned: {plan.reason}"[:200], planned=True)
            return self.recover()
        log.info("leaving at a planned transition", generation=plan.generation,
                 step=self.state.last_committed, spare=pod in plan.spares, reason=plan.reason)
        self.close_group()
        self._not_member()
        self.seen_generation = plan.generation
        if pod in plan.spares:
            self._to(Phase.SPARE, "planned: back to the spare pool")
            self.rt.update(now=True, generation=plan.generation, rank=None, role=Role.spare,
                           state=AgentState.waiting)
            self.follower.follow(plan)
            return self.recover()
        self._to(Phase.RELEASED, "planned shrink")
        return False

    # ------------------------------------------------------------------ recovery
    def await_member(self) -> tuple[int, int] | None:
        """Block until a plan names this pod a member, without entering it yet, and return
        (rank, world size) in it: set-up that needs the rank runs before the state is
        received (a sharded model is sharded for its position; the DDP drop-in's
        ``init_process_group`` returns). None when the job finished, or released this pod,
        first. A spare waits here until promoted."""
        if self.generation > 0 and self.rank is not None:
            return self.rank, self.world_size
        if self._arrival is None:
            if self.phase is Phase.OUTSIDE:
                self._to(Phase.RECOVERING, "waiting for a rank")
            self.rt.update(now=True, state=AgentState.waiting)
            got = self._await_plan(None)
            if got is None or got.kind != "plan":
                return None
            self._arrival = got
        plan = self._arrival.plan
        return plan.rank_of(self.cfg.pod), plan.world_size

    def await_position(self) -> int | None:
        """(Sharded models) ``await_member``, as this rank's shard position: the model is
        sharded for it before the state is received."""
        if self.generation > 0 and self.rank is not None:
            return self.rank % self.cfg.shard_size
        got = self.await_member()
        if got is None:
            return None
        plan = self._arrival.plan
        if plan.shard_size != self.cfg.shard_size:
            raise RuntimeError(f"the job is planned with shard size {plan.shard_size} but this "
                               f"pod runs with {self.cfg.shard_size} (CEASELESS_SHARD_SIZE; "
                               "`ceaseless up --shard-size` sets both)")
        return plan.shard_of(got[0])

    def start_early_join(self, backend: str) -> None:
        """(Sharded) A promoted spare connects its groups while the script shards its model
        (``sharded.EarlyJoin``); not for the job's first generation, whose members may
        still restore the script's own checkpoint before they report their step."""
        a = self._arrival
        if a is None or a.plan.generation <= 1 or self.generation > 0:
            return
        from .sharded import EarlyJoin

        try:
            self.early = EarlyJoin(self, a.plan, a.plan.rank_of(self.cfg.pod), backend)
        except Exception as e:  # the ordinary way then
            log.warning("early join not started", error=str(e)[:200])

    def take_early_join(self, plan: Plan, rank: int, backend: str) -> Any:
        e, self.early = self.early, None
        if e is None:
            return None
        if (e.generation, e.rank, e.world_size, e.backend) != (
                plan.generation, rank, plan.world_size, backend):
            e.abandon()
            return None
        return e

    def recover(self) -> bool:
        """Wait for a plan that includes this pod and enter its generation (the first time:
        join the job). False when the job finished, or released this pod, first."""
        from .collectives import Aborted, PeerError
        from .incident import the_bus_failed
        from .state import StateMismatch
        from .store import StoreTimeout

        rt = self.rt
        first = self.phase in (Phase.OUTSIDE, Phase.SPARE) or (
            self.phase is Phase.RECOVERING and self.generation == 0)  # after await_position
        if self.phase in (Phase.FINISHED, Phase.RELEASED):
            return False  # (await_position saw the job end first)
        if not first:
            self.timeline.open("interrupted")
        attempts = 0
        wait_s: float | None = None  # after a failed attempt: how long a newer plan may take
        if self.phase is Phase.FAILED:  # resuming in place failed, or a collective timed out
            attempts, wait_s = 1, self.cfg.recovery_timeout
        if self.phase is not Phase.SPARE:
            self._to(Phase.RECOVERING)
        while True:
            rt.update(now=True, state=AgentState.waiting if first else AgentState.recovering)
            got, self._arrival = self._arrival or self._await_plan(wait_s), None
            if got is None:
                # Our attempt failed but nobody planned a new generation (e.g. every peer
                # is alive): waiting longer would deadlock. Leave; the exit is a fault the
                # control plane handles (a spare takes this rank, or the world shrinks).
                rt.report_sync(ReportKind.recovery_failed,
                               f"no plan after generation {self.generation} in {wait_s:.0f}s")
                self.fallback(f"recovery attempt failed and no newer plan came in {wait_s:.0f}s")
            if got.kind != "plan":
                return False  # finished or released (the phase says which)
            if not first and (why := cuda_broken(self.state.device)) is not None:
                rt.report_sync(ReportKind.recovery_failed, f"CUDA context broken: {why}")
                self.fallback(f"the CUDA context is broken after the abort ({why})")
            try:
                enter(self, got.plan, got.ctx, first)
                self._to(Phase.MEMBER, f"entered generation {got.plan.generation}")
                return True
            except JobStateLost as e:
                log.error("state lost: training cannot go on", reason=str(e))
                rt.report_sync(ReportKind.recovery_failed, str(e))
                self.close_group()
                raise
            except (Aborted, PeerError, TimeoutError, RuntimeError) as e:
                attempts += 1
                kind = type(e).__name__
                log.warning("recovery attempt failed", attempt=attempts,
                            generation=got.plan.generation, error=f"{kind}: {str(e)[:300]}",
                            at=[f"{f.name}@{os.path.basename(f.filename)}:{f.lineno}"
                                for f in traceback.extract_tb(e.__traceback__)[-4:]])
                self.close_group()
                if isinstance(e, StateMismatch):
                    rt.report_sync(ReportKind.digest_mismatch, str(e))
                elif isinstance(e, PeerError):  # the monitor checks who stopped heartbeating
                    rt.report_sync(ReportKind.peer_error, str(e)[:500], timeout=0.5)
                if not isinstance(e, Aborted):  # aborted = a newer plan is already here
                    wait_s = self.cfg.recovery_timeout
                if attempts >= self.cfg.max_attempts:
                    rt.report_sync(ReportKind.recovery_failed,
                                   f"{attempts} in-process attempts failed: {kind}: {e}")
                    self.fallback(f"in-process recovery failed {attempts} times ({kind}: {e})")
                if self.timeline.incident is not None:
                    self.timeline.incident.attempts += 1
                if self.phase is Phase.SPARE:
                    self._to(Phase.RECOVERING, "a promotion failed")
                if the_bus_failed(e) and not isinstance(e, (Aborted, StoreTimeout)):
                    # (a rendezvous that timed out waits for a peer that is gone: a newer
                    # plan's business, as before, not the bus's)
                    # the bus failed this pod, not the generation (its stream leader being
                    # elected after a host was lost: test_hosts_e2e): its peers still wait in
                    # the plan's rendezvous, so enter it again unless a newer plan is here
                    newest = self.newest_plan()
                    if newest is None or newest.plan.generation <= got.plan.generation:
                        time.sleep(min(0.5 * attempts, 2.0))
                        self._arrival = got

    def _await_plan(self, timeout: float | None) -> Arrival | None:
        """The next plan that includes this pod (an ``Arrival`` of kind "plan"); "done" or
        "released" when the job finished or released this pod first; None when ``timeout``
        passed."""

        rt, pod = self.rt, self.cfg.pod
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            after = max(self.generation, self.seen_generation)

            def ready() -> Arrival | None:
                a = self.newest_plan()
                if a is not None and a.plan.generation > after:
                    return a
                if rt.done is not None and (a is None or a.plan.rank_of(pod) is None):
                    return Arrival("done")
                return Arrival("shadow") if self.follower.ready() else None

            got = rt.wait(ready, left)
            if got is None:
                return None
            if got.kind == "shadow":
                self.follower.apply(1)  # one at a time: a plan is noticed between items
                continue
            if got.kind == "done":
                self.follower.stop(quiet=True)
                self._to(Phase.FINISHED, "the job finished without this pod")
                return got
            plan = got.plan
            if plan.rank_of(pod) is not None:
                return got  # a following spare drains its stream in handoff.enter
            self.seen_generation = plan.generation
            if pod in plan.fenced and (self.generation > 0 or self._named_spare
                                       or plan.ts > self._started):
                # We were a member (or a spare) and the plan dropped us (fenced, e.g. after
                # a hang, or a spare declared lost while its host was cut off): a replacement
                # takes our place. A spare cut off may never have seen the plan that named it
                # (it sees the newest after the heal): a fence made while this process lived
                # is its own; an older plan's is another run's history (a reused pod id).
                rt.report_sync(ReportKind.fenced, f"not in plan {plan.generation}")
                self.fallback(f"fenced: pod {pod} is not in plan generation {plan.generation}")
            self._not_member()
            if self.generation > 0 and pod not in plan.spares:
                # Dropped without being fenced: a planned shrink released our slot (we saw
                # the plan only after an error in the old group).
                self._to(Phase.RELEASED, f"not in plan {plan.generation}")
                return Arrival("released")
            self._to(Phase.SPARE, f"a spare of plan {plan.generation}")
            self._named_spare = self._named_spare or pod in plan.spares
            rt.update(now=True, generation=plan.generation, rank=None, role=Role.spare,
                      state=AgentState.waiting)
            self.follower.follow(plan)

    def joined(self, plan: Plan, rank: int | None) -> None:
        """(handoff.enter) The pod holds ``rank`` in ``plan``'s generation from now."""
        self.generation, self.rank, self.world_size = plan.generation, rank, plan.world_size
        export_ranks(rank, plan.world_size)

    def restored(self, plan: Plan, restore_step: int) -> None:
        """(handoff.enter) The state of ``restore_step`` is held: this generation's
        learning-rate ramp starts from the restored factor."""
        self.plan, self._lr_from, self._lr_start = plan, self.state.lr_factor, restore_step + 1

    def close_group(self) -> None:
        self.leader.end()
        if self.group is not None:
            try:
                self.group.close()
            except Exception:
                pass
            self.group = None

    def fallback(self, why: str) -> None:
        """Leave the process: the supervisor restarts this pod as a spare."""
        log.error("leaving: the supervisor restarts this pod as a spare", reason=why)
        print(f"ceaseless: {why}; exiting with {FALLBACK_EXIT_CODE} (restart as spare)",
              file=sys.stderr, flush=True)
        self.rt.update(state=AgentState.leaving)
        self.rt.stop()
        os._exit(FALLBACK_EXIT_CODE)

    # ------------------------------------------------------------------ the end
    def finish(self) -> None:
        """The job's last step committed (a member): END to the spares first (they leave as
        the job ends), then the done state (a long final checkpoint is no stall)."""
        self._to(Phase.FINISHED, "last step committed")
        self.leader.end(final=True)
        self.rt.update(now=True, state=AgentState.done)

    def announce_done(self) -> None:
        """KV ``done``: the job's last step is committed (and checkpointed, if asked)."""
        from .runtime import DONE_KEY

        self.rt.kv.put(DONE_KEY, json.dumps({"step": self.state.last_committed,
                                             "pod": self.cfg.pod,
                                             "generation": self.generation}).encode())

    def leave(self) -> None:
        """Leave the loop without being a member: the job finished first, or a planned
        shrink released this pod (then exit 0 at once when configured)."""
        released = self.phase is Phase.RELEASED
        # job done: rank 0 ends the stream (END) before it reports done; wait for that
        self.follower.stop(quiet=True, drain_s=0.0 if released else END_WAIT_S)
        self._not_member()  # the user's `if s.rank == 0: save()` after the loop: not here
        if released:
            log.info("slot released by a planned shrink; leaving",
                     step=self.state.last_committed, generation=self.seen_generation,
                     exit_now=self.cfg.exit_on_release)
        else:
            log.info("job finished before this pod was promoted; leaving")
        self.rt.update(now=True, state=AgentState.done)
        if released and self.cfg.exit_on_release:
            # The slot is reclaimed: free it now (exit 0) instead of after the interpreter's
            # teardown (about 0.5 s with torch loaded), as a scheduler killing it would.
            self.rt.stop()
            try:
                from plumbing import telemetry

                telemetry.shutdown()
            except Exception:
                pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)

    def install_sigterm(self) -> None:
        """SIGTERM to a pod that is not a member (a spare being released) is a clean leave:
        exit 0, no fault. To a member it is a preemption notice (``agent/preempt.py``): it
        leaves at a step boundary the scaler plans; a second one, or the deadline passing
        first, ends it at once as before (it dies; the job recovers)."""
        import threading

        if threading.current_thread() is not threading.main_thread() or \
                signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the script handles SIGTERM itself, or we cannot install handlers

        def on_term(signum: int, frame: Any) -> None:
            if self.rt.hb.rank is None and self.phase is not Phase.FINISHED:
                log.info("SIGTERM while not a member: leaving", pod=self.cfg.pod)
                self.rt.update(now=True, state=AgentState.leaving)
                raise SystemExit(0)
            if self.phase is Phase.FINISHED:
                from .preempt import exit_now

                exit_now()
            self.preemption.notice(None, "SIGTERM")

        signal.signal(signal.SIGTERM, on_term)
