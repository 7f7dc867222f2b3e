"""Silent data corruption: replicas compare their state every N steps and roll back when they
disagree (issue 32).

Every ``verify_every`` committed steps (``ceaseless up --verify-every N``) each member
computes a digest of its parameters and optimizer state on the device: per tensor the sum of
its bit patterns as integers (exact and order-free, so identical states give identical
digests on any rank; a flipped bit changes it), weighted by the tensor's index. The digests
travel in one small all-reduce (rank r fills row r). When all agree, the state is kept as
the last verified copy in host memory (written over the previous one, its buffers reused:
one copy at a time, no allocation per verification; on CUDA made on a side stream while the
next step computes, waited for on the device before the next update). When they do not,
every member restores that copy and the job computes the steps
after it again (at most N; the batches and randomness are a function of the step, so the
result is the fault-free one); with three or more replicas the majority names the member
that differed: it reports ``corruption`` about itself (at its next commit, once rank 0 has told
the spares that followed the abandoned steps to drop them: ``ShadowLeader.rollback``), the
health monitor declares the fault, the scaler fences it and a spare takes its rank. Sharded
jobs: each rank digests its own shards, and the replicas compare per shard position (rank r
holds position r % k); the copy is of the shards. Module buffers (BatchNorm statistics) are
left out (they may differ per rank by design). The DDP drop-in is verified at its commits
too: after a rollback ``dist.iteration`` returns the step after the copy, and that step is
computed once without its update first (the script holds a later step's prefetched batch).
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from schemas.messages import ReportKind
from .train_state import MAX_SKIPPED
from plumbing import logs, telemetry

log = logs.get("agent")


def state_digest(params: list[torch.Tensor], optimizers: list[Any]) -> torch.Tensor:
    """An int64 scalar on the parameters' device: no host sync, no copy of the state."""
    from .digests import exact
    from .state import local  # sharded (FSDP2): this rank's shard

    tensors = [local(t) for t in params] + [
        local(v) for opt in optimizers for st in opt.state.values()
        for v in st.values() if isinstance(v, torch.Tensor)]
    dev = tensors[0].device if tensors else torch.device("cpu")
    # digests.exact: int64 words (an int32 view summed into int64 widened each float tensor
    # into a temporary twice its size first, about 1 GB/s on a CPU)
    return exact(tensors).to(dev)


class Verifier:
    def __init__(self, every: int, on_nonfinite: str = "skip") -> None:
        self.every = every
        self.on_nonfinite = on_nonfinite  # "rollback": a skipped step goes back to the copy
        self.copy: Any = None          # the last verified FlatState (host)
        self.verified: int | None = None
        self.rolled_back_at: int | None = None  # the step whose commit restored the copy
        # this member differed: reported at the next commit, after the first step computed
        # again, so that spares following rank 0 have seen the job go back (rank 0 ends
        # their streams with ROLLBACK and they drop the discarded steps; promoted before
        # that, they would report the abandoned step as the newest)
        self._report: str | None = None
        # CUDA: the verified copy is made on a side stream while the next step computes; the
        # training stream waits for it before the next update changes the state
        self._stream: Any = None
        self._pending: Any = None
        self._step_time: float | None = None

    def discarded(self, s: int, last_committed: int) -> bool:
        """Step ``s`` ended without its commit: discarded, unless its own commit rolled the
        state back to the verified copy (then the last commit is the copy's step). Only that
        step is excused: a later step discarded before the next commit (a plan arriving
        while the steps after the copy are computed again) recovers as any discarded step
        (excusing it too made a member retry it for ever, out of the next generation)."""
        return last_committed != s and self.rolled_back_at != s

    def due(self, s: int) -> bool:
        return self.every > 0 and (s + 1) % self.every == 0

    def after_commit(self, s: int, state: Any, m: Any, rt: Any, cfg: Any,
                     step_time: float | None = None) -> None:
        """At the commit of step ``s`` (every member alike): compare, keep or roll back."""
        from .collectives import Aborted, PeerError

        t0 = time.perf_counter()
        self._step_time = step_time  # the member's median (Timeline): a rollback's cost
        self.rolled_back_at = None
        if self._report is not None and m is not None and m.is_member:
            rt.report_sync(ReportKind.corruption, self._report)
            self._report = None
        if m is None or m.group is None:
            return
        if getattr(m, "diverged", None) is not None and m.is_member:
            # the handoff found replicas that disagreed (handoff.disagreed): every member
            # alike, at its first commit after it; the corrupt one reports itself after that
            at, self._report = m.diverged
            m.diverged = None
            log.error("replicas disagreed at the handoff: rolling back to the verified copy",
                      step=s, handoff_step=at, verified=self.verified)
            self._rollback_together(s, state, m, rt, cfg, "corruption")
            return
        if self.on_nonfinite == "rollback" and state.new_skip and state.skipped[-1:] == [s]:
            # every member alike (the skip was decided on the reduced loss): back to the
            # verified copy, that step's data still skipped when it comes again
            if self.copy is None:
                log.warning("non-finite step: no verified copy yet to roll back to", step=s)
            else:
                self._rollback(s, state, rt, "nonfinite", m)
                state.skipped = (state.skipped + [s])[-MAX_SKIPPED:]
            return
        if not self.due(s):
            return
        d = state_digest(state.params(), state.optimizers())
        vec = torch.zeros(m.world_size, dtype=torch.int64, device=d.device)
        vec[m.rank] = d
        try:
            m.group.allreduce_([vec], rt.abort, slice_s=cfg.collective_slice,
                               timeout_s=cfg.collective_timeout)
        except (Aborted, PeerError) as e:  # a fault: verified next time
            log.info("verification interrupted", step=s, error=str(e)[:200])
            return
        vals = vec.tolist()
        # sharded: the replicas compare per shard position (rank r holds position r % k)
        k = m.sharding.k if m.sharding is not None else 1
        rows = [[(r, v) for r, v in enumerate(vals) if r % k == pos] for pos in range(k)]
        if all(len({v for _, v in row}) == 1 for row in rows):
            # one copy at a time, written over in place (its buffers reused when the layout
            # is the same: no allocation of a full host copy per verification)
            self.copy, self.verified = self._snapshot(state), s
            log.info("state verified", step=s, seconds=round(time.perf_counter() - t0, 4))
            return
        odd: list[int] = []
        for row in rows:
            top, n = Counter(v for _, v in row).most_common(1)[0]
            odd += [r for r, v in row if v != top] if n * 2 > len(row) else []
        log.error("replicas disagree: silent data corruption", step=s, ranks=odd or "no majority",
                  verified=self.verified)
        if m.rank in odd:
            self._report = (f"state digest differs from the majority at step {s} (last "
                            f"verified step {self.verified})")
        self._rollback_together(s, state, m, rt, cfg, "corruption")

    def _rollback_together(self, s: int, state: Any, m: Any, rt: Any, cfg: Any,
                           reason: str) -> None:
        """Every member back to the newest verified copy any of them holds: its holders
        restore it, members without it (promoted or joined since) receive it from them, as
        in a handoff. One small all-reduce of who holds which copy first, so that all decide
        alike. Sharded (a copy per shard position): only when every member holds it."""
        from .collectives import Aborted, PeerError
        from .handoff import receive
        from .transfer import send_state

        vec = torch.zeros(m.world_size, dtype=torch.int64, device=m.group.device)
        vec[m.rank] = self.verified if self.copy is not None and self.verified is not None else -1
        try:
            m.group.allreduce_([vec], rt.abort, slice_s=cfg.collective_slice,
                               timeout_s=cfg.collective_timeout)
        except (Aborted, PeerError) as e:  # a fault: a new generation's handoff decides
            log.warning("rollback interrupted", step=s, error=str(e)[:200])
            return
        held = vec.tolist()  # a rare path: its one host sync is no step's
        v = max(held)
        holders = [r for r, h in enumerate(held) if h == v]
        others = [r for r in range(m.world_size) if r not in holders]
        if v < 0 or (others and m.sharding is not None):
            log.error("no verified copy every member can go back to: not rolled back",
                      step=s, verified=held)
            return
        if m.rank in holders:
            self._rollback(s, state, rt, reason, m)
        if not others:
            return
        n = min(len(holders), 8)  # each recipient stripes over some of the holders
        plan = {r: [holders[(i + j) % len(holders)] for j in range(n)]
                for i, r in enumerate(others)}
        try:
            if m.rank in holders:
                send_state(m.group, state.describe(), m.rank,
                           {r: srcs for r, srcs in plan.items() if m.rank in srcs}, rt.abort,
                           timeout_s=cfg.collective_timeout)
                return
            st = receive(state, m.group, m.rank, plan[m.rank], rt.abort,
                         timeout_s=cfg.collective_timeout)
        except (Aborted, PeerError) as e:
            log.warning("rollback's transfer interrupted", step=s, error=str(e)[:200])
            return
        state.restore(st, v)
        self.copy = self.verified = None  # no copy of its own until the next check
        self._rolled_back(s, state, rt, reason, m, v)

    def _snapshot(self, state: Any) -> Any:
        """The verified copy: on CUDA queued on a side stream after the work that made the
        state (device to pinned host, no host sync, the training stream goes on); on the
        CPU a plain copy. Its buffers are the previous copy's when the layout is the same."""
        params = state.params()
        dev = params[0].device if params else None
        if dev is None or dev.type != "cuda":
            return state.snapshot(reuse=self.copy)
        self.before_update()
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        self._stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(self._stream):
            copy = state.snapshot(reuse=self.copy, non_blocking=True)
        self._pending = self._stream
        return copy

    def before_update(self) -> None:
        """Before the optimizer changes the state (and before a restore reads the copy): the
        training stream waits for the copy in flight (a device-side wait, no host sync)."""
        if self._pending is not None:
            dev = self._pending.device
            torch.cuda.current_stream(dev).wait_stream(self._pending)
            self._pending = None

    def _rollback(self, s: int, state: Any, rt: Any, reason: str, m: Any = None) -> None:
        if self._stream is not None:
            self.before_update()
            self._stream.synchronize()  # the copy is read on the host side too (its extra)
        state.restore(self.copy)
        self._rolled_back(s, state, rt, reason, m, self.verified)

    def _rolled_back(self, s: int, state: Any, rt: Any, reason: str, m: Any,
                     verified: int) -> None:
        self.rolled_back_at = s
        log.warning("rolled back to the last verified copy", step=s, verified=verified,
                    reason=reason)
        telemetry.mark(telemetry.SPAN_ROLLBACK, time.time(), step=s, restore_step=verified,
                       recomputed_steps=s - verified, reason=reason,
                       step_time=self._step_time or 0.0)
        rt.update(now=True, step=state.last_committed,
                  digest=state.digests.note(state.last_committed, state.digest()))
        if m is not None and m.leader.generation:  # rank 0: its spares drop those steps
            m.leader.rollback(state.last_committed)
