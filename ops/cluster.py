"""``ceaseless up``: a whole cluster on this machine.

An embedded nats-server (JetStream, authentication on), the three services (restarted by
the supervisor if they die), N workers + S spares running the training command, a live
view, and ``summary.json`` at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from schemas.timeouts import DEFAULTS, agent_timeouts_from_env
from schemas.messages import (AgentState, Fault, Heartbeat, JobFailed, Plan, PlanRef, Recovery,
                              Role, StateLost, Transfer)
from schemas import PLAN_KEY
from schemas.policy import SCRIPT_KEY, ScriptInfo
from services.actuator import LocalActuator
from services.actuator.local import record_pid
from services.actuator.prefork import Prefork
from plumbing import logs
from plumbing.plan_wire import PLAN_MODELS, resolve
from plumbing.bus import Bus, Envelope
from services.common.lease import ttl_for
from services.common.natsserver import BusServers
from services.common.permissions import role_permissions, write_role_credentials
from plumbing.tlsgen import CA_ENV

from .runinfo import ClusterInfo, new_run_dir

if TYPE_CHECKING:
    from .emulated import HostRun

log = logs.get("up")
SERVICES = ("health_monitor", "scaler", "state_broker")
# A bound on a clustered bus's first JetStream meta-leader election (a loaded machine is slower)
BUS_READY_S = 30.0
QUORUM_EVERY_S = 1.0  # how often `up` asks its servers whether a majority answers


@dataclass
class UpOptions:
    workers: int = 3
    spares: int = 1
    steps: int = 100
    job: str = "demo"
    run_dir: str | None = None
    cmd: list[str] = field(default_factory=list)
    # None (neither given): the script's own batch sizes the plans (the scaler adopts it
    # from KV `script`; until then, and for the example, DEFAULT_BATCH); given: the flags'.
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    policy: str | None = None            # scaling policy file
    scale_up_snooze: float | None = None
    start_timeout: float | None = None   # None: the scaler's default
    save_params: bool = False
    fault_timeout: float = DEFAULTS["fault_timeout"]
    # = the agents' collective timeout: a step may stand still as long as an all-reduce may
    # wait (a long rank-0 evaluation is no hang)
    stall_timeout: float = DEFAULTS["collective_timeout"]
    verify_every: int = 0  # the agents' CEASELESS_VERIFY_EVERY (up's default: 100)
    on_nonfinite: str = "skip"   # the agents' CEASELESS_ON_NONFINITE (skip | rollback)
    loss_spike: float = 0.0      # the agents' CEASELESS_LOSS_SPIKE (0: off)
    straggler_factor: float | None = None  # None: the monitor's defaults
    straggler_window: float | None = None
    allow_inject: bool = True
    timeout: float | None = None
    live: bool = True
    tls: bool = False
    model: str = "tiny"
    dtype: str = "float32"   # the example's parameter dtype (float64: runs of different
                             # world sizes stay comparable to ~1e-12, see docs/elastic.md)
    extra_env: dict[str, str] = field(default_factory=dict)
    gpus_per_pod: int | None = None  # None: one per pod if the machine has enough, else shared
    replace: bool = True     # start a fresh spare in place of every failed pod
    prefork: bool = True     # fork `python -m` pods from a zygote that imported torch
    checkpoint_dir: str | None = None  # last-resort checkpoints (agent/checkpoint.py)
    checkpoint_every: int = 200
    checkpoint_keep: int = 3
    checkpoint_minutes: float = 0.0  # also every this many minutes (0: by steps only)
    resume: str | None = None  # a checkpoint (or a directory of them) the job starts from
    auto_resume: int = 2     # restarts from the newest checkpoint after a total loss
    max_replacements: int | None = None  # per 5 minutes; None: 2 x (workers + spares)
    actuator: str = "local"  # local | ray (services/actuator/ray.py, docs/cluster.md)
    ray_address: str | None = "auto"
    ray_cpus_per_pod: float = 0.1
    bus_host: str | None = None  # None: 127.0.0.1, with Ray this machine's Ray node IP
    bus_servers: int = 1  # nats-servers of the bus; several: clustered, JetStream replicated
    # Ranks per replica of a sharded model (issue 21; FSDP inside a replica): ``workers``
    # counts ranks (a multiple of it), replica counts count replicas of this many ranks.
    shard_size: int = 1
    # Standby instances of each service (issue 42): K more per service, each with a lease
    # TTL that lets it take over within the fault timeout (services/common/lease.py).
    standbys: int = 0
    # emulated hosts (issue 42): 0 none (everything on this machine's loopback, as always)
    hosts: int = 0
    # the first K of them run the bus and the services only, the pods the others (0: pods
    # on every host, rank 0 with the active services on h1; ops/placement.py)
    control_hosts: int = 0
    # An external bus (issue 42, the Ray path; ops/external.py): comma-separated URLs; `up`
    # starts no nats-server. Its identity (and its services'), the pods' (default the same).
    bus: str | None = None
    bus_creds: str | None = None
    pod_creds: str | None = None
    services: str = "here"   # here: run the services | external: they run elsewhere
    node: str | None = None  # this node's name (its service instances', its Ray driver's)

    @property
    def batch_given(self) -> bool:
        """Did the operator size the batch (--global-batch-size / --micro-batch-size)?"""
        return self.global_batch_size is not None or self.micro_batch_size is not None

    @property
    def batch(self) -> tuple[int, int]:
        """(global batch, micro-batch size): the flags', the default for what is not given."""
        return (self.global_batch_size or DEFAULT_BATCH[0],
                self.micro_batch_size or DEFAULT_BATCH[1])


DEFAULT_BATCH = (32, 4)  # the example's, and the first plan's until the script's is known


class ServiceSupervisor:
    """Runs each control-plane service as a child process; restarts one that dies. With
    ``standbys`` K, K more instances of each (``<name>-s1`` .. ``-sK``: their log and
    pids.txt name); one acts per service, by lease. Every instance gets a fixed
    ``--instance-id``, so one restarted in place takes its own lease back at once."""

    def __init__(self, base: list[str], log_dir: Path, flags: dict[str, list[str]],
                 standbys: int = 0, lease_ttl: float | None = None,
                 hosted: "HostRun | None" = None, node: str | None = None) -> None:
        self.base, self.log_dir, self.flags = base, log_dir, flags
        # `up --bus --node N`: one instance of each, `<service>-N` (one per node of the job)
        self.node = node
        self.standbys, self.lease_ttl = standbys, lease_ttl
        # emulated hosts: each instance runs on its host; one on a lost host is not restarted
        self.hosted = hosted
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}
        self.stopping = False

    @staticmethod
    def instances(standbys: int) -> list[tuple[str, str]]:
        """(service, instance name) of every instance, the first of each named as before."""
        return [(name, name if i == 0 else f"{name}-s{i}")
                for name in SERVICES for i in range(standbys + 1)]

    def start(self, instance: str) -> None:
        name = (instance[:-len(self.node) - 1] if self.node and instance.endswith(
            f"-{self.node}") else re.sub(r"-s\d+$", "", instance))
        out = open(self.log_dir / f"{instance}.log", "ab")
        argv = [sys.executable, "-m", f"services.{name}", *self.base, *self.flags.get(name, []),
                "--instance-id", instance,
                *([] if self.lease_ttl is None else ["--lease-ttl", f"{self.lease_ttl:g}"])]
        if self.hosted is not None:
            argv = [*self.hosted.instance_prefix(instance), *argv]
        self.procs[instance] = subprocess.Popen(argv, stdout=out, stderr=out,
                                                stdin=subprocess.DEVNULL,
                                                start_new_session=True)
        out.close()
        record_pid(self.log_dir.parent, instance, self.procs[instance].pid)

    def start_all(self) -> None:
        for name, instance in self.instances(self.standbys):
            self.start(f"{name}-{self.node}" if self.node else instance)

    async def start_placed(self, bus: Bus, out: Any, wait_s: float = 20.0) -> None:
        """Every service's first instance, and the pods only once each holds its lease (it
        subscribes before it takes it; bounded: after ``wait_s`` whatever is up goes on).
        The pods start as forks within a second: a monitor not listening yet missed two
        members' set-up errors (CI: both replaced by spares that raised the same). With
        standbys, these only once their primary holds the lease, so the instance the
        placement made active is the active one: with emulated hosts, the host that runs
        them all is the one to lose (issue 42)."""
        from services.common.lease import parse_lease
        from schemas.subjects import lease_key

        first = {n: f"{n}-{self.node}" if self.node else n for n in SERVICES}
        for instance in first.values():
            self.start(instance)
        kv = await bus.kv()
        deadline = time.monotonic() + wait_s
        waiting = set(SERVICES)
        while waiting and time.monotonic() < deadline:
            for name in sorted(waiting):
                try:
                    held = parse_lease((await kv.get(lease_key(name))).value)
                except Exception:
                    continue
                # on a node of a shared bus (`up --bus`) another node's instance may act
                if held.holder == first[name] or (self.node and held.holder):
                    waiting.discard(name)
            if waiting:
                await asyncio.sleep(0.05)
        if waiting:
            print(f"  {', '.join(sorted(waiting))} did not take its lease in {wait_s:g}s: "
                  "the pods start anyway" + (" (whichever instance takes it first acts)"
                                             if self.standbys else ""), file=out, flush=True)
        if not self.node:  # (on a node: one instance of each, as start_all)
            for _, instance in self.instances(self.standbys):
                if instance not in self.procs:
                    self.start(instance)

    async def watch(self) -> None:
        while not self.stopping:
            for name, p in list(self.procs.items()):
                if p.poll() is not None and not self.stopping:
                    if self.hosted is not None and self.hosted.instance_down(name):
                        continue  # its host is lost: a standby elsewhere takes over
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    log.warning("service died; restarting", service=name, code=p.returncode,
                                restarts=self.restarts[name])
                    self.start(name)
            await asyncio.sleep(0.2)

    def stop_all(self, timeout: float = 5.0) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class Observer:
    """Everything the live view and the summary need, from the bus."""

    def __init__(self) -> None:
        self.plan: Plan | None = None
        self._bus: Bus | None = None
        self.hb: dict[str, Heartbeat] = {}
        self.faults: list[Fault] = []
        self.recoveries: list[Recovery] = []
        self.lost: StateLost | None = None
        # a transfer that starts a later generation from step -1 (nothing committed):
        # up checks it against this run's checkpoints (a loss the broker did not know of)
        self.fresh: Transfer | None = None
        self.failed: JobFailed | None = None  # the health monitor: the failure is the script's
        self.events: list[str] = []
        self.script: ScriptInfo | None = None  # KV `script`: what the script itself runs

    async def attach(self, bus: Bus) -> None:
        s = bus.subjects
        self._bus = bus  # its bucket holds a large plan's parts (plumbing/plan_wire.py)
        await bus.subscribe(s.plan, PLAN_MODELS, self._plan)
        await bus.subscribe(s.heartbeat(), Heartbeat, self._hb)
        await bus.subscribe(s.fault, Fault, self._fault)
        await bus.subscribe(s.recovery, Recovery, self._recovery)
        await bus.subscribe(s.state_lost, StateLost, self._lost)
        await bus.subscribe(s.transfer, Transfer, self._transfer)
        await bus.subscribe(s.job_failed, JobFailed, self._failed)

    async def _plan(self, msg: Plan | PlanRef, env: Envelope) -> None:
        if self.plan is None or msg.generation > self.plan.generation:
            try:  # a large plan's reference: from the held plan and its change, or its parts
                p = msg if isinstance(msg, Plan) else \
                    await resolve(await self._bus.kv(), msg, self.plan)  # type: ignore[union-attr]
            except Exception as e:
                self.events.append(f"plan g{msg.generation} unreadable: {str(e)[:200]}")
                return
            self.plan = p
            members = " ".join(f"{m.rank}:{m.pod}" for m in sorted(p.members, key=lambda m: m.rank))
            self.events.append(f"plan g{p.generation} W={p.world_size} [{members}] ({p.reason})")

    async def _hb(self, h: Heartbeat, env: Envelope) -> None:
        self.hb[h.pod] = h

    async def _fault(self, f: Fault, env: Envelope) -> None:
        self.faults.append(f)
        self.events.append(f"fault {f.incident}: {f.kind.value} of {f.pod} "
                           f"(detected in {f.detection_latency or 0:.3f}s) {f.reason}")

    async def _recovery(self, r: Recovery, env: Envelope) -> None:
        self.recoveries.append(r)
        if r.downtime is not None:
            self.events.append(f"recovered {r.incident}: rank {r.rank} ({r.pod}) back at step "
                               f"{r.restore_step + 1}, downtime {r.downtime:.3f}s")

    async def _failed(self, m: JobFailed, env: Envelope) -> None:
        if self.failed is None:
            self.failed = m
            self.events.append(f"JOB FAILED: {m.hint}")

    async def _transfer(self, t: Transfer, env: Envelope) -> None:
        if t.generation > 1 and t.restore_step == -1 and self.fresh is None:
            self.fresh = t

    async def _lost(self, m: StateLost, env: Envelope) -> None:
        self.lost = m
        self.events.append(f"STATE LOST g{m.generation}: {m.reason}")

    def table(self, B: int) -> str:
        rows = [f"{'pod':<8}{'role':<8}{'state':<12}{'gen':>4}{'rank':>5}{'step':>7}"
                f"{'loss':>10}{'samples/s':>11}"]
        now = time.time()
        for pod, h in sorted(self.hb.items()):
            stale = now - h.ts > 2.0 and h.state.value not in ("done",)
            sps = f"{B / h.step_time:.1f}" if h.step_time else "-"
            loss = f"{h.loss:.4f}" if h.loss is not None else "-"
            rows.append(f"{pod:<8}{h.role.value:<8}{(h.state.value + ('?' if stale else '')):<12}"
                        f"{h.generation:>4}{h.rank if h.rank is not None else '-':>5}{h.step:>7}"
                        f"{loss:>10}{sps:>11}")
        return "\n".join(rows)


def service_flags(opts: UpOptions) -> dict[str, list[str]]:
    """Each service's own flags (before ``--creds``) from `up`'s options."""
    return {
        "scaler": ["--workers", str(opts.workers),
                   # its view of who is alive (a live spare, a silent member) is the job's
                   # fault timeout's, not the default's: with 3 servers that is 3.5 s, and
                   # at 1.5 s a spare a loaded machine kept silent 2 s was "no live spare"
                   "--fault-timeout", str(opts.fault_timeout),
                   "--global-batch-size", str(opts.batch[0]),
                   "--micro-batch-size", str(opts.batch[1]),
                   # no batch given: the plans take the script's once it is known
                   *([] if opts.batch_given else ["--batch-from-script"]),
                   *_opt("--min-replicas", opts.min_replicas),
                   *_opt("--max-replicas", opts.max_replicas),
                   *_opt("--policy", opts.policy),
                   *_opt("--scale-up-snooze", opts.scale_up_snooze),
                   *_opt("--start-timeout", opts.start_timeout),
                   *(["--shard-size", str(opts.shard_size)] if opts.shard_size > 1 else [])],
        "health_monitor": ["--fault-timeout", str(opts.fault_timeout),
                           "--stall-timeout", str(opts.stall_timeout),
                           # the pods inherit this environment: the monitor must know the
                           # collective timeout they wait with (absent-member rule)
                           "--collective-timeout",
                           str(agent_timeouts_from_env().get(
                               "collective_timeout", DEFAULTS["collective_timeout"])),
                           *_opt("--straggler-factor", opts.straggler_factor),
                           *_opt("--straggler-window", opts.straggler_window),
                           # a member silent while its client fails over to another server
                           # is not the one a peer's error is about (test_hosts_e2e: w1 was
                           # declared 0.7 s into its failover)
                           *(["--suspect-timeout", str(failover_suspect(opts.fault_timeout))]
                             if opts.bus_servers > 1 else [])],
    }


def default_cmd(opts: UpOptions, data_dir: Path) -> list[str]:
    B, m = opts.batch
    # GPT-2 sizes train on synthetic tokens over GPT-2's vocabulary (the generated data's
    # 257 tokens would make a smaller model than the name says)
    data = [] if opts.model in ("124m", "350m", "1b") else ["--data", str(data_dir)]
    return [sys.executable, "-m", "examples.train_gpt", "--steps", str(opts.steps),
            "--global-batch-size", str(B), "--micro-batch-size", str(m),
            "--model", opts.model, "--dtype", opts.dtype, *data]


# What the zygote imports for the pods (services/actuator/prefork.py): torch and the parts a
# first step imports (the optimizer imports torch._dynamo), and the agent's session.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "agent.session"]


async def _zygote(env: dict[str, str], cmd: list[str], log_dir: Path,
                  run_dir: Path) -> Prefork | None:
    """The zygote this run's pods fork from: a shared one (``CEASELESS_ZYGOTE``, a unix
    socket) when its environment fits the pods', else this run's own."""
    shared = os.environ.get("CEASELESS_ZYGOTE")
    if shared:
        z = await Prefork.connect(shared)
        if z is not None and z.handles(cmd, env):
            return z
        if z is not None:
            log.info("prefork: the shared zygote's environment is not the pods'; starting "
                     "this run's own", path=shared, differs=z.differs(env)[:10])
            await z.close()
    return await Prefork.start(env, PRELOAD, log_dir / "zygote.log", run_dir)


class StoreKeeper:
    """The in-memory c10d store bucket, recreated after `up` restarted nats-server (it dies
    with the server). Pods may not create it (their permissions): without it a new pod cannot
    start ("agent could not start: nats: timeout", replaced, failing again) and no new
    generation can rendezvous. The first try races `up`'s own reconnect, so it is tried again
    every round until it is there (issue 41 item 10a: one try that timed out left a job whose
    members trained on while every spare asked for failed at start)."""

    def __init__(self, timeout: float = 5.0, every: float = 1.0) -> None:
        self.timeout, self.every = timeout, every
        self.missing_since: float | None = None   # monotonic; None: the bucket is there
        self._next = 0.0
        self._told = False

    def lost(self) -> None:
        self.missing_since, self._next, self._told = time.monotonic(), 0.0, False

    async def keep(self, bus: Bus, out: Any, started: float) -> bool:
        """One try if one is due; True when the bucket is there."""
        if self.missing_since is None:
            return True
        if time.monotonic() < self._next:
            return False
        try:
            await asyncio.wait_for(bus.store_kv(), self.timeout)
        except Exception as e:
            self._next = time.monotonic() + self.every
            if not self._told:
                self._told = True
                print(f"  could not recreate the store bucket yet ({type(e).__name__}: "
                      f"{str(e)[:200]}); trying again", file=out, flush=True)
            return False
        print(f"[{time.time() - started:7.2f}s] store bucket recreated "
              f"({time.monotonic() - self.missing_since:.1f}s after the restart)",
              file=out, flush=True)
        self.missing_since = None
        return True


async def _watch_quorum(srv: BusServers, bus: Bus, out: Any, started: float,
                        every: float = QUORUM_EVERY_S) -> None:
    """A bus of several servers: say when JetStream loses its quorum (fewer than a majority
    of the servers answer), why, and when it answers again (ops/quorum.py)."""
    from .quorum import QuorumWatch, Watch, probe

    watch = QuorumWatch()
    while True:
        v = await probe(srv.url, down={f"s{i + 1}" for i in srv.down})
        # on the way back only: does JetStream answer a read yet?
        js = await _jetstream_answers(bus) if watch.state in (Watch.lost, Watch.electing) \
            and v.has_quorum else None
        line = watch.observe(v, time.monotonic(), js)
        if line is not None:
            print(f"[{time.time() - started:7.2f}s] {line}", file=out, flush=True)
            (log.info if watch.state is Watch.ok else log.warning)("bus quorum", line=line)
        await asyncio.sleep(every)


async def _jetstream_answers(bus: Bus, timeout: float = 1.0) -> bool:
    """Does JetStream answer a read of the job's bucket (a missing key is an answer)?"""
    from nats.js.errors import KeyNotFoundError, NotFoundError

    try:
        kv = await asyncio.wait_for(bus.kv(), timeout)
        await asyncio.wait_for(kv.get(PLAN_KEY), timeout)
        return True
    except (KeyNotFoundError, NotFoundError):
        return True
    except Exception:  # a timeout, 503 "JetStream system temporarily unavailable"
        return False


def failover_suspect(fault_timeout: float) -> float:
    """The monitor's suspect timeout on a bus of several servers: a client's failover
    (plumbing/bus.py FAILOVER_S) plus two heartbeat intervals (its last heartbeat before
    the loss and the first after it: exactly FAILOVER_S left a failing-over pod suspected
    by a peer's error), kept below the fault timeout."""
    from plumbing.bus import FAILOVER_S
    from schemas.timeouts import DEFAULTS

    return min(FAILOVER_S + 2 * DEFAULTS["heartbeat_interval"], fault_timeout * 0.9)


async def run(opts: UpOptions) -> int:
    run_dir = Path(opts.run_dir) if opts.run_dir else new_run_dir(opts.job)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not opts.hosts:
        return await _run(opts, run_dir, None)
    from .emulated import HostRun
    from .hosts import Hosts
    from .placement import place

    hosts = Hosts.make(opts.hosts)
    hosted = HostRun(hosts, place(hosts.names(), opts.bus_servers, list(SERVICES),
                                  opts.standbys, opts.workers, opts.spares,
                                  control=opts.control_hosts), run_dir)
    print(f"ceaseless up: {opts.hosts} emulated hosts, " + (
        "each a network namespace (" + ", ".join(f"{h.name} {h.addr}" for h in hosts.hosts)
        + ")" if hosts.mode == "netns" else
        "each a loopback address in this namespace (" + ", ".join(
            f"{h.name} {h.addr}" for h in hosts.hosts) + f"; no namespaces: {hosts.why}; "
        "a host can be lost, not partitioned)"), file=sys.stdout, flush=True)
    # a SIGTERM while `up` starts cancels it (then the loop's own handler takes over): the
    # namespaces go either way
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await _run(opts, run_dir, hosted)
    finally:  # also on SIGINT/SIGTERM (`_run` ends its loop on either) and on any error
        await hosted.close()


async def _run(opts: UpOptions, run_dir: Path, hosted: "HostRun | None") -> int:
    log_dir = run_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    # One identity per role, each limited to its subjects by the server itself; this
    # process (launcher, actuator) and the CLI use the operator's.
    ext = None
    if opts.bus:  # an external bus: its credentials as given (ops/external.py)
        from .external import attach

        try:
            ext = attach(opts.bus, opts.bus_creds, opts.pod_creds)
        except ValueError as e:
            raise SystemExit(f"ceaseless up: {e}") from e
        creds_path, creds = ext.creds_path, ext.creds
        roles = {r: (ext.creds_path, ext.creds) for r in SERVICES}
        roles["agent"] = (ext.pod_creds, None)
        users = []
    else:
        roles = write_role_credentials(run_dir / "creds")
        creds_path, creds = roles["operator"]
        users = [(c, role_permissions(r, opts.job)) for r, (_, c) in roles.items()]
    ray_act = None
    bus_host = opts.bus_host or "127.0.0.1"
    if opts.actuator == "ray":
        from services.actuator.ray import RayActuator

        # joined first: the bus must listen where the Ray nodes can reach it
        ray_act = RayActuator(None, [], {}, log_dir, address=opts.ray_address,
                              num_cpus=opts.ray_cpus_per_pod,
                              num_gpus=opts.gpus_per_pod or 0,
                              namespace=f"ceaseless-{opts.job}", watch_nodes=True)
        # several drivers of one job (one per node): the pods outlive each (ray_adopt.py)
        ray_act.detached = ext is not None
        try:
            ray_act.connect()
        except Exception as e:  # no cluster there, a version mismatch
            raise SystemExit(f"ceaseless up: cannot join the Ray cluster at "
                             f"{opts.ray_address!r}: {type(e).__name__}: {e}") from e
        bus_host = opts.bus_host or ray_act.node_ip()
    tls = None
    if opts.tls and ext is None:
        from plumbing.tlsgen import generate

        tls = generate(run_dir / "tls", hosts=tuple(dict.fromkeys(
            ("127.0.0.1", "localhost", bus_host,
             *(hosted.servers()[0] if hosted is not None else ())))))
        os.environ[CA_ENV] = str(tls.ca)  # services (children) and this process trust it
    # one nats-server, or several clustered: every client is given every URL (comma-separated)
    addrs, prefixes = hosted.servers() if hosted is not None else (None, None)
    srv = ext.bus if ext is not None else BusServers.start(
        run_dir / "nats", opts.bus_servers, creds=creds, users=users, tls=tls, host=bus_host,
        hosts=addrs, prefixes=prefixes)
    if hosted is not None:
        hosted.srv = srv
        hosted.write()
    for s in srv.servers:
        record_pid(run_dir, "nats-server", s.proc.pid)
    info = ClusterInfo(nats_url=srv.url, job=opts.job, creds=str(creds_path or ""),
                       run_dir=str(run_dir), pid=os.getpid(), started=time.time(),
                       tls_ca=str(tls.ca) if tls else os.environ.get(CA_ENV))
    info.write()
    out = sys.stdout
    print(f"ceaseless up: job {opts.job!r}, {opts.workers} workers + {opts.spares} spares, "
          f"{_what_runs(opts)}\n  run dir: {run_dir}\n  bus:     {srv.url} (creds {creds_path})\n"
          f"  logs:    {log_dir}/\n  traces:  {run_dir / 'traces'}/", file=out, flush=True)
    cmd = opts.cmd
    if not cmd:
        cmd = default_cmd(opts, _default_data(run_dir / "data"))
    env = {"CEASELESS_NATS_URL": srv.url,
           **({"CEASELESS_CREDS": str(roles["agent"][0])} if roles["agent"][0] else {}),
           "CEASELESS_JOB": opts.job, "CEASELESS_RUN_DIR": str(run_dir),
           "CEASELESS_ALLOW_INJECT": "1" if opts.allow_inject else "0",
           # the agents' own stall watchdog acts at the monitor's stall timeout
           "CEASELESS_STALL_TIMEOUT": str(opts.stall_timeout),
           "CEASELESS_VERIFY_EVERY": str(opts.verify_every),
           "CEASELESS_ON_NONFINITE": opts.on_nonfinite, "CEASELESS_LOSS_SPIKE": str(opts.loss_spike),
           # the agent shards its model over the ranks of a replica (1: unsharded)
           "CEASELESS_SHARD_SIZE": str(opts.shard_size),
           # no batch given: a first plan made with the default is no mismatch to warn about
           "CEASELESS_BATCH_FROM_SCRIPT": "0" if opts.batch_given else "1",
           "PYTHONUNBUFFERED": "1", **opts.extra_env}
    threads_note = _default_threads(env, opts, ray=ray_act is not None)
    if threads_note:
        print(f"  threads: {threads_note}", file=out, flush=True)
    if opts.checkpoint_dir:
        env.update(CEASELESS_CHECKPOINT_DIR=str(Path(opts.checkpoint_dir).resolve()),
                   CEASELESS_CHECKPOINT_EVERY=str(opts.checkpoint_every),
                   CEASELESS_CHECKPOINT_KEEP=str(opts.checkpoint_keep),
                   CEASELESS_CHECKPOINT_MINUTES=str(opts.checkpoint_minutes))
    # Only the pods that start the job load the checkpoint it resumes from; a pod that
    # joins later (a replacement, a capacity joiner) takes the state from its peers: the
    # job's own checkpoints may have rotated that one away by then (issue 33).
    launch_env: dict[str, str] = {}
    ck_before = complete_checkpoints(opts.checkpoint_dir)  # what this run did not write
    if opts.resume:
        from agent import checkpoint

        found = checkpoint.resolve(Path(opts.resume).resolve())
        if found is None:
            raise SystemExit(f"ceaseless up: --resume {opts.resume}: no complete checkpoint "
                             "there (a step-N directory with a manifest.json)")
        print(f"  resume:  {found}", file=out, flush=True)
        launch_env["CEASELESS_RESUME_FROM"] = str(found)
    if opts.save_params:
        env["CEASELESS_SAVE_PARAMS"] = "1"
    if tls is not None:
        env[CA_ENV] = str(tls.ca)
    repo_root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo_root + os.pathsep + os.environ.get("PYTHONPATH", "")
    bus = None
    if len(srv.servers) > 1 or ext is not None:
        # a cluster answers JetStream once its servers have elected a meta leader: wait for
        # it before anything else starts, so that a cluster that never forms leaves nothing
        bus = await Bus.connect(srv.url, opts.job, "ceaseless-up", creds)
        try:
            await bus.ensure_job_storage(BUS_READY_S)
        except Exception as e:
            await bus.close()
            srv.stop()
            raise SystemExit(f"ceaseless up: the bus ({srv.url}) formed no "
                             f"JetStream cluster in {BUS_READY_S:.0f}s ({type(e).__name__}: "
                             f"{str(e)[:200]}); see {run_dir / 'nats'}/s*/nats-server.log")
        if hosted is not None:
            # the streams' leaders off the active instances' host: losing it then costs the
            # standbys a lease expiry, not a Raft election too (docs/cluster.md)
            from .emulated import active_servers, lead_elsewhere

            on_active = active_servers(hosted.placement, list(SERVICES))
            if on_active and len(on_active) < len(srv.servers):
                moved = await lead_elsewhere(
                    bus, {srv.specs[i].server_name for i in on_active}, 15.0, log)
                print(f"  leaders: off {', '.join(f's{i + 1}' for i in on_active)} (the active "
                      f"instances' host): {len(moved['moved'])} streams moved"
                      + (f", {len(moved['stayed'])} stayed" if moved["stayed"] else ""),
                      file=out, flush=True)
    # The pods' zygote (services/actuator/prefork.py) imports torch while the bus and the
    # services come up: every pod, a replacement spare's too, then starts as a fork. With
    # emulated hosts too (forked into its host's namespace): exec'd, a replacement spare took
    # 20-50 s to start on a loaded machine, and a fault meanwhile found no live spare.
    zygote_env = {**os.environ, **env}
    if hosted is not None:  # a pod on a host runs without it (LocalActuator.spawn)
        zygote_env.pop("GLOO_SOCKET_IFNAME", None)
    prefork_task = (asyncio.create_task(_zygote(zygote_env, cmd, log_dir, run_dir))
                    if ray_act is None and opts.prefork else None)
    if bus is None:
        bus = await Bus.connect(srv.url, opts.job, "ceaseless-up", creds)
        await bus.ensure_stream()
        await bus.kv()
        await bus.store_kv()
    base = ["--nats", srv.url, "--job", opts.job, "--run-dir", str(run_dir)]
    flags = service_flags(opts)
    for name in SERVICES:
        if roles[name][0]:
            flags[name] = [*flags.get(name, []), "--creds", str(roles[name][0])]
    node = None
    if ext is not None:
        from .external import node_name

        node = node_name(opts.node)
    sup = ServiceSupervisor(base, log_dir, flags, standbys=opts.standbys,
                            lease_ttl=ttl_for(opts.fault_timeout)
                            if opts.standbys or ext is not None else None,
                            hosted=hosted, node=node)
    if opts.services == "here":
        await sup.start_placed(bus, out)
    sup_task = asyncio.create_task(sup.watch())
    from services.actuator.gpus import GpuAssigner, visible_gpus

    # with Ray, Ray assigns the devices (num_gpus = --gpus-per-pod per actor)
    gpus = (GpuAssigner(visible_gpus(), expected=opts.workers + opts.spares,
                        per_pod=opts.gpus_per_pod) if ray_act is None
            else GpuAssigner([], expected=opts.workers + opts.spares))
    if gpus.mode != "none":
        print(f"  gpus:    {len(gpus.devices)} visible, {gpus.mode}"
              + (f" ({gpus.per_pod} per pod)" if gpus.mode == "exclusive" else ""),
              file=out, flush=True)
    if gpus.warning:
        print(f"ceaseless up: warning: {gpus.warning}", file=sys.stderr, flush=True)
    from services.actuator.replace import ReplacementBudget

    budget = ReplacementBudget(limit=opts.max_replacements if opts.max_replacements is not None
                               else 2 * (opts.workers + opts.spares))
    if ray_act is not None:
        act = ray_act
        act.bus, act.argv, act.env = bus, cmd, env
        act.allow_inject, act.replace, act.budget = opts.allow_inject, opts.replace, budget
        act.launch_env = launch_env
        print(f"  ray:     {opts.ray_address or 'a local Ray'}, pods as actors "
              f"({opts.ray_cpus_per_pod:g} CPU, {opts.gpus_per_pod or 0} GPU each)",
              file=out, flush=True)
    else:
        act = LocalActuator(bus, cmd, env, log_dir, allow_inject=opts.allow_inject, gpus=gpus,
                            replace=opts.replace, budget=budget, launch_env=launch_env)
        if prefork_task is not None:
            act.prefork = await prefork_task
            if act.prefork is not None and act.prefork.proc is not None:
                record_pid(run_dir, "zygote", act.prefork.proc.pid)
    if hosted is not None:  # pods on their hosts; `inject host-loss|partition` runs here
        hosted.sup, hosted.act = sup, act
        act.where, act.on_host_inject = hosted.where, hosted.on_inject
        act.on_exit.append(hosted.exited)
    ha = None
    if ray_act is not None and ext is not None:
        # one driver of the job acts, by lease; the others stand by and adopt its pods
        from services.actuator.ray_adopt import DriverLease

        async def first_pods() -> None:
            await act.start(Role.worker, opts.workers)
            await act.start(Role.spare, opts.spares)

        ha = DriverLease(ray_act, f"actuator-{node}", ttl_for(opts.fault_timeout), first_pods)
        ha.install()
    await act.attach()
    obs = Observer()
    await obs.attach(bus)
    exits: dict[str, int] = {}
    act.on_exit.append(lambda pod, code: exits.__setitem__(pod, code))
    # A pod that fails before it ever heartbeats (a wrong `python`, an import error, a bad
    # command) is reported here with the end of its log, not only left in the log.
    act.heartbeated = lambda pod: pod in obs.hb
    act.on_start_failure.append(lambda pod, code, lines: _report_start_failure(
        act, pod, code, lines, info.started))
    if ha is None:
        await act.start(Role.worker, opts.workers)
        await act.start(Role.spare, opts.spares)
    else:
        await ha.start()
        print(f"  driver:  actuator-{node}, {ha.state.value} (term {ha.lease.term}; one driver "
              f"of the job acts, the others stand by)", file=out, flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    interrupted = False

    def _sigint() -> None:
        nonlocal interrupted
        interrupted = True
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _sigint)
    started = time.monotonic()
    shown = 0
    last_table = 0.0
    script_polled = 0.0
    code, reason = 1, "unknown"
    finished_w, after = 0, ""   # set when every member finished
    tty = out.isatty() and opts.live
    store = StoreKeeper()
    quorum_task = (asyncio.create_task(_watch_quorum(srv, bus, out, info.started))
                   if len(srv.servers) > 1 else None)
    try:
        while not stop.is_set():
            await asyncio.sleep(0.2)
            if hosted is not None:
                for ev in hosted.events:
                    print(f"[{time.time() - info.started:7.2f}s] {ev}", file=out, flush=True)
                hosted.events.clear()
            codes = [s.proc.returncode for i, s in enumerate(srv.servers)
                     if s.proc.poll() is not None and i not in srv.down]
            if codes:
                # A server died: restart it on the same ports and store (the file store keeps
                # the plan and the audit stream; a clustered one catches up from its peers);
                # every client reconnects by itself, to any server it was given. A lone
                # server's in-memory c10d store bucket is recreated empty (old generations'
                # keys are not needed); a cluster's lives on in the other replicas.
                print(f"[{time.time() - info.started:7.2f}s] nats-server exited "
                      f"({', '.join(map(str, codes))}); restarting it", file=out, flush=True)
                for i in srv.restart_dead():
                    record_pid(run_dir, "nats-server", srv.servers[i].proc.pid)
                if len(srv.servers) == 1:
                    store.lost()  # recreated empty, tried every second until it is there
            await store.keep(bus, out, info.started)
            if obs.script is None and time.monotonic() - script_polled > 1.0:
                script_polled = time.monotonic()
                await _read_script(bus, obs, opts)
            for ev in obs.events[shown:]:
                print(f"[{time.time() - info.started:7.2f}s] {ev}", file=out, flush=True)
            shown = len(obs.events)
            if opts.live and time.monotonic() - last_table > (1.0 if tty else 5.0):
                last_table = time.monotonic()
                B = obs.script.global_batch_size if obs.script else opts.batch[0]
                print(obs.table(B) + "\n", file=out, flush=True)
            plan = obs.plan
            if obs.failed is not None:  # before state_lost: a bug, which no restart mends
                code, reason = 1, f"stopped: {obs.failed.hint}"
                break
            if obs.lost is not None:
                code, reason = 2, f"training state lost: {obs.lost.reason}"
                break
            if obs.fresh is not None:  # rare: a later generation from step -1
                wrote = written_since(opts.checkpoint_dir, ck_before)
                if wrote is not None:
                    code, reason = 2, (
                        f"training state lost: generation {obs.fresh.generation} would start "
                        f"again from step -1 (no member holds committed state) although this "
                        f"run checkpointed step {wrote}: the broker had no record of the "
                        "committed steps (lost with it, or not written yet)")
                    break
                obs.fresh = None  # nothing committed yet: a fresh start is right
            # the pods' exits are this driver's to judge while it watches them (with --bus: it
            # acts; a standby, or a driver deposed meanwhile, waits for the job's end)
            watching = ha is None or ha.watching
            if watching and plan is not None and all(
                    exits.get(m.pod) == 0 or (m.pod in exits and m.pod in obs.hb
                                              and obs.hb[m.pod].state == AgentState.done)
                    for m in plan.members):
                # the script's own step count (its --steps may differ from up's); the
                # summary's results refine it below (the steps this run computed)
                done = max((obs.hb[m.pod].step for m in plan.members if m.pod in obs.hb),
                           default=opts.steps - 1) + 1
                code, reason = 0, f"all {plan.world_size} members finished {done} steps"
                finished_w = plan.world_size
                failed = {m.pod: exits[m.pod] for m in plan.members if exits[m.pod] != 0}
                if failed:  # training is done, but the script failed after its loop
                    code = 1
                    after = (", but " + ", ".join(f"{p} exited with {c}"
                                                  for p, c in sorted(failed.items()))
                             + " after it (see its log)")
                    reason += after
                break
            failed_at_start = _failed_at_start(act, obs, opts.workers + opts.spares)
            if failed_at_start:
                code, reason = 1, failed_at_start
                break
            if watching and exits and not act.running():
                code, reason = 1, f"every pod exited ({exits}) before training finished"
                break
            if opts.timeout and time.monotonic() - started > opts.timeout:
                code, reason = 3, f"timed out after {opts.timeout}s"
                break
            if ha is not None and ha.ended is not None:  # the acting driver ended the job
                code = ha.ended.code
                reason = f"the job ended under {ha.ended.holder}: {ha.ended.reason}"
                break
        if interrupted:
            code, reason = 130, "interrupted"
    finally:
        if interrupted and opts.checkpoint_dir:
            await _checkpoint_before_stopping(bus, Path(opts.checkpoint_dir), out, info)
        # Spares leave by themselves when the job is done; give them a moment.
        deadline = time.monotonic() + (3.0 if code == 0 else 0.0)
        while act.running() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if ha is not None:  # the job's end for the other drivers, before its pods stop
            await ha.finish(code, reason)
        await act.shutdown(grace_s=3.0)
        if ray_act is None and act.prefork is not None:
            await act.prefork.close()
        if ray_act is not None:
            ray_act.close()
        if obs.script is None:  # a short job may end between two polls
            await _read_script(bus, obs, opts)
            for ev in obs.events[shown:]:
                print(f"[{time.time() - info.started:7.2f}s] {ev}", file=out, flush=True)
        await _read_faults_back(bus, obs)
        spans = _spans(run_dir)  # once: the run's first step and the goodput ledger
        if finished_w and not interrupted and (
                what := _finished(finished_w, _run_steps(run_dir, spans))):
            reason = what + after
        # a driver that never acted has nothing of its own to say: the acting one's summary
        # (the same run dir, shared by the job's drivers) is the job's
        summary = {} if ha is not None and not ha.acted else _summary(
            run_dir, obs, exits, code, reason, launched=info.started, spans=spans,
            committed=await _read_committed(bus))
        sup.stopping = True
        for t in (sup_task, quorum_task):
            if t is not None:
                t.cancel()
        await asyncio.gather(sup_task, *([quorum_task] if quorum_task else []),
                             return_exceptions=True)
        await bus.close()
        sup.stop_all()
        srv.stop()
    print(f"ceaseless up: {reason} (exit {code})", file=out, flush=True)
    if obs.failed is not None:
        _show_script_failure(obs.failed, opts, run_dir, out)
    if summary.get("final_step") is not None:
        print(f"  final step {summary['final_step']}, params sha256 "
              f"{(summary.get('param_sha256') or '')[:16]}…, incidents "
              f"{len(summary['incidents'])}, lost steps {summary['lost_steps']}", file=out)
    if (summary.get("goodput") or {}).get("effective_ratio") is not None:
        from .ledger import render

        print("  " + "\n  ".join(render(summary["goodput"], last=3)), file=out)
    print(f"  summary: {run_dir / 'summary.json'}", file=out, flush=True)
    if (obs.failed is None and _total_loss(code, exits) and opts.checkpoint_dir
            and opts.auto_resume > 0 and ext is None):
        return await _resume_after_loss(opts, run_dir, summary, out, code)
    return code


def pod_threads(cores: int, workers: int, max_replicas: int | None) -> int:
    """Intra-op threads per pod so that the pods of one machine do not oversubscribe its cores:
    torch's default (a thread per core in every process) makes co-located pods' OpenMP pools
    spin against each other and each other's gloo threads (steps 20-50x slower on 2 cores).
    torchrun sets 1 for several processes; we share the cores out."""
    return max(1, cores // max(1, workers, max_replicas or 0))


def _default_threads(env: dict[str, str], opts: "UpOptions", ray: bool) -> str:
    """Set OMP_NUM_THREADS for the pods unless the operator did; say what was chosen."""
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in env:
        return ""
    if ray:  # Ray sets it per actor from its CPU share
        return ""
    n = pod_threads(os.cpu_count() or 1, opts.workers, opts.max_replicas)
    env["OMP_NUM_THREADS"] = str(n)
    return (f"OMP_NUM_THREADS={n} per pod ({os.cpu_count()} cores here; set OMP_NUM_THREADS "
            "to choose)")


def _what_runs(opts: UpOptions) -> str:
    """The header's account of the job: the example's steps and batch (up's flags are its
    arguments); a script of the user's runs its own steps (shown once it starts)."""
    B, m = opts.batch
    if not opts.cmd:
        return f"{opts.steps} steps of the example, global batch {B} = {m} x {B // m}"
    import shlex

    shown = shlex.join(opts.cmd)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    batch = (f"plans sized for global batch {B} = {m} x {B // m}" if opts.batch_given
             else "the script's batch")
    return f"running `{shown}` (its own step count; {batch})"


async def _read_script(bus: Bus, obs: Observer, opts: UpOptions) -> None:
    """KV `script` (rank 0 writes it at its first step): show what the script runs, and
    warn, in up's own output, when up's batch flags size the plans for another batch."""
    async def get() -> bytes:
        return (await (await bus.kv()).get(SCRIPT_KEY)).value or b""

    try:
        info = ScriptInfo.model_validate_json(await asyncio.wait_for(get(), 1.0))
    except Exception:  # not written yet (KeyNotFoundError), a bus hiccup, a bad value
        return
    obs.script = info
    B, m = info.global_batch_size, info.micro_batch_size
    total = f"{info.total} steps, " if info.total is not None else ""
    fixed = (f"; its world size stays {info.fixed_world_size} (a DDP script: no shrink, "
             "no growth)" if info.fixed_world_size is not None else "")
    obs.events.append(f"script: {total}global batch {B} = {m} x {B // m} micro-batches "
                      f"(rank 0: {info.pod}){fixed}")
    fB, fm = opts.batch
    if (B, m) == (fB, fm):
        return
    if opts.batch_given:
        obs.events.append(
            f"WARNING: the script trains with global batch {B} = {m} x {B // m}, but "
            f"--global-batch-size {fB} --micro-batch-size {fm} size the plans for "
            f"{fB} = {fm} x {fB // fm} (the micro-batch shares and the largest replica "
            f"count follow the flags): pass the script's, or leave both flags out and "
            f"the plans take the script's")
    else:
        obs.events.append(f"plans from now on are sized for the script's batch (the first "
                          f"was made with the default {fB} = {fm} x {fB // fm})")


def _spans(run_dir: Path) -> list[Any] | None:
    """The job's spans (None: no traces, or they cannot be read: they are an aid)."""
    from .ledger import load

    try:
        return load(run_dir)
    except Exception:
        return None


def _run_steps(run_dir: Path, spans: list[Any] | None = None) -> tuple[int | None, int | None]:
    """(first step computed in this run, final step): the first from every pod's first
    commit in the traces (``ledger.first_committed_step``: the finishing members may all be
    spares promoted mid-run), else from the members' result files (each holds the loss of
    every step it committed); the final from the result files. (None, None) without
    results."""
    first, final = None, None
    for p in (run_dir / "results").glob("*.json"):
        try:
            r = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        steps = [int(k) for k in r.get("losses", {})]
        if steps:
            first = min(steps) if first is None else min(first, min(steps))
        if r.get("final_step") is not None:
            final = r["final_step"] if final is None else max(final, r["final_step"])
    from .ledger import first_committed_step

    traced = first_committed_step(spans) if spans else None
    return (first if traced is None else traced), final


def _finished(world_size: int, steps: tuple[int | None, int | None]) -> str | None:
    """What the run did: "finished N steps", or for a run that started later than step 0
    (--resume, a restart after a total loss, the script's own checkpoint) "finished at step
    N (K computed in this run, resumed from step S)"; steps are counted as the script's
    total is (the final step index + 1). None without results."""
    first, final = steps
    if final is None:
        return None
    done = final + 1
    if first is None or first <= 0:
        return f"all {world_size} members finished {done} steps"
    return (f"all {world_size} members finished at step {done} ({done - first} computed in "
            f"this run, resumed from step {first})")
START_FAILURES_IN_FULL = 3  # log tails printed whole; later ones as their error line


def _report_start_failure(act: Any, pod: str, code: int, lines: list[str],
                          started: float) -> None:
    """On `up`'s stderr: the first few pods that failed before they ever heartbeated with
    the end of their log, later ones with their error line only (a crash loop stays
    readable)."""
    from services.actuator.podlog import error_line

    n = len(act.start_failures)
    head = (f"[{time.time() - started:7.2f}s] pod {pod} failed before it started training "
            f"(exit {code})")
    if n > START_FAILURES_IN_FULL:
        print(f"{head}: {error_line(lines) or '(its log is empty)'}", file=sys.stderr,
              flush=True)
        return
    body = "\n".join(f"  | {ln}" for ln in lines) if lines else "  (its log is empty)"
    print(f"{head}; the end of its log ({act.log_path(pod)}):\n{body}", file=sys.stderr,
          flush=True)


def _failed_at_start(act: Any, obs: Observer, pods: int) -> str | None:
    """Why `up` stops now because the command does not start (None: it does not): no pod
    ever heartbeated, and as many pods as the job starts with have failed before they
    did (waiting for the scaler's start timeout, or replacing them, would change
    nothing)."""
    failures = act.start_failures
    if obs.hb or len(failures) < pods:
        return None
    from services.actuator.podlog import error_line

    errors = sorted({error_line(lines) or "(empty log)" for _, _, lines in failures})
    return (f"every pod failed before it started training ({len(failures)} pods, none "
            f"heartbeated): {'; '.join(errors)[:500]} (see the log lines above)")


async def _checkpoint_before_stopping(bus: Bus, ckdir: Path, out: Any, info: Any,
                                      wait_s: float = 30.0) -> None:
    """Stopped (SIGINT/SIGTERM): ask rank 0 for a checkpoint at its next step boundary and
    wait for it, bounded (a stuck job must still stop)."""
    from agent import checkpoint

    t0 = time.time()
    try:
        kv = await bus.kv()
        await kv.put("checkpoint_request", f"stop-{t0:.3f}".encode())
    except Exception as e:
        print(f"  could not ask for a final checkpoint: {e}", file=out, flush=True)
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        p = checkpoint.latest(ckdir)
        if p is not None:
            try:
                if checkpoint.manifest(p)["time"] >= t0:
                    print(f"[{time.time() - info.started:7.2f}s] final checkpoint {p}",
                          file=out, flush=True)
                    return
            except (OSError, ValueError, KeyError):
                pass
        await asyncio.sleep(0.2)
    print(f"  no final checkpoint within {wait_s:g}s; stopping anyway", file=out, flush=True)


def _show_script_failure(f: JobFailed, opts: UpOptions, run_dir: Path, out: Any) -> None:
    """The script's own error (its traceback as the pod sent it) or the repeated hang, in
    `up`'s output, with where the committed state can be taken from."""
    what = "error" if f.kind.value == "script_error" else "hang"
    print(f"  the same {what} at step {f.step + 1} on {' and '.join(f.pods)}; logs: "
          f"{run_dir / 'logs'}", file=out)
    for line in f.error.rstrip().splitlines():
        print(f"  | {line}", file=out)
    ck = None
    if opts.checkpoint_dir:
        from agent import checkpoint

        ck = checkpoint.latest(opts.checkpoint_dir)
    print(f"  newest last-resort checkpoint: {ck}; fix the script and start again with "
          f"--resume {opts.checkpoint_dir}" if ck else
          "  no last-resort checkpoint (--checkpoint-dir): a fixed script starts from step 0 "
          "or from your own checkpoint", file=out, flush=True)


def complete_checkpoints(ckdir: str | Path | None) -> set[tuple[str, float]]:
    """(name, time written) of every complete checkpoint in ``ckdir`` (none: empty)."""
    from agent import checkpoint

    out = set()
    d = Path(ckdir) if ckdir else None
    if d is None or not d.is_dir():
        return out
    for p in d.iterdir():
        if p.name.startswith("step-"):
            try:
                out.add((p.name, float(checkpoint.manifest(p)["time"])))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # not complete (no manifest yet), or not ours to judge
    return out


def written_since(ckdir: str | Path | None, before: set[tuple[str, float]]) -> int | None:
    """The newest step of a complete checkpoint in ``ckdir`` that was not there (or not
    that one) when the run started: proof that this run committed that step."""
    steps = [int(name.split("-")[1]) for name, t in complete_checkpoints(ckdir) - before
             if name.split("-")[1].isdigit()]
    return max(steps, default=None)


def _total_loss(code: int, exits: dict[str, int]) -> bool:
    """Every holder of the state is gone: the broker said so (2), or every pod was killed
    (by a signal: not a script that keeps failing, which a restart would not mend)."""
    return code == 2 or (code == 1 and bool(exits) and all(c < 0 for c in exits.values()))


async def _read_committed(bus: Bus, timeout: float = 1.0) -> int | None:
    """The state broker's record of the highest committed step (KV `committed`); None if
    there is none or it cannot be read (the bus down: an aid to the summary, no more)."""
    from nats.js.errors import KeyNotFoundError, NotFoundError

    from schemas.messages import HighWater
    from schemas.subjects import COMMITTED_KEY

    async def get() -> int | None:
        try:
            entry = await (await bus.kv()).get(COMMITTED_KEY)
        except (KeyNotFoundError, NotFoundError):
            return None
        return HighWater.model_validate_json(entry.value or b"").step

    try:
        return await asyncio.wait_for(get(), timeout)
    except Exception as e:
        log.warning("could not read KV committed", error=str(e)[:200])
        return None


def recomputed(from_step: int, recorded: int | None) -> tuple[int, int | None, str]:
    """(committed step, steps recomputed, what to say) for a restart from the checkpoint of
    ``from_step`` after a loss when the broker's record (KV `committed`) held ``recorded``
    (None: none). The checkpoint proves its own step was committed; the record lags the
    members by up to a heartbeat view, so steps committed in that time are recomputed too
    and counted by no one: the count is a lower bound, and said so."""
    if recorded is None:
        return from_step, None, (f"resumed from checkpoint step {from_step}; the steps "
                                 "committed after it are recomputed (how many is unknown: "
                                 "the broker recorded no committed step)")
    committed = max(recorded, from_step)
    n = committed - from_step
    if n == 0:
        return committed, 0, (f"resumed from checkpoint step {from_step}; the broker "
                              "recorded no later committed step, so none is known to be "
                              "recomputed")
    return committed, n, (f"resumed from checkpoint step {from_step}; steps {from_step + 1}-"
                          f"{committed} recomputed ({n} step{'s' if n != 1 else ''}, at "
                          "least: the broker records a commit up to a heartbeat view late)")


async def _resume_after_loss(opts: UpOptions, run_dir: Path, first: dict[str, Any],
                             out: Any, code: int) -> int:
    """The last resort (issue 20): no pod holds the committed state any more, so the job
    starts again, in ``run_dir/restart-N``, from the newest complete checkpoint (the steps
    after it are recomputed; data positions follow from the step). The run dir's summary
    becomes the restarted job's, with the loss recorded in it: the checkpoint and its step,
    the step committed before the loss (``committed_step``, the broker's record) and the
    steps recomputed."""
    from agent import checkpoint

    found = checkpoint.latest(opts.checkpoint_dir)
    if found is None:
        print("ceaseless up: no complete checkpoint to resume from", file=out, flush=True)
        return code
    from_step = int(checkpoint.manifest(found)["step"])
    committed, n_again, said = recomputed(from_step, first.get("committed_step"))
    n = len(list(run_dir.glob("restart-*"))) + 1
    sub = run_dir / f"restart-{n}"
    was = f" (step {committed} was committed)" if first.get("committed_step") is not None \
        else ""
    print(f"ceaseless up: every holder of the state is gone{was}; restarting from {found} "
          f"({opts.auto_resume - 1} more restart(s) allowed) in {sub}", file=out, flush=True)
    import dataclasses

    code = await run(dataclasses.replace(opts, run_dir=str(sub), resume=str(found),
                                         auto_resume=opts.auto_resume - 1))
    print(f"ceaseless up: after the total loss: {said}", file=out, flush=True)
    try:
        merged = json.loads((sub / "summary.json").read_text())
    except (OSError, ValueError):
        return code
    merged["restarts"] = [{"run_dir": str(sub), "from_checkpoint": str(found),
                           "from_step": from_step, "committed_step": committed,
                           "recomputed_steps": n_again,
                           "lost_incidents": first.get("incidents", [])},
                          *merged.get("restarts", [])]
    merged["recomputed_steps"] = sum(r.get("recomputed_steps") or 0
                                     for r in merged["restarts"])
    (run_dir / "summary.json").write_text(json.dumps(merged, indent=1))
    return code


async def _read_faults_back(bus: Bus, obs: Observer) -> None:
    """The faults `up`'s own client did not hear (published while it failed over to another
    server: a lost host's, test_hosts_e2e), read back from the job stream for the summary."""
    from services.common.history import read_back

    try:
        got = await asyncio.wait_for(read_back(bus, bus.subjects.fault, Fault, log), 3.0)
    except Exception as e:  # the summary goes on with what was heard
        log.warning("faults not read back", error=str(e)[:200])
        return
    heard = {f.incident for f in obs.faults}
    for f, _ in got:
        if f.incident not in heard:
            heard.add(f.incident)
            obs.faults.append(f)


def _opt(flag: str, value: Any) -> list[str]:
    return [] if value is None else [flag, str(value)]


def _default_data(fallback: Path) -> Path:
    """The example's corpus: generated once into the user's cache and shared by every run
    (it is a pure function of its arguments); into ``fallback`` if the cache is not
    writable."""
    try:
        from agent.data import corpus
    except ImportError:
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback
    return corpus.ensure(fallback, n_tokens=2_000_000, seed=0)


def param_digests(finals: list[dict[str, Any]]) -> tuple[set[str], bool]:
    """The final parameters' digest(s) of a job from its members' result files, and whether
    the members agree. Unsharded: every member's sha256 of the whole model. Sharded (a
    result names its ``shard``: replica, position): each rank hashed its own shards, so the
    replicas must agree per position, and the job's digest is one sha256 over the positions'
    digests in order (equal for two runs with equal parameters and the same shard size)."""
    if not any(r.get("shard") for r in finals):
        digests = {r["param_sha256"] for r in finals}
        return digests, len(digests) <= 1
    import hashlib

    by_pos: dict[int, set[str]] = {}
    for r in finals:
        pos = r["shard"][1] if r.get("shard") else -1
        by_pos.setdefault(pos, set()).add(r["param_sha256"])
    consistent = all(len(v) == 1 for v in by_pos.values()) and -1 not in by_pos
    if not consistent:
        return {f"{p}:{d}" for p, v in by_pos.items() for d in v}, False
    h = hashlib.sha256()
    for p in sorted(by_pos):
        h.update(f"{p}:{next(iter(by_pos[p]))};".encode())
    return {h.hexdigest()}, True


def _goodput(spans: list[Any] | None, results: list[dict[str, Any]],
             launched: float | None) -> dict[str, Any] | None:
    """The goodput ledger (ops/ledger.py) up to the job's last commit; None without traces."""
    from .ledger import build

    if spans is None:
        return None
    last = max((t for r in results for _, t in r.get("commits", [])), default=None)
    try:
        return build(spans, launched=launched, end=last)
    except Exception as e:  # an aid: never a reason to lose the summary
        return {"error": f"{type(e).__name__}: {e}"}


def _summary(run_dir: Path, obs: Observer, exits: dict[str, int], code: int,
             reason: str, launched: float | None = None,
             spans: list[Any] | None = None, committed: int | None = None) -> dict[str, Any]:
    results = []
    for p in sorted((run_dir / "results").glob("*.json")):
        try:
            results.append(json.loads(p.read_text()))
        except (OSError, ValueError):
            pass
    finals = [r for r in results if r.get("final_step") is not None]
    digests, consistent = param_digests(finals)
    final_step = max((r["final_step"] for r in finals), default=None)
    losses: dict[str, float] = {}
    for r in results:
        losses.update(r.get("losses", {}))
    incidents = []
    for f in obs.faults:
        recs = [r for r in obs.recoveries if r.incident == f.incident]
        downs = [r.downtime for r in recs if r.downtime is not None]
        # As `ceaseless trace` counts it: from the last evidence of the failure (where the
        # `detect` span starts) to the end of the last rank's first step (Recovery.ts).
        since = f.detected_at - (f.detection_latency or 0.0)
        incidents.append({"incident": f.incident, "kind": f.kind.value, "pod": f.pod,
                          "detection_latency": f.detection_latency,
                          "downtime": (max(0.0, max(r.ts for r in recs) - since)
                                       if recs else None),
                          "rank_downtime": max(downs) if downs else None,
                          "ranks_recovered": len(recs)})
    # Recovered incidents no fault named: a new scaler lease holder handles a member silent
    # since before it took over itself (services/scaler: "handled as faulted"; a lost host
    # takes the active monitor with the pod, test_hosts_e2e)
    named = {f.incident for f in obs.faults}
    for inc in dict.fromkeys(r.incident for r in obs.recoveries):
        if inc in named or not inc.startswith("inc-"):  # (planned changes are not faults)
            continue
        downs = [r.downtime for r in obs.recoveries if r.incident == inc and
                 r.downtime is not None]
        incidents.append({"incident": inc, "kind": "silent",
                          "pod": inc[len("inc-"):].rpartition("-g")[0] or None,
                          "detection_latency": None,
                          "downtime": max(downs) if downs else None,
                          "rank_downtime": max(downs) if downs else None,
                          "ranks_recovered": sum(r.incident == inc for r in obs.recoveries)})
    summary = {
        "exit_code": code, "reason": reason, "final_step": final_step,
        "param_sha256": digests.pop() if len(digests) == 1 else None,
        "param_sha256_consistent": consistent,
        "lost_steps": sum(r.lost_steps for r in obs.recoveries),
        # the highest step the state broker saw committed (KV `committed`; None: unknown)
        "committed_step": committed,
        "incidents": incidents, "pod_exits": exits,
        "generation": obs.plan.generation if obs.plan else 0,
        "world_size": obs.plan.world_size if obs.plan else 0,
        "losses": dict(sorted(losses.items(), key=lambda kv: int(kv[0]))),
        # the non-finite guard's skipped steps (part of the state: every finishing member
        # holds the job's list)
        "skipped_steps": sorted({s for r in finals for s in r.get("skipped_steps", [])}),
        "job_failed": obs.failed.model_dump(mode="json") if obs.failed is not None else None,
        # what the script itself ran (KV `script`: its batch and step total)
        "script": obs.script.model_dump(exclude_none=True) if obs.script else None,
        # the effective training time ratio and, per incident, where the time went
        "goodput": _goodput(spans, results, launched),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
