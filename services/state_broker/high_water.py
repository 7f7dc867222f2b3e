"""The job's committed high-water mark, kept where a restarted state broker reads it.

The mark (the highest step a member of the current plan reported committed) is the only
record that the job ever committed a step: members that hold no state after it are a total
loss (``state_lost``), not a fresh start. In the broker's memory alone it died with the
broker, so one host that ran every pod and the broker restarted training from step 0
(issue 41). Here it is also kept in the job's KV bucket, key ``committed``
(``schemas.messages.HighWater``; only the state broker's identity may write it):

* ``start`` reads the stored mark before the broker looks at any plan; a read that fails
  fails the start (the supervisor restarts the broker): deciding without it is the bug.
* ``note`` raises the mark in memory (called for every committed step seen: no I/O) and
  wakes one writer task, which puts the newest mark by compare-and-set, so the stored mark
  only ever rises, even with a second broker beside this one. While a write is in flight
  newer marks wait for the next one (one small write per heartbeat view at most).
"""

from __future__ import annotations

import asyncio
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from pydantic import ValidationError

from plumbing.aio import cancel_all
from plumbing.bus import Bus
from schemas.messages import HighWater
from schemas.subjects import COMMITTED_KEY

RETRY_S = 0.2  # after a failed write (the server restarting): try again this much later


class HighWaterRecord:
    """The high-water mark in memory (``step``, -1: nothing committed) and in KV."""

    def __init__(self, bus: Bus, log: Any, retry_s: float = RETRY_S) -> None:
        self.bus, self.log, self.retry_s = bus, log, retry_s
        self.step = -1
        self.generation = 0
        self.pod = ""
        self.stored = -1          # the mark KV holds, as far as this broker knows
        self.writes = 0
        self.write_errors = 0
        self._kv: Any = None
        self._revision: int | None = None
        self._dirty = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._kv = await self.bus.kv()
        await self._load()
        if self.stored >= 0:
            self.log.info("committed high water read", step=self.stored,
                          generation=self.generation, pod=self.pod)
        self._task = asyncio.create_task(self._writer())

    async def stop(self, flush_s: float = 1.0) -> None:
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None
        if self._kv is not None and self.step > self.stored:  # stopped: one last write
            try:
                await asyncio.wait_for(self._write(), flush_s)
            except Exception as e:
                self.log.warning("could not write KV committed at stop", step=self.step,
                                 error=str(e)[:200])

    def note(self, step: int, generation: int, pod: str) -> None:
        """Step ``step`` was committed by ``pod``, a member of plan ``generation``."""
        if step <= self.step:
            return
        self.step, self.generation, self.pod = step, generation, pod
        self._dirty.set()

    def status(self) -> dict[str, Any]:
        return {"step": self.step, "stored": self.stored, "writes": self.writes,
                "write_errors": self.write_errors}

    async def _load(self) -> None:
        """Take the stored mark (and its revision, for the next compare-and-set)."""
        try:
            entry = await self._kv.get(COMMITTED_KEY)
        except (KeyNotFoundError, NotFoundError):  # never written (or deleted): nothing yet
            self._revision = None
            return
        self._revision = entry.revision
        try:
            hw = HighWater.model_validate_json(entry.value or b"")
        except ValidationError as e:  # only the broker writes it: a bug, said and overwritten
            self.log.error("KV committed does not validate; ignoring it", revision=entry.revision,
                           error=str(e)[:300])
            return
        self.stored = max(self.stored, hw.step)
        if hw.step > self.step:
            self.step, self.generation, self.pod = hw.step, hw.generation, hw.pod

    async def _writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._write()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the server restarting: the mark stays in memory
                self.write_errors += 1
                self.log.warning("could not write KV committed; retrying", step=self.step,
                                 error=str(e)[:200])
                self._dirty.set()
                await asyncio.sleep(self.retry_s)

    async def _write(self) -> None:
        while self.step > self.stored:
            hw = HighWater(step=self.step, generation=self.generation, pod=self.pod)
            data = hw.model_dump_json().encode()
            try:
                if self._revision is None:
                    self._revision = await self._kv.create(COMMITTED_KEY, data)
                else:
                    self._revision = await self._kv.update(COMMITTED_KEY, data,
                                                           last=self._revision)
            except KeyWrongLastSequenceError:  # written by another broker: take the higher
                await self._load()
                continue
            self.stored = hw.step
            self.writes += 1
