"""Ray actuator: every pod is a Ray actor that runs the training command as its child.

``ceaseless up --actuator ray [--ray-address auto|ADDRESS]``. The control plane (nats-server
and the three services) stays where ``up`` runs; only the pods go to the Ray cluster. The
actuator keeps ``LocalActuator``'s interface and its rules (bus wiring, ``inject kill``,
replacement spares within the ``ReplacementBudget``, ``is_failure``); what differs is how
a pod runs:

* ``PodActor`` (``max_restarts=0``, a small ``num_cpus``, ``num_gpus`` = ``--gpus-per-pod``)
  starts the command as its child process with the pod's environment, plus the
  ``CUDA_VISIBLE_DEVICES`` Ray assigned (``num_gpus`` > 0) and the node's address for gloo
  (``CEASELESS_GLOO_HOSTNAME`` = the node IP Ray reports, unless the node's own environment
  sets it or ``GLOO_SOCKET_IFNAME``). The child dies with the actor (``PR_SET_PDEATHSIG``).
  The actor only runs and reports; the actuator, in the ``up`` process, publishes the
  ``Lifecycle`` events.
* An actor that dies (its node lost, its worker killed) makes the pending ``wait`` call fail
  at once: that is reported as the pod exiting with ``ACTOR_LOST_EXIT_CODE`` (-9, as if
  SIGKILLed), so the health monitor declares a crash without waiting for the heartbeat
  timeout, and the pod is replaced like any failed pod.
* Placement (``spare_node``): one actor per pod; members with Ray's ``SPREAD`` strategy; a
  spare on an alive node that could hold it (its total resources) and holds no member (the
  one with the fewest of the job's pods), by soft node affinity, so a node loss takes a member or a spare but rarely both; where
  every node holds a member, ``SPREAD``; a node being drained is never chosen, and nodes
  with room now come first.
* Several drivers (``up --bus``, ``detached``): each pod's actor is named (its id, in the
  job's namespace) and detached, so it outlives the driver that started it; one driver
  acts by lease and a standby adopts the pods (``ray_adopt.py``).
* Cluster signals (``watch_nodes``, on in ``ceaseless up``): Ray's node table is polled
  every ``poll_s`` (1 s). A node that joins with room for N pods → ``capacity add N``; a
  node that leaves with room announced and never used → ``capacity remove``; a node being
  drained (``ray drain-node``, the autoscaler's drain: GCS's draining-node list, with its
  deadline) → a ``priority`` release that names the job's pods on it (``NodeSignals``).
"""

from __future__ import annotations

import asyncio
import math
import os
import signal as _signal_mod
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterable

from schemas.messages import (Capacity, CapacityChange, Decision, Lifecycle, LifecycleEvent,
                              Priority, Role)
from plumbing import logs

from .base import PodSpec
from .local import LocalActuator, record_pid
from .replace import ReplacementBudget

log = logs.get("actuator")

# The exit code reported for a pod whose actor died under it (node lost, worker killed):
# like a SIGKILL, a failure (replaced) and a "kill" for `up`'s total-loss rule.
ACTOR_LOST_EXIT_CODE = -9

# Variables of `up`'s own environment that travel to the pods (the rest of a pod's
# environment is its node's): the agent's settings and the collective libraries' knobs.
# Per-node settings (which address gloo binds) are never taken from `up`'s machine.
FORWARDED_PREFIXES = ("CEASELESS_", "TORCH_", "NCCL_", "GLOO_", "OMP_")
PER_NODE = ("CEASELESS_GLOO_HOSTNAME", "GLOO_SOCKET_IFNAME", "CEASELESS_POD",
            "CEASELESS_ROLE", "CUDA_VISIBLE_DEVICES")
# Paths in the pod's environment that name files on `up`'s machine: their contents travel
# with the start call and the actor writes them into a private directory on its node.
FILE_VARS = ("CEASELESS_CREDS", "CEASELESS_TLS_CA")

# The child sets its parent-death signal, then becomes the command (Linux; elsewhere it
# just runs the command). A separate interpreter, not ``preexec_fn``: the actor's worker
# process has many threads.
_DIE_WITH_PARENT = (
    "import ctypes, os, sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(137)  # the actor is already gone\n"
    "os.execvpe(sys.argv[2], sys.argv[2:], os.environ)\n"
)


class PodActor:
    """One pod on a Ray node (an async actor: every call runs on its one event loop, whose
    thread forks the child and lives as long as the actor)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.private: str | None = None
        self.info: dict[str, Any] = {}  # what ``start`` returned: a driver adopting it asks

    async def start(self, pod: str, argv: list[str], env: dict[str, str], log_dir: str,
                    files: dict[str, str], gpus: bool) -> dict[str, Any]:
        import ray

        node_ip = ray.util.get_node_ip_address()
        full = {**os.environ, **env}
        if gpus:  # the devices Ray assigned to this actor
            full["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        if not full.get("CEASELESS_GLOO_HOSTNAME") and not full.get("GLOO_SOCKET_IFNAME"):
            full["CEASELESS_GLOO_HOSTNAME"] = node_ip
        if files:
            self.private = tempfile.mkdtemp(prefix=f"ceaseless-{pod}-")
            for var, content in files.items():
                path = os.path.join(self.private, var.lower())
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(content)
                full[var] = path
        try:
            os.makedirs(log_dir, exist_ok=True)
        except OSError:  # `up`'s log dir is not on this node's filesystem
            log_dir = self.private or tempfile.mkdtemp(prefix=f"ceaseless-{pod}-")
        log_path = os.path.join(log_dir, f"{pod}.log")
        out = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()), *argv], env=full,
                stdout=out, stderr=out, stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
        self.info = {"pid": self.proc.pid, "node_id": ray.get_runtime_context().get_node_id(),
                     "node_ip": node_ip, "log": log_path, "role": env.get("CEASELESS_ROLE"),
                     "cuda_visible_devices": full.get("CUDA_VISIBLE_DEVICES")}
        return self.info

    async def describe(self) -> dict[str, Any]:
        """``start``'s answer, for a driver that adopts this pod (ray_adopt.py)."""
        return dict(self.info)

    async def wait(self) -> int:
        assert self.proc is not None
        code = await asyncio.to_thread(self.proc.wait)
        self._forget_files()
        return code

    async def signal(self, sig: int) -> bool:
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            return False
        return True

    async def terminate(self, grace_s: float) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit code (None: not running)."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        await self.signal(_signal_mod.SIGTERM)
        try:  # a member takes a first SIGTERM as a preemption notice; a second ends it now
            return await asyncio.to_thread(self.proc.wait, min(0.3, grace_s))
        except subprocess.TimeoutExpired:
            await self.signal(_signal_mod.SIGTERM)
        try:
            return await asyncio.to_thread(self.proc.wait, grace_s)
        except subprocess.TimeoutExpired:
            await self.signal(_signal_mod.SIGKILL)
            return await asyncio.to_thread(self.proc.wait)

    def _forget_files(self) -> None:
        if self.private:
            for name in FILE_VARS:
                try:
                    os.unlink(os.path.join(self.private, name.lower()))
                except OSError:
                    pass


def spare_node(alive: Iterable[str], member_nodes: Iterable[str],
               pod_nodes: Iterable[str], room: Iterable[str] | None = None) -> str | None:
    """Where a new spare goes: an alive node that holds no member, the one holding the
    fewest of the job's pods (ties: the first in ``alive``), among those with room for a
    pod now (``room``, when known) first; None when every alive node holds a member (Ray's
    SPREAD then decides)."""
    members = set(member_nodes)
    load = Counter(pod_nodes)
    fits = set(room) if room is not None else None
    free = [n for n in alive if n not in members]
    if not free:
        return None
    return min(free, key=lambda n: (fits is not None and n not in fits, load[n]))


def pods_that_fit(free: dict[str, float], need: dict[str, float]) -> int:
    """How many pods needing ``need`` fit in a node's ``free`` resources (1 when a pod
    needs nothing Ray counts)."""
    need = {k: v for k, v in need.items() if v > 0}
    if not need:
        return 1
    return max(0, min(math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in need.items()))


DRAIN_PRIORITY = 1000  # the priority of a release asked for by a node drain


class NodeSignals:
    """What the Ray node table means for the job, poll by poll (pure: no Ray, no clock).

    ``update`` takes one poll: ``nodes`` (node id -> (alive, pods that fit in its free
    resources now)), ``draining`` (node id -> deadline in wall ms, 0: none) and ``pods_on``
    (node id -> the job's pods there), and returns the events to publish:

    * ``("add", node, n)``: a node not seen before is alive, not draining, with room for n
      pods (the nodes of the first poll are the job's starting cluster: no event);
    * ``("remove", node, n)``: a node whose room was announced (and not refused) leaves, or
      starts draining, holding none of that room's pods: n = the room still free, at most
      what was announced;
    * ``("drain", node, deadline_ms, pods)``: a node starts draining with the job's pods.
    """

    def __init__(self) -> None:
        self.seeded = False
        self.known: set[str] = set()
        self.fit: dict[str, int] = {}
        self.announced: dict[str, int] = {}
        self.draining: set[str] = set()
        self.gone: set[str] = set()

    def refused(self, node: str) -> None:
        """The scaler refused the ``add`` for ``node``: its room never raised the target."""
        self.announced.pop(node, None)

    def update(self, nodes: dict[str, tuple[bool, int]], draining: dict[str, int],
               pods_on: dict[str, list[str]]) -> list[tuple]:
        out: list[tuple] = []
        for node, (alive, fit) in nodes.items():
            if alive:
                self.fit[node] = fit
        if not self.seeded:
            self.seeded = True
            self.known = {n for n, (alive, _) in nodes.items() if alive}
            self.draining = set(draining)
            return out
        for node, (alive, fit) in sorted(nodes.items()):
            if alive and node not in self.known and node not in self.gone:
                self.known.add(node)
                if node not in draining and fit > 0:
                    self.announced[node] = fit
                    out.append(("add", node, fit))
        for node in sorted(self.known):
            alive = nodes.get(node, (False, 0))[0]
            if alive and node in draining and node not in self.draining:
                self.draining.add(node)
                pods = sorted(pods_on.get(node, []))
                out.extend(self._unused(node))
                if pods:
                    out.append(("drain", node, draining[node], pods))
            elif not alive:
                self.known.discard(node)
                self.gone.add(node)
                if not pods_on.get(node):
                    out.extend(self._unused(node))
                self.announced.pop(node, None)
        return out

    def _unused(self, node: str) -> list[tuple]:
        n = min(self.announced.pop(node, 0), self.fit.get(node, 0))
        return [("remove", node, n)] if n > 0 else []


class RayActuator(LocalActuator):
    def __init__(self, bus: Any, argv: list[str], env: dict[str, str], log_dir: Path, *,
                 address: str | None = "auto", num_cpus: float = 0.1,
                 num_gpus: float = 0, resources: dict[str, float] | None = None,
                 start_timeout_s: float = 120.0, unavailable_grace_s: float = 0.5,
                 namespace: str | None = None, restart_fallback: bool = True,
                 allow_inject: bool = False, replace: bool = True,
                 budget: ReplacementBudget | None = None, watch_nodes: bool = False,
                 poll_s: float = 1.0, launch_env: dict[str, str] | None = None) -> None:
        super().__init__(bus, argv, env, log_dir, restart_fallback=restart_fallback,
                         allow_inject=allow_inject, gpus=None, replace=replace, budget=budget,
                         launch_env=launch_env)
        self.watch_nodes = watch_nodes
        self.poll_s = poll_s
        self.signals = NodeSignals()
        self.room: set[str] | None = None     # nodes with room for a pod (last poll)
        self.draining: dict[str, int] = {}    # node id -> drain deadline (wall ms, 0: none)
        self.node_events: list[tuple[float, tuple]] = []  # (wall time, event) published
        self._requests: dict[str, str] = {}   # our capacity add request id -> node id
        self._late: set[str] = set()          # draining nodes past their deadline, logged
        self._poller: asyncio.Task | None = None
        self.address = address
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.resources = dict(resources or {})  # custom Ray resources every pod needs
        self.start_timeout_s = start_timeout_s
        self.unavailable_grace_s = unavailable_grace_s
        self.namespace = namespace
        self.actors: dict[str, Any] = {}
        self.pids: dict[str, int] = {}
        self.nodes: dict[str, str] = {}     # pod -> Ray node id (while running)
        self.info: dict[str, dict] = {}     # pod -> what its actor reported at start
        self._starting: dict[str, asyncio.Event] = {}  # pod -> set once its start is known
        self._connected_here = False
        self._actor_cls: Any = None
        # Named (the pod id, in ``namespace``) and detached: the pods outlive this driver, so
        # that a standby driver adopts them (``up --bus``, ray_adopt.py); the job's end
        # still ends them (``shutdown``). Off: they die with the driver, as always.
        self.detached = False

    # ------------------------------------------------------------------ Ray connection
    def connect(self) -> None:
        """Join the Ray cluster (``address``: "auto", "host:port", or None to start a
        local one), unless this process already did."""
        import ray

        if not ray.is_initialized():
            ray.init(address=self.address, namespace=self.namespace, log_to_driver=False,
                     configure_logging=False)
            self._connected_here = True
        self._actor_cls = ray.remote(PodActor)

    def close(self) -> None:
        import ray

        if self._connected_here and ray.is_initialized():
            ray.shutdown()
            self._connected_here = False

    def node_ip(self) -> str:
        """The address of this process's Ray node (where the bus should listen)."""
        import ray

        return ray.util.get_node_ip_address()

    # ------------------------------------------------------------------ cluster signals
    async def attach(self) -> None:
        await super().attach()
        if self.watch_nodes and self._poller is None:
            await self.bus.subscribe(self.bus.subjects.decision, Decision, self._on_decision)
            if self._actor_cls is None:
                self.connect()
            self._poller = asyncio.create_task(self._poll_nodes())

    async def _on_decision(self, d: Decision, env: Any) -> None:
        node = self._requests.pop(d.request_id, None)
        if node is not None and not d.accepted:
            self.signals.refused(node)

    def _need(self) -> dict[str, float]:
        return {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}

    def _node_table(self) -> tuple[dict[str, tuple[bool, int]], dict[str, int], dict[str, str]]:
        """One poll (blocking: run in a thread): each node's (alive, pods that fit in its
        free resources), the draining nodes' deadlines, the alive nodes' addresses."""
        import ray

        table = ray.nodes()
        free = ray._private.state.available_resources_per_node()
        draining = ray._private.state.state.get_draining_nodes()
        need = self._need()
        nodes, ips = {}, {}
        for n in table:
            nid, alive = n["NodeID"], bool(n.get("Alive"))
            res = free.get(nid, n.get("Resources", {})) if alive else {}
            nodes[nid] = (alive, pods_that_fit(res, need))
            if alive:
                ips[nid] = n.get("NodeManagerAddress", "?")
        return nodes, draining, ips

    async def _poll_nodes(self) -> None:
        while True:
            try:
                nodes, draining, ips = await asyncio.to_thread(self._node_table)
                self.draining = dict(draining)
                self.room = {n for n, (alive, fit) in nodes.items()
                             if alive and fit > 0 and n not in draining}
                pods_on: dict[str, list[str]] = {}
                for pod, node in self.nodes.items():
                    pods_on.setdefault(node, []).append(pod)
                for ev in self.signals.update(nodes, draining, pods_on):
                    await self._signal(ev, ips)
                self._check_deadlines(pods_on)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the GCS restarting, a broken connection: poll again
                log.warning("ray node poll failed", error=f"{type(e).__name__}: {str(e)[:200]}")
            await asyncio.sleep(self.poll_s)

    async def _signal(self, ev: tuple, ips: dict[str, str]) -> None:
        s = self.bus.subjects
        node = ev[1]
        where = f"ray node {ips.get(node, '')} {node[:12]}".replace("  ", " ")
        if ev[0] == "add":
            msg = Capacity(change=CapacityChange.add, count=ev[2],
                           reason=f"{where} joined with room for {ev[2]} pod(s)")
            self._requests[msg.request_id] = node
            await self.bus.publish(s.capacity, msg)
        elif ev[0] == "remove":
            msg = Capacity(change=CapacityChange.remove, count=ev[2],
                           reason=f"{where} left with room for {ev[2]} pod(s) unused")
            await self.bus.publish(s.capacity, msg)
        else:
            deadline, pods = ev[2], ev[3]
            left = f", deadline in {deadline / 1000 - time.time():.1f}s" if deadline else ""
            msg = Priority(release=len(pods), priority=DRAIN_PRIORITY, pods=pods,
                           reason=f"{where} is draining{left}: {', '.join(pods)}")
            await self.bus.publish(s.priority, msg)
        self.node_events.append((time.time(), ev))
        log.info("ray node signal", event=ev[0], node=node[:12], detail=msg.reason,
                 request_id=msg.request_id)

    def _check_deadlines(self, pods_on: dict[str, list[str]]) -> None:
        now_ms = time.time() * 1000
        for node, deadline in self.draining.items():
            if deadline and now_ms > deadline and pods_on.get(node) and node not in self._late:
                self._late.add(node)
                log.warning("pods still on a drained node past its deadline", node=node[:12],
                            pods=pods_on[node])

    # ------------------------------------------------------------------ interface
    async def start(self, role: Role, count: int = 1) -> list[str]:
        pods = [self.new_pod_id(role) for _ in range(count)]
        for pod in pods:
            self.roles[pod] = role  # reserve the id at once (new_pod_id checks roles)
        await asyncio.gather(*(self.spawn(self.pod_spec(p, role)) for p in pods))
        return pods

    def log_path(self, pod: str) -> Path:
        """The pod's log as its actor wrote it (`up`'s log dir, or a private directory
        on its node when that is not shared: then not readable here)."""
        return Path(self.info.get(pod, {}).get("log") or self.log_dir / f"{pod}.log")

    def pod_env(self, spec: PodSpec) -> dict[str, str]:
        fwd = {k: v for k, v in os.environ.items()
               if k.startswith(FORWARDED_PREFIXES) and k not in PER_NODE}
        env = {**fwd, **self.env, **spec.env,
               "CEASELESS_POD": spec.pod, "CEASELESS_ROLE": spec.role.value}
        for k in PER_NODE[:2]:
            if k in self.env or k in spec.env:  # set for the pods on purpose: keep it
                env[k] = {**self.env, **spec.env}[k]
        return env

    async def _strategy(self, role: Role) -> Any:
        if role != Role.spare:
            return "SPREAD"
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        members = (set(m.pod for m in self.plan.members) if self.plan is not None
                   else {p for p, r in self.roles.items() if r == Role.worker})
        # A member still starting has no node yet: placing the spare now could put it beside
        # that member (a spare must be away from the members). Wait for their starts first,
        # bounded: a start that never reports places the spare as before.
        busy = [asyncio.ensure_future(self._starting[p].wait())
                for p in members if p in self._starting]
        if busy:
            _, late = await asyncio.wait(busy, timeout=self.start_timeout_s)
            for t in late:
                t.cancel()
        nodes = await asyncio.to_thread(ray.nodes)
        need = self._need()
        alive = [n["NodeID"] for n in nodes if n.get("Alive") and all(
            n.get("Resources", {}).get(k, 0) >= v for k, v in need.items() if v > 0)
            and n["NodeID"] not in self.draining]
        node = spare_node(alive, [self.nodes[p] for p in members if p in self.nodes],
                          self.nodes.values(), room=self.room)
        if node is None:
            return "SPREAD"
        return NodeAffinitySchedulingStrategy(node_id=node, soft=True)

    async def spawn(self, spec: PodSpec) -> None:
        if self._actor_cls is None:
            self.connect()
        self.roles[spec.pod] = spec.role
        self._starting[spec.pod] = asyncio.Event()
        try:
            await self._spawn(spec)
        finally:
            self._starting.pop(spec.pod).set()

    async def _spawn(self, spec: PodSpec) -> None:
        import ray

        env = self.pod_env(spec)
        files = {}
        for var in FILE_VARS:
            if env.get(var):
                try:
                    files[var] = Path(env[var]).read_text()
                except OSError:
                    pass  # not a file here: the nodes must have it at that path
        actor = self._actor_cls.options(
            num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources,
            max_restarts=0,
            max_task_retries=0, scheduling_strategy=await self._strategy(spec.role),
            **({"name": spec.pod, "namespace": self.namespace, "lifetime": "detached"}
               if self.detached else {})).remote()
        t0 = time.monotonic()
        try:
            info = await asyncio.wait_for(_ref(actor.start.remote(
                spec.pod, list(spec.argv), env, str(self.log_dir), files,
                self.num_gpus > 0)), self.start_timeout_s)
        except Exception as e:  # no node with the resources, the actor died at start
            ray.kill(actor, no_restart=True)
            # a pod that failed: it counts against the crash-loop budget like any other
            # (not replaced: it never ran)
            self.budget.take(time.monotonic())
            log.warning("pod not started", pod=spec.pod, role=spec.role.value,
                        reason=f"{type(e).__name__}: {str(e)[:300]}")
            return
        self.actors[spec.pod] = actor
        self.pids[spec.pod] = info["pid"]
        self.nodes[spec.pod] = info["node_id"]
        self.info[spec.pod] = info
        record_pid(self.log_dir.parent, spec.pod, info["pid"])
        log.info("pod started", pod=spec.pod, role=spec.role.value, pid=info["pid"],
                 node=info["node_ip"], node_id=info["node_id"][:12],
                 start_s=round(time.monotonic() - t0, 3),
                 cuda_visible_devices=info.get("cuda_visible_devices"))
        await self.bus.publish(self.bus.subjects.lifecycle(spec.pod), Lifecycle(
            pod=spec.pod, event=LifecycleEvent.started, role=spec.role, pid=info["pid"]))
        task = asyncio.create_task(self._watch_actor(spec.pod, actor, info["pid"]))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch_actor(self, pod: str, actor: Any, pid: int) -> None:
        import ray

        why: dict[str, Any] = {}
        while True:
            try:
                code = await _ref(actor.wait.remote())
                break
            except ray.exceptions.ActorUnavailableError as e:
                # the connection to the actor broke: its worker or node is gone (it has no
                # restarts), or a network blip; it is lost unless it answers again soon
                if await self._answers(actor):
                    continue
                error = type(e).__name__
            except ray.exceptions.RayError as e:  # the actor died: its node is lost
                error = type(e).__name__
            code = ACTOR_LOST_EXIT_CODE
            why = {"reason": "actor lost", "node_id": self.nodes.get(pod, "?")[:12],
                   "error": error}
            break
        self.actors.pop(pod, None)
        self.pids.pop(pod, None)
        self.nodes.pop(pod, None)
        try:
            ray.kill(actor, no_restart=True)  # frees its resources (it outlives its child)
        except Exception:
            pass
        await self._exited(pod, code, pid, **why)

    async def _answers(self, actor: Any) -> bool:
        """Whether an actor whose connection broke answers again within
        ``unavailable_grace_s`` (a died one never does)."""
        import ray

        deadline = time.monotonic() + self.unavailable_grace_s
        while time.monotonic() < deadline:
            try:
                await asyncio.wait_for(_ref(actor.signal.remote(0)), 0.5)
                return True
            except ray.exceptions.ActorDiedError:
                return False
            except (ray.exceptions.RayError, asyncio.TimeoutError):
                await asyncio.sleep(0.2)
        return False

    async def stop(self, pod: str, grace_s: float = 5.0) -> bool:
        actor = self.actors.get(pod)
        if actor is None:
            return False
        self.stopped.add(pod)  # released on purpose (a scale-down): no replacement
        try:
            await asyncio.wait_for(_ref(actor.terminate.remote(grace_s)), grace_s + 5.0)
        except Exception:
            if pod in self.actors:  # not just ended by its watcher
                await self._kill_actor(pod, actor)
        return True

    async def kill(self, pod: str) -> bool:
        actor = self.actors.get(pod)
        if actor is None:
            return False
        self.killed.add(pod)
        try:
            await asyncio.wait_for(_ref(actor.signal.remote(_signal_mod.SIGKILL)), 5.0)
        except Exception:
            if pod in self.actors:
                await self._kill_actor(pod, actor)
        return True

    async def _kill_actor(self, pod: str, actor: Any) -> None:
        """The actor does not answer: end it (its child dies with it)."""
        import ray

        log.warning("actor does not answer; killing it", pod=pod)
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass

    def signal(self, pod: str, sig: int) -> bool:
        actor = self.actors.get(pod)
        if actor is None:
            return False
        actor.signal.remote(int(sig))  # not awaited (inject hang / resume)
        return True

    def running(self) -> dict[str, int]:
        return dict(self.pids)

    async def shutdown(self, grace_s: float = 5.0) -> None:
        self.shutting_down = True
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None
        await asyncio.gather(*(self.stop(p, grace_s) for p in list(self.actors)),
                             return_exceptions=True)
        for t in list(self._watchers):
            try:
                await asyncio.wait_for(t, grace_s + 5.0)
            except Exception:
                pass
        import ray

        for pod, actor in list(self.actors.items()):
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass


def _ref(ref: Any) -> "asyncio.Future[Any]":
    """A Ray ObjectRef as an asyncio future of this loop."""
    return asyncio.wrap_future(ref.future())
