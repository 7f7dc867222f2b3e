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
    "test_up_threads.py", "test_ledger.py", "test_guards.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in UNIT_FILES:
            item.add_marker(pytest.mark.unit)


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
    """Fault-free runs of the default example, one per (world size, steps), computed once
    per session and shared by every module that compares against them."""
    import asyncio
    import concurrent.futures

    from harness import STEPS, run_job

    cache: dict[tuple, dict] = {}

    def get(workers: int, steps: int = STEPS, extra: tuple[str, ...] = ()) -> dict:
        """``extra``: `up` flags that change the trajectory (``--dtype float64``); flags that
        do not (verification, straggler settings) need no reference of their own."""
        key = (workers, steps, tuple(extra))
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref{workers}-{steps}")
            with concurrent.futures.ThreadPoolExecutor(1) as ex:  # the test's loop is running
                cache[key] = ex.submit(asyncio.run, run_job(
                    d, "ref", workers, 0, steps=steps, extra=list(extra) or None)).result()
            assert cache[key]["param_sha256"], cache[key]
        return cache[key]

    return get
