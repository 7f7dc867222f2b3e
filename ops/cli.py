"""The ``ceaseless`` command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from schemas import Subjects
from schemas.messages import Capacity, CapacityChange, Decision, Inject, InjectAction, Priority

SERVICE_NAMES = ("health_monitor", "scaler", "state_broker")


# ----------------------------------------------------------------------------- connection
def _add_conn(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", help="a `ceaseless up` run dir (default: the most recent run)")
    p.add_argument("--nats", help="bus URL (instead of --run-dir); several servers: "
                   "comma-separated URLs")
    p.add_argument("--creds", help="credentials JSON file (with --nats)")
    p.add_argument("--job", help="job name (default: the run's, else demo)")


async def _connect(args: argparse.Namespace, name: str):
    from plumbing.bus import Bus, Credentials

    from .runinfo import ClusterInfo, find_run_dir

    if args.nats:
        creds = Credentials.load(args.creds) if args.creds else None
        return await Bus.connect(args.nats, args.job or "demo", name, creds,
                                 max_reconnect_attempts=2)
    info = ClusterInfo.read(find_run_dir(args.run_dir))
    from plumbing.tlsgen import client_options

    return await Bus.connect(info.nats_url, args.job or info.job, name,
                             Credentials.load(info.creds), max_reconnect_attempts=2,
                             **client_options(info.tls_ca))


# ----------------------------------------------------------------------------- up
def fault_timeout_for(given: float | None, bus_servers: int) -> float:
    """``--fault-timeout`` as given, else its default: above a client's failover time
    (plumbing/bus.py FAILOVER_S) when the bus has several servers."""
    from plumbing.bus import FAILOVER_S
    from schemas.timeouts import DEFAULTS

    if given is not None:
        return given
    if bus_servers > 1:
        return max(DEFAULTS["fault_timeout"], FAILOVER_S + 1.0)
    return DEFAULTS["fault_timeout"]


def external_bus_refusal(opts: Any, args: argparse.Namespace) -> str | None:
    """Why `up`'s flags do not go with (or without) ``--bus``; None: they do."""
    if not opts.bus:
        given = [f for f, v in (("--bus-creds", opts.bus_creds), ("--pod-creds", opts.pod_creds),
                                ("--node", opts.node)) if v]
        if opts.services != "here":
            given.append("--services external")
        return f"{', '.join(given)} only with --bus" if given else None
    if opts.hosts:
        return "--hosts emulates hosts with a bus `up` starts: not with --bus"
    if opts.tls:
        return ("--tls makes certificates for a bus `up` starts; with --bus give tls:// URLs "
                "and the bus's CA in CEASELESS_TLS_CA")
    if args.bus_servers != 1:
        return "--bus-servers: `up` starts no server with --bus (its URLs are the servers)"
    if opts.standbys:
        return ("--standbys: with --bus each node's `up` runs one instance of each service "
                "(--services here); the other nodes' are the standbys")
    return None


def cmd_up(args: argparse.Namespace) -> int:
    from .cluster import UpOptions, run

    cmd = list(args.cmd or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    opts = UpOptions(workers=args.workers, spares=args.spares, steps=args.steps, job=args.job,
                     run_dir=args.run_dir, cmd=cmd, global_batch_size=args.global_batch_size,
                     micro_batch_size=args.micro_batch_size, min_replicas=args.min_replicas,
                     fault_timeout=fault_timeout_for(args.fault_timeout, args.bus_servers),
                     stall_timeout=args.stall_timeout,
                     allow_inject=not args.no_inject, timeout=args.timeout, tls=args.tls,
                     replace=not args.no_replace, max_replacements=args.max_replacements,
                     # CEASELESS_PREFORK=0: --no-prefork for every `up` (a test suite's A/B)
                     prefork=not args.no_prefork and os.environ.get("CEASELESS_PREFORK") != "0",
                     checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                     checkpoint_keep=args.checkpoint_keep, resume=args.resume,
                     auto_resume=args.auto_resume, checkpoint_minutes=args.checkpoint_minutes,
                     live=not args.quiet, model=args.model, dtype=args.dtype, policy=args.policy,
                     max_replicas=args.max_replicas, scale_up_snooze=args.scale_up_snooze,
                     save_params=args.save_params, start_timeout=args.start_timeout,
                     gpus_per_pod=args.gpus_per_pod, actuator=args.actuator,
                     ray_address=args.ray_address, ray_cpus_per_pod=args.ray_cpus_per_pod,
                     bus_host=args.bus_host, bus_servers=args.bus_servers, shard_size=args.shard_size,
                     straggler_factor=args.straggler_factor, verify_every=args.verify_every,
                     straggler_window=args.straggler_window,
                     on_nonfinite=args.on_nonfinite, loss_spike=args.loss_spike,
                     standbys=args.standbys, hosts=args.hosts,
                     control_hosts=args.control_hosts, bus=args.bus, bus_creds=args.bus_creds,
                     pod_creds=args.pod_creds, services=args.services, node=args.node)
    why = external_bus_refusal(opts, args)
    if why:
        print(f"ceaseless up: {why}", file=sys.stderr)
        return 2
    if opts.bus:  # its servers count as --bus-servers (the fault timeout, the monitor's)
        from plumbing.bus import split_urls

        opts.bus_servers = len(split_urls(opts.bus))
        opts.fault_timeout = fault_timeout_for(args.fault_timeout, opts.bus_servers)
    if opts.hosts and opts.actuator != "local":
        print("ceaseless up: --hosts emulates hosts on this machine: local actuator only",
              file=sys.stderr)
        return 2
    from .hosts import MAX_HOSTS

    if not 0 <= opts.hosts <= MAX_HOSTS:
        print(f"ceaseless up: --hosts takes 0 (none) to {MAX_HOSTS}", file=sys.stderr)
        return 2
    if opts.control_hosts and not 0 < opts.control_hosts < opts.hosts:
        print(f"ceaseless up: --control-hosts {opts.control_hosts} needs --hosts above it "
              f"(the pods run on the other hosts; --hosts {opts.hosts})", file=sys.stderr)
        return 2
    if opts.standbys < 0:
        print("ceaseless up: --standbys must be at least 0", file=sys.stderr)
        return 2
    if opts.workers < 1:
        print("ceaseless up: --workers must be at least 1", file=sys.stderr)
        return 2
    if opts.bus_servers < 1:
        print("ceaseless up: --bus-servers must be at least 1", file=sys.stderr)
        return 2
    from plumbing.bus import FAILOVER_S

    if opts.bus_servers > 1 and opts.fault_timeout <= FAILOVER_S:
        print(f"ceaseless up: --fault-timeout {opts.fault_timeout:g} is too short for a bus of "
              f"{opts.bus_servers} servers: a client whose server is lost takes up to "
              f"{FAILOVER_S:g}s to go to another, and its pod's heartbeats would read as its "
              f"loss; give more than {FAILOVER_S:g} (the default with --bus-servers > 1 is "
              f"{fault_timeout_for(None, opts.bus_servers):g})", file=sys.stderr)
        return 2
    k = opts.shard_size
    if k < 1:
        print("ceaseless up: --shard-size must be at least 1", file=sys.stderr)
        return 2
    if opts.workers % k:
        print(f"ceaseless up: --workers {opts.workers} is not a multiple of --shard-size {k}: "
              f"the job runs whole replicas of {k} ranks (try --workers "
              f"{max(k, opts.workers // k * k)})", file=sys.stderr)
        return 2
    from agent.config import check_guards

    try:
        check_guards(opts.on_nonfinite, opts.verify_every, opts.loss_spike)
        if opts.straggler_factor or opts.straggler_window is not None:
            from services.health_monitor.stragglers import FACTOR, Rule

            # the monitor's own check, before anything starts (a factor of 0: the rule off)
            Rule(factor=opts.straggler_factor or FACTOR,
                 **({} if opts.straggler_window is None else {"window": opts.straggler_window}))
    except ValueError as e:
        print(f"ceaseless up: {e}", file=sys.stderr)
        return 2
    from schemas.timeouts import agent_timeouts_from_env, check_timeouts

    try:
        # the pods inherit this environment: their timeouts are part of the chain
        check_timeouts(fault_timeout=opts.fault_timeout, stall_timeout=opts.stall_timeout,
                       **agent_timeouts_from_env())
    except ValueError as e:  # TimeoutConfigError, or a variable that is not a number
        print(f"ceaseless up: {e}", file=sys.stderr)
        return 2
    from schemas.policy import load_policy

    try:  # refuse a bad policy here, not in a scaler that the supervisor restarts forever
        pol = load_policy(opts.policy, min_replicas=opts.min_replicas,
                          max_replicas=opts.max_replicas,
                          scale_up_snooze_s=opts.scale_up_snooze)
        if opts.policy:
            opts.policy = str(Path(opts.policy).resolve())
        if opts.workers // k > pol.max_replicas:
            what = f"--workers {opts.workers}" + (
                f" ({opts.workers // k} replicas of {k})" if k > 1 else "")
            raise ValueError(f"{what} exceeds max_replicas {pol.max_replicas}")
        if k > 1:  # the batch must split into whole replicas (the scaler would refuse it)
            from services.scaler.policy import PolicyConfig

            PolicyConfig.from_policy(pol, workers=opts.workers,
                                     global_batch_size=opts.batch[0],
                                     micro_batch_size=opts.batch[1], shard_size=k)
        if opts.actuator == "local":
            from services.actuator.gpus import GpuAssigner, visible_gpus

            GpuAssigner(visible_gpus(), expected=opts.workers + opts.spares,
                        per_pod=opts.gpus_per_pod)  # refuse --gpus-per-pod the machine cannot give
        else:
            try:
                import ray  # noqa: F401
            except ImportError:
                raise ValueError("--actuator ray needs Ray: pip install 'ceaseless[ray]'")
    except ValueError as e:
        print(f"ceaseless up: {e}", file=sys.stderr)
        return 2
    return asyncio.run(run(opts))


# ----------------------------------------------------------------------------- status
async def _status(args: argparse.Namespace) -> dict[str, Any]:
    bus = await _connect(args, "ceaseless-status")
    try:
        out: dict[str, Any] = {"job": bus.subjects.job, "services": {}}
        for name in SERVICE_NAMES:
            try:
                r = await bus.nc.request(bus.subjects.service_status(name), b"", timeout=1.0)
                out["services"][name] = json.loads(r.data)
            except Exception as e:
                out["services"][name] = {"error": f"no answer ({type(e).__name__})"}
        out["bus"] = await _quorum(args)
        if out["bus"] is not None and not out["bus"]["quorum"]:
            # JetStream cannot answer: its reads would each wait out their timeout
            out.update(leases={}, plan=None, script=None, goodput=_ledger(args),
                       streams={"error": "no JetStream quorum"})
            from .emulated import placement_status, read_hosts
            from .runinfo import find_run_dir

            hosts = None if args.nats else read_hosts(find_run_dir(args.run_dir))
            if hosts is not None:
                out["hosts"] = placement_status(hosts, {})
            return out
        out["leases"] = await _leases(bus)
        try:
            kv = await bus.js.key_value(bus.subjects.kv_bucket)
            entry = await kv.get("plan")
            from plumbing.plan_wire import read_value  # a large plan's ref: read its parts

            out["plan"] = (await read_value(kv, entry.value, None)).model_dump(mode="json")
            out["plan_revision"] = entry.revision
        except Exception:
            out["plan"] = None
        try:  # what the training script itself runs (rank 0 writes KV `script`)
            out["script"] = json.loads((await kv.get("script")).value)
        except Exception:
            out["script"] = None
        out["goodput"] = _ledger(args)
        await _placement(args, bus, out)
        return out
    finally:
        await bus.close()


async def _quorum(args: argparse.Namespace) -> dict[str, Any] | None:
    """A bus of several servers: how many answer, whether that is a JetStream quorum
    (ops/quorum.py); None for a single server."""
    from .quorum import probe, server_names
    from .runinfo import ClusterInfo, find_run_dir

    url = args.nats or ClusterInfo.read(find_run_dir(args.run_dir)).nats_url
    if len(server_names(url)) < 2:
        return None
    return (await probe(url)).as_dict()


async def _placement(args: argparse.Namespace, bus: Any, out: dict[str, Any]) -> None:
    """`up --hosts`: which host runs each pod, instance and server (the run dir's
    hosts.json), which instances are active, and each stream's and bucket's leader."""
    from .emulated import bus_leaders, placement_status, read_hosts
    from .runinfo import find_run_dir

    hosts = None if args.nats else read_hosts(find_run_dir(args.run_dir))
    if hosts is not None:
        out["hosts"] = placement_status(hosts, out.get("leases") or {})
    try:
        out["streams"] = await bus_leaders(bus)
    except Exception as e:  # an aid: the rest of the status still shows
        out["streams"] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}


async def _leases(bus: Any) -> dict[str, Any]:
    """Which instance of each service is active (its lease in KV: holder, term, seconds
    left); None for a service whose lease is absent or ran out (no instance acts)."""
    from services.common.lease import parse_lease
    from schemas.subjects import lease_key

    out: dict[str, Any] = {}
    try:
        kv = await bus.js.key_value(bus.subjects.kv_bucket)
    except Exception:
        return out
    # the Ray driver's too (`up --actuator ray --bus`: one acts per job); listed only where
    # it has one (a local actuator takes none: "no active instance" would mislead)
    for name in (*SERVICE_NAMES, "actuator"):
        try:
            cur = parse_lease((await kv.get(lease_key(name))).value)
        except Exception:
            if name != "actuator":
                out[name] = None
            continue
        left = cur.expires - time.time()
        out[name] = ({"active": cur.holder, "term": cur.term, "expires_in_s": round(left, 3)}
                     if cur.holder and left > 0 else None)
    return out


def _ledger(args: argparse.Namespace) -> dict[str, Any] | None:
    """The goodput ledger so far, from the run directory's traces (None with --nats: no run
    directory to read)."""
    if args.nats:
        return None
    from .ledger import from_run_dir
    from .runinfo import ClusterInfo, find_run_dir

    try:
        info = ClusterInfo.read(find_run_dir(args.run_dir))
        return from_run_dir(info.run_dir, launched=info.started)
    except Exception as e:  # an aid: the rest of the status still shows
        return {"error": f"{type(e).__name__}: {e}"}


def _render_status(st: dict[str, Any]) -> str:
    lines = [f"job {st['job']}"]
    if st.get("bus"):
        lines.append(st["bus"]["line"])
    plan = st.get("plan")
    if plan:
        members = sorted(plan["members"], key=lambda m: m["rank"])
        k = plan.get("shard_size", 1)
        shards = f" = replicas {plan['world_size'] // k} x shards {k}" if k > 1 else ""
        lines.append(f"plan generation {plan['generation']} (revision {st.get('plan_revision')}): "
                     f"world size {plan['world_size']}{shards}, "
                     f"global batch {plan['global_batch_size']} "
                     f"= {plan['micro_batch_size']} x {sum(plan['shares'].values())} micro-batches, "
                     f"reason: {plan['reason']}")
        lines.append("  ranks: " + ", ".join(f"{m['rank']}={m['pod']}" for m in members))
        sc = st.get("script")
        if sc:
            same = (sc["global_batch_size"], sc["micro_batch_size"]) == (
                plan["global_batch_size"], plan["micro_batch_size"])
            source = ((st["services"].get("scaler") or {}).get("policy") or {}).get(
                "batch_source")
            if same:
                note = ""
            elif source in ("script", "default"):  # `up` was given no batch
                note = ("; the plan was made before the script's batch was known, the next "
                        "ones are sized for it")
            else:
                note = ("; the plan was sized for another batch: pass the script's to "
                        "`ceaseless up` (--global-batch-size, --micro-batch-size), or "
                        "neither flag")
            lines.append(f"  script: global batch {sc['global_batch_size']} = "
                         f"{sc['micro_batch_size']} x "
                         f"{sc['global_batch_size'] // sc['micro_batch_size']} micro-batches, "
                         f"{sc['total']} steps (pod {sc['pod']})" + note)
        if plan.get("spares"):
            lines.append("  spares: " + ", ".join(plan["spares"]))
    else:
        lines.append("no plan yet")
    mon = st["services"].get("health_monitor", {})
    pods = mon.get("pods") or {}
    if pods:
        lines.append(f"{'pod':<10}{'role':<8}{'state':<12}{'gen':>4}{'rank':>5}{'step':>7}{'age s':>8}"
                     f"  {'device':<16}health")
        for pod, p in sorted(pods.items()):
            lines.append(f"{pod:<10}{str(p.get('role')):<8}{str(p.get('state')):<12}"
                         f"{p.get('generation', '-'):>4}{str(p.get('rank', '-')):>5}"
                         f"{p.get('step', '-'):>7}{p.get('age', 0):>8.2f}  "
                         f"{str(p.get('device') or '-'):<16}{p.get('health', '')}")
        if (mon.get("pods_total") or 0) > len(pods):  # a status lists the first (not ok first)
            lines.append(f"... and {mon['pods_total'] - len(pods)} more pods not listed")
    waiting = mon.get("waiting") or {}
    if waiting:
        lines.append("waiting in the all-reduce: "
                     + ", ".join(f"{p} {t:.1f}s" for p, t in list(waiting.items())[:8])
                     + f" (a live member not among them is declared hung at "
                       f"{mon.get('config', {}).get('collective_timeout', '?')}s)")
    leases = st.get("leases") or {}
    for name, s in st["services"].items():
        state = s.get("error") or f"up {s.get('uptime_s', 0):.0f}s, dropped {sum(s.get('dropped', {}).values())}"
        if name in leases:
            ls = leases[name]
            state += (f"; active: {ls['active']} (term {ls['term']})" if ls
                      else "; no active instance (lease expired)")
        lines.append(f"service {name}: {state}")
    if "actuator" in leases:  # the Ray drivers' lease (`up --bus`)
        ls = leases["actuator"]
        lines.append(f"actuator: active: {ls['active']} (term {ls['term']})" if ls
                     else "actuator: no driver acts (lease expired)")
    sc = st["services"].get("scaler", {})
    if sc.get("policy"):
        pol = sc["policy"]
        sizes = (",".join(map(str, pol["replica_discrete_values"]))
                 if pol.get("replica_discrete_values") else
                 f"{pol['min_replicas']}..{pol['max_replicas']} step "
                 f"{pol.get('replica_increment_step', 1)}")
        lines.append(f"policy: replicas {sizes}; scale-up snooze {pol.get('scale_up_snooze_s')}s, "
                     f"scaling timeout {pol.get('scaling_timeout_s')}s, graceful shutdown "
                     f"{pol.get('graceful_shutdown_timeout_s')}s; global batch "
                     f"{pol['global_batch_size']} (constant)")
    if plan or sc.get("scale"):
        scale = sc.get("scale") or {}
        k = plan.get("shard_size", 1) if plan else 1
        target = scale.get("target", plan["world_size"] // k if plan else "?")
        cur = plan["world_size"] // k if plan else 0
        lines.append(f"scale: {cur} replica(s){f' of {k} ranks' if k > 1 else ''}, "
                     f"target {target}"
                     + (f" (last request: {scale['reason']})" if scale.get("reason") else ""))
        if plan:
            lines.append(f"  last change: generation {plan['generation']}: {plan['reason']}")
        for r in scale.get("releases", []):
            lines.append(f"  release {r['request_id']} ({r['count']}): freed {r['freed']}, "
                         f"leaving {r['leaving']}")
        if sc.get("waiting"):
            lines.append(f"  waiting: {sc['waiting']}")
    hosts = st.get("hosts")
    if hosts:  # `up --hosts`: what runs where
        lines.append(f"hosts ({hosts.get('mode')}):")
        for h, v in hosts.get("hosts", {}).items():
            what = [s for s, x in hosts.get("servers", {}).items() if x.get("host") == h]
            what += [i + ("*" if x.get("active") else "")
                     for i, x in hosts.get("instances", {}).items() if x.get("host") == h]
            what += [p for p, x in hosts.get("pods", {}).items() if x == h]
            lines.append(f"  {h} {v.get('addr')} {v.get('state')}: {' '.join(what) or '-'}")
        lead = st.get("streams") or {}
        if lead and "error" not in lead:
            lines.append("  leaders: " + ", ".join(f"{k} {v.get('leader')}"
                                                   for k, v in sorted(lead.items())))
    led = st.get("goodput")
    if led and "error" not in led:
        from .ledger import render

        lines += render(led)
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    try:
        while True:
            st = asyncio.run(_status(args))
            if args.json:
                print(json.dumps(st, indent=2, default=str))
            else:
                if args.watch:
                    print("\x1b[2J\x1b[H", end="")
                print(_render_status(st), flush=True)
            if not args.watch:
                return 0
            time.sleep(1.0)
    except FileNotFoundError as e:
        print(f"ceaseless status: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    except Exception as e:
        print(f"ceaseless status: cannot reach the cluster: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------- inject
def build_inject(args: argparse.Namespace) -> tuple[str, Any]:
    """The subject and message an inject command publishes (what `nats pub` would)."""
    s = Subjects(args.job or "demo")
    if args.action == "capacity":
        n = int(args.amount)
        if n == 0:
            raise ValueError("capacity change must be +N or -N, not 0")
        return s.capacity, Capacity(change=CapacityChange.add if n > 0 else CapacityChange.remove,
                                    count=abs(n), reason=args.reason or "operator")
    if args.action == "priority":
        if not args.release:
            raise ValueError("priority needs --release N")
        return s.priority, Priority(release=args.release, priority=args.priority,
                                    reason=args.reason or "operator")
    if args.action in ("host-loss", "partition", "host-return"):
        if getattr(args, "host", None) is None or args.rank is not None or args.pod is not None:
            raise ValueError(f"inject {args.action} needs --host hK (and no --rank or --pod)")
        if (args.action == "partition") != (getattr(args, "for_s", None) is not None):
            raise ValueError(f"inject partition needs --for S; {args.action} takes no --for")
        return s.inject, Inject(action=InjectAction(args.action), host=args.host,
                                for_s=args.for_s)
    if (args.rank is None) == (args.pod is None):
        raise ValueError(f"inject {args.action} needs exactly one of --rank R or --pod P")
    return s.inject, Inject(action=InjectAction(args.action), rank=args.rank, pod=args.pod,
                            at_step=args.at_step, deadline_s=getattr(args, "deadline", None),
                            factor=getattr(args, "factor", None),
                            tensor=getattr(args, "tensor", None))


async def _inject(args: argparse.Namespace) -> int:
    bus = await _connect(args, "ceaseless-inject")
    try:
        if not args.job:
            args.job = bus.subjects.job
        subject, msg = build_inject(args)
        answers: asyncio.Queue = asyncio.Queue()
        rid = getattr(msg, "request_id", None)
        if rid is not None and args.wait > 0:
            async def on_decision(d: Decision, _e) -> None:
                if d.request_id == rid:
                    answers.put_nowait(d)
            await bus.subscribe(bus.subjects.decision, Decision, on_decision)
        await bus.publish(subject, msg)
        await bus.nc.flush()
        print(f"published on {subject}: {msg.model_dump_json()}", flush=True)
        if rid is None or args.wait <= 0:
            return 0
        # The scaler answers on `decision`: accepted (what will happen) or refused (why);
        # a release once more when its slots are free. A fault: the pod that runs it or the
        # supervisor (`up`), accepted (who, when) or refused (why).
        deadline = time.monotonic() + args.wait
        while True:
            try:
                d = await asyncio.wait_for(answers.get(), max(0.01, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                who = "any pod or the supervisor" if isinstance(msg, Inject) else "the scaler"
                print(f"no answer from {who} in {args.wait:g}s (is it running?)",
                      file=sys.stderr)
                return 1
            kind = "completed" if d.completed else "accepted" if d.accepted else "refused"
            print(f"{kind}: {d.reason}" + (f" (target {d.target})" if d.target else ""),
                  flush=True)
            if not d.accepted:
                return 1
            if d.completed or not isinstance(msg, Priority) and not (
                    isinstance(msg, Capacity) and msg.change == CapacityChange.remove):
                return 0
    finally:
        await bus.close()


def cmd_inject(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_inject(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"ceaseless inject: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        print(f"ceaseless inject: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------- schemas
def cmd_schemas_export(args: argparse.Namespace) -> int:
    from schemas.export import index, json_schemas

    out = Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    for kind, schema in json_schemas().items():
        (out / f"{kind}.schema.json").write_text(json.dumps(schema, indent=2) + "\n")
    idx = index()
    (out / "index.json").write_text(json.dumps(idx, indent=2) + "\n")
    print(f"wrote {len(idx['schemas'])} JSON Schemas to {out}/")
    return 0


# ----------------------------------------------------------------------------- main
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The CLI's parser. With ``argv`` given and no ``bench`` in it, the benchmark
    subcommands are registered without importing them (they import torch: seconds)."""
    p = argparse.ArgumentParser(prog="ceaseless", description=__doc__.strip() + " Checkpointless, "
                                "elastic training for PyTorch.")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="run a local cluster: nats, services, workers, spares")
    up.add_argument("--workers", type=int, default=3,
                    help="ranks to train on (with --shard-size K: a multiple of K)")
    up.add_argument("--spares", type=int, default=1)
    up.add_argument("--shard-size", type=int, default=1, metavar="K",
                    help="sharded models: replicas of K ranks (FSDP inside a replica); "
                         "replica counts (min/max replicas, capacity, priority) count "
                         "replicas (default 1: unsharded)")
    up.add_argument("--steps", type=int, default=100,
                    help="the example's step count (a script of your own, `-- CMD`, runs "
                         "its own)")
    up.add_argument("--job", default="demo")
    up.add_argument("--run-dir")
    up.add_argument("--global-batch-size", type=int, default=None,
                    help="samples per step the plans are sized for (default: the training "
                         "script's own, taken from it once it runs; the example gets 32)")
    up.add_argument("--micro-batch-size", type=int, default=None,
                    help="samples per micro-batch (default: the script's; the example's 4)")
    from schemas.policy import ScalingPolicy

    pol = {k: f.default for k, f in ScalingPolicy.model_fields.items()}
    up.add_argument("--min-replicas", type=int,
                    help=f"(default: the policy's, else {pol['min_replicas']})")
    up.add_argument("--max-replicas", type=int,
                    help=f"(default: the policy's, else {pol['max_replicas']})")
    up.add_argument("--policy", help="scaling policy file (TOML/YAML), see docs/elastic.md")
    up.add_argument("--scale-up-snooze", type=float,
                    help="no scale-up within this many seconds of the last change "
                         f"(default {pol['scale_up_snooze_s']:g})")
    up.add_argument("--save-params", action="store_true",
                    help="each finishing member also writes its final parameters to "
                         "results/<pod>.pt (for comparisons across world sizes)")
    up.add_argument("--start-timeout", type=float,
                    help="the first plan waits this long for every worker before it starts "
                         "with the ones alive (default 30)")
    from schemas.timeouts import DEFAULTS

    up.add_argument("--fault-timeout", type=float, default=None,
                    help=f"seconds of silence before a pod is declared lost (default "
                         f"{DEFAULTS['fault_timeout']:g}; with --bus-servers > 1: "
                         f"{fault_timeout_for(None, 3):g}, above a client's failover to "
                         "another server)")
    up.add_argument("--standbys", type=int, default=0, metavar="K",
                    help="K standby instances of each service (health monitor, scaler, state "
                         "broker): one acts, by lease; a standby takes over within the fault "
                         "timeout of the active one's loss (default %(default)s)")
    up.add_argument("--stall-timeout", type=float, default=DEFAULTS["collective_timeout"],
                    help="(default: the agents' collective timeout, %(default)s s)")
    up.add_argument("--verify-every", type=int, default=100, metavar="N",
                    help="every N steps the replicas compare a digest of their state; the "
                         "agreed one is kept in host memory, a disagreement rolls back to it "
                         "and the odd replica is replaced (default %(default)s; 0: off)")
    up.add_argument("--on-nonfinite", choices=["skip", "rollback"], default="skip",
                    help="a step whose loss or gradient is not finite is skipped on every rank; "
                         "rollback: also go back to the last verified copy and compute the "
                         "steps after it again, that step's data skipped (default %(default)s)")
    up.add_argument("--loss-spike", type=float, default=0.0, metavar="F",
                    help="skip a step whose loss is over F times the median of the last "
                         "committed ones, as a non-finite one (default 0: off)")
    up.add_argument("--straggler-factor", type=float, default=None, metavar="F",
                    help="a member whose own compute of a step is F times the other members' "
                         "median (or slowed F times more than they were, against its own "
                         "steady pace) for most of --straggler-window s is swapped for a live "
                         "spare at a step boundary (default 3; 0: off)")
    up.add_argument("--straggler-window", type=float, default=None, metavar="S",
                    help="(default 10 s)")
    up.add_argument("--gpus-per-pod", type=int, default=None, metavar="N",
                    help="GPUs each pod sees (CUDA_VISIBLE_DEVICES). Default: one per pod when "
                         "the machine has enough, else pods share them (gloo for CUDA "
                         "tensors); 0: none")
    up.add_argument("--actuator", choices=["local", "ray"], default="local",
                    help="where pods run: local processes (default), or Ray actors on a Ray "
                         "cluster (extra ceaseless[ray]; docs/cluster.md)")
    up.add_argument("--ray-address", default="auto", metavar="auto|ADDRESS",
                    help="with --actuator ray: the cluster to join (default auto: the one "
                         "this machine is part of, RAY_ADDRESS or `ray start`'s)")
    up.add_argument("--ray-cpus-per-pod", type=float, default=0.1, metavar="N",
                    help="with --actuator ray: the CPUs each pod's actor reserves")
    up.add_argument("--bus-host", metavar="ADDR",
                    help="the address nats-server listens on and pods connect to (default "
                         "127.0.0.1; with --actuator ray the IP of this machine's Ray node)")
    up.add_argument("--bus-servers", type=int, default=1, metavar="N",
                    help="nats-servers of the bus (default 1); several run clustered, every "
                         "stream and KV bucket replicated on min(N, 3) of them, and every "
                         "client fails over between them (docs/cluster.md)")
    up.add_argument("--bus", metavar="URLS",
                    help="attach to a running bus (comma-separated nats:// or tls:// URLs, a "
                         "NATS cluster run per node): start no nats-server; with --actuator "
                         "ray several drivers of one job (one per node, the same --run-dir) "
                         "take turns by lease "
                         "(docs/cluster.md \"The control plane on several Ray nodes\")")
    up.add_argument("--bus-creds", metavar="FILE",
                    help="with --bus: the credentials JSON of `up` and its services")
    up.add_argument("--pod-creds", metavar="FILE",
                    help="with --bus: the pods' credentials JSON (default --bus-creds)")
    up.add_argument("--services", choices=["here", "external"], default="here",
                    help="with --bus: run one instance of each service here (default; one "
                         "acts per job, by lease) or none (they run elsewhere)")
    up.add_argument("--node", metavar="NAME",
                    help="with --bus: this node's name, in its service instances' and its "
                         "driver's lease holder ids (default: the host name)")
    up.add_argument("--hosts", type=int, default=0, metavar="H",
                    help="emulate H hosts on this machine (network namespaces as root, else "
                         "loopback addresses): the nats-servers, service instances and pods "
                         "placed over them, h1 running a server, every active service and "
                         "rank 0; `ceaseless inject host-loss|partition|host-return --host hK` "
                         "(default 0: none; docs/cluster.md \"Losing a host\")")
    up.add_argument("--control-hosts", type=int, default=0, metavar="K",
                    help="with --hosts: the first K hosts run the nats-servers and the service "
                         "instances (each host one instance of every service) and no pod; the "
                         "pods run on the others (default 0: pods on every host; "
                         "docs/cluster.md \"Losing a host\")")
    up.add_argument("--model", default="tiny", help="example model: tiny | small | 10m | mlp10m | 124m | 350m | 1b "
                         "(the last three: GPT-2 shapes on synthetic tokens)")
    up.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="the example's parameter dtype")
    up.add_argument("--timeout", type=float, help="give up after this many seconds")
    up.add_argument("--no-inject", action="store_true", help="refuse fault injection")
    up.add_argument("--no-replace", action="store_true",
                    help="do not start a fresh spare in place of a failed pod (by default "
                         "every failed pod is replaced, so the job heals back to its size)")
    up.add_argument("--no-prefork", action="store_true",
                    help="start every pod with exec; by default a `python -m` pod is forked "
                         "from a process that imported torch once (starts in milliseconds)")
    up.add_argument("--checkpoint-dir", metavar="DIR",
                    help="last-resort checkpoints of the committed state (rank 0, in the "
                         "background, torch.distributed.checkpoint); recovery never needs them")
    up.add_argument("--checkpoint-every", type=int, default=200, metavar="STEPS")
    up.add_argument("--checkpoint-keep", type=int, default=3, metavar="N")
    up.add_argument("--checkpoint-minutes", type=float, default=0.0, metavar="M",
                    help="also checkpoint when M minutes passed since the last one (0: off); "
                         "stopping `up` (Ctrl-C, SIGTERM) asks for a final one either way")
    up.add_argument("--auto-resume", type=int, default=2, metavar="N",
                    help="with --checkpoint-dir: when every holder of the state is gone, "
                         "restart the job from the newest checkpoint, at most N times (0: off)")
    up.add_argument("--resume", metavar="DIR",
                    help="start from a checkpoint (a step-N directory, or a --checkpoint-dir: "
                         "its newest complete one)")
    up.add_argument("--max-replacements", type=int, default=None, metavar="N",
                    help="crash-loop guard: at most N replacements in 5 minutes "
                         "(default: 2 x (workers + spares))")
    up.add_argument("--tls", action="store_true",
                    help="serve the bus over TLS only, with a throw-away CA and server "
                         "certificate for this run (needs 'cryptography': ceaseless[tls])")
    up.add_argument("--quiet", action="store_true", help="no live table")
    up.add_argument("cmd", nargs=argparse.REMAINDER, help="-- CMD ... (default: the example)")
    up.set_defaults(func=cmd_up)

    st = sub.add_parser("status", help="membership, generation, per-rank step and health")
    _add_conn(st)
    st.add_argument("--watch", action="store_true")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    inj = sub.add_parser("inject", help="publish a fault, capacity or priority event")
    _add_conn(inj)
    inj.add_argument("action", choices=["kill", "hang", "stall", "resume", "exception", "nan",
                                        "preempt", "slow", "bitflip", "capacity", "priority",
                                        "host-loss", "partition", "host-return"])
    inj.add_argument("amount", nargs="?", help="capacity: +N or -N")
    inj.add_argument("--rank", type=int)
    inj.add_argument("--pod")
    inj.add_argument("--at-step", type=int)
    inj.add_argument("--deadline", type=float, help="preempt: seconds the pod has (default 30)")
    inj.add_argument("--factor", type=float, help="slow: each step's compute takes F times as long")
    inj.add_argument("--tensor", help="bitflip: the parameter's name (default: the first)")
    inj.add_argument("--host", help="host-loss, partition, host-return (a lost host back): "
                                    "the emulated host (`up --hosts`)")
    inj.add_argument("--for", dest="for_s", type=float,
                     help="partition: seconds the host's link stays cut")
    inj.add_argument("--release", type=int)
    inj.add_argument("--priority", type=int, default=0)
    inj.add_argument("--reason")
    inj.add_argument("--wait", type=float, default=10.0,
                     help="seconds to wait for the answer, printed (capacity/priority: the "
                          "scaler's, a release until its slots are free; a fault: the pod's "
                          "or the supervisor's, accepted or refused with why); 0: do not wait")
    inj.set_defaults(func=cmd_inject)

    sc = sub.add_parser("schemas", help="the wire contract")
    scs = sc.add_subparsers(dest="schemas_cmd", required=True)
    ex = scs.add_parser("export", help="write every message's JSON Schema to DIR")
    ex.add_argument("dir")
    ex.set_defaults(func=cmd_schemas_export)

    # Registered explicitly: a module that cannot be imported is a broken install, said
    # when it happens, never a subcommand that silently disappears.
    from ops import chaos, cli_data, cli_trace

    cli_trace.register(sub)
    cli_data.register(sub)
    chaos.register(sub)
    # Commands of packages above this one (``bench``) come through the entry-point group
    # ``ceaseless.commands`` (pyproject.toml), so the operator tools never import the
    # benchmarks that are built on them. One that fails to load raises here, as above.
    from importlib.metadata import entry_points

    for ep in sorted(entry_points(group=COMMANDS), key=lambda e: e.name):
        ep.load()(sub, lazy=argv is not None and ep.name not in argv)
    return p


COMMANDS = "ceaseless.commands"  # entry-point group: register(subparsers, lazy) per command


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    # The CLI's own log lines (`up`'s supervisor, a bus warning) go to stderr: stdout is the
    # command's output (`ceaseless status --json | jq`).
    from plumbing import logs

    logs.configure(None, os.environ.get("CEASELESS_LOG_LEVEL", "info"), json=False)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
