"""Heartbeat fan-in: one process reads every agent's heartbeat, the others get its view.

At thousands of agents, each heartbeat read by three services costs three parses and three
handler calls (about 25 µs each here). The health monitor must read every heartbeat; the
scaler and the state broker need less, less often. So the monitor publishes a
``HealthView`` (``ViewPublisher``):

* at once, the full last heartbeat of each pod that appeared or changed generation, state,
  role or rank (what recovery waits on);
* every ``interval`` (0.5 s), every watched pod in compact form: generation, committed step
  and its digest, seconds since its heartbeat (parsed in bulk: about 1 µs a pod);
* every ``COMPLETE_EVERY`` (8) intervals, every pod's full last heartbeat (in chunks).

``HeartbeatFeed`` gives a consumer its heartbeats from that view while it arrives, and
subscribes to the heartbeats themselves while it does not (the monitor down, restarting,
paused, or not running at all as in unit tests), so the scaler and the broker never depend
on the monitor being up. It switches to the view on a complete listing.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Awaitable, Callable, Iterable

from schemas.messages import (MAX_PODS, MAX_VIEW_LIVE, MAX_VIEW_PODS, HealthView, Heartbeat,
                              HeartbeatBatch, Seen, new_id)
from schemas.timeouts import VIEW_INTERVAL

from plumbing.aio import cancel_all, wait_event
from plumbing.bus import Bus, Envelope

# (heartbeat, subject it came on, seconds since it was received by whoever read it)
OnHeartbeat = Callable[[Heartbeat, str, float], Awaitable[None]]
# (pods, generations, committed steps, their digests, seconds since each one's heartbeat)
OnBeats = Callable[[list[str], list[int], list[int], list[str], list[float]], None]
# the monitor's watched pods (or those named): (last heartbeat, monotonic time received)
Heard = Callable[[Iterable[str] | None], list[tuple[Heartbeat, float]]]
COMPLETE_EVERY = 8  # a complete listing (full heartbeats) every 8 intervals
_MAX_TRACKED = MAX_PODS


def _parts(heard: list[tuple[Heartbeat, float]],
           size: int = MAX_VIEW_PODS) -> list[list[tuple[Heartbeat, float]]]:
    """One listing's chunks (one, empty, for nothing heard)."""
    return [heard[i:i + size] for i in range(0, len(heard), size)] or [[]]


class ViewPublisher:
    """The health monitor's side. ``heard(pods)`` gives (last heartbeat, monotonic time it was
    received) of the given watched pods, or of every watched pod for None: the monitor's own
    table, so a pod it stops watching is out of the view with nothing to keep in step.
    ``note(prev, hb)`` on every accepted heartbeat marks a changed pod for sending at once."""

    def __init__(self, bus: Bus, log: Any, heard: Heard, interval: float = VIEW_INTERVAL,
                 active: Callable[[], bool] = lambda: True) -> None:
        self.bus, self.log, self.heard, self.interval = bus, log, heard, interval
        self.active = active  # a standby monitor publishes no view (issue 42)
        self.id = new_id()
        self.urgent: set[str] = set()
        self._wake = asyncio.Event()
        self.seq = 0
        self.published = 0

    def note(self, prev: Heartbeat | None, hb: Heartbeat) -> None:
        # (``_key``'s fields compared in place: this runs for every heartbeat, 65,536 a
        # second at 16,384 pods, and two tuples a call were a fifth of the monitor's time)
        if (prev is None or prev.generation != hb.generation or prev.state != hb.state
                or prev.role != hb.role or prev.rank != hb.rank):
            self.urgent.add(hb.pod)
            self._wake.set()

    async def run(self) -> None:
        next_full, rounds = time.monotonic(), 0
        while True:
            left = next_full - time.monotonic()
            if left > 0 and not self._wake.is_set():
                await wait_event(self._wake, left)
            self._wake.clear()
            if not self.active():
                self.urgent.clear()
                next_full, rounds = time.monotonic() + self.interval, 0
                continue
            try:
                if time.monotonic() >= next_full:
                    if rounds % COMPLETE_EVERY == 0:
                        self.urgent.clear()
                        await self._publish_full(self.heard(None), complete=True)
                    else:
                        await self._publish_compact()
                    rounds += 1
                    next_full = time.monotonic() + self.interval
                elif self.urgent:
                    await asyncio.sleep(0.001)  # gather what arrives in the same burst
                    pods, self.urgent = self.urgent, set()
                    await self._publish_full(self.heard(pods), complete=False)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # disconnected: the next round tries again
                self.log.debug("health view not published", error=str(e)[:200])

    def _view(self, **kw: Any) -> HealthView:
        self.seq += 1
        return HealthView(monitor=self.id, seq=self.seq, interval=self.interval, **kw)

    def full_views(self, heard: list[tuple[Heartbeat, float]], complete: bool,
                   now: float) -> list[HealthView]:
        """The messages of one listing of full heartbeats (none: nothing to send)."""
        if not heard and not complete:
            return []
        parts = _parts(heard)
        return [self._full(part, complete, i, len(parts), now) for i, part in enumerate(parts)]

    def _full(self, part: list[tuple[Heartbeat, float]], complete: bool, i: int, n: int,
              now: float) -> HealthView:
        return self._view(full=complete, chunk=i, chunks=n,
                          pods=[Seen(hb=hb, age=min(3600.0, max(0.0, now - t)))
                                for hb, t in part])

    def compact_views(self, items: list[tuple[Heartbeat, float]],
                      now: float) -> list[HealthView]:
        """The messages of one compact listing of ``items``."""
        parts = _parts(items, MAX_VIEW_LIVE)
        return [self._compact(part, i, len(parts), now) for i, part in enumerate(parts)]

    def _compact(self, part: list[tuple[Heartbeat, float]], i: int, n: int,
                 now: float) -> HealthView:
        return self._view(chunk=i, chunks=n, live=[hb.pod for hb, _ in part],
                          gens=[hb.generation for hb, _ in part],
                          steps=[hb.step for hb, _ in part],
                          digests=[hb.step_digest for hb, _ in part],
                          ages=[min(3600.0, max(0.0, now - t)) for _, t in part])

    async def _publish_full(self, heard: list[tuple[Heartbeat, float]], complete: bool) -> None:
        if not heard and not complete:
            return
        parts = _parts(heard)
        for i, part in enumerate(parts):
            if i:  # built and sent a chunk at a time, the loop free between them: a listing
                # of 16,384 pods took 0.1-0.3 s, so long the monitor read no heartbeat and
                # its link check (a PING) timed out (issue 45)
                await asyncio.sleep(0)
            await self.bus.publish(self.bus.subjects.health,
                                   self._full(part, complete, i, len(parts), time.monotonic()))
        self.published += 1

    async def _publish_compact(self) -> None:
        parts = _parts(self.heard(None), MAX_VIEW_LIVE)
        for i, part in enumerate(parts):
            if i:  # as _publish_full: the loop free between chunks
                await asyncio.sleep(0)
            await self.bus.publish(self.bus.subjects.health,
                                   self._compact(part, i, len(parts), time.monotonic()))
        self.published += 1


class HeartbeatFeed:
    """A consumer's heartbeats: from the monitor's view while one arrived within
    ``2 × interval + 0.5 s``, read directly otherwise (and at start, until the first
    complete listing). Each full heartbeat reaches ``on_heartbeat`` once (a complete listing
    repeats a pod's last one until a newer one arrives), never older than one already given
    for that pod within a generation; compact entries go to ``on_beats`` in bulk, and a
    consumer applies only those whose generation it already holds for the pod."""

    def __init__(self, bus: Bus, log: Any, on_heartbeat: OnHeartbeat, on_beats: OnBeats,
                 on_resume: Callable[[float], None] | None = None) -> None:
        self.bus, self.log = bus, log
        self.on_heartbeat, self.on_beats = on_heartbeat, on_beats
        # told the monotonic time the feed listens again after a view stopped coming
        self.on_resume = on_resume
        self._direct: Any = None
        self._view_sub: Any = None
        self._last_view = 0.0
        self._stale_after = 2 * VIEW_INTERVAL + 0.5
        self._given: dict[str, tuple[int, int, float]] = {}  # pod -> (generation, step, ts)
        self._task: asyncio.Task | None = None
        self.switches = 0

    @property
    def source(self) -> str:
        return "direct" if self._direct is not None else "monitor view"

    def horizon(self, now: float) -> float:
        """Until when this feed has heard what there was to hear: now while it reads the
        heartbeats, the last view's arrival while it reads views. Silence is measured up to
        here: a view that stopped coming (the monitor killed) is the feed's deafness, not the
        pods' silence (a spare judged dead from a dead monitor's last view shrank a job)."""
        return now if self._direct is not None else min(now, self._last_view)

    async def start(self) -> None:
        await self._go_direct()
        self._view_sub = await self.bus.subscribe(self.bus.subjects.health, HealthView,
                                                  self._on_view)
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_all([self._task])
        for sub in [*(self._direct or ()), self._view_sub]:
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass
        self._direct = self._view_sub = None

    async def _go_direct(self) -> None:
        if self._direct is None:  # the heartbeats and the hosts' batches of them (issue 45)
            s = self.bus.subjects
            one = await self.bus.subscribe(s.heartbeat(), Heartbeat, self._on_direct)
            try:
                batches = await self.bus.subscribe(s.heartbeats(), HeartbeatBatch,
                                                   self._on_batch)
            except BaseException:
                await one.unsubscribe()
                raise
            self._direct = (one, batches)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self._direct is None and time.monotonic() - self._last_view > self._stale_after:
                self.switches += 1
                self.log.warning("no health view from the monitor: reading heartbeats directly",
                                 silent_s=round(time.monotonic() - self._last_view, 3))
                try:
                    await self._go_direct()
                except Exception as e:  # disconnected: the next round tries again
                    self.log.warning("could not subscribe to heartbeats", error=str(e)[:200])
                    continue
                if self.on_resume is not None:  # nothing was heard between: from here on
                    self.on_resume(time.monotonic())

    async def _on_direct(self, hb: Heartbeat, env: Envelope) -> None:
        await self._give(hb, env.subject, 0.0)

    async def _on_batch(self, batch: HeartbeatBatch, env: Envelope) -> None:
        for hb in batch.beats:
            await self._give(hb, env.subject, 0.0)

    async def _on_view(self, view: HealthView, env: Envelope) -> None:
        self._last_view = time.monotonic()
        self._stale_after = 2 * view.interval + 0.5
        for s in view.pods:
            await self._give(s.hb, env.subject, s.age)
        if view.live:
            self.on_beats(view.live, view.gens, view.steps, view.digests, view.ages)
        if self._direct is not None and view.full:
            subs, self._direct = self._direct, None
            self.switches += 1
            self.log.info("reading heartbeats from the monitor's health view")
            for sub in subs:
                try:
                    await sub.unsubscribe()
                except Exception:
                    pass

    async def _give(self, hb: Heartbeat, subject: str, age: float) -> None:
        prev = self._given.get(hb.pod)
        if prev is not None:
            if prev[2] == hb.ts and prev[0] == hb.generation and prev[1] == hb.step:
                return  # the same heartbeat again (the view repeats it)
            if hb.generation == prev[0] and hb.step < prev[1]:
                return  # older than one already given
        elif len(self._given) >= _MAX_TRACKED:
            self._given.clear()
        self._given[hb.pod] = (hb.generation, hb.step, hb.ts)
        await self.on_heartbeat(hb, subject, age)
