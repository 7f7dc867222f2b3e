"""What a new lease holder's read-back of the job stream costs (issue 42): N faults in the
stream, then ``services.common.history.read_back`` of them, timed (the scaler and the health
monitor do this once when they take a lease, before they decide or declare anything).

    python -m bench.readback [--faults 0,100,4096] [--repeat 3]

A real nats-server (JetStream file store) in a temporary directory; prints one line per
read-back."""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from plumbing import logs
from plumbing.bus import Bus
from schemas.messages import Fault, FaultKind
from services.common.history import read_back
from services.common.natsserver import NatsServer


async def measure(n: int, repeat: int) -> list[float]:
    srv = NatsServer.start(Path(tempfile.mkdtemp()) / "nats")
    try:
        bus = await Bus.connect(srv.url, "bench", "bench", srv.creds)
        await bus.ensure_stream()
        now = time.time()
        for i in range(n):
            await bus.publish(bus.subjects.fault, Fault(
                incident=f"inc-s{i}-g1", pod=f"s{i}", kind=FaultKind.lost, detected_at=now,
                last_seen=now, generation=1), msg_id=f"inc-s{i}-g1")
        out = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            got = await read_back(bus, bus.subjects.fault, Fault, logs.get("bench"))
            out.append(time.perf_counter() - t0)
            assert len(got) == n, (len(got), n)
        await bus.close()
        return out
    finally:
        srv.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", default="0,100,4096")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    for n in (int(x) for x in a.faults.split(",")):
        times = asyncio.run(measure(n, a.repeat))
        print(f"faults {n}: read back in " + ", ".join(f"{t * 1000:.0f} ms" for t in times))


if __name__ == "__main__":
    main()
