"""asyncio helpers that stay correct under Python 3.11's lost-cancellation race."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for ``event`` at most ``timeout`` seconds; True if it was set.

    Not ``asyncio.wait_for(event.wait(), ...)``: on Python 3.11 that swallows a cancellation
    that arrives just as the event is set, and a loop built on it then never stops (seen as
    a 180 s hang in a service's shutdown)."""
    try:
        async with asyncio.timeout(max(0.0, timeout)):
            await event.wait()
        return True
    except TimeoutError:
        return event.is_set()


async def cancel_all(tasks: list[asyncio.Task], *, attempts: int = 50,
                     interval: float = 0.1) -> None:
    """Cancel ``tasks`` and wait for them, cancelling again those still running.

    Python 3.11's ``asyncio.wait_for`` (used inside nats-py's request) returns the result
    when the awaited future completes just as the task is cancelled, so one cancellation can
    be lost; a single cancel-and-gather then waits forever."""
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    for _ in range(attempts):
        if not pending:
            break
        _, pending = await asyncio.wait(pending, timeout=interval)
        for t in pending:
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
