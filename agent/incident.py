"""The pod's timeline: commits, step times, goodput, and the report of each recovery.

An ``Incident`` is opened when this pod notices a fault (or a plan moves it) and closed by
the first commit after it: that commit publishes a ``Recovery`` (its phases: abort,
rendezvous, state_sync, data_resume, first_step), the ``recover`` span with one child span
per phase, and the downtime metric. Nothing here decides anything; it only measures.
"""

from __future__ import annotations

import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from schemas.messages import Recovery
from plumbing import logs

METRICS_EVERY_S = 1.0  # the step-rate and goodput gauges are set at most this often

log = logs.get("agent")
tracer = trace.get_tracer("ceaseless.agent")


@dataclass
class Incident:
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
class Timeline:
    """This pod's commits and its open incident (training thread only)."""

    step_times: deque = field(default_factory=lambda: deque(maxlen=50))
    losses: dict[int, float] = field(default_factory=dict)
    # (step, wall time) of every commit, in order: benchmarks measure gaps from it
    commits: deque = field(default_factory=lambda: deque(maxlen=100_000))
    incident: Incident | None = None
    last_commit_time: float | None = None
    first_commit_time: float | None = None
    useful_s: float = 0.0                  # wall time in steps no incident interrupted
    metrics_at: float | None = None        # when the gauges were last set

    def open(self, reason: str, notice: float | None = None, **kw: Any) -> Incident:
        """The open incident, or a new one noticed at ``notice`` (default: now)."""
        if self.incident is None:
            self.incident = Incident(notice=time.time() if notice is None else notice,
                                     last_commit=self.last_commit_time, reason=reason, **kw)
        return self.incident

    def commit(self, s: int, loss: float, now: float) -> None:
        if self.last_commit_time is not None and self.incident is None:
            self.step_times.append(now - self.last_commit_time)
            self.useful_s += now - self.last_commit_time  # a step with no incident in it
        if self.first_commit_time is None:
            self.first_commit_time = now
            from plumbing import telemetry  # the goodput ledger's start of training

            telemetry.mark(telemetry.SPAN_TRAIN_START, now, step=s)
        self.losses[s] = loss
        self.commits.append((s, now))
        self.last_commit_time = now

    def median_step(self) -> float | None:
        st = self.step_times
        return sorted(st)[len(st) // 2] if st else None

    def record_metrics(self, now: float) -> None:
        # gauges, read by the exporter every few seconds: set at most once a second, not at
        # every commit (issue 44: a fixed cost of a small step), and at once after an
        # incident (``close``)
        if self.metrics_at is not None and now - self.metrics_at < METRICS_EVERY_S:
            return
        try:
            from plumbing import telemetry

            inst = telemetry.instruments()
            med = self.median_step()
            if med:
                inst.record_steps_per_second(1.0 / max(1e-9, med))
                self.metrics_at = now
            wall = now - (self.first_commit_time or now)
            if wall > 0:
                inst.record_goodput(min(1.0, self.useful_s / wall))
        except Exception:  # metrics are an aid, never a reason to stop training
            pass

    def close(self, rt: Any, cfg: Any, rank: int | None, world_size: int | None,
              first_step_end: float) -> None:
        """The first commit after the incident: publish its report, spans and metric."""
        inc, self.incident = self.incident, None
        self.metrics_at = None  # the gauges are set at this commit (goodput fell)
        if inc is None or rt is None or not inc.t_plan:
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
                       pod=cfg.pod, rank=rank, phases=phases,
                       restore_step=inc.restore_step, lost_steps=0,
                       bytes_received=inc.bytes_received, downtime=downtime,
                       ts=first_step_end)
        rt.publish(rt.bus.subjects.recovery, msg, ctx=inc.plan_ctx)
        recover = _trace(inc, phases, first_step_end, cfg, rank, world_size)
        if downtime is not None:
            try:
                from plumbing import telemetry

                telemetry.instruments().record_recovery(downtime, 0, role=inc.role)
            except Exception:
                pass
        with trace.use_span(recover, end_on_exit=False):  # the log line carries its trace id
            log.info("recovered", **{k: round(v, 4) for k, v in phases.items()},
                     downtime=downtime and round(downtime, 4), generation=inc.generation,
                     incident=inc.incident)


def _trace(inc: Incident, phases: dict[str, float], end: float, cfg: Any, rank: int | None,
           world_size: int | None) -> Any:
    ns = lambda t: int(t * 1e9)  # noqa: E731
    attrs = {"ceaseless.job": cfg.job, "ceaseless.pod": cfg.pod,
             "ceaseless.rank": rank, "ceaseless.generation": inc.generation,
             "ceaseless.world_size": world_size,
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


def trace_grad_sync(cfg: Any, step: int, rank: int | None, generation: int, buckets: int,
                    t: dict[str, Any]) -> None:
    """One step's overlapped gradient sync as spans (CEASELESS_TRACE_STEPS=1): ``grad_sync``
    (armed for the last backward -> sums written back), its children ``last_backward``
    (armed -> ``s.step()`` called) and ``allreduce`` (first bucket posted -> done); the
    overlap is where they intersect, the exposed wait is what follows the backward."""
    if not t.get("armed") or not t.get("posted"):
        return
    ns = lambda x: int(x * 1e9)  # noqa: E731
    first = min(t["posted"].values())
    attrs = {"ceaseless.pod": cfg.pod, "ceaseless.step": step, "ceaseless.rank": rank,
             "ceaseless.generation": generation, "ceaseless.buckets": buckets,
             "ceaseless.buckets_during_backward": t["during_backward"],
             "ceaseless.exposed_ms": round((t["done"] - t["finish"]) * 1e3, 3)}
    parent = tracer.start_span("grad_sync", start_time=ns(t["armed"]), attributes=attrs)
    ctx = trace.set_span_in_context(parent)
    tracer.start_span("last_backward", context=ctx, start_time=ns(t["armed"]),
                      attributes=attrs).end(end_time=ns(t["finish"]))
    tracer.start_span("allreduce", context=ctx, start_time=ns(first),
                      attributes=attrs).end(end_time=ns(t["done"]))
    parent.end(end_time=ns(t["done"]))


def the_bus_failed(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is the bus's or the rendezvous
    store's: a failure of this pod's machinery, replaced like a crash, never the script's bug
    that stops the job, however many ranks raise it at once (a bus that failed them together
    after a nats-server restart, seen in the soak)."""
    import torch.distributed as dist
    from nats.errors import Error as NatsError

    return _in_chain(exc, (NatsError, dist.DistStoreError))


def _in_chain(exc: BaseException, kinds: tuple[type, ...]) -> bool:
    """Whether ``exc`` or an exception it was raised from (cause or context) is one of
    ``kinds``."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kinds):
            return True
        e = e.__cause__ or e.__context__
    return False


def not_the_scripts(exc: BaseException) -> bool:
    """Whether ``exc`` ends a script without being the script's bug: the bus or the store
    failed (``the_bus_failed``), or the control plane declared the state lost
    (``JobStateLost``: every pod of such a generation raises it at once, and judged as one
    bug on two pods it stopped the job instead of restarting it from its checkpoint: the
    soak, seed 7, a kill_all after a restart)."""
    from .vocab import JobStateLost

    return _in_chain(exc, (JobStateLost,)) or the_bus_failed(exc)


def describe(exc_type: type, exc: BaseException, tb: Any, limit: int = 2000) -> str:
    """``Type: message`` on the first line, then the end of the traceback (its innermost
    frames): the health monitor tells one bug on two pods from two faults by both, and
    `ceaseless up` prints it."""
    head = f"{exc_type.__name__}: {exc}".splitlines()[0][:300] if str(exc) else exc_type.__name__
    body = "".join(traceback.format_exception(exc_type, exc, tb))
    room = limit - len(head) - 1
    return f"{head}\n{body[-room:]}" if room > 0 else head
