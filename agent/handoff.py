"""Entering a generation: rendezvous, then the state handoff the broker plans.

``enter`` builds the new process group (ranks from the plan, the store on NATS; a group
already built by ``prejoin.py`` is taken over), waits for the broker's transfer plan, and
moves the committed state: a recipient receives it from its sources (striped, checksummed,
``agent/state.py``), a source sends it, everyone else checks that it holds the restore
step. A spare that followed the job applies its stream while the peers connect instead.
Rank 0 then starts streaming to the plan's spares (``shadow_roles.ShadowLeader``).

The steps, in order: ``_open_incident``, ``_join`` (the rank), ``_rendezvous`` (one of three
paths: a promoted spare's early join, a prejoin's group, a fresh group; what to do while
the peers connect is ``_meanwhile``), ``_handoff_state``, ``_start_streaming``. What it
needs of the membership is ``ports.Entrant``.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from schemas.messages import AgentState, Plan, ReportKind, Role, Transfer
from plumbing import logs

from .ports import Entrant
from .shadow_roles import why_not
from .vocab import JobStateLost

log = logs.get("agent")


def enter(m: Entrant, plan: Plan, plan_ctx: Any, first: bool,
          keep_grads: bool = False) -> None:
    """Enter ``plan``'s generation (raises on failure: the caller counts attempts)."""
    inc = _open_incident(m, plan, plan_ctx, first)
    rank = _join(m, plan)
    _rendezvous(m, plan, rank)
    if inc is not None:
        inc.t_group = time.time()
    restore_step, received, sent = _handoff_state(m, plan, rank, keep_grads)
    if inc is not None:
        inc.t_sync = time.time()
        inc.restore_step = restore_step
        inc.bytes_received, inc.bytes_sent = received, sent
        inc.role = "recipient" if received else ("source" if sent else "survivor")
    _start_streaming(m, plan, rank)
    # data_resume: the loader position is a pure function of the step
    if inc is not None:
        inc.t_data = time.time()
    state = m.state
    m.rt.update(now=True, step=state.last_committed,
                digest=state.digests.note(state.last_committed, state.digest()),
                state=AgentState.training, pending_step=None)
    log.info("joined generation", generation=plan.generation, rank=rank,
             world_size=plan.world_size, restore_step=restore_step, received=received,
             sent=sent)


def _open_incident(m: Entrant, plan: Plan, plan_ctx: Any, first: bool) -> Any:
    """The incident this entry belongs to (None: none, the job's first join), with the
    plan's times and context."""
    tl, g = m.timeline, plan.generation
    if tl.incident is None and first and g > 1:
        # A spare promoted into a running job: its part starts when the plan arrived
        # (nothing to abort; its rendezvous includes noticing the plan).
        newest = m.newest_plan()
        at = newest.at if newest is not None else 0.0
        tl.open("promoted", notice=min(at or time.time(), time.time()), promoted=True)
        tl.incident.last_commit = None
    inc = tl.incident
    if inc is not None:
        inc.t_plan, inc.generation, inc.incident, inc.plan_ctx = (
            inc.notice if inc.promoted or inc.planned else time.time(), g, plan.incident,
            plan_ctx)
    return inc


def _join(m: Entrant, plan: Plan) -> int:
    """Join the generation (runtime and membership) and return this pod's rank in it; a
    sharded model must fit the plan's shards."""
    m.rt.join(plan.generation, plan.world_size)
    m.close_group()
    rank = plan.rank_of(m.cfg.pod)
    sh = m.sharding
    if plan.shard_size > 1 and sh is None:
        raise RuntimeError("the job is sharded (shard size "
                           f"{plan.shard_size}) but this pod's model is not: shard it with "
                           "s.shard(model, ...) or fully_shard(..., mesh=s.mesh) first")
    if sh is not None:
        sh.check(plan, rank)
    m.joined(plan, rank)
    return rank


def _meanwhile(m: Entrant, plan: Plan, rank: int, pre: Any) -> Callable[[], None] | None:
    """Report the step this pod holds to the broker, and what to do while the peers
    connect (None: nothing): a following spare applies its stream first. A prejoin
    reported already. (A source sends from its live tensors: nothing to copy ahead.)"""
    rt, state, g = m.rt, m.state, plan.generation

    def report() -> None:  # the broker takes this step and digest for the generation
        rt.update(now=True, generation=g, rank=rank, role=Role.worker,
                  step=state.last_committed,
                  digest=state.digests.note(state.last_committed, state.digest()),
                  state=AgentState.recovering)

    if pre is not None:
        return None  # the runtime reported the generation and is building the group (prejoin.py)
    if m.follower.following:
        # A spare that followed the job: apply what already arrived (cheaper than a
        # transfer) while the peers connect, then report the step it holds.
        def settle() -> None:
            m.follower.settle()
            m.follower.stop()
            report()

        return settle
    report()
    return None


def _rendezvous(m: Entrant, plan: Plan, rank: int) -> None:
    """Build the generation's group (``m.group``; ranks from the plan, the store on NATS)
    by one of three paths: a promoted spare's early join taken over (sharded), a prejoin's
    group taken over, or a fresh group. Sharded: the shard and position groups too."""
    from .collectives import AbortableGroup, make_group_abortable

    rt, cfg, g = m.rt, m.cfg, plan.generation
    pre = rt.take_prejoin(g)
    meanwhile = _meanwhile(m, plan, rank, pre)
    # sharded: the replica's shard group and the position group connect meanwhile (a
    # promoted spare started all three while its script sharded the model: EarlyJoin)
    early = sharded = None
    sh = m.sharding
    if sh is not None:
        early = m.take_early_join(plan, rank, m.backend)
        sharded = early.finish if early is not None else \
            sh.build(rt.stores.rendezvous, plan, rank, rt.abort, cfg)
    if early is not None:
        if meanwhile is not None:
            meanwhile()
        pg = early.world_group(rt.abort, cfg.collective_slice)
    elif pre is not None and (pre.rank, pre.world_size) == (rank, plan.world_size):
        pg = pre.wait_group(rt.abort, cfg.collective_slice)
    else:
        if pre is not None:
            pre.drop()
        try:
            pg = make_group_abortable(rt.stores.rendezvous(f"g{g}."), rank, plan.world_size,
                                      rt.abort, timeout_s=cfg.collective_timeout,
                                      backend=m.backend, slice_s=cfg.collective_slice,
                                      meanwhile=meanwhile)
        except BaseException:
            if sharded is not None:
                sharded.abandon()
            raise
    m.group = AbortableGroup(pg, bucket_bytes=max(1, int(cfg.bucket_mb * 2**20)))
    if sharded is not None:
        from .solo import collective_args

        sharded(collective_args(rt, g, cfg.collective_timeout, cfg.solo_max)["extend"])
        m.state.shard = divmod(rank, plan.shard_size)


def _handoff_state(m: Entrant, plan: Plan, rank: int,
                   keep_grads: bool) -> tuple[int, int, int]:
    """The state handoff the broker plans (it names sources and recipients): receive,
    send, or check the restore step held. Returns (the restore step, bytes received, bytes
    sent). Nothing is copied whole: a source sends its live tensors, a recipient receives
    into its own (``agent/transfer.py``)."""
    from .collectives import Aborted
    from .rollforward import finish
    from .transfer import send_state

    rt, cfg, state, g = m.rt, m.cfg, m.state, plan.generation
    got = rt.wait_transfer(g, cfg.recovery_timeout)
    if got is None:
        raise TimeoutError(f"no transfer plan for generation {g} in {cfg.recovery_timeout}s")
    if got.kind == "abort":
        raise Aborted(f"plan {rt.plan.generation} superseded {g} during rendezvous")
    if got.kind == "lost":
        raise JobStateLost(got.lost.reason)
    transfer = got.transfer
    received = sent = 0
    odd: str | None = None
    finish(m, plan, transfer, rank)  # sharded: a step some members committed (rollforward.py)
    if rank in transfer.sources:
        odd = diverged(plan, transfer, state.last_committed,
                       state.digests.of(state.last_committed))
        st = receive(state, m.group, rank, transfer.sources[rank], rt.abort)
        state.restore(st, transfer.restore_step)
        received = st.nbytes
        if state.last_committed != transfer.restore_step:
            raise RuntimeError(f"received state of step {state.last_committed}, "
                               f"expected {transfer.restore_step}")
        if odd is not None:  # repaired now; the pod is still suspect (agent/verify.py)
            log.error("replicas disagree at the handoff: silent data corruption",
                      step=transfer.restore_step, generation=g)
    else:
        if state.last_committed != transfer.restore_step:
            raise RuntimeError(f"transfer plan restores step {transfer.restore_step} but this "
                               f"rank holds step {state.last_committed} and receives nothing")
        mine = {r: srcs for r, srcs in transfer.sources.items() if rank in srcs}
        if mine:  # the state is at the restore step and nothing changes it meanwhile
            sent = send_state(m.group, state.describe(), rank, mine, rt.abort) or 0
    _note_divergence(m, plan, transfer, odd if rank in transfer.sources else None)
    if not keep_grads:
        state.zero_grad()
    m.restored(plan, transfer.restore_step)
    return transfer.restore_step, received, sent


def _note_divergence(m: Entrant, plan: Plan, transfer: Transfer, odd: str | None) -> None:
    """Replicas that disagreed at the restore step: the majority's state is not the
    fault-free one either (the corrupt replica's gradients were in every update since the
    flip), so every member rolls back to the last verified copy at its next commit
    (``agent/verify.py``; decided by each member from the same transfer, so all alike), and
    the corrupt one reports itself after that, as a verification's finding is reported. A
    divergence noted before and never rolled back (a newer plan came first) is reported now;
    without verification (no copy to go back to) at once."""
    rt = m.rt
    if m.diverged is not None and m.diverged[1] is not None:
        rt.report_sync(ReportKind.corruption, m.diverged[1])
    m.diverged = None
    found = disagreed(plan, transfer)
    if m.cfg.verify_every > 0 and found:
        m.diverged = (transfer.restore_step, odd)
        log.warning("replicas disagreed at the handoff: every member rolls back to the last "
                    "verified copy at its next commit", step=transfer.restore_step,
                    generation=plan.generation,
                    majority=len({r for s in transfer.sources.values() for r in s}) > 1)
        return
    if found:
        log.error("replicas disagreed at the handoff and no verified copy is kept "
                  "(--verify-every 0): the job trains on from the sources' state",
                  step=transfer.restore_step, generation=plan.generation)
    if odd is not None:
        rt.report_sync(ReportKind.corruption, odd)


def disagreed(plan: Plan, transfer: Transfer) -> bool:
    """Whether ``transfer`` made a member that held the restore step a recipient (what every
    member sees alike): its digest there was not the sources' (``diverged``'s conditions,
    told from the transfer's ``steps`` instead of the member's own digest). One against one
    counts too: nobody can be named then, but one of the two replicas was corrupt and its
    gradients are in both states, so every member still goes back to the verified copy (CI
    lost it so once: a promoted spare one step behind, two holders, the job trained on)."""
    if (plan.generation <= 1 or plan.shard_size > 1 or transfer.restore_step < 0
            or not transfer.digest):
        return False
    return any(transfer.steps.get(r) == transfer.restore_step for r in transfer.sources)


def diverged(plan: Plan, transfer: Transfer, step: int, digest: str) -> str | None:
    """Why this recipient is a corrupt replica, or None. A member named a recipient while it
    held the restore step itself holds a digest the majority there does not: silent data
    corruption found by the handoff instead of by the next verification (a plan, such as a
    capacity add, came between the flipped bit and the check). The handoff repairs the
    state, every member then rolls back to the verified copy (``_note_divergence``) and the
    pod is reported, as verify.py reports one, so that a spare takes its rank.
    Not in a job's first generation (ranks may hold what each script loaded: rank 0's is
    taken) nor at step -1 (each rank's own initialisation), nor sharded (a digest per
    position: only position 0's is in the transfer), nor when a single source held the step
    against it: one against one is no majority (the broker took the lower rank's; verify.py
    names nobody then)."""
    if (plan.generation <= 1 or plan.shard_size > 1 or transfer.restore_step < 0
            or step != transfer.restore_step or not digest or not transfer.digest
            or digest == transfer.digest):
        return None
    if len({r for srcs in transfer.sources.values() for r in srcs}) < 2:
        return None
    return (f"replicas disagree at the handoff of generation {plan.generation}: this "
            f"member's state of step {step} has digest {digest[:16]}, the majority's "
            f"{transfer.digest[:16]}")


def receive(state: Any, group: Any, rank: int, sources: list[int], abort: Any,
            timeout_s: float | None = None) -> Any:
    """Receive the state into ``state``'s own tensors (``TrainState``; no second copy). It
    keeps its committed step until the first piece lands in them: a transfer that fails
    before (a source lost while connecting, an abort) leaves its older step usable, which
    it reports in the next incident (the broker may then roll back to it). From that piece
    on, until verified whole, it holds none: half written, a retry must not report them."""
    from .transfer import recv_state

    return recv_state(group, rank, sources, abort, timeout_s=timeout_s,
                      into=state.destinations, on_write=state.forget)


def _start_streaming(m: Entrant, plan: Plan, rank: int) -> None:
    """Rank 0 streams to the plan's spares (``shadow_roles.ShadowLeader``), each's first
    state from the live tensors."""
    if rank == 0 and why_not(m.cfg, m.state) is None:
        m.leader.lead(plan)
