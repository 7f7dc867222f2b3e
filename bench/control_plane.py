"""Control-plane benchmark: many simulated agents against one real health monitor, scaler and
state broker on a real nats-server.

    python -m bench.control_plane [--agents 256,1024,4096] [--procs 4] [--rounds 4]
                                  [--silences 5] [--fault-timeout 1.5] [--pods-per-host 8]
                                  [--json PATH]
                                  [--svg PATH] [--write-doc]
    ceaseless bench control-plane ...        (same options)

For each size N: nats-server (JetStream) on a free 127.0.0.1 port, the job's stream and KV
buckets as ``ceaseless up`` creates them, the three services as their own processes
(``python -m services.health_monitor`` / ``services.scaler --workers N`` /
``services.state_broker``), and N simulated agents spread over ``--procs`` processes. A
simulated agent is an asyncio heartbeater using the real ``schemas`` models and ``Bus``: it
heartbeats every 0.25 s (the agent's default) as a waiting worker, follows the plan (its rank
and generation from the plan it received, state ``training``, a step that advances with wall
time), and stops when it is fenced (each pod's heartbeat is built with the real model once
per generation and rank, then only its step and time are filled in: the agents stand for
machines of their own, not for load on this one). The agents of one process share one NATS
connection and one plan subscription (one decode of a plan serves all of them). With
``--pods-per-host K`` (default 8) every K agents are a host whose relay sends their latest
heartbeats as one ``HeartbeatBatch`` each interval (agent/hostbeat.py; the relay is simulated
in the agents' process: the pods' messages to it stay on their machine); 0: each heartbeat is
its own message, as before issue 45's batches.

Then ``--rounds`` rounds: in each, ``--silences`` random members stop heartbeating (as a
SIGSTOPped or vanished process does). Reported:

* **detection latency**: from the silenced agent's last heartbeat to the ``fault`` for it
  arriving at the benchmark's own subscriber, p50 / p99 / max over every silence;
* **plan delivery**: from a plan's ``ts`` (the scaler stamps it when it builds it) to the
  last agent process having received and decoded it (all N agents then know it); also from
  the fault to that moment;
* **CPU** of each service process (and of nats-server and the agent processes) over the
  measured phase, as a fraction of one core (from ``/proc/<pid>/stat``);
* **memory per agent** of each service: its resident memory's growth from before the agents
  started to the end, over N (the interpreter's own ~60 MiB left out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, config, emit_with_plot, fmt, machine, machine_line, summary, main
from schemas.timeouts import DEFAULTS as TIMEOUTS
from schemas.timeouts import VIEW_INTERVAL

SECTION = "## Control plane"
HB_INTERVAL = TIMEOUTS["heartbeat_interval"]  # the agent's default
STEP_PERIOD = 0.5  # simulated step time: every member's step advances with wall time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agents", default="256,1024,4096", help="simulated agents per run")
    p.add_argument("--procs", type=int, default=4, help="processes the agents are spread over")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--silences", type=int, default=5, help="silenced agents per round")
    p.add_argument("--fault-timeout", type=float, default=TIMEOUTS["fault_timeout"])
    p.add_argument("--settle-timeout", type=float, default=30.0,
                   help="seconds a round may take to get its plan to every agent")
    p.add_argument("--start-timeout", type=float, default=None,
                   help="seconds the first plan may take to reach every agent "
                        "(default 60 + agents / 50)")
    p.add_argument("--view-interval", type=float, default=VIEW_INTERVAL,
                   help="the monitor's health-view interval (0: no view; the scaler and the "
                        "broker read every heartbeat themselves, as before the fan-in)")
    p.add_argument("--pods-per-host", type=int, default=8,
                   help="simulated pods per host: each host's relay sends its pods' heartbeats "
                        "in one HeartbeatBatch an interval (plumbing/hostbeat.py); 0: every pod "
                        "sends its own heartbeat message (before issue 45's batches)")
    p.add_argument("--profile", action="store_true",
                   help="run the three services under cProfile: <run dir>/<service>.prof "
                        "(where their time goes; slower)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="keep the run dirs here (default: a temp dir)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--svg", help="write the plot here (default with --write-doc: "
                                 "docs/img/bench-control-plane.svg)")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


# ---------------------------------------------------------------------------- agents
async def agents_main(a: argparse.Namespace) -> None:
    from schemas.messages import AgentState, Heartbeat, HeartbeatBatch, Plan, PlanRef, Role
    from plumbing.bus import Bus, Credentials
    from plumbing.plan_wire import PLAN_MODELS, resolve

    bus = await Bus.connect(a.nats, a.job, f"sim-agents-{a.first}", Credentials.load(a.creds))
    pods = [f"w{i}" for i in range(a.first, a.first + a.count)]
    rng = random.Random(a.first)
    due = {p: time.monotonic() + rng.random() * HB_INTERVAL for p in pods}
    silenced: dict[str, float] = {}
    last_sent: dict[str, float] = {}
    state = {"gen": 0, "ranks": {}, "fenced": set()}
    out = open(a.out, "a", buffering=1)
    t0 = a.t0

    kv = await bus.kv()

    async def on_plan(msg: Plan | PlanRef, env) -> None:
        if msg.generation <= state["gen"]:
            return
        # a large plan is a reference: built from the held plan by its change, or read
        plan = await resolve(kv, msg, state.get("plan"))
        state["plan"] = plan
        state["gen"] = plan.generation
        state["ranks"] = {m.pod: m.rank for m in plan.members}
        state["fenced"] = set(plan.fenced)
        out.write(json.dumps({"plan": plan.generation, "ts": plan.ts, "recv": time.time(),
                              "world": plan.world_size, "incident": plan.incident}) + "\n")

    await bus.subscribe(bus.subjects.plan, PLAN_MODELS, on_plan)

    async def on_ctl(msg) -> None:
        req = json.loads(msg.data)
        pod = req["pod"]
        silenced[pod] = time.time()
        await msg.respond(json.dumps({"pod": pod, "last_hb": last_sent.get(pod)}).encode())

    await bus.nc.subscribe(f"bench.{a.job}.silence.{a.first}", cb=on_ctl)
    await bus.nc.flush()
    out.write(json.dumps({"ready": time.time(), "pid": os.getpid()}) + "\n")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    subj = {p: bus.subjects.heartbeat(p) for p in pods}
    # --pods-per-host k: pods w<k*h>..w<k*h+k-1> are host h<h>; its relay (the host's lowest
    # pod, as agent/hostbeat.py elects) sends the latest heartbeat of each every interval
    k = a.pods_per_host
    host_of = {p: f"h{int(p[1:]) // k}" for p in pods} if k > 0 else {}
    hosts = sorted(set(host_of.values()), key=lambda h: int(h[1:]))
    pending: dict[str, dict[str, str]] = {h: {} for h in hosts}
    relay_due = {h: time.monotonic() + rng.random() * HB_INTERVAL for h in hosts}
    relay_of = {h: min((p for p in pods if host_of[p] == h), key=lambda p: int(p[1:]))
                for h in hosts}
    hsubj = {h: bus.subjects.heartbeats(h) for h in hosts}
    # A pod's heartbeat is built with the real model once per (generation, rank) and then
    # filled in (step, ts) as text: the simulated agents stand for machines of their own, and
    # building each heartbeat (~20 µs) took more of this machine's 2 cores at 16,384 agents
    # than the control plane under test.
    made: dict[str, tuple[tuple[int, int | None], str]] = {}

    def beat(p: str, rank: int | None, step: int) -> bytes:
        key = (state["gen"], rank)
        t = made.get(p)
        if t is None or t[0] != key:
            hb = Heartbeat(pod=p, role=Role.worker, generation=state["gen"], rank=rank,
                           step=_STEP_MARK, ts=_TS_MARK, pid=os.getpid(),
                           state=AgentState.training if rank is not None else AgentState.waiting,
                           step_time=STEP_PERIOD if rank is not None else None)
            t = made[p] = (key, fill_template(hb.model_dump_json(by_alias=True)))
        return (t[1] % (step if rank is not None else -1, time.time())).encode()

    checked = False
    while not stop.is_set():
        now = time.monotonic()
        step = int((time.time() - t0) / STEP_PERIOD)
        for p in pods:
            if due[p] > now or p in silenced or p in state["fenced"]:
                continue
            due[p] = now + HB_INTERVAL
            raw = beat(p, state["ranks"].get(p), step)
            if k > 0:  # to its host's relay (on the same machine: no message here)
                pending[host_of[p]][p] = raw.decode()
            else:
                await bus.nc.publish(subj[p], raw)
            last_sent[p] = time.time()
        for h in hosts:
            if relay_due[h] > now:
                continue
            relay_due[h] = now + HB_INTERVAL
            if pending[h]:
                data = batch_text(h, relay_of[h], list(pending[h].values()), time.time())
                if not checked:
                    from plumbing.bus import decode
                    decode(HeartbeatBatch, data, hsubj[h])  # raises on a malformed batch
                    checked = True
                pending[h] = {}
                await bus.nc.publish(hsubj[h], data)
        try:
            await asyncio.wait_for(stop.wait(), 0.01)
        except asyncio.TimeoutError:
            pass
    out.close()
    await bus.close()


_STEP_MARK, _TS_MARK = 987654321, 1234.5678  # stand-ins, replaced by fill_template


def batch_text(host: str, relay: str, beats: list[str], ts: float) -> bytes:
    """A ``HeartbeatBatch`` of heartbeats given as JSON text, as a relay's ``Batcher`` would
    send them (plumbing/hostbeat.py; tests/test_hostbeat.py decodes it with the model, and the
    agents check their first one): text, so that the simulated relays cost this machine
    nothing the real ones would not."""
    return (f'{{"schema_version":1,"host":"{host}","relay":"{relay}","beats":['
            + ",".join(beats) + f'],"ts":{ts!r}}}').encode()


def fill_template(raw: str) -> str:
    """A heartbeat's JSON (built with the stand-ins above) as a %-format of (step, ts)."""
    out = raw.replace("%", "%%").replace(f'"step":{_STEP_MARK}', '"step":%d') \
        .replace(f'"ts":{_TS_MARK!r}', '"ts":%r')
    if out.count("%d") != 1 or out.count("%r") != 1:
        raise ValueError(f"heartbeat template: step/ts not found once in {raw[:200]}")
    return out


# ---------------------------------------------------------------------------- one size
def cpu_seconds(pid: int) -> float | None:
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def rss_bytes(pid: int) -> int | None:
    """Resident memory of ``pid`` now (``VmRSS``)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


async def one_size(d: Path, n: int, a: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from schemas.messages import Fault, Plan, PlanRef
    from plumbing.plan_wire import PLAN_MODELS, resolve
    from plumbing.bus import Bus
    from services.common.natsserver import NatsServer, write_credentials

    d.mkdir(parents=True, exist_ok=True)
    job = "cpbench"
    creds_path = d / "creds.json"
    creds = write_credentials(creds_path)
    srv = NatsServer.start(d / "nats", creds=creds)
    pidfile = d / "control-plane.pids"
    pidfile.write_text(f"nats-server {srv.proc.pid}\n")
    procs: dict[str, subprocess.Popen] = {}
    env = {**os.environ, "PYTHONPATH": str(REPO), "CEASELESS_LOG_LEVEL": "warning"}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)

    def start(name: str, cmd: list[str]) -> None:
        log = open(d / f"{name}.log", "wb")
        procs[name] = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        with open(pidfile, "a") as f:
            f.write(f"{name} {procs[name].pid}\n")

    bus = None
    try:
        bus = await Bus.connect(srv.url, job, "bench-control-plane", creds)
        await bus.ensure_stream()
        await bus.kv()
        await bus.store_kv()
        faults: dict[str, tuple[float, Fault]] = {}
        plans: dict[int, tuple[float, Plan]] = {}

        async def on_fault(f: Fault, env) -> None:
            faults.setdefault(f.pod, (time.time(), f))

        kv = await bus.kv()

        async def on_plan(msg: Plan | PlanRef, env) -> None:
            if msg.generation not in plans:
                held = plans[max(plans)][1] if plans else None
                plans.setdefault(msg.generation, (time.time(), await resolve(kv, msg, held)))

        await bus.subscribe(bus.subjects.fault, Fault, on_fault)
        await bus.subscribe(bus.subjects.plan, PLAN_MODELS, on_plan)
        base = [sys.executable, "-m"]
        svc = (lambda name: [sys.executable, "-m", "cProfile", "-o", str(d / f"{name}.prof"),
                             "-m"] if a.profile else base)
        common = ["--nats", srv.url, "--creds", str(creds_path), "--job", job, "--run-dir",
                  str(d), "--log-level", "warning"]
        start("health_monitor", [*svc("health_monitor"), "services.health_monitor", *common,
                                 "--fault-timeout", str(a.fault_timeout),
                                 "--view-interval", str(a.view_interval)])
        start("scaler", [*svc("scaler"), "services.scaler", *common, "--workers", str(n),
                         "--max-replicas", str(n), "--min-replicas", "1",
                         "--global-batch-size", str(n), "--micro-batch-size", "1",
                         "--start-timeout", "120", "--fault-timeout", str(a.fault_timeout)])
        start("state_broker", [*svc("state_broker"), "services.state_broker", *common])
        # as `ceaseless up` does, the agents come after the services; here after each one
        # answers on its status endpoint (registered last in its start-up)
        end = time.monotonic() + 60
        for name in ("health_monitor", "scaler", "state_broker"):
            while True:
                try:
                    await bus.nc.request(bus.subjects.service_status(name), b"{}", timeout=1)
                    break
                except Exception:
                    if procs[name].poll() is not None or time.monotonic() > end:
                        raise RuntimeError(f"{name} did not come up: "
                                           f"{(d / f'{name}.log').read_text()[-2000:]}")
        # each service's memory before any agent: what it holds per agent is the growth
        rss_idle = {name: rss_bytes(p.pid) for name, p in procs.items()}
        rss_idle["nats-server"] = rss_bytes(srv.proc.pid)
        t0 = time.time()
        t_setup = time.monotonic()
        per = [n // a.procs + (1 if i < n % a.procs else 0) for i in range(a.procs)]
        firsts = [sum(per[:i]) for i in range(a.procs)]
        outs = []
        for i, (first, count) in enumerate(zip(firsts, per)):
            if count == 0:
                continue
            o = d / f"agents{i}.jsonl"
            outs.append((first, o))
            start(f"agents{i}", [*base, "bench.control_plane", "agents", "--nats", srv.url,
                                 "--creds", str(creds_path), "--job", job, "--first", str(first),
                                 "--count", str(count), "--out", str(o), "--t0", str(t0),
                                 "--pods-per-host", str(a.pods_per_host)])
        start_to = a.start_timeout or 60 + n / 50

        async def wait(pred, timeout: float, what: str) -> None:
            end = time.monotonic() + timeout
            while not pred():
                for name, p in procs.items():
                    if p.poll() is not None:
                        raise RuntimeError(f"{name} exited {p.returncode}: "
                                           f"{(d / f'{name}.log').read_text()[-2000:]}")
                if time.monotonic() > end:
                    raise TimeoutError(f"control-plane bench, {n} agents: {what}")
                await asyncio.sleep(0.02)

        def received(o: Path) -> list[dict]:
            try:
                return [json.loads(x) for x in o.read_text().splitlines() if x.strip()]
            except (OSError, ValueError):
                return []

        def delivered(gen: int) -> float | None:
            """When the last agent process had plan ``gen`` (None: not all yet)."""
            ts = []
            for _, o in outs:
                r = [x["recv"] for x in received(o) if x.get("plan") == gen]
                if not r:
                    return None
                ts.append(r[0])
            return max(ts)

        await wait(lambda: 1 in plans and delivered(1) is not None, start_to,
                   "the first plan to reach every agent")
        t_g1 = time.monotonic()
        init_delivery = delivered(1) - plans[1][1].ts
        await asyncio.sleep(2 * HB_INTERVAL + 1.0)  # every agent heartbeats as a member
        cpu0 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
        cpu0["nats-server"] = cpu_seconds(srv.proc.pid)
        w0 = time.monotonic()
        silenced: list[dict[str, Any]] = []
        error = None
        try:
            await rounds(silenced, plans, faults, outs, wait, delivered, bus, job, a, rng)
        except TimeoutError as e:  # a result too: the control plane did not keep up
            error = str(e)
        wall = time.monotonic() - w0
        cpu1 = {name: cpu_seconds(p.pid) for name, p in procs.items()}
        cpu1["nats-server"] = cpu_seconds(srv.proc.pid)
        rss = {name: rss_bytes(p.pid) for name, p in procs.items()
               if not name.startswith("agents")}
        rss["nats-server"] = rss_bytes(srv.proc.pid)
        per_agent = {k: (v - rss_idle[k]) / n for k, v in rss.items()
                     if v is not None and rss_idle.get(k) is not None}
        for s in silenced:
            hit = faults.get(s["pod"])
            if hit is None:
                s["detect_s"] = s["detected_at_s"] = None
                continue
            t_recv, f = hit
            s["detect_s"] = t_recv - s["last_hb"] if s["last_hb"] else None
            s["detected_at_s"] = f.detected_at - s["last_hb"] if s["last_hb"] else None
            s["kind"] = f.kind.value
            s["incident"] = f.incident
        deliveries = []
        for g in sorted(plans):
            if g == 1:
                continue
            t_all = delivered(g)
            p = plans[g][1]
            if t_all is None:
                continue
            fault_t = faults[p.incident.split("-")[1]][0] if p.incident and p.incident.startswith(
                "inc-") and p.incident.split("-")[1] in faults else None
            deliveries.append({"generation": g, "world": p.world_size, "ts_to_all_s": t_all - p.ts,
                               "fault_to_all_s": (t_all - fault_t) if fault_t else None,
                               "bytes": len(p.model_dump_json())})
        cpu = {k: ((cpu1[k] - cpu0[k]) / wall if cpu0.get(k) is not None and cpu1.get(k)
                   is not None else None) for k in cpu1}
        det = [s["detect_s"] for s in silenced if s["detect_s"] is not None]
        return {"agents": n, "procs": len(outs), "silences": silenced, "plans": deliveries,
                "initial_plan_delivery_s": init_delivery,
                "setup_s": round(t_g1 - t_setup, 3),
                "measured_s": wall, "cpu_core_fraction": cpu, "rss_bytes": rss,
                "rss_idle_bytes": rss_idle, "rss_per_agent_bytes": per_agent,
                "detect_p50_s": quantile(det, 0.5), "detect_p99_s": quantile(det, 0.99),
                "detect_max_s": max(det) if det else None,
                "plan_delivery": summary(x["ts_to_all_s"] for x in deliveries),
                "fault_to_plan_everywhere": summary(x["fault_to_all_s"] for x in deliveries
                                                    if x["fault_to_all_s"] is not None),
                "heartbeats_per_s": n / HB_INTERVAL, "error": error,
                "faults_seen": sum(1 for x in silenced if x.get("detect_s") is not None),
                "pods_per_host": a.pods_per_host, "read_directly": read_directly(d)}
    finally:
        if bus is not None:
            try:
                await asyncio.wait_for(bus.close(), 3)
            except Exception:
                pass
        for p in procs.values():  # by PID
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        srv.stop()


DIRECT_EVENT = "no health view from the monitor: reading heartbeats directly"


def read_directly(d: Path) -> dict[str, int]:
    """How often the scaler and the broker fell back to reading every heartbeat themselves
    (services/common/heartbeats.py): the cascade when the monitor's view comes late."""
    out = {}
    for name in ("scaler", "state_broker"):
        try:
            out[name] = (d / f"{name}.log").read_text().count(DIRECT_EVENT)
        except OSError:
            out[name] = -1
    return out


async def rounds(silenced, plans, faults, outs, wait, delivered, bus, job, a, rng) -> None:
    for r in range(a.rounds):
        gen = max(plans)
        members = [m.pod for m in plans[gen][1].members]
        victims = rng.sample(members, min(a.silences, len(members) - 1))
        for pod in victims:
            i = int(pod[1:])
            first = max(f for f, _ in outs if f <= i)
            rep = await bus.nc.request(f"bench.{job}.silence.{first}",
                                       json.dumps({"pod": pod}).encode(), timeout=5)
            info = json.loads(rep.data)
            silenced.append({"pod": pod, "round": r, "last_hb": info["last_hb"],
                             "silenced": time.time()})
            await asyncio.sleep(rng.random() * 0.05)
        await wait(lambda: all(v in faults for v in victims), a.fault_timeout * 4 + 10,
                   f"faults for {victims}")
        # every victim fenced in a plan that reached every agent
        def settled() -> bool:
            done = [g for g, (_, p) in plans.items()
                    if all(v in p.fenced or v not in {m.pod for m in p.members}
                           for v in victims)]
            return bool(done) and delivered(min(done)) is not None
        await wait(settled, a.settle_timeout, f"a plan without {victims} at every agent")
        await asyncio.sleep(0.5)


def quantile(v: list[float], q: float) -> float | None:
    """Nearest-rank quantile (p99 of fewer than 100 samples is their maximum)."""
    if not v:
        return None
    s = sorted(v)
    import math

    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


# ---------------------------------------------------------------------------- all sizes
def sizes_of(a: argparse.Namespace) -> list[int]:
    """The sizes to run, each checked before anything starts: a size the scaler's policy
    refuses (ValueError, the policy's reason) would otherwise fail only once its services
    are up."""
    from schemas.policy import ScalingPolicy

    try:
        sizes = [int(x) for x in a.agents.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--agents {a.agents!r}: give sizes as integers, e.g. 1024,4096") from None
    if not sizes:
        raise ValueError("--agents names no size")
    for n in sizes:
        try:  # as the scaler is started below: --max-replicas N --min-replicas 1
            ScalingPolicy(min_replicas=1, max_replicas=n)
        except ValueError as e:
            raise ValueError(f"{n} agents: the scaler's policy refuses it: {e}") from None
    return sizes


def failures(res: dict[str, Any]) -> list[str]:
    """Why each size that could not run did not (empty: every size ran)."""
    return [f"{r['agents']} agents: {r['failed']}" for r in res["runs"] if r.get("failed")]


async def run_all(a: argparse.Namespace) -> dict[str, Any]:
    sizes = sizes_of(a)
    work = Path(a.work_dir) if a.work_dir else Path(tempfile.mkdtemp(prefix="ceaseless-bench-"))
    rng = random.Random(a.seed)
    runs = []
    for n in sizes:
        t = time.monotonic()
        try:
            res = await one_size(work / f"agents-{n}", n, a, rng)
        except (TimeoutError, RuntimeError) as e:  # did not even get going: a result too
            print(f"{n:>5} agents: failed: {e}", flush=True)
            runs.append({"agents": n, "failed": str(e)[:500]})
            continue
        res["wall_s"] = round(time.monotonic() - t, 1)
        runs.append(res)
        c = res["cpu_core_fraction"]
        if res["error"]:
            print(f"{n:>5} agents: did not keep up: {res['error']}", flush=True)
        f3 = (lambda v: f"{v:.3f}" if v is not None else "-")
        # what each holds per agent: its growth from before the agents started
        kb = {k: f"{v / 1024:.1f}" for k, v in res["rss_per_agent_bytes"].items()}
        print(f"{n:>5} agents: detect p50 {f3(res['detect_p50_s'])}s p99 "
              f"{f3(res['detect_p99_s'])}s; plan to all {fmt(res['plan_delivery'])}; initial "
              f"plan {f3(res['initial_plan_delivery_s'])}s; CPU monitor "
              f"{c.get('health_monitor') or 0:.2f} scaler {c.get('scaler') or 0:.2f} broker "
              f"{c.get('state_broker') or 0:.2f} nats {c.get('nats-server') or 0:.2f}; RSS KiB per "
              f"agent monitor {kb.get('health_monitor')} scaler {kb.get('scaler')} broker "
              f"{kb.get('state_broker')} nats {kb.get('nats-server')}; read heartbeats "
              f"directly {res['read_directly']}", flush=True)
    return {"benchmark": "control-plane", "machine": machine(),
            "config": config(a) | {"command": "python -m bench.control_plane "
                                   + " ".join(sys.argv[1:])}, "runs": runs}


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    out = [SECTION, "", machine_line(res["machine"]),
           f"Command: `{c['command']}`. One nats-server, one health monitor, one scaler, one "
           f"state broker (each its own process, as `ceaseless up` runs them), simulated agents "
           f"in {c['procs']} processes heartbeating every {HB_INTERVAL} s with the real schemas "
           f"and bus, " + (f"{c['pods_per_host']} pods a host, each host's heartbeats in one "
                           "`HeartbeatBatch` an interval" if c.get("pods_per_host") else
                           "each heartbeat its own message") + f"; fault timeout {c['fault_timeout']} s; {c['rounds']} rounds of "
           f"{c['silences']} silenced members per size. Detection = last heartbeat of the "
           "silenced agent → its `fault` received by a subscriber; plan delivery = the plan's "
           "`ts` → the last agent process has it decoded; CPU = fraction of one core over the "
           "measured phase; memory per agent = resident memory's growth from before the "
           "agents started, over the agents.", "",
           "| agents | detection p50 | p99 | max | plan → all agents, median (min–max) | "
           "fault → plan at all agents | first plan → all | CPU monitor | scaler | broker | "
           "nats-server | agents (all procs) | KiB per agent: monitor / scaler / broker / nats |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        if r.get("failed"):
            out.append(f"| {r['agents']} | failed: {r['failed'][:200]} |" + " |" * 11)
            continue
        cpu = r["cpu_core_fraction"]
        ag = sum(v for k, v in cpu.items() if k.startswith("agents") and v is not None)
        f = (lambda v: f"{v:.3f} s" if v is not None else "–")
        out.append(f"| {r['agents']} | {f(r['detect_p50_s'])} | {f(r['detect_p99_s'])} | "
                   f"{f(r['detect_max_s'])} | {fmt(r['plan_delivery'])} | "
                   f"{fmt(r['fault_to_plan_everywhere'])} | {f(r['initial_plan_delivery_s'])} | "
                   f"{cpu.get('health_monitor') or 0:.2f} | {cpu.get('scaler') or 0:.2f} | "
                   f"{cpu.get('state_broker') or 0:.2f} | {cpu.get('nats-server') or 0:.2f} | "
                   f"{ag:.2f} | {per_agent_kib(r)} |")
    for r in res["runs"]:
        if r.get("error"):
            out += ["", f"{r['agents']} agents: the run stopped early: {r['error']} "
                    f"({r['faults_seen']} of {len(r['silences'])} silences were detected; "
                    "the figures above are from what completed)."]
    for r in res["runs"]:
        if any((r.get("read_directly") or {}).values()):
            out += ["", f"{r['agents']} agents: the scaler / the broker fell back to reading "
                    f"every heartbeat themselves {r['read_directly']} times (the monitor's "
                    "view came late)."]
    out += ["", "![control plane](img/bench-control-plane.svg)"]
    return "\n".join(out) + "\n"


def per_agent_kib(r: dict[str, Any]) -> str:
    """Each service's memory growth from before the agents started, per agent."""
    g = r.get("rss_per_agent_bytes") or {}
    return " / ".join(f"{g[k] / 1024:.1f}" if g.get(k) is not None else "–"
                      for k in ("health_monitor", "scaler", "state_broker", "nats-server"))


def plot(res: dict[str, Any]) -> str:
    from bench.report import svg

    groups, vals = [], {}
    for r in [x for x in res["runs"] if not x.get("failed")]:
        g = f"{r['agents']} agents"
        groups.append(g)
        det = [s["detect_s"] for s in r["silences"] if s["detect_s"] is not None]
        vals[(g, "detection p50")] = r["detect_p50_s"]
        vals[(g, "detection p99")] = r["detect_p99_s"]
        vals[(g, "plan → all agents")] = r["plan_delivery"]
        vals[(g, "fault → plan at all")] = r["fault_to_plan_everywhere"]
        del det
    return svg.bars(f"Control plane: detection and plan delivery ({res['machine']['cores']} "
                    "CPU cores)", groups, ["detection p50", "detection p99", "plan → all agents",
                                           "fault → plan at all"], vals, "seconds",
                    note=f"{res['machine']['date']}; fault timeout "
                         f"{res['config']['fault_timeout']} s; heartbeat every {HB_INTERVAL} s")


def run(a: argparse.Namespace) -> int:
    """0 when every size ran (a run that did not keep up is a result: its figures say so);
    non-zero, with the reason on stderr, when a size could not run at all."""
    try:
        sizes_of(a)
    except ValueError as e:
        print(f"control-plane bench: {e}", file=sys.stderr, flush=True)
        return 2
    res = asyncio.run(run_all(a))
    rc = emit_with_plot(a, res, markdown(res), SECTION, "bench-control-plane.svg", plot)
    bad = failures(res)
    for why in bad:
        print(f"control-plane bench: could not run {why}", file=sys.stderr, flush=True)
    return rc or (1 if bad else 0)


def _agents(argv: list[str]) -> None:
    """One process of simulated agents: a mode of this benchmark's command line."""
    p = argparse.ArgumentParser(description="simulated agents (one process)")
    for k in ("--nats", "--creds", "--job", "--out"):
        p.add_argument(k, required=True)
    p.add_argument("--first", type=int, required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--t0", type=float, required=True)
    p.add_argument("--pods-per-host", type=int, default=0)
    asyncio.run(agents_main(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main(__name__, modes={"agents": _agents}))
