"""Test helpers: a local cluster (see ops/launcher.py) and a bounded wait."""

from __future__ import annotations

from pathlib import Path

import asyncio

from ops.launcher import REPO, Cluster, _ours  # noqa: F401  (re-exported for tests)


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


STEPS = 80  # long enough that heartbeats (0.25 s) see the fault step before the end


async def run_job(tmp_path, name, workers, spares, fault=None, steps=STEPS, extra=None,
                  cmd=None, replace=False):
    """One `ceaseless up` job (of the default example unless ``cmd``); ``fault(cluster)`` runs
    once the spares registered. Returns the summary with the plans seen on the bus."""
    async with Cluster(tmp_path / name, workers, spares, steps, extra=extra, cmd=cmd,
                       replace=replace) as c:
        if fault is not None:
            await c.wait_spares(spares)  # on a slow machine a spare may register late
            await fault(c)
        code = await c.finish()
        assert code == 0, c.output() + "\n" + c.pod_tails()
        s = c.summary()
        s["plans"] = c.plans
        return s


def log_events(run_dir, pod: str, event: str) -> list[dict]:
    """The JSON log records of ``pod`` (``<run_dir>/logs/<pod>.log``) whose event is ``event``."""
    import json

    out = []
    for line in (Path(run_dir) / "logs" / f"{pod}.log").read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out

