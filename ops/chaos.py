"""``ceaseless chaos``: the bundled example under a seeded, reproducible fault schedule.

    ceaseless chaos --duration 600 --seed 1 [--workers 3 --spares 2] [--elastic]

1. A fault-free reference run of the same example, world size and steps.
2. The chaos run (``ceaseless up`` via ops/launcher.py's ``Cluster``), where a schedule
   drawn from ``--seed`` injects, one after the other, worker SIGKILLs, hangs (SIGSTOP),
   training-thread stalls (``inject stall``: heartbeats go on, the pod's watchdog reports it), spare
   kills, rank-0 kills, SIGKILLs of each control-plane service, nats-server SIGKILLs (the
   launcher restarts it on the same port and store), a second fault during recovery (the
   promoted spare dies while it enters the new generation), a worker fault while a service
   is down, and ``kill_all``: SIGKILL of every pod at once (members, spares, replacements,
   by the PIDs ``up`` recorded), a total loss; with ``--elastic`` also capacity add/remove
   and priority release on the bus; with ``--kinds host`` whole emulated hosts lost,
   partitioned, and lost during a recovery, each lost host given back before the next
   event (``ops/chaos_hosts.py``: ``up --hosts 3 --bus-servers 3 --standbys 1``; a
   ``kill_<service>`` then kills the instance that holds the service's lease).
   Events fire at seeded fractions of the run's steps (so the schedule does not depend on how
   fast this machine is), each once the job is healthy again (every member of the latest plan
   training, enough spares as the scaler counts them, holding the state if the job has one
   replica; ``ceaseless up`` replaces every failed pod by itself, and only
   elastic scale-ups make the chaos tool ask the actuator for more). Each fault must be *survived*: a new plan without the victim and every member
   past the step the fault interrupted (worker faults), or the service back and training on
   (control-plane faults), within a bounded time. A schedule with ``kill_all`` runs ``up``
   with last-resort checkpoints (``run_dir/checkpoints``, every ``--checkpoint-every``
   steps, default steps / 25, at least 10; ``--auto-resume`` = kill_all events + 1): after
   the loss ``up`` starts the job again in ``restart-N/`` (nested for a restart's restart)
   with a new nats-server and credentials, plans from generation 1 and the same pod ids;
   the tool re-attaches to it (``Cluster.reattach``). A kill_all is survived once the
   restarted job trained past the step it was killed at (``RESTART_TIMEOUT``); the steps
   after the checkpoint are recomputed (bitwise) and reported as such, not as lost.
3. The verdict: the chaos run's final parameters must equal the reference's bitwise when the
   world size never changed (losses within 1e-4 relative otherwise), no committed step lost,
   every injected fault survived, and one restart of ``up`` per kill_all. The final results
   are the last restart's (``up``'s summary of the run dir is that job's; lost steps of the
   jobs before it come from their Recovery messages). It prints faults injected and
   survived, downtime p50/p99 (per incident, from the Recovery messages as ``ceaseless up``
   summarises them), lost steps and recomputed steps, writes ``chaos.json`` in the run
   dir, and exits non-zero if anything failed.

Everything started is cleaned up by PID (``pids.txt``), never by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from schemas.timeouts import DEFAULTS as TIMEOUTS

from . import chaos_guards, chaos_hosts
from .chaos_guards import GUARD_KINDS
from .chaos_hosts import HOST_GROUP, HOST_KINDS

SERVICES = ("health_monitor", "scaler", "state_broker")
# Worker faults need a spare each (two for a fault during recovery): then the world size
# never changes and the result must be bitwise the reference's.
KINDS = ("kill", "hang", "stall", "kill_rank0", "spare_kill", "kill_health_monitor",
         "kill_scaler", "kill_state_broker", "nats_restart", "during_recovery",
         "kill_with_service", "kill_all")
ELASTIC_KINDS = ("capacity_add", "capacity_remove", "priority")
WEIGHTS = {"kill": 3, "hang": 2, "stall": 1, "kill_rank0": 1, "spare_kill": 1, "kill_health_monitor": 1,
           "kill_scaler": 1, "kill_state_broker": 1, "nats_restart": 1, "during_recovery": 1,
           "kill_with_service": 1, "kill_all": 1, "capacity_add": 1, "capacity_remove": 1, "priority": 1}
SPARES_NEEDED = {"kill": 1, "hang": 1, "stall": 1, "kill_rank0": 1, "during_recovery": 2,
                 "kill_with_service": 1, "spare_kill": 1, "capacity_add": 1,
                 **chaos_guards.SPARES_NEEDED, **chaos_hosts.SPARES_NEEDED}
# Steps per second of the tiny example on a 2-core machine, by world size (to size a run
# from --duration; the schedule itself is in steps, so a slower machine only runs longer).
RATE = {1: 12.0, 2: 9.0, 3: 7.0, 4: 5.0}
READY_TIMEOUT = 120.0     # the job healthy again (members training, spares registered)
RECOVER_TIMEOUT = 90.0    # a fault handled: new plan, everyone past the interrupted step
FRESH = TIMEOUTS["fault_timeout"]  # a heartbeat younger than this is a live pod
# kill_all: the total loss found (the broker declares the state lost once replacement pods
# hold nothing), `up` stopped and started again from the newest checkpoint, and every
# member trained past the step the job was killed at (recomputing the steps after the
# checkpoint)
RESTART_TIMEOUT = 240.0


def checkpoint_every(steps: int) -> int:
    """Checkpoint interval of a chaos run with kill_all events: small, so that a total loss
    recomputes some steps (a few percent of the run), and at least every 10 steps."""
    return max(10, steps // 25)


@dataclass
class ChaosOptions:
    duration: float = 600.0
    seed: int = 0
    workers: int = 3
    spares: int = 2
    steps: int | None = None
    gap: float = 8.0             # mean seconds between events (sets how many there are)
    elastic: bool = False
    guards: bool = False         # also the guards' events (ops/chaos_guards.py)
    run_dir: str | None = None
    model: str = "tiny"
    kinds: list[str] | None = None
    checkpoint_every: int | None = None   # with kill_all events; None: checkpoint_every()
    # None: float64 with --elastic (the world size changes, so the result is compared with
    # the reference within 1e-4, which float32 does not hold over thousands of steps: the
    # changed order of additions grows to ~1e-3 in the losses), else float32 (bitwise).
    dtype: str | None = None

    @property
    def example_dtype(self) -> str:
        return self.dtype or ("float64" if self.elastic else "float32")


@dataclass
class Event:
    index: int
    at_fraction: float   # of the run's steps
    kind: str
    u: float             # target choice in [0, 1)
    u2: float            # second choice (the service of kill_with_service)


@dataclass
class Outcome:
    index: int
    kind: str
    injected: bool = False
    survived: bool = False
    at_step: int | None = None
    target: str = ""
    detail: str = ""
    recover_s: float | None = None   # injection to "handled and training again" (observer)
    t: float | None = None           # injection wall time
    recomputed: int | None = None    # kill_all: committed steps after the checkpoint, run again


class ChaosFailure(Exception):
    pass


def _service_of(name: str) -> str:
    """The service of a control-plane instance's pids.txt name (``scaler-s1``: a standby of
    ``scaler``, `up --standbys`); any other name as it is."""
    base, sep, k = name.rpartition("-s")
    return base if sep and k.isdigit() and base in SERVICES else name


def _signal(pid: int, sig: int, what: str) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        raise ChaosFailure(f"{what} (pid {pid}) is already gone") from None


def make_schedule(seed: int, duration: float, gap: float = 8.0, elastic: bool = False,
                  kinds: list[str] | None = None, guards: bool = False) -> list[Event]:
    """The events of a run: a pure function of its arguments. Every kind once (in a seeded
    order) before any repeats, as long as there are enough events."""
    rng = random.Random(seed)
    pool = list(kinds or (KINDS + (ELASTIC_KINDS if elastic else ())
                          + (GUARD_KINDS if guards else ())))
    n = max(1, int(duration // gap))
    order = rng.sample(pool, len(pool))
    while len(order) < n:
        order.append(rng.choices(pool, weights=[WEIGHTS.get(k, 1) for k in pool])[0])
    order = order[:n]
    lo, hi = 0.05, 0.80
    out = []
    for i, kind in enumerate(order):
        frac = lo + (hi - lo) * (i + rng.uniform(0.15, 0.85)) / n
        out.append(Event(i, round(frac, 4), kind, rng.random(), rng.random()))
    return out


def default_steps(opts: ChaosOptions) -> int:
    rate = RATE.get(opts.workers, 4.0) if opts.model == "tiny" else 1.0
    return max(60, int(opts.duration * rate))


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(-(-q * len(v) // 100)) - 1))
    return v[k]


# ----------------------------------------------------------------------------- the run
class Chaos:
    def __init__(self, c: Any, opts: ChaosOptions, steps: int) -> None:
        self.c, self.opts, self.steps = c, opts, steps
        self.stopped: list[int] = []          # SIGSTOPped pids: SIGKILLed at the end
        self.victims: set[str] = set()        # pods this tool killed, stopped or stalled
        # pods the health monitor declared faulted (e.g. a spare starting on a loaded machine
        # that missed its heartbeats): the scaler will not promote them, so neither may we
        # count them as ready spares
        self.faulted: set[str] = set()
        self.requested: dict[str, float] = {}  # spares asked of the actuator, not yet seen
        self._top_lock = asyncio.Lock()
        self.decisions: list[Any] = []
        self.recoveries: list[tuple[int, Any]] = []  # (segment: restarts before it, msg)
        self.faults: list[Any] = []
        self.log: list[str] = []
        self.t_start = time.time()
        self.ckdir: Path | None = None         # last-resort checkpoints (kill_all events)
        # the jobs `up` restarted after a total loss: dir, checkpoint, last step seen before
        self.restarts: list[dict[str, Any]] = []
        self.segment = 0                        # index of the attached job (0: the first)
        self.killed_gen: int | None = None      # the generation a kill_all killed
        self.trained_plans: list[Any] = []      # plans of the jobs before the attached one
        self.nan_steps: list[int] = []          # steps made non-finite (the guards' `nan`)
        # each with how many total-loss restarts came before it (a later one may undo it)
        self.nan_events: list[tuple[int, int]] = []

    def say(self, text: str) -> None:
        line = f"[{time.time() - self.t_start:7.2f}s] {text}"
        self.log.append(line)
        print(line, flush=True)

    async def attach(self) -> None:
        """Subscribe now and again on every bus `up` starts after a total loss."""
        self.c.on_attach.append(self._subscribe)
        await self._subscribe(self.c.bus)

    async def _subscribe(self, bus) -> None:
        from schemas.messages import Decision, Fault, Recovery

        s = bus.subjects
        segment = self.segment

        async def on_dec(m, env):
            self.decisions.append(m)

        async def on_rec(m, env):
            self.recoveries.append((segment, m))

        async def on_fault(m, env):
            self.faults.append(m)
            self.faulted.add(m.pod)

        await bus.subscribe(s.decision, Decision, on_dec)
        await bus.subscribe(s.recovery, Recovery, on_rec)
        await bus.subscribe(s.fault, Fault, on_fault)

    async def follow(self) -> None:
        """In the background all run long: after a total loss `up` starts the job again in
        ``restart-N/`` with a new nats-server, new credentials, plans from generation 1 and
        the same pod ids; re-attach to it as soon as its ``cluster.json`` is there."""
        from agent import checkpoint

        while self.c.proc.poll() is None:
            await asyncio.sleep(0.2)
            d = self.c.job_dir()
            if d == self.c.attached_dir:
                continue
            # the old job's last committed step: its members' last heartbeats (the plans
            # after a kill_all only hold replacement pods at step -1, and no step is
            # trained in them: the broker declares the state lost)
            last = max((h.step for h in self.c.hb.values()), default=-1)
            plans = [p for p in self.c.plans
                     if self.killed_gen is None or p.generation <= self.killed_gen]
            # `up` resumes from the newest complete checkpoint; none is written until the
            # new pods run, so this is the one it chose
            found = checkpoint.latest(self.ckdir) if self.ckdir else None
            from_step = int(found.name.split("-")[1]) if found else None
            self.segment += 1
            try:
                await self.c.reattach(d)
            except Exception as e:  # its server not answering yet: next round
                self.segment -= 1
                self.say(f"  could not attach to {d} yet: {type(e).__name__}: {e}")
                continue
            self.victims.clear()  # the restarted job names its pods w0.., s0.. again
            self.faulted.clear()
            # spares asked of the old job's actuator never register in the new one: else
            # they count as coming for a minute and the pool is not refilled
            self.requested.clear()
            self.trained_plans += plans
            self.killed_gen = None
            self.restarts.append({"run_dir": str(d), "checkpoint": str(found) if found else None,
                                  "from_step": from_step, "last_step": last})
            self.say(f"  `up` restarted the job in {d} from "
                     f"{found.name if found else 'no checkpoint'} (last step seen {last}); "
                     "re-attached")

    # ------------------------------------------------------------------ views
    def plan(self):
        return max(self.c.plans, key=lambda p: p.generation) if self.c.plans else None

    def fresh(self, h) -> bool:
        return time.time() - h.ts < FRESH

    def spares(self) -> list[Any]:
        now, (members, committed) = time.time(), self._members_committed()
        return [h for h in self.c.hb.values()
                if self._not_a_ready_spare(h, members, committed, now) is None]

    def _members_committed(self) -> tuple[set[str], int]:
        plan = self.plan()
        members = {m.pod for m in plan.members} if plan else set()
        return members, max((h.step for p, h in self.c.hb.items() if p in members), default=-1)

    def _not_a_ready_spare(self, h: Any, members: set[str], committed: int,
                           now: float) -> str | None:
        """Why the pod of heartbeat ``h`` is not a ready spare (None: it is one)."""
        plan = self.plan()
        if h.role.value != "spare" or h.pod in members:
            return "a member" if h.pod in members else f"role {h.role.value}"
        if plan is not None and h.pod in plan.fenced:
            return f"fenced in plan g{plan.generation}"
        if now - h.ts >= FRESH:
            return f"last heartbeat {now - h.ts:.1f}s ago"
        if h.state.value != "waiting":
            return f"state {h.state.value}"
        # a pod killed a moment ago still looks fresh: it is excluded
        if h.pod in self.victims:
            return "this tool's victim"
        if h.pod in self.faulted:
            return "declared faulted by the health monitor"
        # The scaler's view (Scaler.alive_spares): alive, waiting, not a member. A spare
        # need not hold the job's state: one at step -1 is promoted all the same and
        # receives it by transfer. Its shadow stream from rank 0 ends, for the rest of the
        # generation, when it lags or diverges (a rollback after a bitflip, a step applied
        # and not confirmed): it follows again only at the next plan, and none comes while
        # this tool waits, so requiring step >= 0 here waited for ever (issue 41 item 10a:
        # "not healthy with 1 spare(s) after 120s" while the job trained on to its end).
        # Only a job of one replica needs its spares to hold the state: a fault of that
        # replica leaves no other holder (a total loss if the spare holds nothing).
        if plan is not None and plan.replicas <= 1 and h.step < 0 <= committed:
            return f"holds no step, and the job's one replica committed {committed}"
        return None

    def unready(self, need: int) -> str:
        """Why the job is not ready for an event that needs ``need`` spares, in one line:
        each member that is not training in the latest plan, each spare-role pod this tool
        does not count and why, and the spares asked of the actuator and not seen yet."""
        plan = self.plan()
        if plan is None:
            return "no plan"
        now, (members, committed) = time.time(), self._members_committed()
        parts = [f"plan g{plan.generation} (committed step {committed})"]
        for m in plan.members:
            why = self._member_problem(m.pod, plan, now)
            if why:
                parts.append(f"member {m.pod} (rank {m.rank}): {why}")
        ready = []
        for h in sorted(self.c.hb.values(), key=lambda h: h.pod):
            if h.pod in members or h.role.value != "spare":
                continue
            why = self._not_a_ready_spare(h, members, committed, now)
            if why is None:
                ready.append(h.pod)
            else:
                parts.append(f"spare {h.pod} (g{h.generation}, step {h.step}): {why}")
        parts.append(f"ready spares {len(ready)} of {need} needed"
                     + (f" ({', '.join(ready)})" if ready else ""))
        if self.requested:
            parts.append(f"asked of the actuator, not seen ready: {', '.join(sorted(self.requested))}")
        return "; ".join(parts)

    def _member_problem(self, pod: str, plan: Any, now: float, past: int | None = None) -> str | None:
        """Why member ``pod`` of ``plan`` keeps the job from being healthy (None: it does not)."""
        h = self.c.hb.get(pod)
        if h is None:
            return "no heartbeat seen"
        if h.state.value == "done" or h.step >= self.steps - 1:
            return None  # finished: nothing left to recover
        if now - h.ts >= FRESH:
            return f"last heartbeat {now - h.ts:.1f}s ago"
        if h.generation != plan.generation:
            return f"in generation {h.generation}"
        if h.state.value != "training":
            return f"state {h.state.value}"
        if past is not None and h.step <= past:
            return f"at step {h.step}, not past {past}"
        return None

    def step(self) -> int:
        plan = self.plan()
        if plan is None:
            return -1
        steps = [self.c.hb[m.pod].step for m in plan.members if m.pod in self.c.hb]
        return max(steps, default=-1)

    def healthy(self, gen: int | None = None, past: int | None = None,
                exclude: set[str] = frozenset()) -> bool:
        plan = self.plan()
        if plan is None or (gen is not None and plan.generation <= gen):
            return False
        if any(m.pod in exclude for m in plan.members):
            return False
        now = time.time()
        return not any(self._member_problem(m.pod, plan, now, past) for m in plan.members)

    def finished(self) -> bool:
        return self.c.proc.poll() is not None or self.step() >= self.steps - 1

    def latest_pid(self, name: str) -> int:
        pids = [pid for n, pid in self.c.pids() if n == name]
        if not pids:
            raise ChaosFailure(f"no {name} pid recorded")
        return pids[-1]

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.c.pids() if n == name)

    async def active(self, service: str) -> str:
        """The instance of ``service`` that acts: with standbys (`up --standbys`, the host
        kinds' runs) the one holding its lease, else the only one."""
        if not any(_service_of(n) == service and n != service for n, _ in self.c.pids()):
            return service
        from schemas.subjects import lease_key
        from services.common.lease import parse_lease

        try:
            held = parse_lease((await (await self.c.bus.kv()).get(lease_key(service))).value)
        except Exception:
            return service
        return held.holder if held.holder and self.count(held.holder) else service

    async def wait(self, pred, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            v = pred()
            if v:
                return v
            if self.c.proc.poll() is not None:
                raise ChaosFailure(f"the cluster exited ({self.c.proc.returncode}) while "
                                   f"waiting for {what}")
            if time.monotonic() > deadline:
                raise ChaosFailure(f"timed out after {timeout:.0f}s waiting for {what}")
            await asyncio.sleep(0.05)

    # ------------------------------------------------------------------ spares
    async def top_up(self) -> None:
        """Ask the actuator for spares until the job has --spares of them (counting those
        asked for and not registered yet)."""
        async with self._top_lock:
            await self._top_up()

    async def _top_up(self) -> None:
        from schemas.messages import ActuatorAction, ActuatorCommand, ActuatorReply, Role

        planned = self.opts.guards or bool({"slow", "preempt"} & set(self.opts.kinds or ()))
        if not (self.opts.elastic or planned):
            # `up` replaces every failed pod by itself; scale-ups and planned departures (a
            # straggler swapped out, a preempted pod: they leave, exit 0) use spares up
            return

        have = {h.pod for h in self.spares()}
        now = time.monotonic()
        # asked for and not registered yet (a pod that never registers is forgotten after
        # a minute, then replaced)
        self.requested = {p: t for p, t in self.requested.items()
                          if p not in have and now - t < 60
                          and (p not in self.c.hb or self.fresh(self.c.hb[p]))}
        missing = self.opts.spares - len(have) - len(self.requested)
        if missing <= 0:
            return
        bus = self.c.bus
        try:
            reply = await bus.request(
                bus.subjects.actuator,
                ActuatorCommand(action=ActuatorAction.start, role=Role.spare, count=missing,
                                reason="chaos: keep the spare pool full"),
                ActuatorReply, timeout=10.0)
        except Exception as e:
            self.say(f"  spare request failed ({type(e).__name__}); retrying later")
            return
        if reply.ok:
            self.requested.update({p: now for p in reply.pods})
            self.say(f"  started spare(s) {', '.join(reply.pods)}")

    async def keep_spares(self) -> None:
        """In the background all run long: spares are replaced as soon as faults use them
        (starting one takes seconds: import torch), not when the next event needs them."""
        while True:
            await asyncio.sleep(2.0)
            if self.c.proc.poll() is not None or self.finished():
                return
            try:
                await self.top_up()
            except Exception as e:  # the bus may be restarting
                self.say(f"  spare top-up failed: {type(e).__name__}")

    async def ready(self, need: int) -> None:
        """Every member training in the latest plan and ``need`` spares registered."""
        deadline = time.monotonic() + READY_TIMEOUT
        next_why = time.monotonic() + READY_TIMEOUT / 4
        last_top = 0.0
        while True:
            if self.finished():
                if time.monotonic() > next_why:  # not ready for a while, then the job ended
                    raise ChaosFailure(f"the job finished while not ready for the event "
                                       f"({self.unready(need)})")
                return
            ok = self.healthy() and len(self.spares()) >= need
            if ok:
                return
            if time.monotonic() - last_top > 3.0:
                last_top = time.monotonic()
                await self.top_up()
            if self.c.proc.poll() is not None:
                raise ChaosFailure(f"the cluster exited ({self.c.proc.returncode})")
            if time.monotonic() > deadline:
                raise ChaosFailure(f"job not healthy with {need} spare(s) after "
                                   f"{READY_TIMEOUT:.0f}s: {self.unready(need)}")
            if time.monotonic() > next_why:  # what keeps it, while it lasts
                next_why = time.monotonic() + READY_TIMEOUT / 4
                self.say(f"  waiting to be ready: {self.unready(need)}")
            await asyncio.sleep(0.1)

    # ------------------------------------------------------------------ faults
    def _victim(self, ev: Event, rank0: bool = False):
        plan = self.plan()
        ranks = sorted(m.rank for m in plan.members)
        if not rank0 and len(ranks) > 1:
            ranks = [r for r in ranks if r != 0]
        rank = 0 if rank0 else ranks[int(ev.u * len(ranks)) % len(ranks)]
        h = self.c.hb.get(plan.pod_of(rank))   # the plan's pod, not an old holder of the rank
        if h is None or not h.pid or not self.fresh(h):
            raise ChaosFailure(f"no live pod at rank {rank}")
        return rank, h

    async def _recovered(self, out: Outcome, gen: int, victims: set[str], step: int,
                         t0: float, timeout: float | None = None) -> None:
        await self.wait(lambda: self.finished() or self.healthy(gen=gen, past=step,
                                                                exclude=victims),
                        timeout or RECOVER_TIMEOUT,
                        f"recovery from {out.kind} of {', '.join(victims)}")
        out.recover_s = time.monotonic() - t0

    async def _progress(self, out: Outcome, step: int, t0: float, steps: int = 3) -> None:
        await self.wait(lambda: self.finished() or (self.healthy() and self.step() >= step + steps),
                        RECOVER_TIMEOUT, f"training on after {out.kind}")
        out.recover_s = time.monotonic() - t0

    async def _service_back(self, name: str, before: int) -> None:
        await self.wait(lambda: self.count(name) > before, 30, f"{name} restarted")
        if name == "nats-server":
            return
        bus = self.c.bus
        deadline = time.monotonic() + 30
        while True:  # it answers its status endpoint: connected and serving again
            try:
                await bus.nc.request(bus.subjects.service_status(_service_of(name)), b"",
                                     timeout=1.0)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise ChaosFailure(f"{name} restarted but does not answer") from None
                await asyncio.sleep(0.2)

    async def inject(self, ev: Event, out: Outcome) -> None:
        kind = ev.kind
        plan = self.plan()
        gen, step = plan.generation, self.step()
        out.at_step = step
        t0 = time.monotonic()
        out.t = time.time()
        if kind == "kill_all":
            await self._kill_all(ev, out, step, t0)
        elif kind in ("kill", "hang", "stall", "kill_rank0", "kill_with_service"):
            rank, h = self._victim(ev, rank0=kind == "kill_rank0")
            self.victims.add(h.pod)
            out.target = f"rank {rank} ({h.pod})"
            if kind == "hang":
                _signal(h.pid, signal.SIGSTOP, h.pod)
                self.stopped.append(h.pid)
            elif kind == "stall":  # the training thread blocks; its heartbeats go on
                from schemas.messages import Inject, InjectAction

                await self.c.bus.publish(self.c.bus.subjects.inject,
                                         Inject(action=InjectAction.stall, pod=h.pod))
            else:
                _signal(h.pid, signal.SIGKILL, h.pod)
            if kind == "kill_with_service":
                name = await self.active(SERVICES[int(ev.u2 * len(SERVICES)) % len(SERVICES)])
                before = self.count(name)
                _signal(self.latest_pid(name), signal.SIGKILL, name)
                out.target += f" + {name}"
            out.injected = True
            self.say(f"#{ev.index} {kind}: {out.target} at step {step} (g{gen})")
            if kind == "kill_with_service":
                await self._service_back(name, before)
            await self._recovered(out, gen, {h.pod}, step, t0)
        elif kind == "during_recovery":
            rank, h = self._victim(ev)
            self.victims.add(h.pod)
            _signal(h.pid, signal.SIGKILL, h.pod)
            out.injected = True
            await self.wait(lambda: (p := self.plan()).generation > gen or self.finished(), 60,
                            "the replacement plan")
            new = self.plan()
            promoted = new.pod_of(rank)
            victims = {h.pod}
            if promoted and promoted != h.pod:
                await self.wait(lambda: self.finished() or (
                    (x := self.c.hb.get(promoted)) is not None
                    and x.generation >= new.generation), 30, "the promoted spare adopting it")
                p = self.c.hb[promoted]
                self.victims.add(promoted)
                if p.pid and not self.finished():
                    _signal(p.pid, signal.SIGKILL, promoted)
                    victims.add(promoted)
            out.target = f"rank {rank} ({h.pod}), then its replacement {promoted}"
            self.say(f"#{ev.index} {kind}: {out.target} at step {step} (g{gen})")
            await self._recovered(out, new.generation if len(victims) > 1 else gen, victims,
                                  step, t0)
        elif kind == "spare_kill":
            sp = sorted(self.spares(), key=lambda h: h.pod)
            if not sp:
                raise ChaosFailure("no spare to kill")
            h = sp[int(ev.u * len(sp)) % len(sp)]
            self.victims.add(h.pod)
            _signal(h.pid, signal.SIGKILL, h.pod)
            out.injected, out.target = True, h.pod
            self.say(f"#{ev.index} {kind}: {h.pod} at step {step}")
            await self._progress(out, step, t0)
            # the job did not change: same plan, nobody else affected
            if self.plan().generation != gen and not self.finished():
                out.detail = f"plan changed to g{self.plan().generation}"
        elif kind.startswith("kill_") or kind == "nats_restart":
            name = ("nats-server" if kind == "nats_restart"
                    else await self.active(kind[len("kill_"):]))
            before = self.count(name)
            _signal(self.latest_pid(name), signal.SIGKILL, name)
            out.injected, out.target = True, name
            self.say(f"#{ev.index} {kind}: SIGKILL {name} at step {step}")
            await self._service_back(name, before)
            await self._progress(out, max(step, self.step()), t0)
        elif kind in ELASTIC_KINDS:
            from schemas.messages import Capacity, CapacityChange, Priority

            bus = self.c.bus
            if kind == "priority":
                msg = Priority(release=1, priority=10, reason="chaos")
                subject = bus.subjects.priority
            else:
                msg = Capacity(change=CapacityChange.add if kind == "capacity_add"
                               else CapacityChange.remove, count=1, reason="chaos")
                subject = bus.subjects.capacity
            n = len(self.decisions)
            await bus.publish(subject, msg)
            out.injected, out.target = True, f"{subject.rsplit('.', 1)[1]} {msg.request_id}"
            self.say(f"#{ev.index} {kind} at step {step}")
            d = await self.wait(lambda: next((x for x in self.decisions[n:]
                                              if x.request_id == msg.request_id), None),
                                60, f"the scaler's decision on {kind}")
            out.detail = f"{'accepted' if d.accepted else 'refused'}: {d.reason}"
            await self._progress(out, step, t0)
        elif kind in GUARD_KINDS:
            await chaos_guards.inject(self, ev, out)
        elif kind in HOST_KINDS:
            await chaos_hosts.inject(self, ev, out)
        else:
            raise ChaosFailure(f"unknown event kind {kind!r}")
        out.survived = True
        self.say(f"  survived in {out.recover_s:.2f}s{(' (' + out.detail + ')') if out.detail else ''}")

    def pods(self) -> list[tuple[str, int]]:
        """Every live pod `up` (its actuator) started: members, spares, replacements, in
        the run dir and its restarts, as recorded in pids.txt (not services, nats-server)."""
        return [(n, pid) for n, pid in self.c.live() if _service_of(n) not in SERVICES
                and n not in ("nats-server", "zygote")]

    async def _kill_all(self, ev: Event, out: Outcome, step: int, t0: float) -> None:
        """SIGKILL every pod at once: no holder of the state survives. `up` restarts the job
        from its newest checkpoint; survived once every member of the restarted job trained
        past the step it was killed at."""
        from agent import checkpoint

        if self.ckdir is None:
            raise ChaosFailure("kill_all needs the run's checkpoints (none configured)")
        await self.wait(lambda: checkpoint.latest(self.ckdir) is not None, 120,
                        "a complete checkpoint to restart from")
        step = max(step, self.step())
        out.at_step = step
        n = len(self.restarts)
        self.killed_gen = self.plan().generation
        killed = []
        for name, pid in self.pods():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(name)
            except ProcessLookupError:
                pass
        if not killed:
            raise ChaosFailure("no live pod to kill")
        out.injected = True
        out.target = f"{len(killed)} pods ({', '.join(sorted(killed))})"
        self.say(f"#{ev.index} kill_all: SIGKILL {out.target} at step {step} "
                 f"(g{self.plan().generation})")
        await self.wait(lambda: len(self.restarts) > n and (
            self.finished() or self.healthy(past=step)), RESTART_TIMEOUT,
            f"the job restarted from a checkpoint and past step {step}")
        out.recover_s = time.monotonic() - t0
        r = self.restarts[n]
        if r["from_step"] is not None:
            out.recomputed = max(0, max(step, r["last_step"]) - r["from_step"])
        out.detail = (f"restarted in {Path(r['run_dir']).name} from checkpoint step "
                      f"{r['from_step']}, {out.recomputed} step(s) recomputed")

    def cleanup(self) -> None:
        live = {pid for _, pid in self.c.live()}
        for pid in self.stopped:
            if pid in live:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


class SmallStart(Exception):
    """The first plan is smaller than --workers: some workers registered after the scaler's
    start timeout (an overloaded machine). Such a run is not comparable bitwise, so it is
    started again."""


ATTEMPTS = 3


async def _full_start(c: Any, workers: int) -> None:
    p = await c.wait_for(lambda: c.plans and c.plans[0], READY_TIMEOUT, "the first plan")
    if p.world_size < workers:
        raise SmallStart(f"the first plan has {p.world_size} of {workers} workers (the others "
                         f"registered after the scaler's start timeout): starting again")


async def _reference(base: Path, opts: ChaosOptions, steps: int, timeout: float,
                     nan_steps: list[int] | None = None) -> dict:
    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await _reference_once(base / ("reference" if attempt == 1 else
                                                 f"reference-{attempt}"),
                                         opts, steps, timeout, nan_steps or [])
        except SmallStart as e:
            print(f"reference: {e}", flush=True)
            if attempt == ATTEMPTS:
                raise ChaosFailure(str(e)) from None
    raise AssertionError("unreachable")


async def _reference_once(run_dir: Path, opts: ChaosOptions, steps: int, timeout: float,
                          nan_steps: list[int]) -> dict:
    from ops.launcher import Cluster

    async with Cluster(run_dir, opts.workers, 0, steps, timeout=timeout,
                       extra=["--model", opts.model, "--dtype", opts.example_dtype]) as c:
        await _full_start(c, opts.workers)
        await chaos_guards.inject_reference(c, nan_steps)
        code = await c.finish(timeout + 30)
        if code != 0:
            raise ChaosFailure(f"the reference run failed (exit {code}):\n{c.output()}")
        s = c.summary()
        s["world_sizes"] = sorted({p.world_size for p in c.plans})
        return s


async def run(opts: ChaosOptions) -> int:
    from ops.launcher import Cluster

    steps = opts.steps or default_steps(opts)
    base = Path(opts.run_dir or Path("runs") / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}-s{opts.seed}")
    base.mkdir(parents=True, exist_ok=True)
    schedule = make_schedule(opts.seed, opts.duration, opts.gap, opts.elastic, opts.kinds,
                             opts.guards)
    print(f"ceaseless chaos: seed {opts.seed}, {opts.workers} workers + {opts.spares} spares, "
          f"{steps} steps ({opts.example_dtype}), {len(schedule)} events\n  run dir: {base}", flush=True)
    for ev in schedule:
        print(f"  #{ev.index:<3} at {ev.at_fraction:5.1%} of the steps: {ev.kind}", flush=True)
    run_timeout = max(600.0, 6 * opts.duration)
    ref, ref_s = None, 0.0
    if not any(ev.kind == "nan" for ev in schedule):  # else after the chaos run, with its NaNs
        ref, ref_s = await _timed_reference(base, opts, steps, run_timeout)

    for attempt in range(1, ATTEMPTS + 1):
        try:
            return await _chaos_once(base / ("chaos" if attempt == 1 else f"chaos-{attempt}"),
                                     base, opts, steps, schedule, ref, ref_s, run_timeout)
        except SmallStart as e:
            print(f"chaos run: {e}", flush=True)
            if attempt == ATTEMPTS:
                raise ChaosFailure(str(e)) from None
    raise AssertionError("unreachable")


async def _timed_reference(base: Path, opts: ChaosOptions, steps: int, timeout: float,
                           nan_steps: list[int] | None = None) -> tuple[dict, float]:
    t = time.monotonic()
    ref = await _reference(base, opts, steps, timeout, nan_steps)
    ref_s = time.monotonic() - t
    print(f"reference: {steps} steps in {ref_s:.1f}s, params {ref['param_sha256'][:16]}…"
          + (f", non-finite steps {sorted(set(nan_steps))}" if nan_steps else ""), flush=True)
    return ref, ref_s


async def _chaos_once(run_dir: Path, base: Path, opts: ChaosOptions, steps: int,
                      schedule: list[Event], ref: dict | None, ref_s: float,
                      run_timeout: float) -> int:
    from ops.launcher import Cluster

    outcomes: list[Outcome] = []
    failures: list[str] = []
    t = time.monotonic()
    # Replacement pods keep the spare pool full (a generous budget: chaos kills on purpose);
    # a stalled training thread is reported by its own watchdog at the stall timeout.
    extra = ["--model", opts.model, "--dtype", opts.example_dtype,
             "--max-replacements", "1000", "--stall-timeout", "8"]
    kill_alls = sum(1 for ev in schedule if ev.kind == "kill_all")
    if any(ev.kind == "bitflip" for ev in schedule):  # found within this many steps
        extra += ["--verify-every", str(chaos_guards.VERIFY_EVERY)]
    if any(ev.kind == "slow" for ev in schedule):  # a shorter window: a shorter run
        extra += ["--straggler-window", str(chaos_guards.STRAGGLER_WINDOW)]
    # host events: 3 hosts, a server on each, a standby of every service off h1
    extra += chaos_hosts.up_args([ev.kind for ev in schedule])
    ckdir = None
    if kill_alls:
        # Every pod killed at once: `up` restarts the job from its newest last-resort
        # checkpoint (one restart per kill_all, and one to spare).
        ckdir = (run_dir / "checkpoints").resolve()
        extra += ["--checkpoint-dir", str(ckdir), "--checkpoint-every",
                  str(opts.checkpoint_every or checkpoint_every(steps)),
                  "--auto-resume", str(kill_alls + 1)]
    async with Cluster(run_dir, opts.workers, opts.spares, steps, timeout=run_timeout,
                       replace=True, extra=extra) as c:
        ch = Chaos(c, opts, steps)
        ch.ckdir = ckdir
        tasks: list[asyncio.Task] = []
        try:
            await ch.attach()
            tasks.append(asyncio.create_task(ch.follow()))
            await _full_start(c, opts.workers)
            await c.wait_spares(opts.spares, timeout=READY_TIMEOUT)
            tasks.append(asyncio.create_task(ch.keep_spares()))
            for ev in schedule:
                out = Outcome(ev.index, ev.kind)
                outcomes.append(out)
                if failures:
                    out.detail = "not injected: an earlier fault failed"
                    continue
                margin = max(30, steps // 12)
                try:
                    await ch.wait(lambda: ch.finished() or ch.step() >= ev.at_fraction * steps,
                                  run_timeout, f"step {ev.at_fraction * steps:.0f}")
                    await ch.ready(SPARES_NEEDED.get(ev.kind, 0))
                    if ch.finished() or ch.step() >= steps - margin:
                        out.detail = "not injected: training too close to its end"
                        continue
                    await ch.inject(ev, out)
                except Exception as e:
                    out.detail = (str(e).splitlines() or [type(e).__name__])[0][:300]
                    failures.append(f"#{ev.index} {ev.kind}: {out.detail}")
                    ch.say(f"  FAILED: {out.detail}")
            code = await c.finish(run_timeout + 30)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ch.cleanup()
        chaos_s = time.monotonic() - t
        s = c.summary()
        # the plans members trained in: not those of a total loss (replacement pods at
        # step -1, the state declared lost, nothing trained)
        plans = ch.trained_plans + list(c.plans)
    if ref is None:
        # the final trajectory's skips: a NaN step a total loss undid was computed again clean
        final_skips, _ = chaos_guards.nan_outcome(ch.nan_events, ch.restarts,
                                                  s.get("skipped_steps") or [])
        ref, ref_s = await _timed_reference(base, opts, steps, run_timeout, final_skips)
    return _verdict(base, opts, steps, schedule, outcomes, failures, ref, s, plans, code,
                    ref_s, chaos_s, ch)


def _verdict(base: Path, opts: ChaosOptions, steps: int, schedule: list[Event],
             outcomes: list[Outcome], failures: list[str], ref: dict, s: dict, plans: list,
             code: int, ref_s: float, chaos_s: float, ch: Chaos) -> int:
    failures = list(failures) + chaos_guards.verdict(s, ref, ch)
    if code != 0:
        failures.append(f"the chaos run exited {code}: {s.get('reason')}")
    if s.get("final_step") != steps - 1:
        failures.append(f"final step {s.get('final_step')}, expected {steps - 1}")
    world_sizes = sorted({p.world_size for p in plans} | {s.get("world_size") or opts.workers})
    fixed = world_sizes == [opts.workers]
    # `up`'s summary after a restart is the last job's: add what the recoveries of the
    # jobs before it lost (steps recomputed after a kill_all's checkpoint are not lost
    # committed steps: they are counted apart)
    lost = int(s.get("lost_steps") or 0) + sum(r.lost_steps for seg, r in ch.recoveries
                                               if seg < ch.segment)
    if s.get("final_step") is not None and s["final_step"] < steps - 1:
        lost += steps - 1 - s["final_step"]
    if lost:
        failures.append(f"{lost} lost step(s)")
    kill_alls = [o for o in outcomes if o.kind == "kill_all" and o.injected]
    restarts = s.get("restarts", [])
    if len(restarts) != len(kill_alls):
        failures.append(f"`up` restarted the job {len(restarts)} time(s) after a total loss, "
                        f"{len(kill_alls)} kill_all event(s) injected")
    recomputed = sum(o.recomputed or 0 for o in kill_alls)
    incidents = s.get("incidents", []) + [i for r in restarts for i in r.get("lost_incidents", [])]
    ref_losses, losses = ref["losses"], s.get("losses", {})
    compared = [k for k in losses if k in ref_losses]
    if fixed:
        check = "bitwise parameters"
        if s.get("param_sha256") != ref["param_sha256"]:
            failures.append(f"params {str(s.get('param_sha256'))[:16]} != reference "
                            f"{ref['param_sha256'][:16]}")
        bad = [k for k in compared if losses[k] != ref_losses[k]]
    else:
        check = f"losses within 1e-4 (world sizes {world_sizes})"
        if not s.get("param_sha256_consistent", True):
            failures.append("members finished with different parameters")
        bad = [k for k in compared if (losses[k] is None) != (ref_losses[k] is None) or (
               losses[k] is not None
               and abs(losses[k] - ref_losses[k]) > 1e-4 * max(1.0, abs(ref_losses[k])))]
    # a skipped non-finite step has no loss (None) in both runs
    rel = [abs(losses[k] - ref_losses[k]) / max(1e-12, abs(ref_losses[k])) for k in compared
           if losses[k] is not None and ref_losses[k] is not None]
    if bad:
        failures.append(f"{len(bad)} step loss(es) differ from the reference, e.g. step "
                        f"{bad[0]}: {losses[bad[0]]} vs {ref_losses[bad[0]]}")
    if not compared:
        failures.append("no losses to compare")
    injected = [o for o in outcomes if o.injected]
    survived = [o for o in injected if o.survived]
    downs = [i["downtime"] for i in incidents if i.get("downtime") is not None]
    rec = [o.recover_s for o in survived if o.recover_s is not None
           and o.kind in ("kill", "hang", "kill_rank0", "during_recovery", "kill_with_service",
                          "host_loss", "host_during_recovery")]
    by_kind: dict[str, list[int]] = {}
    for o in injected:
        by_kind.setdefault(o.kind, [0, 0])
        by_kind[o.kind][0] += 1
        by_kind[o.kind][1] += int(o.survived)
    report = {
        "seed": opts.seed, "duration": opts.duration, "workers": opts.workers,
        "spares": opts.spares, "steps": steps, "elastic": opts.elastic, "dtype": opts.example_dtype,
        "reference_s": round(ref_s, 1), "chaos_s": round(chaos_s, 1),
        "events": len(schedule), "faults_injected": len(injected),
        "faults_survived": len(survived), "by_kind": by_kind,
        "incidents": len(incidents),
        "downtime_p50": percentile(downs, 50), "downtime_p99": percentile(downs, 99),
        "downtime_max": max(downs) if downs else None,
        "recover_p50": percentile(rec, 50), "recover_p99": percentile(rec, 99),
        "lost_steps": lost, "recomputed_steps": recomputed,
        "nan_steps": sorted(set(ch.nan_steps)), "skipped_steps": s.get("skipped_steps", []),
        # injected, then undone by a total loss: computed again clean after the restart
        "nan_undone": sorted(set(ch.nan_steps) - set(s.get("skipped_steps") or [])),
        "goodput": s.get("goodput"),
        "restarts": [{**r, "outcome": o.index} for r, o in zip(ch.restarts, kill_alls)],
        "check": check, "world_sizes": world_sizes,
        "generation": s.get("generation"), "param_sha256": s.get("param_sha256"),
        "reference_sha256": ref["param_sha256"], "losses_compared": len(compared),
        "max_loss_rel_diff": max(rel, default=None),
        "failures": failures, "outcomes": [asdict(o) for o in outcomes],
        "schedule": [asdict(e) for e in schedule], "log": ch.log,
    }
    (base / "chaos.json").write_text(json.dumps(report, indent=2) + "\n")

    def f(x):
        return "-" if x is None else f"{x:.3f}s"

    print("\nceaseless chaos: " + ("PASSED" if not failures else "FAILED"))
    print(f"  faults injected   {len(injected)} of {len(schedule)} scheduled "
          f"({', '.join(f'{k} {v[0]}' for k, v in sorted(by_kind.items()))})")
    print(f"  faults survived   {len(survived)}")
    print(f"  incidents         {len(incidents)} (generation {s.get('generation')}"
          + (f" of the job's restart {len(restarts)}" if restarts else "") + ")")
    print(f"  downtime          p50 {f(report['downtime_p50'])}, p99 {f(report['downtime_p99'])}"
          f" (per incident, last evidence of the fault to every rank's first step after it)")
    print(f"  fault to healthy  p50 {f(report['recover_p50'])}, p99 {f(report['recover_p99'])}"
          f" (observer: injection to every member training past the interrupted step)")
    print(f"  lost steps        {lost}")
    if kill_alls:
        print(f"  total losses      {len(kill_alls)}, restarted {len(restarts)} time(s) from a "
              f"checkpoint; {recomputed} committed step(s) after it recomputed (bitwise; "
              "not counted as lost)")
    print(f"  result            {check}: "
          f"{'equal' if not any('params' in x or 'loss' in x for x in failures) else 'DIFFERENT'}"
          f" ({len(compared)} losses compared)")
    print(f"  time              reference {ref_s:.0f}s, chaos {chaos_s:.0f}s; report "
          f"{base / 'chaos.json'}")
    for x in failures:
        print(f"  FAILURE: {x}")
    return 0 if not failures else 1


# ----------------------------------------------------------------------------- CLI
def cmd_chaos(args: argparse.Namespace) -> int:
    kinds = args.kinds.split(",") if args.kinds else None
    if kinds and (HOST_GROUP in kinds or set(kinds) & set(HOST_KINDS)):
        why = chaos_hosts.namespaces_missing()
        if why is not None:  # `up --hosts` falls back to loopback addresses: no partition
            print(f"ceaseless chaos: hosts are loopback addresses here ({why}): no "
                  "partition events", file=sys.stderr)
            if "partition" in kinds:
                print("ceaseless chaos: `partition` needs network namespaces", file=sys.stderr)
                return 2
        kinds = chaos_hosts.expand(kinds, why)
    if kinds:
        unknown = (set(kinds) - set(KINDS) - set(ELASTIC_KINDS) - set(GUARD_KINDS)
                   - set(HOST_KINDS))
        if unknown:
            print(f"ceaseless chaos: unknown kinds {sorted(unknown)}", file=sys.stderr)
            return 2
    need = max(SPARES_NEEDED.get(k, 0) for k in (kinds or KINDS + (
        GUARD_KINDS if args.guards else ())))
    if "slow" in (kinds or (GUARD_KINDS if args.guards else ())) and args.workers < 3:
        print("ceaseless chaos: `slow` needs --workers >= 3 (a straggler is slow against the "
              "median of the others)", file=sys.stderr)
        return 2
    if args.workers < 1 or args.spares < max(1, need):
        print(f"ceaseless chaos: needs --workers >= 1 and --spares >= {max(1, need)} "
              "(a fault during recovery uses two)", file=sys.stderr)
        return 2
    opts = ChaosOptions(duration=args.duration, seed=args.seed, workers=args.workers,
                        spares=args.spares, steps=args.steps, gap=args.gap,
                        elastic=args.elastic, guards=args.guards, run_dir=args.run_dir,
                        model=args.model,
                        kinds=kinds, dtype=args.dtype, checkpoint_every=args.checkpoint_every)
    # SIGTERM (`timeout`, a CI runner) unwinds as Ctrl-C does, so the run's `up` and every
    # process it started are stopped by PID, not left training on.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(run(opts))
    except ChaosFailure as e:
        print(f"ceaseless chaos: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def register(sub: Any) -> None:
    p = sub.add_parser("chaos", help="run the example under a seeded fault schedule and "
                                     "compare with a fault-free run")
    p.add_argument("--duration", type=float, default=600.0,
                   help="seconds of chaos (sizes the run: steps and number of events)")
    p.add_argument("--seed", type=int, default=0, help="the schedule is a function of the seed")
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--spares", type=int, default=2)
    p.add_argument("--steps", type=int, help="training steps (default: from --duration)")
    p.add_argument("--gap", type=float, default=8.0, help="mean seconds between events")
    p.add_argument("--elastic", action="store_true",
                   help="also capacity add/remove and priority release events (the world "
                        "size then changes: losses are compared within 1e-4)")
    p.add_argument("--guards", action="store_true",
                   help="also the guards' events: nan, slow, preempt, bitflip (the chaos run "
                        "then verifies every 10 steps)")
    p.add_argument("--kinds", help="comma-separated subset of: "
                   + ",".join(KINDS + ELASTIC_KINDS + GUARD_KINDS + HOST_KINDS)
                   + f"; `{HOST_GROUP}`: every host kind this machine can run (the run's "
                   "`up` then gets " + " ".join(chaos_hosts.UP_ARGS) + ")")
    p.add_argument("--model", default="tiny")
    p.add_argument("--dtype", choices=["float32", "float64"],
                   help="the example's dtype (default: float64 with --elastic, else float32)")
    p.add_argument("--checkpoint-every", type=int, metavar="N",
                   help="with kill_all events: the chaos run's last-resort checkpoint "
                        "interval (default: steps / 25, at least 10)")
    p.add_argument("--run-dir", help="default: runs/chaos-<time>-s<seed>")
    p.set_defaults(func=cmd_chaos)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m ops.chaos")
    register(ap.add_subparsers(dest="command", required=True))
    a = ap.parse_args(["chaos", *sys.argv[1:]])
    sys.exit(a.func(a))
