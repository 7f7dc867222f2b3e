"""Message sizes against the job's size: every message that grows with the members, built
with the real schemas (and the services' own code where they build it), no cluster.

    python -m bench.message_sizes [--members 1024,4096,16384,65536] [--json PATH]
                                  [--write-doc]
    ceaseless bench message-sizes ...        (same options)

Per size N (pods named as ``ceaseless up`` names them: ``w0..``, spares ``s0..``):

* **plan**: N members, every rank's share, 8 spares, the fenced pods (the scaler keeps the
  last 256): the whole plan's encoding, and what is published to every agent and kept in
  KV ``plan`` (``plumbing.plan_wire``: the plan whole up to 64 KiB, else a reference to its
  KV parts): the first plan's, and the next generation's after a fault (rank 7 replaced by
  a spare: a reference carrying the change); the time an agent takes to apply that change
  and to decode the whole plan;
* **health view**: the monitor's complete listing of full heartbeats (``chunks`` messages of
  512) and its compact listing every interval (messages of 4,096 entries), from the
  monitor's own builder (``ViewPublisher``);
* **transfer**: one recipient, one source, and every rank's committed step (``steps``);
* **status**: the reply of each service's status endpoint (what ``ceaseless status`` reads),
  from the services' own ``status()`` with N members heartbeating.

A message over ``MAX_PAYLOAD_BYTES`` (nats-server's ``max_payload``) cannot be sent at all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from bench.common import config, emit, machine, machine_line, main, timings
from schemas import MAX_PAYLOAD_BYTES
from schemas.messages import (AgentState, Heartbeat, Member, Plan, PlanRef, Role, Transfer)

SECTION = "## Message sizes"
SPARES = 8
FENCED = 256  # services/scaler/policy.py MAX_FENCED


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--members", default="1024,4096,16384,65536", help="job sizes")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")


def plan(n: int) -> Plan:
    return Plan(generation=2, members=[Member(pod=f"w{i}", rank=i) for i in range(n)],
                world_size=n, global_batch_size=n, micro_batch_size=1,
                shares={i: 1 for i in range(n)}, spares=[f"s{i}" for i in range(SPARES)],
                fenced=[f"w{n + i}" for i in range(FENCED)], reason="fault inc-w7-g1",
                incident="inc-w7-g1", term=3)


def after_fault(p: Plan) -> Plan:
    """The next generation after a fault of rank 7: the first spare takes its rank, it is
    fenced (the oldest fenced pod dropped: the scaler keeps the last 256)."""
    members = list(p.members)
    members[7] = Member(pod=p.spares[0], rank=7)
    return Plan.model_validate(p.model_dump() | {
        "generation": p.generation + 1, "members": members, "spares": p.spares[1:],
        "fenced": [*p.fenced[1:], p.members[7].pod], "reason": "fault inc-w7-g2",
        "incident": "inc-w7-g2", "ts": time.time()})


def heartbeats(p: Plan) -> list[Heartbeat]:
    return [Heartbeat(pod=m.pod, role=Role.worker, generation=p.generation, rank=m.rank,
                      step=123456, digest="0123456789abcdef" * 4, digest_step=123455,
                      state=AgentState.training, step_time=0.512, loss=2.345678, pid=123456,
                      device="cuda:0 [GPU 3]", compute_time=0.401)
            for m in p.members]


def transfer(n: int) -> Transfer:
    return Transfer(generation=2, restore_step=123456, sources={7: [0]},
                    steps={r: 123456 for r in range(n)}, digest="0123456789abcdef" * 4,
                    incident="inc-w7-g1", term=3, plan_ts=time.time())


def wire(msg: Any) -> int:
    return len(msg.model_dump_json(by_alias=True).encode())


async def statuses(p: Plan, hbs: list[Heartbeat]) -> dict[str, int]:
    """Each service's status reply with ``p`` adopted and ``hbs`` heard, built by its own
    ``status()`` (a service object without a bus: only its in-memory view is used)."""
    from services.health_monitor import HealthMonitor
    from services.scaler.scaler import Scaler
    from services.state_broker.broker import StateBroker

    out: dict[str, int] = {}
    mon = HealthMonitor(None, view_interval=None)  # type: ignore[arg-type]
    sc = Scaler(None, workers=p.world_size, max_replicas=p.world_size,  # type: ignore[arg-type]
                global_batch_size=p.global_batch_size, micro_batch_size=1)
    br = StateBroker(None)  # type: ignore[arg-type]
    for svc in (mon, sc, br):
        svc.plans.plan = p
    env = _Env()
    for hb in hbs:
        await mon._on_heartbeat(hb, env)
        await sc._on_heartbeat(hb, env.subject)
        await br._on_heartbeat(hb, env.subject)
    for svc in (mon, sc, br):
        out[svc.name] = len(json.dumps(svc.status(), default=str).encode())
    return out


class _Env:
    """What a handler reads of a message's envelope: its subject."""
    subject = "ceaseless.bench.heartbeat.w0"


def measure(n: int) -> dict[str, Any]:
    from services.common.heartbeats import ViewPublisher

    p = plan(n)
    hbs = heartbeats(p)
    now = time.monotonic()
    heard = [(hb, now) for hb in hbs]
    vp = ViewPublisher(None, None, lambda pods: heard)  # type: ignore[arg-type]
    full = [wire(v) for v in vp.full_views(heard, True, now)]
    compact = [wire(v) for v in vp.compact_views(heard, now)]
    from plumbing.plan_wire import apply_change, for_wire

    pb = wire(p)
    raw = p.model_dump_json(by_alias=True)
    encode_s = _best(lambda: p.model_dump_json(by_alias=True))
    decode_s = _best(lambda: Plan.model_validate_json(raw))  # an agent reading it whole
    first, parts = for_wire(p, None)
    nxt = after_fault(p)
    msg, _ = for_wire(nxt, p)
    held = Plan.model_validate_json(raw)  # as an agent holds it
    apply_s = _best(lambda: apply_change(held, msg)) if isinstance(msg, PlanRef) else None
    return {"members": n, "plan_bytes": pb, "plan_encode_s": encode_s,
            "plan_decode_s": decode_s, "plan_msg_first_bytes": wire(first),
            "plan_msg_fault_bytes": wire(msg), "plan_parts": len(parts),
            "plan_apply_s": apply_s, "heartbeat_bytes": wire(hbs[0]),
            "view_full_bytes": sum(full), "view_full_msgs": len(full),
            "view_full_max_msg": max(full),
            "view_compact_bytes": sum(compact), "view_compact_msgs": len(compact),
            "view_compact_max_msg": max(compact),
            "transfer_bytes": wire(transfer(n)),
            "status_bytes": asyncio.run(statuses(p, hbs))}


def _best(f: Any, times: int = 3) -> float:
    """Seconds ``f()`` takes, the fastest of ``times`` (the machine is shared)."""
    return min(timings(f, times))


def run_all(a: argparse.Namespace) -> dict[str, Any]:
    sizes = [int(x) for x in a.members.split(",") if x.strip()]
    return {"benchmark": "message-sizes", "machine": machine(), "max_payload": MAX_PAYLOAD_BYTES,
            "config": config(a) | {"command": "python -m bench.message_sizes "
                                   + " ".join(sys.argv[1:])},
            "runs": [measure(n) for n in sizes]}


def _kb(b: int, limit: int) -> str:
    s = f"{b / 1024:,.0f} KiB" if b < 10 * 2**20 else f"{b / 2**20:,.1f} MiB"
    return f"**{s}** (over)" if b > limit else s


def _b(b: int, limit: int) -> str:
    """Bytes, exactly while under 10 KiB (a plan reference is a few hundred)."""
    return f"{b:,} B" if b < 10 * 1024 else _kb(b, limit)


def markdown(res: dict[str, Any]) -> str:
    lim = res["max_payload"]
    out = [SECTION, "", machine_line(res["machine"]),
           f"Command: `{res['config']['command']}`. Built with the real schemas and the "
           "services' own builders (`ViewPublisher`, each service's `status()`), no cluster; "
           f"pods named as `ceaseless up` names them (`w0..`); {SPARES} spares, {FENCED} "
           f"fenced pods in the plan. One message may carry at most {lim // 1024} KiB "
           "(nats-server's `max_payload`, `schemas.MAX_PAYLOAD_BYTES`): **(over)** marks one "
           "that cannot be sent. The view's listings are split into messages of 512 full / "
           "4,096 compact entries (bytes: all messages of one listing, then the largest one).",
           "",
           "| members | plan, whole (KV parts) | plan message, first / after a fault "
           "(to every agent, in KV `plan`) | plan encode / decode whole / apply a fault's "
           "change (one core, fastest of 3) | health view, "
           "complete listing (messages; largest) | compact listing, every interval | "
           "transfer | status: monitor | scaler | broker |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        st = r["status_bytes"]
        k = r["plan_parts"]
        parts = f" ({k} part{'s' if k > 1 else ''})" if k else " (whole)"
        apply = "-" if r["plan_apply_s"] is None else f"{r['plan_apply_s'] * 1e3:.0f}"
        out.append(
            f"| {r['members']:,} | {_kb(r['plan_bytes'], 2**62)}{parts} | "
            f"{_b(r['plan_msg_first_bytes'], lim)} / {_b(r['plan_msg_fault_bytes'], lim)} | "
            f"{r['plan_encode_s'] * 1e3:.0f} / {r['plan_decode_s'] * 1e3:.0f} / {apply} ms | "
            f"{_kb(r['view_full_bytes'], 2**62)} ({r['view_full_msgs']}; "
            f"{_kb(r['view_full_max_msg'], lim)}) | {_kb(r['view_compact_bytes'], 2**62)} "
            f"({r['view_compact_msgs']}; {_kb(r['view_compact_max_msg'], lim)}) | "
            f"{_kb(r['transfer_bytes'], lim)} | {_kb(st['health_monitor'], lim)} | "
            f"{_kb(st['scaler'], lim)} | {_kb(st['state_broker'], lim)} |")
    return "\n".join(out) + "\n"


def run(a: argparse.Namespace) -> int:
    from plumbing import logs

    logs.configure(None, level="warning")  # not a line per pod the services start to watch
    res = run_all(a)
    return emit(res, markdown(res), SECTION, a.json, a.write_doc)


if __name__ == "__main__":
    sys.exit(main(__name__))
