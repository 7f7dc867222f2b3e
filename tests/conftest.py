"""Shared fixtures: a real nats-server with JetStream on a free loopback port."""

from __future__ import annotations

import pytest
import pytest_asyncio

from plumbing.bus import Bus
from services.common.natsserver import NatsServer, write_credentials


# The unit tier (`python -m pytest -m unit`, about 2 minutes on 2 cores): one part at a time,
# against a real nats-server where it needs a bus, never a whole `ceaseless up`. Everything
# else (clusters, real faults, benchmarks' smoke runs) is the full suite's.
UNIT_FILES = {
    "test_bus.py", "test_checkpoint.py", "test_collectives.py", "test_data_loader.py",
    "test_data_prepare.py", "test_dropin.py", "test_gpus.py", "test_grad_sync.py", "test_health_monitor.py",
    "test_heartbeat_feed.py", "test_layers.py", "test_membership.py", "test_permissions.py",
    "test_policy_file.py", "test_policy_properties.py", "test_ports.py", "test_repeats.py",
    "test_scaler.py", "test_schemas_timeouts.py", "test_session_local.py",
    "test_state_broker.py", "test_store.py", "test_trace_cli.py", "test_transfer.py",
    "test_up_threads.py", "test_ledger.py", "test_guards.py", "test_prefork.py",
}


# Unit files whose tests share a module fixture worth keeping to one worker (a traced job,
# a corpus): `--dist loadgroup` (pyproject) sends a group to one.
ONE_WORKER_FILES = {"test_trace_cli.py", "test_data_loader.py"}


@pytest.hookimpl(tryfirst=True)  # before the marks select (-m unit) and xdist names groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in UNIT_FILES:
            item.add_marker(pytest.mark.unit)
            if item.path.name in ONE_WORKER_FILES:
                item.add_marker(pytest.mark.xdist_group(item.path.stem))
        else:
            # Everything that runs clusters or real faults runs on one worker, one test at a
            # time, in order: they are bound by real timeouts and step counts (two of them at
            # once on 2 cores made three fail in one run). The other workers take the unit
            # tier meanwhile.
            item.add_marker(pytest.mark.xdist_group("clusters"))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most 4. The cluster tests stay on one of them, one at
    a time (the "clusters" group above); the unit tier spreads over all."""
    import os

    return max(1, min(len(os.sched_getaffinity(0)), 4))


@pytest.fixture
def nats_server(tmp_path):
    creds = write_credentials(tmp_path / "creds.json")
    srv = NatsServer.start(tmp_path / "nats", creds=creds)
    srv.creds_path = tmp_path / "creds.json"
    try:
        yield srv
    finally:
        srv.stop()


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
