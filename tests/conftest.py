"""Shared fixtures: a real nats-server with JetStream on a free loopback port."""

from __future__ import annotations

import os

import pytest
import pytest_asyncio

from plumbing.bus import Bus
from services.common.natsserver import NatsServer, write_credentials


# The unit tier (`python -m pytest -m unit`, about 2 minutes on 2 cores): one part at a time,
# against a real nats-server where it needs a bus, never a whole `ceaseless up`. Everything
# else (clusters, real faults, benchmarks' smoke runs) is the full suite's.
UNIT_FILES = {
    "test_bus.py", "test_bus_cluster.py", "test_checkpoint.py", "test_collectives.py", "test_data_loader.py",
    "test_data_prepare.py", "test_dropin.py", "test_gpus.py", "test_grad_sync.py", "test_health_monitor.py",
    "test_heartbeat_feed.py", "test_layers.py", "test_membership.py", "test_permissions.py",
    "test_policy_file.py", "test_policy_properties.py", "test_ports.py", "test_repeats.py",
    "test_scaler.py", "test_schemas_timeouts.py", "test_session_local.py",
    "test_state_broker.py", "test_store.py", "test_trace_cli.py", "test_transfer.py",
    "test_up_threads.py", "test_ledger.py", "test_guards.py", "test_prefork.py",
    "test_stragglers.py", "test_scale.py",
    "test_inject.py", "test_actuator.py", "test_schemas_export.py",
    "test_graveyard.py", "test_standby.py", "test_placement.py", "test_hosts.py",
    "test_quorum.py", "test_plan_wire.py", "test_hearing.py", "test_ray_adopt.py",
    "test_hostbeat.py",
}


# Unit files whose tests share a module fixture worth keeping to one worker (a traced job,
# a corpus): `--dist loadgroup` (pyproject) sends a group to one.
ONE_WORKER_FILES = {"test_trace_cli.py", "test_data_loader.py"}

# Full-suite files that start no cluster and wait on no fault timeout: any worker may run them
# beside the cluster tests (the rest are the "clusters" group, one test at a time).
BESIDE_CLUSTERS = {"test_bad_input.py", "test_compose.py", "test_state_handoff.py",
                   "test_telemetry.py", "test_tls.py", "test_shadow.py", "test_shadow_roles.py",
                   "test_host_syncs.py",
                   # no `up`: two gloo processes (FSDP2), one nats-server restarted, pure
                   # functions; bitwise or generously bounded (~30 s off the serial worker)
                   "test_sharded.py", "test_store_keeper.py", "test_data_bench.py",
                   # one process each (Lightning, the HF Trainer in subprocesses, ~40 s each): not the quick tier
                   "test_lightning.py", "test_hf.py"}


def pytest_itemcollected(item):
    # as each test is collected: before `-m unit` selects and xdist's loadgroup names groups
    if item.path.name in UNIT_FILES:
        item.add_marker(pytest.mark.unit)
        if item.path.name in ONE_WORKER_FILES:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))
    elif item.path.name not in BESIDE_CLUSTERS:
        # Everything that runs clusters or real faults runs on one worker, one test at a
        # time, in order: they are bound by real timeouts and step counts (two of them at
        # once on 2 cores made three fail in one run). The other workers take the unit tier
        # meanwhile.
        item.add_marker(pytest.mark.xdist_group("clusters"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4. The cluster tests stay on one of them, one at
    a time (the "clusters" group above); the unit tier spreads over all."""
    import os

    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture(scope="session", autouse=True)
def shared_zygote(request, tmp_path_factory):
    """One zygote for every cluster of this run (services/actuator/zygote.py --listen): each
    `ceaseless up` a test starts forks its pods from it (CEASELESS_ZYGOTE) instead of paying
    ~2 s for importing torch in a zygote of its own. Not for the unit tier. At the end, what
    it forked and is still running is killed by PID, then the zygote."""
    import os
    import subprocess
    import sys
    import time

    from harness import REPO
    from ops.cluster import PRELOAD

    if os.environ.get("CEASELESS_ZYGOTE") or all(
            i.get_closest_marker("unit") for i in request.session.items):
        yield None
        return
    # torch sets this in the test process the first time a test compiles; every later cluster
    # inherits it: set it now, so that the zygote's environment is theirs
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    cache_dir()
    d = tmp_path_factory.mktemp("zygote")
    sock = d / "z.sock"
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = str(REPO)  # as ops/launcher.py's Cluster gives `up`
    with open(d / "zygote.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.actuator.zygote", "--listen", str(sock),
             "--preload", ",".join(PRELOAD)], env=env, cwd=REPO, stdout=log, stderr=log,
            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if sock.exists():
        os.environ["CEASELESS_ZYGOTE"] = str(sock)
    try:
        yield sock
    finally:
        os.environ.pop("CEASELESS_ZYGOTE", None)
        for pid in _children(proc.pid):
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        proc.kill()
        proc.wait(10)


def _children(ppid: int) -> list[int]:
    import os

    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rpartition(")")[2].split()[1]) == ppid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


@pytest.fixture
def nats_server(tmp_path):
    creds = write_credentials(tmp_path / "creds.json")
    srv = NatsServer.start(tmp_path / "nats", creds=creds)
    srv.creds_path = tmp_path / "creds.json"
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def no_trainer_leftovers():
    """A trainer run in this process (Lightning, the HF Trainer) may leave its default
    process group and its variables (RANK, WORLD_SIZE, MASTER_ADDR...) behind: the next test
    on the same worker starts without them (Lightning's made Accelerate build a group of its
    own in test_hf's refusal tests)."""
    env = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(env)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest_asyncio.fixture
async def bus(nats_server):
    b = await Bus.connect(nats_server.url, "test", "test-client", nats_server.creds)
    await b.ensure_stream()
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """Fault-free runs of the default example, one per (world size, steps, flags), computed
    once per test run and shared by every module that compares against them; with parallel
    test workers (pytest-xdist) by every worker too (a file per run, made under a lock)."""
    import asyncio
    import concurrent.futures
    import fcntl
    import json
    import os

    from harness import STEPS, run_job

    # an xdist worker's base temp is `pytest-N/popen-gwK/`: its parent is this run's, shared
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "references"
    root.mkdir(exist_ok=True)
    cache: dict[tuple, dict] = {}

    def get(workers: int, steps: int = STEPS, extra: tuple[str, ...] = ()) -> dict:
        """``extra``: `up` flags that change the trajectory (``--dtype float64``); flags that
        do not (verification, straggler settings) need no reference of their own."""
        key = (workers, steps, tuple(extra))
        if key in cache:
            return cache[key]
        name = f"ref{workers}-{steps}" + "".join(f"_{x.lstrip('-')}" for x in extra)
        path = root / f"{name}.json"
        with open(root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one worker runs it; the others wait and read
            if not path.exists():
                d = tmp_path_factory.mktemp(name)
                with concurrent.futures.ThreadPoolExecutor(1) as ex:  # the test's loop runs
                    s = ex.submit(asyncio.run, run_job(
                        d, "ref", workers, 0, steps=steps, extra=list(extra) or None)).result()
                assert s["param_sha256"], s
                s.pop("plans", None)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(s))
                tmp.replace(path)
            cache[key] = json.loads(path.read_text())
        return cache[key]

    return get
