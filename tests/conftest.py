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
