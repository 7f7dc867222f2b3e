"""The Ray actuator (services/actuator/ray.py, issue 22) on a real local Ray cluster: one
head and two worker raylets on this host (``ray.cluster_utils.Cluster``), shared by the
module, and a real nats-server (conftest). Skipped without the ``ray`` extra.

Every Ray address here is loopback: Ray otherwise advertises the host's first non-loopback
address, so ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when ray is imported) makes it
resolve its node address to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
ray = pytest.importorskip("ray")

from harness import until  # noqa: E402
from schemas.messages import Lifecycle, LifecycleEvent, Role  # noqa: E402
from services.actuator.ray import ACTOR_LOST_EXIT_CODE, RayActuator, spare_node  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]

# A node's death reaches the driver first as the actor being unavailable (its connection
# broke), which the actuator confirms and reports at once. Ray's own health checks (a node
# marked dead after about 14 s by default) are lowered to about 2 s, as the issue allows for
# tests, so that a test does not wait for a dead node to be known before the next places
# pods.
HEAD = {"num_cpus": 1, "include_dashboard": False,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 4}}
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    t0 = time.monotonic()
    c = Cluster(initialize_head=True, head_node_args=HEAD)
    try:
        for _ in range(2):
            c.add_node(num_cpus=1, resources={"pods": 10})
        ray.init(address=c.address, log_to_driver=False)
        TIMES["cluster start (head + 2 nodes + driver)"] = time.monotonic() - t0
        print(f"\nray cluster up in {TIMES['cluster start (head + 2 nodes + driver)']:.1f}s")
        yield c
    finally:
        t0 = time.monotonic()
        ray.shutdown()
        c.shutdown()
        print(f"\nray cluster down in {time.monotonic() - t0:.1f}s; times {TIMES}")


class Events:
    def __init__(self) -> None:
        self.got: list[Lifecycle] = []

    async def on(self, m: Lifecycle, env) -> None:
        self.got.append(m)

    def exited(self, pod: str) -> Lifecycle | None:
        return next((m for m in self.got if m.pod == pod and m.event == LifecycleEvent.exited),
                    None)

    def started(self) -> list[str]:
        return [m.pod for m in self.got if m.event == LifecycleEvent.started]


async def _actuator(bus, tmp_path, argv, **kw) -> tuple[RayActuator, Events]:
    ev = Events()
    await bus.subscribe(bus.subjects.lifecycle(), Lifecycle, ev.on)
    act = RayActuator(bus, argv, {"CEASELESS_RUN_DIR": str(tmp_path)}, tmp_path / "logs",
                      resources={"pods": 1}, start_timeout_s=60, **kw)
    await act.attach()
    return act, ev


SCRIPT = ("import os, sys, time\n"
          "pod = os.environ['CEASELESS_POD']\n"
          "print(pod, os.environ['CEASELESS_ROLE'], os.environ['CEASELESS_GLOO_HOSTNAME'],"
          " flush=True)\n"
          "if pod == 'w0': time.sleep(60)\n"
          "sys.exit(3 if pod == 'w1' else 0)\n")


async def test_pods_run_as_actors_and_their_exits_are_lifecycle_events(cluster, bus, tmp_path):
    """w0 sleeps, w1 exits 3 (a failure: a replacement spare starts, away from the member's
    node, and exits 0: not replaced), a spare exits 0; then w0 is killed (-9)."""
    act, ev = await _actuator(bus, tmp_path, [sys.executable, "-c", SCRIPT])
    try:
        t0 = time.monotonic()
        assert await act.start(Role.worker, 2) == ["w0", "w1"]
        TIMES["start 2 pods (actors + processes)"] = time.monotonic() - t0
        assert set(act.running()) <= {"w0", "w1"}
        await until(lambda: ev.exited("w1"), 30, "w1's exit")
        assert ev.exited("w1").exit_code == 3 and ev.exited("w1").role == Role.worker
        # the replacement: a spare, on a node without a member
        await until(lambda: ev.exited("s0"), 60, "the replacement spare's exit")
        assert ev.exited("s0").exit_code == 0 and ev.exited("s0").role == Role.spare
        assert act.replacements == [("w1", "s0")]
        assert act.info["s0"]["node_id"] != act.info["w0"]["node_id"]
        assert "s1" not in ev.started()  # exit 0 is not a failure
        out = (tmp_path / "logs" / "w1.log").read_text()
        assert out.split() == ["w1", "worker", "127.0.0.1"]
        assert act.running().keys() == {"w0"} and act.running()["w0"] == act.info["w0"]["pid"]
        t0 = time.monotonic()
        assert await act.kill("w0")
        await until(lambda: ev.exited("w0"), 10, "w0's exit after kill")
        TIMES["kill -> lifecycle exit"] = time.monotonic() - t0
        assert ev.exited("w0").exit_code == -9
        await until(lambda: "s1" in ev.started(), 60, "w0's replacement")
        assert set(ev.started()[:2]) == {"w0", "w1"}  # started concurrently
    finally:
        await act.shutdown(grace_s=2)
    assert not act.running()


async def test_stop_sends_sigterm_and_is_not_replaced(cluster, bus, tmp_path):
    act, ev = await _actuator(bus, tmp_path, [sys.executable, "-c",
                                              "import time; time.sleep(60)"])
    try:
        await act.start(Role.spare, 1)
        assert await act.stop("s0", grace_s=5)
        await until(lambda: ev.exited("s0"), 10, "s0's exit")
        assert ev.exited("s0").exit_code == -15
        await asyncio.sleep(0.5)
        assert act.replacements == [] and ev.started() == ["s0"]
    finally:
        await act.shutdown(grace_s=2)


async def test_a_lost_node_is_reported_as_the_pod_exiting_at_once(cluster, bus, tmp_path):
    """The node holding a pod dies (all its Ray processes SIGKILLed): the actuator publishes
    the pod's exit (ACTOR_LOST_EXIT_CODE) at once, not after a heartbeat timeout, and its
    replacement starts on a node that is alive."""
    victim = cluster.add_node(num_cpus=1, resources={"victim": 1, "pods": 10})
    act, ev = await _actuator(bus, tmp_path, [sys.executable, "-c",
                                              "import time; time.sleep(60)"])
    try:
        act.resources = {"victim": 0.5}      # w0 goes to the victim node ...
        await act.start(Role.worker, 1)
        assert act.info["w0"]["node_id"] == victim.node_id
        act.resources = {"pods": 1}          # ... its replacement anywhere else
        pid = act.info["w0"]["pid"]
        t0 = time.monotonic()
        cluster.remove_node(victim, allow_graceful=False)
        await until(lambda: ev.exited("w0"), 30, "w0's exit after its node died")
        TIMES["node lost -> lifecycle exit"] = time.monotonic() - t0
        assert ev.exited("w0").exit_code == ACTOR_LOST_EXIT_CODE
        await until(lambda: not _alive(pid), 10, "the pod's process to die with its actor")
        await until(lambda: "s0" in act.running(), 60, "the replacement")
        assert act.info["s0"]["node_id"] != victim.node_id
    finally:
        await act.shutdown(grace_s=2)
    _wait_dead(victim.node_id)  # the next test must not place a pod on it


START_FAILS = ("import os, sys\n"
               "print('resume from', os.environ.get('CEASELESS_RESUME_FROM'), flush=True)\n"
               "sys.exit('fails at start on purpose')\n")


async def test_a_pod_failing_at_start_is_reported_counted_and_resumes_only_at_launch(
        cluster, bus, tmp_path):
    """Issue 33, with pods as Ray actors: a pod started before the job's first plan gets
    ``launch_env`` (CEASELESS_RESUME_FROM), one started once a plan exists does not (it
    joins a live job: its peers give it the state). A pod that exits with an error before
    it ever heartbeats is reported with its log's error line; every failure counts against
    the budget (limit 1: w0 fails and is replaced by s0, which fails and is not replaced)
    and a start request is then refused."""
    from schemas.messages import (ActuatorAction, ActuatorCommand, ActuatorReply, Member,
                                  Plan)
    from services.actuator.replace import ReplacementBudget

    act, ev = await _actuator(bus, tmp_path, [sys.executable, "-c", START_FAILS],
                              launch_env={"CEASELESS_RESUME_FROM": "/ckpt/step-00000937"},
                              budget=ReplacementBudget(limit=1))
    act.heartbeated = lambda pod: False
    try:
        await act.start(Role.worker, 1)
        await until(lambda: ev.exited("w0"), 60, "w0's exit")
        # the job's first plan arrives (w0's replacement s0 may start before or after it)
        await bus.publish(bus.subjects.plan, Plan(
            generation=1, members=[Member(pod="w9", rank=0)], world_size=1,
            global_batch_size=4, micro_batch_size=4, shares={0: 1}))
        await until(lambda: act.plan is not None, 10, "the plan")
        await until(lambda: ev.exited("s0"), 60, "the replacement's exit")
        await until(lambda: len(act.start_failures) == 2, 10, "both reported")
        assert [(p, c) for p, c, _ in act.start_failures] == [("w0", 1), ("s0", 1)]
        assert all("fails at start on purpose" in lines for _, _, lines in act.start_failures)
        log_w0 = (tmp_path / "logs" / "w0.log").read_text()
        assert "resume from /ckpt/step-00000937" in log_w0, log_w0
        reply = await bus.request(bus.subjects.actuator, ActuatorCommand(
            action=ActuatorAction.start, role=Role.spare, count=1), ActuatorReply, timeout=10)
        assert not reply.ok and "crash loop" in reply.error, reply
        assert act.replacements == [("w0", "s0")]  # s0's failure used the budget up
        # a pod started once the job has a plan never gets the launch environment
        act.budget = ReplacementBudget(limit=10)
        reply = await bus.request(bus.subjects.actuator, ActuatorCommand(
            action=ActuatorAction.start, role=Role.spare, count=1), ActuatorReply, timeout=60)
        assert reply.ok and reply.pods == ["s1"], reply
        await until(lambda: ev.exited("s1"), 60, "s1's exit")
        log_s1 = (tmp_path / "logs" / "s1.log").read_text()
        assert "resume from None" in log_s1, log_s1
    finally:
        await act.shutdown(grace_s=2)


def _wait_dead(node_id: str, timeout: float = 30) -> None:
    """Until the GCS counts a removed raylet dead: until then Ray may still place actors
    there, which then die at once (seen: the next test's pod never started)."""
    deadline = time.monotonic() + timeout
    while any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes()):
        assert time.monotonic() < deadline, f"node {node_id[:12]} still alive"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_spare_placement_rule():
    assert spare_node(["a", "b", "c"], ["a"], ["a", "b"]) == "c"   # no member, fewest pods
    assert spare_node(["a", "b"], ["a"], ["a", "b", "b"]) == "b"
    assert spare_node(["a", "b"], ["a", "b"], []) is None         # every node has a member
    assert spare_node([], [], []) is None


def _node_of(cluster, pid: int):
    """The worker raylet (a ``ray._private.node.Node``) whose process tree holds ``pid``."""
    raylets = {n.all_processes["raylet"][0].process.pid: n for n in cluster.worker_nodes}
    for _ in range(6):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().split(") ")[1].split()[1])
        except (OSError, ValueError, IndexError):
            return None
        if pid in raylets:
            return raylets[pid]
    return None


@pytest.mark.timeout(300)
async def test_up_with_the_ray_actuator_survives_the_loss_of_a_members_node(cluster, tmp_path):
    """`ceaseless up --actuator ray`, 2 workers + 1 spare, one pod per raylet (0.6 CPU each,
    one raylet added for the replacement): the raylet holding a member is removed (every Ray
    process on it SIGKILLed, the pod with them). The spare takes the rank, a replacement
    spare starts, the job finishes every step at world size 2, bitwise equal to the
    fault-free run, no step lost."""
    from harness import Cluster

    cluster.add_node(num_cpus=1, resources={"pods": 10})
    steps = 40
    t0 = time.monotonic()
    async with Cluster(tmp_path / "up", 2, 1, steps, replace=True, extra=[
            "--actuator", "ray", "--ray-address", cluster.address, "--ray-cpus-per-pod", "0.6",
            "--", sys.executable, "-m", "examples.train_gpt", "--steps", str(steps),
            "--sleep", "0.05"]) as c:
        await c.wait_spares(1)
        await c.wait_rank_step(1, 5)
        TIMES["up --actuator ray: to step 5 with a spare"] = time.monotonic() - t0
        victim = next(((r, n) for r in (1, 0)
                       if (n := _node_of(cluster, c.member(r).pid)) is not None), None)
        assert victim is not None, "no member on a removable raylet"
        rank, node = victim
        pod = c.member(rank).pod
        t1 = time.monotonic()
        cluster.remove_node(node, allow_graceful=False)
        await c.wait_for(lambda: c.plans and c.plans[-1].pod_of(rank) not in (None, pod),
                         60, "a plan without the lost member")
        TIMES["node lost -> new plan (up)"] = time.monotonic() - t1
        _wait_dead(node.node_id)
        assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
    TIMES["up --actuator ray: whole job"] = time.monotonic() - t0
    out = (tmp_path / "up" / "up.out").read_text()
    assert s["final_step"] == steps - 1 and s["param_sha256_consistent"], s
    # bitwise the fault-free run of the same command (local pods; --sleep changes no value)
    ref = await _reference(tmp_path, steps)
    assert s["param_sha256"] == ref["param_sha256"] and s["lost_steps"] == 0, (s, ref)
    assert all(p.world_size == 2 for p in c.plans), [p.world_size for p in c.plans]
    assert s["pod_exits"][pod] == ACTOR_LOST_EXIT_CODE, s["pod_exits"]
    assert [i["pod"] for i in s["incidents"]] == [pod], s["incidents"]
    assert "replacement started as a spare" in out, out[-3000:]
    print(f"incident: {s['incidents']}, lost steps {s['lost_steps']}")


def test_node_signals_rule():
    """The node table, poll by poll: the first poll's nodes are the job's; a node that joins
    with room → add; one that drains with the job's pods → drain (naming them); one that
    leaves with its announced room unused → remove; a refused add is not taken back."""
    from services.actuator.ray import NodeSignals, pods_that_fit

    assert pods_that_fit({"CPU": 2.0, "pods": 1}, {"CPU": 0.6, "pods": 0.5, "GPU": 0}) == 2
    assert pods_that_fit({"CPU": 0.5}, {"CPU": 0.6}) == 0 and pods_that_fit({}, {}) == 1
    sig = NodeSignals()
    assert sig.update({"a": (True, 0), "b": (True, 1)}, {}, {"a": ["w0"]}) == []
    assert sig.update({"a": (True, 0), "b": (True, 1), "c": (True, 2)}, {}, {}) == [
        ("add", "c", 2)]
    # c holds one of the job's pods, then drains: its pods go, its free room is taken back
    assert sig.update({"a": (True, 0), "c": (True, 1), "d": (True, 1)}, {"c": 99},
                      {"c": ["s1"]}) == [("add", "d", 1), ("remove", "c", 1),
                                         ("drain", "c", 99, ["s1"])]
    assert sig.update({"a": (True, 0), "c": (True, 1), "d": (True, 1)}, {"c": 99}, {}) == []
    # d leaves unused; b (a starting node) leaves: nothing (it was never announced)
    assert sig.update({"a": (True, 0), "c": (False, 0), "d": (False, 0)}, {}, {}) == [
        ("remove", "d", 1)]
    sig.update({"a": (True, 0), "e": (True, 1)}, {}, {})
    sig.refused("e")
    assert sig.update({"a": (True, 0), "e": (False, 0)}, {}, {}) == []


@pytest.mark.timeout(300)
async def test_up_grows_onto_an_added_node_and_gives_a_drained_one_back(cluster, tmp_path):
    """`ceaseless up --actuator ray --max-replicas 3`, 2 workers and no spare on a full
    cluster (one pod per raylet; the test's blockers hold every other raylet). A raylet is
    added: the actuator's node poll publishes `capacity add 1`, the scaler starts a spare
    (on the new node, the only one with room) and promotes it at a step boundary (2 -> 3).
    Then that node is drained with a 30 s deadline (GCS DrainNode, what `ray drain-node`
    and the autoscaler send): a `priority` release naming its pod, which leaves at a step
    boundary (3 -> 2) well before the deadline. No fault, no step lost, one global batch."""
    from harness import Cluster
    from ray.core.generated import autoscaler_pb2
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from schemas.messages import Decision

    @ray.remote(num_cpus=1)
    class Blocker:
        def ping(self):
            return True

    alive = [n["NodeID"] for n in ray.nodes()
             if n["Alive"] and n["Resources"].get("CPU", 0) >= 1]
    keep = [n.node_id for n in cluster.worker_nodes if n.node_id in alive][:2]
    assert len(keep) == 2, alive
    blockers = [Blocker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        node_id=n, soft=False)).remote() for n in alive if n not in keep]
    ray.get([b.ping.remote() for b in blockers], timeout=60)
    added = None
    steps = 120
    slow = tmp_path / "slow"  # slower (same numerics) until the drained pod is gone
    slow.touch()
    t0 = time.monotonic()
    try:
        async with Cluster(tmp_path / "up", 2, 0, steps, replace=True, extra=[
                "--actuator", "ray", "--ray-address", cluster.address,
                "--ray-cpus-per-pod", "1", "--max-replicas", "3", "--scale-up-snooze", "1",
                "--", sys.executable, "-m", "examples.train_gpt", "--steps", str(steps),
                "--sleep", "0.05", "--sleep-while", str(slow)]) as c:
            decisions: list[Decision] = []
            exits: dict[str, float] = {}

            async def on_decision(d, _e):
                decisions.append(d)

            async def on_life(m, _e):
                if m.event == LifecycleEvent.exited:
                    exits[m.pod] = time.monotonic()
            await c.bus.subscribe(c.bus.subjects.decision, Decision, on_decision)
            await c.bus.subscribe(c.bus.subjects.lifecycle(), Lifecycle, on_life)
            await c.wait_rank_step(1, 5)
            t1 = time.monotonic()
            added = cluster.add_node(num_cpus=1)
            first = await c.wait_for(lambda: c.plans and c.plans[-1].world_size == 3 and
                                     _rank(c, 2, c.plans[-1].generation),
                                     120, "a third replica training")
            TIMES["node added -> 3rd replica training (up)"] = time.monotonic() - t1
            joiner = first.pod
            step = first.step
            await c.wait_for(lambda: (h := _rank(c, 2)) and h.step >= step + 3, 60,
                             "the third replica training on")
            assert _node_of(cluster, first.pid) is added, "the joiner is not on the new node"
            t2 = time.monotonic()
            deadline_s = 30
            ok, err = ray._raylet.GcsClient(address=cluster.address).drain_node(
                added.node_id, autoscaler_pb2.DrainNodeReason.Value(
                    "DRAIN_NODE_REASON_PREEMPTION"), "test drain",
                time.time_ns() // 1_000_000 + deadline_s * 1000)
            assert ok, err
            await c.wait_for(lambda: joiner in exits, 60, "the drained node's pod to exit")
            TIMES["drain -> pod exited (up)"] = exits[joiner] - t2
            assert exits[joiner] - t2 < deadline_s
            slow.unlink()  # nothing left to wait for: the rest of the steps at full speed
            assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
            s = c.summary()
            plans = list(c.plans)
    finally:
        for b in blockers:
            ray.kill(b)
        if added is not None:
            cluster.remove_node(added, allow_graceful=False)
            _wait_dead(added.node_id)
    TIMES["up --actuator ray, grow + drain: whole job"] = time.monotonic() - t0
    assert [p.world_size for p in plans] == [2, 3, 2], [p.reason for p in plans]
    assert all(p.apply_step is not None for p in plans[1:]), [p.reason for p in plans]
    assert len({p.global_batch_size for p in plans}) == 1
    assert all(sum(p.shares.values()) * p.micro_batch_size == p.global_batch_size
               for p in plans)
    assert s["final_step"] == steps - 1 and s["param_sha256_consistent"], s
    assert s["incidents"] == [] and s["lost_steps"] == 0, s
    assert s["pod_exits"][joiner] == 0, s["pod_exits"]
    adds = [d for d in decisions if "joined with room for 1 pod" in d.reason]
    rel = [d for d in decisions if "is draining" in d.reason]
    rel += [d for d in decisions if rel and d.request_id == rel[0].request_id and d.completed]
    assert adds and adds[0].accepted and adds[0].target == 3, decisions
    assert rel and rel[0].accepted and rel[-1].completed and rel[-1].pods == [joiner], decisions


def _rank(c, rank: int, generation: int = 0):
    """The heartbeat of the pod training at ``rank`` (in ``generation`` or later)."""
    return next((h for h in c.hb.values() if h.rank == rank and h.state.value == "training"
                 and h.generation >= generation), None)


REFS: dict[int, dict] = {}  # fault-free runs of the example, by steps (shared by the tests)


async def _reference(tmp_path, steps: int) -> dict:
    """The fault-free run of `examples.train_gpt --steps N` at world size 2 (local pods;
    ``--sleep`` changes no value), once per module."""
    if steps not in REFS:
        from harness import run_job

        REFS[steps] = await run_job(tmp_path, "ref", 2, 0, steps=steps, extra=[
            "--", sys.executable, "-m", "examples.train_gpt", "--steps", str(steps)])
    return REFS[steps]


async def _lease_holder(bus, key: str) -> str | None:
    from services.common.lease import parse_lease

    try:
        cur = parse_lease((await (await bus.kv()).get(key)).value)
    except Exception:
        return None
    return cur.holder if cur.expires > time.time() else None


@pytest.mark.timeout(300)
async def test_a_standby_driver_adopts_the_pods_when_the_acting_one_is_lost(
        cluster, nats_server, tmp_path):
    """Issue 42, the Ray path: the services (one instance each, started once) and two
    `up --actuator ray --bus URL --services external` drivers (n1, n2) sharing a run dir, on
    a real nats-server. n1 takes the actuator lease and starts 2 workers + 1 spare (named,
    detached actors); n2 stands by. n1 is SIGKILLed mid-training: n2 takes the lease within
    the fault timeout and adopts the running pods (no second set). Then a member's process
    is SIGKILLed: n2 publishes its exit (the spare takes the rank) and starts a replacement
    spare. The job finishes with 0 lost steps, bitwise equal to the fault-free run."""
    import signal
    import subprocess

    from harness import REPO, Cluster
    from ops.cluster import ServiceSupervisor, UpOptions, service_flags
    from schemas.subjects import lease_key
    from services.common.lease import ttl_for

    job, steps, fault_timeout = f"ha{os.getpid() % 100000}", 40, 3.0
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    url, creds = nats_server.url, str(nats_server.creds_path)
    slow = tmp_path / "slow"  # slower (same numerics) until the faults are behind
    slow.touch()
    opts = UpOptions(workers=2, spares=1, job=job, fault_timeout=fault_timeout,
                     start_timeout=120)
    flags = {n: [*f, "--creds", creds] for n, f in service_flags(opts).items()}
    flags["state_broker"] = ["--creds", creds]
    sup = ServiceSupervisor(["--nats", url, "--job", job, "--run-dir", str(run)], run / "logs",
                            flags, lease_ttl=ttl_for(fault_timeout), node="n0")

    def driver(node: str, services: str = "external") -> list[str]:
        return [sys.executable, "-m", "ops.cli", "up", "--run-dir", str(run), "--job", job,
                "--workers", "2", "--spares", "1", "--steps", str(steps), "--quiet",
                "--timeout", "240", "--start-timeout", "120", "--fault-timeout",
                str(fault_timeout), "--bus", url, "--bus-creds", creds, "--services",
                services, "--node", node, "--actuator", "ray", "--ray-address",
                cluster.address, "--ray-cpus-per-pod", "0.3", "--", sys.executable, "-m",
                "examples.train_gpt", "--steps", str(steps), "--sleep", "0.1",
                "--sleep-while", str(slow)]

    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = str(REPO)
    first = None
    t0 = time.monotonic()
    try:
        sup.start_all()
        with open(tmp_path / "n1.out", "wb") as out:
            first = subprocess.Popen(driver("n1"), stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=REPO, env=env)
        from plumbing.bus import Bus, Credentials

        watch = await Bus.connect(url, job, "test-watch", Credentials.load(creds))
        try:
            await until(lambda: (run / "cluster.json").exists(), 60, "n1's cluster.json")
            holder = None
            while holder != "actuator-n1":
                assert first.poll() is None and time.monotonic() - t0 < 120, (
                    tmp_path / "n1.out").read_text()[-3000:]
                holder = await _lease_holder(watch, "actuator_lease")
                await asyncio.sleep(0.1)
            c = Cluster(run, 2, 1, steps, replace=True)
            # n2 also runs an instance of each service (`--services here`): standbys, as
            # the leases are n0's
            c.argv = driver("n2", "here")  # its up.out in the run dir; n1's beside it
            async with c:
                await c.wait_spares(1)
                await c.wait_rank_step(1, 5)
                TIMES["up --bus, 2 drivers: to step 5 with a spare"] = time.monotonic() - t0
                pods = {h.pod for h in c.hb.values()}
                t1 = time.monotonic()
                first.send_signal(signal.SIGKILL)  # the acting driver's host is lost
                first.wait(10)
                while await _lease_holder(watch, "actuator_lease") != "actuator-n2":
                    assert time.monotonic() - t1 < 30, c.output()
                    await asyncio.sleep(0.05)
                TIMES["driver lost -> standby holds the lease"] = time.monotonic() - t1
                await c.wait_for(lambda: "pod adopted" in c.output() and "actuator acting"
                                 in c.output(), 30, "n2 adopting the pods")
                TIMES["driver lost -> standby acting"] = time.monotonic() - t1
                for n in ("health_monitor", "scaler", "state_broker"):  # n2's: standbys
                    assert await _lease_holder(watch, lease_key(n)) == f"{n}-n0", n
                victim = c.member(1)
                os.kill(victim.pid, signal.SIGKILL)
                await c.wait_for(lambda: c.plans and c.plans[-1].pod_of(1) not in
                                 (None, victim.pod), 60, "a plan without the killed member")
                await c.wait_for(lambda: "replacement started as a spare" in c.output(), 60,
                                 "n2 replacing the killed pod")
                slow.unlink()
                assert await c.finish() == 0, c.output() + "\n" + c.pod_tails()
                s = c.summary()
                out = (run / "up.out").read_text()
        finally:
            await watch.close()
    finally:
        if first is not None and first.poll() is None:
            first.kill()
            first.wait(10)
        sup.stop_all()
        _kill_named_actors(f"ceaseless-{job}")
    TIMES["up --bus, 2 drivers: whole job"] = time.monotonic() - t0
    ref = await _reference(tmp_path, steps)
    assert s["final_step"] == steps - 1 and s["param_sha256_consistent"], s
    assert s["param_sha256"] == ref["param_sha256"] and s["lost_steps"] == 0, (s, ref)
    assert [i["pod"] for i in s["incidents"]] == [victim.pod], s["incidents"]
    # one set of pods: n2 started none but the replacement (no second w0/w1/s0)
    assert out.count("pod adopted") == len(pods) == 3, out[-3000:]
    started = [ln for ln in out.splitlines() if "pod started" in ln]
    assert len(started) == 1 and "role=spare" in started[0], started
    assert "action=adopt" in out
    # n2's own service instances ran as standbys: the leases stayed with n0's
    assert all((run / "logs" / f"{n}-n2.log").exists() for n in
               ("health_monitor", "scaler", "state_broker")), sorted((run / "logs").iterdir())


def _kill_named_actors(namespace: str) -> None:
    """Every actor a test's drivers left in ``namespace`` (detached: nothing else ends them)."""
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["namespace"] == namespace:
            try:
                ray.kill(ray.get_actor(a["name"], namespace=namespace), no_restart=True)
            except Exception:
                pass
