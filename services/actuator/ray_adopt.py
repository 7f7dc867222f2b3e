"""A lease for the Ray driver (issue 42, the Ray path): several ``ceaseless up --actuator ray
--bus URLS`` drivers of one job, on different nodes; one acts, the others stand by.

The acting driver holds ``actuator_lease`` in the job's KV (the ``Lease`` of
services/common/lease.py, as every service's). Its pods are named, detached Ray actors
(the pod id, in the job's namespace ``ceaseless-<job>``): they outlive it. A standby that
takes the lease (the holder lost: its TTL ran out) does not start a second set: it lists
the job's named actors, adopts each (its handle, pid and node, asked of the actor) and
watches its exit as the creator did (``RayActuator._watch_actor``: the exit published, a
failed pod replaced); the scaler's commands already carry the scaler's term, so nothing
else is needed to follow on. Pod ids already used (lifecycle ``started`` events in the job
stream) are never given again.

State machine (``DriverState``): STANDBY -> TAKING (lease taken: adopt, or start the job's
first pods when it has none and no plan: ``on_acquire``) -> ACTIVE -> STANDBY (lease lost:
the pods are left running, unwatched, for the next holder) ; ENDED (the job's end, written
by the acting driver to ``actuator_end``, seen: every driver stops). Only an ACTIVE (or
TAKING: answered once taken) driver answers actuator commands and injections.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Awaitable, Callable, Iterable

from nats.js.errors import KeyNotFoundError, NotFoundError

from plumbing import logs
from schemas.messages import Lifecycle, LifecycleEvent, Role
from schemas.subjects import ACTUATOR_END_KEY
from services.common.lease import TICKS_PER_TTL, Lease

from .local import record_pid
from .ray import ACTOR_LOST_EXIT_CODE, RayActuator, _ref

log = logs.get("actuator")

SERVICE = "actuator"          # its lease's key: actuator_lease
ADOPT_CALL_S = 10.0           # an adopted actor's ``describe`` (its node may be slow)
_POD = re.compile(r"^([ws])\d+$")  # LocalActuator.new_pod_id's ids


class DriverState(str, Enum):
    STANDBY = "standby"
    TAKING = "taking"
    ACTIVE = "active"
    ENDED = "ended"


class Action(str, Enum):
    START = "start"   # a new job: start its first pods
    ADOPT = "adopt"   # a running job: adopt its pods
    END = "end"       # the job has ended: nothing to act on


def on_acquire(pods: Iterable[str], has_plan: bool, ended: bool) -> Action:
    """What a driver that just took the lease does: a job that has pods or a plan is
    running (adopt, never start a second set); one with neither and no end is new."""
    if ended:
        return Action.END
    if list(pods) or has_plan:
        return Action.ADOPT
    return Action.START


def role_of(pod: Any) -> Role | None:
    m = _POD.match(pod) if isinstance(pod, str) else None
    if m is None:
        return None
    return Role.worker if m.group(1) == "w" else Role.spare


def job_pods(named: Iterable[dict], namespace: str) -> dict[str, Role]:
    """The job's pods among Ray's named actors (``list_named_actors(all_namespaces=True)``):
    those in its namespace whose name is a pod id; anything else there is logged, skipped."""
    out: dict[str, Role] = {}
    for a in named:
        if not isinstance(a, dict) or a.get("namespace") != namespace:
            continue
        role = role_of(a.get("name"))
        if role is None:
            log.warning("named actor in the job's namespace is not a pod; left alone",
                        name=str(a.get("name"))[:64], namespace=namespace)
            continue
        out[a["name"]] = role
    return out


@dataclass(frozen=True)
class JobEnd:
    holder: str
    code: int
    reason: str

    def dumps(self) -> bytes:
        return json.dumps({"holder": self.holder, "code": self.code,
                           "reason": self.reason}).encode()


def parse_end(raw: bytes | None) -> JobEnd | None:
    """The job's end as the acting driver wrote it; None: absent or not readable (logged)."""
    if not raw:
        return None
    try:
        obj = json.loads(raw)
        return JobEnd(str(obj["holder"]), int(obj["code"]), str(obj["reason"]))
    except (ValueError, TypeError, KeyError) as e:
        log.warning("job end unreadable; ignored", key=ACTUATOR_END_KEY, error=str(e)[:200])
        return None


class DriverLease:
    """Gates a ``RayActuator`` by the actuator lease. ``install`` before ``attach``;
    ``start`` takes the lease or stands by; ``finish`` writes the job's end (when acting)
    and gives the lease back. ``start_pods`` is how the job's first pods are started."""

    def __init__(self, act: RayActuator, holder: str, ttl: float,
                 start_pods: Callable[[], Awaitable[None]]) -> None:
        self.act = act
        self.holder = holder
        self.start_pods = start_pods
        self.state = DriverState.STANDBY
        self.lease = Lease(act.bus, SERVICE, holder, ttl, log,
                           on_acquired=self._acquired, on_lost=self._lost)
        self.ended: JobEnd | None = None
        self.taken: list[tuple[float, Action, list[str]]] = []  # (wall time, action, pods)
        self._ready = asyncio.Event()
        self._poll = False
        self._decisions = False
        self._taking: asyncio.Task | None = None
        self._watch_end: asyncio.Task | None = None

    @property
    def watching(self) -> bool:
        """It acts: the pods' exits it sees are the job's."""
        return self.state is DriverState.ACTIVE

    @property
    def acted(self) -> bool:
        return bool(self.taken)

    # ------------------------------------------------------------------ gate
    def install(self) -> None:
        """Commands and injections reach the actuator only while this driver acts (a
        standby never answers: the acting one does)."""
        on_command, on_inject = self.act._on_command, self.act.injections.on_inject

        async def command(cmd: Any, env: Any) -> None:
            if await self._acting():
                await on_command(cmd, env)

        async def inject(msg: Any, env: Any) -> None:
            if await self._acting():
                await on_inject(msg, env)

        self.act._on_command = command  # type: ignore[method-assign]
        self.act.injections.on_inject = inject  # type: ignore[method-assign]
        # the node table is polled (capacity signals) by the acting driver only
        self._poll, self.act.watch_nodes = self.act.watch_nodes, False

    async def _acting(self) -> bool:
        if self.state is DriverState.TAKING:  # answered once the pods are adopted
            try:
                await asyncio.wait_for(self._ready.wait(), self.lease.ttl)
            except asyncio.TimeoutError:
                return False
        return self.state is DriverState.ACTIVE and self.lease.acting

    # ------------------------------------------------------------------ lease
    async def start(self) -> None:
        await self.lease.start()
        self._watch_end = asyncio.create_task(self._end_loop())

    def _acquired(self, term: int) -> None:
        if self.state is DriverState.ENDED:
            return
        self.state = DriverState.TAKING
        self._taking = asyncio.create_task(self._take(term))

    def _lost(self, holder: str | None) -> None:
        if self.state is DriverState.ENDED:
            return
        if self._taking is not None:
            self._taking.cancel()
        self._ready.clear()
        self.state = DriverState.STANDBY
        self._disown()
        log.warning("actuator lease lost: pods left to the next holder", holder=holder)

    async def _take(self, term: int) -> None:
        try:
            await self._take_once(term)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # Ray or the bus not answering: give it back, take it again
            log.warning("actuator lease taken but not acted on; given back",
                        error=f"{type(e).__name__}: {str(e)[:200]}")
            self.state = DriverState.STANDBY
            self._disown()
            await self.lease.release()

    async def _take_once(self, term: int) -> None:
        import ray

        t0 = time.monotonic()
        kv = await self.act.bus.kv()
        from services.common.plans import load_plan

        ended = await self._read_end(kv)
        named = await asyncio.to_thread(ray.util.list_named_actors, all_namespaces=True)
        pods = job_pods(named, self.act.namespace or "")
        plan, _, _ = await load_plan(kv)
        action = on_acquire(pods, plan is not None, ended is not None)
        if action is Action.END:
            self._end(ended)
            return
        if plan is not None and (self.act.plan is None
                                 or plan.generation > self.act.plan.generation):
            self.act.plan = plan
        await self._learn_ids()
        await self._watch_nodes()
        if action is Action.ADOPT:
            await asyncio.gather(*(self._adopt(p, r) for p, r in sorted(pods.items())))
        self.state = DriverState.ACTIVE
        self._ready.set()
        self.taken.append((time.time(), action, sorted(pods)))
        log.info("actuator acting", term=term, action=action.value, pods=sorted(pods),
                 take_s=round(time.monotonic() - t0, 3))
        if action is Action.START:
            await self.start_pods()

    async def _learn_ids(self) -> None:
        """Every pod id the job used (its ``started`` events): never given again."""
        from services.common.history import read_back

        try:
            seen = await read_back(self.act.bus, self.act.bus.subjects.lifecycle(), Lifecycle,
                                   log)
        except Exception as e:  # the stream not answering: ids of actors still known
            log.warning("pod ids not read back", error=str(e)[:200])
            return
        for m, _ in seen:
            if m.event == LifecycleEvent.started:
                self.act.roles.setdefault(m.pod, m.role)

    async def _adopt(self, pod: str, role: Role) -> None:
        import ray

        act = self.act
        act.roles[pod] = role
        try:
            actor = await asyncio.to_thread(ray.get_actor, pod, act.namespace)
            info = await asyncio.wait_for(_ref(actor.describe.remote()), ADOPT_CALL_S)
            pid = int(info["pid"])
        except Exception as e:  # gone since it was listed, or never started its process
            log.warning("pod not adopted: lost", pod=pod, error=f"{type(e).__name__}: "
                        f"{str(e)[:200]}")
            await act._exited(pod, ACTOR_LOST_EXIT_CODE, None, reason="actor lost",
                              error="not adoptable")
            return
        act.actors[pod], act.pids[pod] = actor, pid
        act.nodes[pod], act.info[pod] = info.get("node_id", "?"), info
        record_pid(act.log_dir.parent, pod, pid)
        log.info("pod adopted", pod=pod, role=role.value, pid=pid,
                 node=info.get("node_ip"))
        task = asyncio.create_task(act._watch_actor(pod, actor, pid))
        act._watchers.add(task)
        task.add_done_callback(act._watchers.discard)

    async def _watch_nodes(self) -> None:
        act = self.act
        if self._poll and act._poller is None:
            if not self._decisions:  # answers to its capacity requests (RayActuator.attach)
                from schemas.messages import Decision

                await act.bus.subscribe(act.bus.subjects.decision, Decision, act._on_decision)
                self._decisions = True
            act._poller = asyncio.create_task(act._poll_nodes())

    def _disown(self) -> None:
        """Stop watching the pods (they run on, for the next holder) and the nodes."""
        act = self.act
        for t in [*act._watchers, *([act._poller] if act._poller else [])]:
            t.cancel()
        act._poller = None
        act.actors.clear()
        act.pids.clear()
        act.nodes.clear()

    # ------------------------------------------------------------------ the job's end
    async def _read_end(self, kv: Any) -> JobEnd | None:
        try:
            return parse_end((await kv.get(ACTUATOR_END_KEY)).value)
        except (KeyNotFoundError, NotFoundError):
            return None

    def _end(self, end: JobEnd | None) -> None:
        self.state = DriverState.ENDED
        self.ended = end
        self._ready.set()
        log.info("the job ended under another driver", end=end)

    async def _end_loop(self) -> None:
        """A standby learns the job's end from KV (a tick apart, as the lease)."""
        kv = await self.act.bus.kv()
        while self.state is not DriverState.ENDED:
            await asyncio.sleep(self.lease.ttl / TICKS_PER_TTL)
            if self.state is DriverState.STANDBY:
                try:
                    end = await self._read_end(kv)
                except Exception:  # the bus away: the lease notices too
                    continue
                if end is not None:
                    self._end(end)

    async def finish(self, code: int, reason: str) -> None:
        """The job ends here: the acting driver writes its end (the standbys stop, none
        takes the lease to adopt pods that are being stopped), then every driver stops."""
        if self.state is DriverState.ACTIVE:
            try:
                kv = await self.act.bus.kv()
                await kv.put(ACTUATOR_END_KEY, JobEnd(self.holder, code, reason).dumps())
            except Exception as e:
                log.warning("job end not written", error=str(e)[:200])
        if self.state is not DriverState.ENDED:
            self.state = DriverState.ENDED
        for t in (self._taking, self._watch_end):
            if t is not None:
                t.cancel()
        await self.lease.stop()

    def status(self) -> dict[str, Any]:
        return {"state": self.state.value, **self.lease.status(),
                "taken": [(round(t, 3), a.value, p) for t, a, p in self.taken]}
