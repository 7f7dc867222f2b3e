"""TLS on the bus: a throw-away CA per run; clients verify the server against it."""

from __future__ import annotations

import asyncio
import stat

import pytest

pytest.importorskip("cryptography")

from plumbing.bus import Bus  # noqa: E402
from services.common.natsserver import NatsServer, write_credentials  # noqa: E402
from plumbing.tlsgen import client_context, generate  # noqa: E402

pytestmark = [pytest.mark.timeout(60)]


@pytest.fixture
def tls_server(tmp_path):
    files = generate(tmp_path / "tls")
    creds = write_credentials(tmp_path / "creds.json")
    srv = NatsServer.start(tmp_path / "nats", creds=creds, tls=files)
    try:
        yield srv, creds, files, tmp_path
    finally:
        srv.stop()


async def test_tls_round_trip_and_verification(tls_server):
    srv, creds, files, tmp = tls_server
    assert srv.url.startswith("tls://")
    assert stat.S_IMODE(files.key.stat().st_mode) == 0o600
    bus = await Bus.connect(srv.url, "tlsjob", "t", creds, tls=client_context(files.ca))
    got = []

    async def on(msg):
        got.append(msg.data)
    await bus.nc.subscribe("x.y", cb=on)
    await bus.nc.flush()
    await bus.nc.publish("x.y", b"hello")
    await bus.nc.flush()
    await asyncio.sleep(0.1)
    assert got == [b"hello"]
    await bus.close()
    # A client that does not trust this run's CA is refused (server not authenticated)...
    other = generate(tmp / "other")
    with pytest.raises(Exception):
        await Bus.connect(srv.url, "tlsjob", "t", creds, tls=client_context(other.ca),
                          allow_reconnect=False, connect_timeout=2)
    # ...and so is a plain-text client.
    with pytest.raises(Exception):
        await Bus.connect(srv.url.replace("tls://", "nats://"), "tlsjob", "t", creds,
                          allow_reconnect=False, connect_timeout=2)


async def test_ca_from_the_environment(tls_server, monkeypatch):
    srv, creds, files, _ = tls_server
    monkeypatch.setenv("CEASELESS_TLS_CA", str(files.ca))
    bus = await Bus.connect(srv.url, "tlsjob", "t", creds)  # agents/services: CA from env
    assert bus.nc.is_connected
    await bus.close()
