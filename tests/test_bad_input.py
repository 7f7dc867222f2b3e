"""1,000 malformed or semantically bad messages on every job subject while the three
control-plane services run: they keep running and answering, the plan in KV does not move,
and each service's drop counter accounts for exactly the messages it could not validate."""

from __future__ import annotations

import asyncio
import json
import random
import time

from schemas import PLAN_KEY, Plan
from schemas.messages import (BY_KIND, ActuatorCommand, AgentState, Capacity, Decision, Fault,
                              HealthView, Heartbeat, HeartbeatBatch, Inject, Lifecycle, Member, Priority,
                              Recovery, Report, Role, Seen, StateLost, Transfer)
from plumbing.bus import Bus, DropError, decode
from services.health_monitor import HealthMonitor
from services.scaler import Scaler
from services.state_broker import StateBroker
from harness import until

# The services, the fake agents and the flood share this test's one event loop, so while
# 1,000 messages are logged and dropped the heartbeats can lag by tenths of a second on a
# loaded 2-core machine: timeouts with headroom, so that lag is not mistaken for a fault.
FT = 1.5
N_MESSAGES = 1000
MAX_BYTES = 1024 * 1024 - 256  # under the server's 1 MB max_payload




def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))


def _valid_samples(pod: str) -> dict[str, object]:
    now = time.time()
    return {
        "heartbeat": Heartbeat(pod=pod, role=Role.worker, generation=1, rank=0, step=3),
        # (on heartbeats.<host>: the pod id stands for its host's here)
        "heartbeats": HeartbeatBatch(host=pod, relay=pod, beats=[
            Heartbeat(pod=pod, role=Role.worker, generation=1, rank=0, step=3)]),
        "report": Report(pod=pod, report="exception", generation=1),
        "lifecycle": Lifecycle(pod=pod, event="exited", exit_code=1),
        "recovery": Recovery(incident="i", generation=1, pod=pod, rank=0, phases={"a": 1.0},
                             restore_step=1),
        "fault": Fault(incident=f"inc-{pod}-g1", pod=pod, kind="lost", detected_at=now,
                       last_seen=now, generation=1),
        "plan": Plan(generation=1, members=[Member(pod=pod, rank=0)], world_size=1,
                     global_batch_size=8, micro_batch_size=8, shares={0: 1}),
        "transfer": Transfer(generation=1, restore_step=1, sources={1: [0]}),
        "state_lost": StateLost(generation=1, reason="x"),
        "decision": Decision(request_id="r", accepted=False, reason="x"),
        "capacity": Capacity(change="add", count=1),
        "priority": Priority(release=1),
        "inject": Inject(action="kill", pod=pod),
        "actuator": ActuatorCommand(action="kill", pod=pod),
        "health": HealthView(monitor="m", seq=1, full=False, interval=0.5, pods=[Seen(
            hb=Heartbeat(pod=pod, role=Role.worker, generation=1, rank=0, step=3), age=0.1)]),
    }


def bad_messages(bus: Bus, rng: random.Random) -> list[tuple[str, bytes]]:
    s = bus.subjects
    pods = ["w0", "w1", "s0", "ghost", "x" * 64]
    per_pod = ["heartbeat", "heartbeats", "report", "lifecycle"]
    single = ["recovery", "fault", "plan", "transfer", "state_lost", "decision", "capacity",
              "priority", "inject", "actuator", "health"]
    out: list[tuple[str, bytes]] = []

    def subject(kind: str, pod: str | None = None) -> str:
        if kind in per_pod:
            return f"{s.base}.{kind}.{pod or rng.choice(pods)}"
        return f"{s.base}.{kind}"

    def one(kind: str) -> tuple[str, bytes]:
        pod = rng.choice(pods[:3])
        sample = json.loads(_valid_samples(pod)[kind].model_dump_json())
        r = rng.randrange(10)
        if r == 0:    # random bytes
            return subject(kind), rng.randbytes(rng.randrange(0, 300))
        if r == 1:    # JSON that is not an object
            return subject(kind), json.dumps(rng.choice(
                [[1, 2], 3, "x", None, True, [sample]])).encode()
        if r == 2:    # wrong / missing schema_version
            v = dict(sample)
            choice = rng.choice([2, "1", None, 0, "absent"])
            if choice == "absent":
                v.pop("schema_version")
            else:
                v["schema_version"] = choice
            return subject(kind, pod), json.dumps(v).encode()
        if r == 3:    # wrong field types / unknown fields / missing fields
            v = dict(sample)
            key = rng.choice(sorted(v))
            mode = rng.randrange(3)
            if mode == 0 and key != "schema_version":
                v[key] = {"nested": [1, 2, {"deep": None}]}
            elif mode == 1:
                v["unexpected"] = 1
            else:
                v = {"schema_version": 1}
            return subject(kind, pod), json.dumps(v).encode()
        if r == 4 and kind in per_pod:  # pod/subject mismatch (a spoofed pod)
            other = rng.choice([p for p in pods if p != pod])
            return subject(kind, other), json.dumps(sample).encode()
        if r == 5:    # truncated JSON
            data = json.dumps(sample).encode()
            return subject(kind, pod), data[: rng.randrange(1, max(2, len(data) - 1))]
        if r == 6:    # semantically bad values
            v = dict(sample)
            for key, bad in (("generation", -5), ("step", -7), ("rank", -1), ("pod", "bad!id"),
                             ("world_size", 0), ("count", 0), ("digest", "XYZ")):
                if key in v:
                    v[key] = bad
                    break
            else:
                v["schema_version"] = 99
            return subject(kind, pod), json.dumps(v).encode()
        # r >= 7: stale generations and other valid-but-wrong messages (not drops)
        return stale(kind, pod)

    def stale(kind: str, pod: str) -> tuple[str, bytes]:
        now = time.time()
        member = rng.choice(["w0", "w1"])
        if kind in ("heartbeat", "heartbeats", "health"):
            m = Heartbeat(pod=member, role=Role.worker, generation=0, rank=0, step=99,
                          state=AgentState.training)
            if kind == "heartbeats":  # a host's relay repeating that stale heartbeat
                return subject(kind, "h0"), HeartbeatBatch(
                    host="h0", relay=member, beats=[m]).model_dump_json().encode()
            if kind == "health":  # the monitor's view repeating that stale heartbeat
                return subject(kind), HealthView(monitor="m", seq=1, full=False, interval=0.5,
                                                 pods=[Seen(hb=m, age=0.0)]).model_dump_json().encode()
            return subject(kind, member), m.model_dump_json().encode()
        if kind == "report":
            m = Report(pod=member, report=rng.choice(["exception", "peer_error",
                                                      "recovery_failed"]), generation=0)
            return subject(kind, member), m.model_dump_json().encode()
        if kind == "lifecycle":
            m = Lifecycle(pod="ghost", event=rng.choice(["started", "exited"]), exit_code=3)
            return subject(kind, "ghost"), m.model_dump_json().encode()
        if kind == "fault":  # stale generation of a live member, or an unknown pod
            target = rng.choice([member, "ghost"])
            m = Fault(incident=f"old-{target}", pod=target, kind="lost", detected_at=now,
                      last_seen=now, generation=0 if target == member else 1)
            return subject(kind), m.model_dump_json().encode()
        if kind == "plan":  # a conflicting generation 1, or a generation KV never had
            gen = rng.choice([1, 50, 2**20])
            m = Plan(generation=gen, members=[Member(pod="ghost", rank=0)], world_size=1,
                     global_batch_size=64, micro_batch_size=8, shares={0: 8})
            return subject(kind), m.model_dump_json().encode()
        if kind == "transfer":
            return subject(kind), Transfer(generation=1, restore_step=5,
                                           sources={1: [0]}).model_dump_json().encode()
        sample = _valid_samples(pod)[kind]
        return subject(kind, pod), sample.model_dump_json().encode()

    kinds = per_pod * 3 + single  # the heartbeat/report/lifecycle subjects get more traffic
    for i in range(N_MESSAGES - 8):
        out.append(one(kinds[i % len(kinds)]))
    # oversize, up to the server limit: non-JSON and JSON with a huge field
    for kind in ("heartbeat", "plan", "fault", "capacity"):
        out.append((subject(kind, "w0"), rng.randbytes(MAX_BYTES)))
        pad = json.dumps({"schema_version": 1, "pod": "w0", "pad": "x" * (MAX_BYTES - 64)})
        out.append((subject(kind, "w0"), pad.encode()[:MAX_BYTES]))
    # the status endpoints get garbage requests too (they ignore the body)
    for name in ("health_monitor", "scaler", "state_broker"):
        out.append((s.service_status(name), rng.randbytes(100)))
    rng.shuffle(out)
    return out


class Beater:
    def __init__(self, bus, pod, role):
        self.bus, self.pod, self.role = bus, pod, role
        self.generation, self.rank, self.step, self.state = 0, None, -1, AgentState.waiting
        self.task = asyncio.create_task(self._run())

    async def _run(self):
        while True:
            await self.bus.publish(self.bus.subjects.heartbeat(self.pod), Heartbeat(
                pod=self.pod, role=self.role, generation=self.generation, rank=self.rank,
                step=self.step, state=self.state))
            await asyncio.sleep(0.05)


async def test_bad_input_on_every_subject(nats_server, bus):
    url, creds = nats_server.url, nats_server.creds
    buses = [await Bus.connect(url, "test", n, creds)
             for n in ("health_monitor", "scaler", "state_broker")]
    mon = HealthMonitor(buses[0], fault_timeout=FT, suspect_timeout=1.0, stall_timeout=5.0)
    # min = max = 2 replicas: the valid capacity/priority requests among the messages are
    # refused (at the policy's bounds) instead of legitimately resizing the job.
    sc = Scaler(buses[1], workers=2, min_replicas=2, max_replicas=2, fault_timeout=FT,
                lease_ttl=3.0, tick_interval=0.02)
    br = StateBroker(buses[2], member_wait=2.0)
    # With the monitor running, the scaler and the broker read its health view instead of
    # the heartbeats (services/common/heartbeats.py).
    subs = {mon: ["heartbeat.*", "heartbeats.*", "report.*", "lifecycle.*", "plan"],
            sc: ["health", "lifecycle.*", "report.*", "fault", "capacity", "priority", "plan"],
            br: ["health", "plan"]}
    # the scaler decodes only the reports that name a preemption (Bus.subscribe(only=))
    only = {(sc, "report.*"): b'"preempted"'}
    transfers: list = []

    async def on_transfer(t, _e):
        transfers.append(t)
    await bus.subscribe(bus.subjects.transfer, Transfer, on_transfer)
    beaters = {p: Beater(bus, p, Role.worker) for p in ("w0", "w1")}
    beaters["s0"] = Beater(bus, "s0", Role.spare)
    svcs = [mon, sc, br]
    try:
        for svc in svcs:
            await svc.start()
            await svc.register_micro()
        await until(lambda: sc.plans.plan is not None, what="initial plan")
        plan = sc.plans.plan
        for pod, b in beaters.items():  # the agents adopt generation 1
            b.generation = 1
            b.rank = plan.rank_of(pod)
            if b.rank is not None:
                b.state = AgentState.training
        await until(lambda: transfers and mon.generation == 1, what="generation-1 transfer")
        await until(lambda: sc.feed.source == br.feed.source == "monitor view",
                    what="the scaler and the broker on the monitor's view")
        # and the scaler saw every agent in generation 1: that is how it tells the stale
        # generation-0 faults below from a real one (the initial plan comes as soon as the
        # workers beat, so the first monitor view it reads may still be generation 0's)
        await until(lambda: all((p := sc.pods.get(pod)) is not None and p.generation == 1
                                for pod in beaters), what="the scaler's view of generation 1")
        kv = await bus.kv()
        entry = await kv.get(PLAN_KEY)
        base_drops = {svc: sum(svc.bus.dropped.values()) for svc in svcs}

        msgs = bad_messages(bus, random.Random(20261202))
        assert len(msgs) >= N_MESSAGES
        expected = {svc: 0 for svc in svcs}
        for subject, data in msgs:
            kind = bus.subjects.kind_of(subject)
            model = BY_KIND.get(kind or "")
            try:
                dropped = model is not None and decode(model, data, subject) is None
            except DropError:
                dropped = True
            for svc, pats in subs.items():
                if dropped and any(_matches(f"{bus.subjects.base}.{p}", subject)
                                   and only.get((svc, p), b"") in data for p in pats):
                    expected[svc] += 1
        for i, (subject, data) in enumerate(msgs):
            await bus.nc.publish(subject, data)
            if i % 50 == 0:
                await bus.nc.flush()
        await bus.nc.flush()
        for svc in svcs:
            await until(lambda: sum(svc.bus.dropped.values()) - base_drops[svc] >= expected[svc],
                        timeout=15, what=f"{svc.name} drops")
        await asyncio.sleep(0.5)  # let valid-but-wrong messages be handled too
        for svc in svcs:
            assert sum(svc.bus.dropped.values()) - base_drops[svc] == expected[svc], svc.name
            assert svc.bus.handler_errors == 0, svc.name
            for t in svc._tasks:  # the loops run; finished helpers did not fail
                assert not t.done() or (not t.cancelled() and t.exception() is None), svc.name
        assert min(expected.values()) > 50 and max(expected.values()) > 300
        # every service still answers its status endpoint
        for svc in svcs:
            resp = await bus.nc.request(bus.subjects.service_status(svc.name), b"", timeout=2)
            body = json.loads(resp.data)
            assert body["service"] == svc.name and "error" not in body, body
            assert sum(body["dropped"].values()) == sum(svc.bus.dropped.values())
        # the plan did not move, no fault was declared for a live member, one transfer
        after = await kv.get(PLAN_KEY)
        assert after.revision == entry.revision and after.value == entry.value
        assert sc.plans_written == 1 and sc.plans.generation == 1 and not sc.pending
        assert mon.generation == 1 and br.plans.generation == 1
        assert not [f for f in mon.faults if f["pod"] in ("w0", "w1", "s0")]
        assert br.transfers_published == 1 and br.handled_generation == 1
        assert transfers[0].generation == 1 and transfers[0].sources == {1: [0]}
        assert sc.ignored.get("stale fault") and sc.ignored.get("not a member")
        assert mon.ignored.get("stale generation 0 < 1")
    finally:
        for b in beaters.values():
            b.task.cancel()
        for svc in svcs:
            await svc.stop()
        for b in buses:
            await b.close()
