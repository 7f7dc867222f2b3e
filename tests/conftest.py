"""Shared fixtures: a real nats-server with JetStream on a free loopback port."""

from __future__ import annotations

import pytest
import pytest_asyncio

from services.common.bus import Bus
from services.common.natsserver import NatsServer, write_credentials


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

    cache: dict[tuple[int, int], dict] = {}

    def get(workers: int, steps: int = STEPS) -> dict:
        key = (workers, steps)
        if key not in cache:
            d = tmp_path_factory.mktemp(f"ref{workers}-{steps}")
            with concurrent.futures.ThreadPoolExecutor(1) as ex:  # the test's loop is running
                cache[key] = ex.submit(asyncio.run,
                                       run_job(d, "ref", workers, 0, steps=steps)).result()
            assert cache[key]["param_sha256"], cache[key]
        return cache[key]

    return get
