"""Local process supervisor: pods are child processes of ``ceaseless up``.

It answers ``ActuatorCommand`` requests on ``ceaseless.<job>.actuator``, executes
``inject kill`` / ``hang`` / ``resume`` (``inject.py``), publishes a ``Lifecycle`` event for every start and exit, and starts a
fresh spare in place of every pod that fails (any non-zero exit: a crash, a kill, a fenced
pod, ``FALLBACK_EXIT_CODE`` when in-process recovery gave up), within a crash-loop budget
(``replace.py``); ``replace=False`` only restarts ``FALLBACK_EXIT_CODE`` pods.

``launch_env`` (``CEASELESS_RESUME_FROM`` of a resumed job) goes only to the pods started
before the job's first plan: a pod that joins a live job (a replacement spare, a capacity
joiner) takes the state from its peers, never from the checkpoint the job started from,
which the job's own checkpoints may have rotated away since (issue 33).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from schemas.messages import (ActuatorAction, ActuatorCommand, ActuatorReply, Decision,
                              Inject, Lifecycle, LifecycleEvent, Plan, PlanRef, Role)
from plumbing import logs
from plumbing.bus import Bus, Envelope
from plumbing.plan_wire import PLAN_MODELS, resolve
from plumbing.terms import NewestTerm

from . import podlog
from .base import PodHost, PodProcess, PodSpec
from .inject import InjectDesk
from .prefork import Prefork
from .replace import ReplacementBudget, is_failure

# The agent exits with this code when in-process recovery failed too often or it was
# fenced: "restart me as a spare".
FALLBACK_EXIT_CODE = 75
# The exit code recorded for a pod whose command could not be run at all (a shell's "command
# not found"): a failure at start like any other.
COMMAND_NOT_RUN_EXIT_CODE = 127

log = logs.get("actuator")


class LocalActuator:
    def __init__(self, bus: Bus, argv: list[str], env: dict[str, str], log_dir: Path,
                 restart_fallback: bool = True, allow_inject: bool = False,
                 gpus: Any = None, replace: bool = True,
                 budget: ReplacementBudget | None = None,
                 launch_env: dict[str, str] | None = None) -> None:
        self.allow_inject = allow_inject
        self.gpus = gpus  # a GpuAssigner (services/actuator/gpus.py), or None: env as is
        self.bus = bus
        self.argv = argv
        self.env = env
        # only for the pods that start the job (before its first plan): see the module doc
        self.launch_env = dict(launch_env or {})
        self.log_dir = log_dir
        self.restart_fallback = restart_fallback
        self.replace = replace
        self.budget = budget or ReplacementBudget()
        self.shutting_down = False
        self.stopped: set[str] = set()  # pods this actuator asked to stop: not replaced
        self.replacements: list[tuple[str, str]] = []  # (failed pod, its replacement)
        self.procs: dict[str, PodProcess] = {}
        # pods forked from a zygote that imported torch (prefork.py), set by `up`; None: exec
        self.prefork: Prefork | None = None
        self._said_exec = False
        self.roles: dict[str, Role] = {}
        self.exits: dict[str, int] = {}
        self._counters = {Role.worker: itertools.count(), Role.spare: itertools.count()}
        self._watchers: set[asyncio.Task] = set()
        self.plan: Plan | None = None
        self.injections = InjectDesk(self)  # `ceaseless inject`: executed or refused, answered
        self.on_exit: list[Callable[[str, int], None]] = []
        self.killed: set[str] = set()
        # Whether a pod ever heartbeated (set by `up`, which watches the heartbeats): a pod
        # that exits with an error before that failed at start, and is reported with the
        # end of its log: (pod, exit code, log tail) to ``on_start_failure`` and in
        # ``start_failures``.
        self.heartbeated: Callable[[str], bool] | None = None
        self.start_failures: list[tuple[str, int, list[str]]] = []
        self.on_start_failure: list[Callable[[str, int, list[str]], None]] = []
        # the newest scaler term a command was acted on in: an older one is a deposed scaler's
        self.scaler = NewestTerm("scaler")
        # Emulated hosts (`up --hosts`, issue 42), set by `up`: where a new pod runs (its
        # host's command prefix, env and namespace), and the handler of a host's injection
        self.where: Callable[[str], PodHost] | None = None
        self.on_host_inject: Callable[[Inject], Awaitable[str | None]] | None = None

    # ------------------------------------------------------------------ bus wiring
    async def attach(self) -> None:
        s = self.bus.subjects
        await self.bus.subscribe(s.actuator, ActuatorCommand, self._on_command)
        await self.bus.subscribe(s.inject, Inject, self.injections.on_inject)
        await self.bus.subscribe(s.decision, Decision, self.injections.on_decision)
        await self.bus.subscribe(s.plan, PLAN_MODELS, self._on_plan)

    async def _on_plan(self, msg: Plan | PlanRef, env: Envelope) -> None:
        if self.plan is None or msg.generation > self.plan.generation:
            try:  # a large plan's reference: from the held plan and its change, or its parts
                plan = msg if isinstance(msg, Plan) else \
                    await resolve(await self.bus.kv(), msg, self.plan)
            except Exception as e:  # bad input: logged, the last good plan stays
                log.warning("plan unreadable", generation=msg.generation, error=str(e)[:200])
                return
            if self.plan is None or plan.generation > self.plan.generation:
                self.plan = plan

    async def _on_command(self, cmd: ActuatorCommand, env: Envelope) -> None:
        try:
            if self._stale(cmd, env):
                reply = ActuatorReply(ok=False, error=f"term {cmd.term} < {self.scaler.term}: "
                                      "a deposed scaler's command, not acted on")
            elif cmd.action == ActuatorAction.start:
                refused = self.budget.refused(time.monotonic())
                if refused is not None:  # pods keep failing: starting more would loop
                    log.warning("start refused", role=cmd.role.value, count=cmd.count,
                                reason=refused, requested=cmd.reason)
                    reply = ActuatorReply(ok=False, error=refused)
                else:
                    pods = await self.start(cmd.role, cmd.count)
                    reply = ActuatorReply(ok=True, pods=pods)
            elif cmd.pod is None:
                reply = ActuatorReply(ok=False, error=f"{cmd.action.value} needs a pod")
            elif cmd.action == ActuatorAction.kill:
                reply = ActuatorReply(ok=await self.kill(cmd.pod), pods=[cmd.pod])
            else:
                reply = ActuatorReply(ok=await self.stop(cmd.pod), pods=[cmd.pod])
        except Exception as e:
            reply = ActuatorReply(ok=False, error=str(e)[:500])
        if env.raw.reply:
            await self.bus.nc.publish(env.raw.reply, reply.model_dump_json().encode())

    def _stale(self, cmd: ActuatorCommand, env: Envelope) -> bool:
        """A command of an older scaler term than one acted on (issue 42): a deposed
        scaler's, refused and logged. (No await between the check and the note: no lock.)"""
        if cmd.term is None or self.scaler.term is None or cmd.term >= self.scaler.term:
            self.scaler.note(cmd.term)
            return False
        self.scaler.ignored += 1
        log.warning("ignored message", subject=env.subject, action=cmd.action.value,
                    pod=cmd.pod, term=cmd.term,
                    reason=f"term {cmd.term} < {self.scaler.term}: a deposed scaler's command")
        return True

    # ------------------------------------------------------------------ interface
    def new_pod_id(self, role: Role) -> str:
        prefix = "w" if role == Role.worker else "s"
        while True:
            pod = f"{prefix}{next(self._counters[role])}"
            if pod not in self.roles:
                return pod

    def pod_spec(self, pod: str, role: Role) -> PodSpec:
        """A new pod's spec: ``launch_env`` only while the job has no plan yet (the pods
        that start it); a pod joining a live job gets the state from its peers."""
        env = dict(self.launch_env) if self.plan is None else {}
        return PodSpec(pod=pod, role=role, argv=self.argv, env=env)

    async def start(self, role: Role, count: int = 1) -> list[str]:
        pods = []
        for _ in range(count):
            pod = self.new_pod_id(role)
            await self.spawn(self.pod_spec(pod, role))
            pods.append(pod)
        return pods

    async def spawn(self, spec: PodSpec) -> None:
        gpu_env: dict[str, str] = {}
        if self.gpus is not None:
            from .gpus import NoFreeGpu

            try:
                gpu_env = self.gpus.assign(spec.pod)
            except NoFreeGpu as e:
                log.warning("pod not started", pod=spec.pod, reason=str(e))
                return
        env = {**os.environ, **self.env, **spec.env, **gpu_env,
               "CEASELESS_POD": spec.pod, "CEASELESS_ROLE": spec.role.value}
        argv, run, netns = spec.argv, spec.argv, None
        if self.where is not None:
            # its host's: exec'd through the prefix, or forked into the host's namespace (a
            # spare then starts in seconds on a loaded machine, not the imports' 20-50 s)
            at = self.where(spec.pod)
            run, env, netns = [*at.prefix, *argv], {**env, **at.env}, at.netns
            env.pop("GLOO_SOCKET_IFNAME", None)  # an interface would win over the address
        self.log_dir.mkdir(parents=True, exist_ok=True)
        proc = None
        if self.prefork is not None and self.prefork.handles(argv, env):
            try:
                proc = await self.prefork.spawn(argv, env, self.log_path(spec.pod), netns=netns)
            except OSError as e:
                log.warning("prefork failed; the pod is exec'd", pod=spec.pod, error=str(e))
        elif self.prefork is not None and not self._said_exec:
            self._said_exec = True  # once: why pods do not fork (the command, or the env)
            log.info("pods are exec'd, not forked from the zygote", pod=spec.pod,
                     command=argv[:3], differs=self.prefork.differs(env)[:10],
                     zygote_alive=self.prefork.alive)
        out = open(self.log_dir / f"{spec.pod}.log", "ab")
        try:
            if proc is None:
                proc = await asyncio.create_subprocess_exec(
                    *run, env=env, stdout=out, stderr=out,
                    stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
        except OSError as e:
            # The command cannot run at all (a wrong `python`, not executable): a pod that
            # failed at start, as the shell would put it (127), with the error in its log
            out.write(f"ceaseless: cannot start the pod's command: "
                      f"{type(e).__name__}: {e}\n".encode())
            out.close()
            self.roles[spec.pod] = spec.role
            if self.gpus is not None:
                self.gpus.release(spec.pod)
            log.warning("pod not started", pod=spec.pod, role=spec.role.value,
                        reason=f"{type(e).__name__}: {e}")
            task = asyncio.create_task(self._exited(spec.pod, COMMAND_NOT_RUN_EXIT_CODE, None))
            self._watchers.add(task)
            task.add_done_callback(self._watchers.discard)
            return
        out.close()
        self.procs[spec.pod] = proc
        self.roles[spec.pod] = spec.role
        record_pid(self.log_dir.parent, spec.pod, proc.pid)
        log.info("pod started", pod=spec.pod, role=spec.role.value, pid=proc.pid)
        await self.bus.publish(self.bus.subjects.lifecycle(spec.pod), Lifecycle(
            pod=spec.pod, event=LifecycleEvent.started, role=spec.role, pid=proc.pid))
        task = asyncio.create_task(self._watch(spec.pod, proc))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch(self, pod: str, proc: PodProcess) -> None:
        code = await proc.wait()
        self.procs.pop(pod, None)
        if self.gpus is not None:
            self.gpus.release(pod)
        await self._exited(pod, code, proc.pid)

    def log_path(self, pod: str) -> Path:
        """Where the pod's output goes (on this machine)."""
        return self.log_dir / f"{pod}.log"

    async def _exited(self, pod: str, code: int, pid: int | None, **why: Any) -> None:
        """A pod is gone: record it, publish the ``exited`` lifecycle event, tell the
        ``on_exit`` callbacks, count a failure against the crash-loop budget and start a
        replacement spare if the rules say so (shared with the Ray actuator, ``ray.py``)."""
        self.exits[pod] = code
        failed = is_failure(code, self.shutting_down) and pod not in self.stopped
        lines: list[str] | None = None
        if (failed and code > 0 and self.heartbeated is not None
                and not self.heartbeated(pod)):
            # it exited with an error before it ever heartbeated: it failed at start, and
            # its log says why (a signal, code < 0, is no error of the pod's own)
            lines = podlog.tail(self.log_path(pod))
            why = {**why, "error": podlog.error_line(lines) or "(its log is empty)",
                   "log": str(self.log_path(pod))}
            log.warning("pod failed before it started training", pod=pod, exit_code=code,
                        **why)
        else:
            log.info("pod exited", pod=pod, exit_code=code, **why)
        try:
            await self.bus.publish(self.bus.subjects.lifecycle(pod), Lifecycle(
                pod=pod, event=LifecycleEvent.exited, role=self.roles[pod], pid=pid,
                exit_code=code), msg_id=f"exit-{pod}")
        except Exception as e:  # the bus may be down; the monitor also sees silence
            log.warning("could not publish exit", pod=pod, error=str(e)[:200])
        for cb in self.on_exit:
            cb(pod, code)
        if lines is not None:
            self.start_failures.append((pod, code, lines))
            for scb in self.on_start_failure:
                scb(pod, code, lines)
        if not failed:
            return
        # every failed pod counts, replaced or not: a crash loop of pods that someone else
        # asks for (a keeper of the spare pool, the scaler) is found too
        refused = self.budget.take(time.monotonic())
        fallback = code == FALLBACK_EXIT_CODE and self.restart_fallback and pod not in self.killed
        if self.replace or fallback:
            if refused is not None:
                log.warning("pod not replaced", pod=pod, exit_code=code, reason=refused)
                return
            new = await self.start(Role.spare, 1)
            self.replacements += [(pod, n) for n in new]
            log.info("replacement started as a spare", old=pod, new=new, exit_code=code)

    async def stop(self, pod: str, grace_s: float = 5.0) -> bool:
        proc = self.procs.get(pod)
        if proc is None:
            return False
        self.stopped.add(pod)  # released on purpose (a scale-down): no replacement
        _signal(proc, signal.SIGTERM)
        try:  # a member takes a first SIGTERM as a preemption notice; a second ends it now
            await asyncio.wait_for(proc.wait(), 0.3)
            return True
        except asyncio.TimeoutError:
            _signal(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except asyncio.TimeoutError:
            _signal(proc, signal.SIGKILL)
            try:  # answered once it has exited (a release names its pods only then)
                await asyncio.wait_for(proc.wait(), grace_s)
            except asyncio.TimeoutError:
                log.warning("pod still running after SIGKILL", pod=pod)
        return True

    async def kill(self, pod: str) -> bool:
        proc = self.procs.get(pod)
        if proc is None:
            return False
        self.killed.add(pod)
        _signal(proc, signal.SIGKILL)
        return True

    def signal(self, pod: str, sig: int) -> bool:
        proc = self.procs.get(pod)
        if proc is None:
            return False
        _signal(proc, sig)
        return True

    def running(self) -> dict[str, int]:
        return {pod: p.pid for pod, p in self.procs.items()}

    async def shutdown(self, grace_s: float = 5.0) -> None:
        self.shutting_down = True  # what exits now is not replaced
        await asyncio.gather(*(self.stop(p, grace_s) for p in list(self.procs)),
                             return_exceptions=True)
        for t in list(self._watchers):
            try:
                await asyncio.wait_for(t, 2.0)
            except Exception:
                pass


def record_pid(run_dir: Path, name: str, pid: int) -> None:
    """Every child's pid goes to <run_dir>/pids.txt, so a harness can clean up by PID: a line
    ``name pid start``, the start its kernel start time (``proc_start``), which tells the
    process from a later one that reuses its pid."""
    with open(run_dir / "pids.txt", "a") as f:
        f.write(f"{name} {pid} {proc_start(pid) or '-'}\n")


def proc_start(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat, field 22), or None
    if there is no such process (or no /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) is in parentheses and may hold spaces: split after it
    return stat.rpartition(")")[2].split()[19]


def _signal(proc: PodProcess, sig: int) -> None:
    try:
        proc.send_signal(sig)  # SIGKILL also ends a stopped (SIGSTOP) process
    except ProcessLookupError:
        pass
