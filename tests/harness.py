"""Test helpers: a local cluster (see services/launcher.py) and a bounded wait."""

from __future__ import annotations

import asyncio

from services.launcher import REPO, Cluster, _ours  # noqa: F401  (re-exported for tests)


async def until(pred, timeout: float = 5.0, what: str = "condition"):
    """Wait until ``pred()`` is truthy (bounded); returns its value."""
    async def _loop():
        while True:
            v = pred()
            if v:
                return v
            await asyncio.sleep(0.02)
    try:
        return await asyncio.wait_for(_loop(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"timed out after {timeout}s waiting for {what}") from None
