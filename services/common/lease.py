"""One service instance acts per job: a lease in the job's KV bucket (issue 42).

Every service (scaler, health monitor, state broker) can run as several instances; each
holds a ``Lease`` part on its own key (``lease_key(service)``). The value is JSON
``{holder, expires, term}``: taken by create when absent or by compare-and-set when expired,
renewed every ``ttl / 3``. ``term`` rises by one each time an instance takes the lease (never
on a renewal), so what the active instance publishes carries a number every receiver can
compare: a message of an older term than the newest one seen comes from a deposed instance
and is ignored.

State machine: STANDBY -> ACTIVE (the lease taken: ``on_acquired``) -> STANDBY (lost,
expired unrenewed or released: ``on_lost``). ``acting`` also checks the local clock, so an
instance cut off from the bus stops acting when its lease runs out, before any standby can
take it (the standby waits for the same expiry).

The TTL: a standby notices an expired lease at its next tick (``ttl / 3`` later), so with
``ttl = fault_timeout * 3 / 4`` it takes over within the fault timeout of the active
instance's loss (``ttl_for``)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError

from plumbing.bus import Bus
from schemas.subjects import lease_key

TICKS_PER_TTL = 3  # renewals (and standby checks) per TTL
# The default TTL: one instance per service (the default) is only restarted in place, with
# the same --instance-id, and takes its lease back at once; `up --standbys K` gives every
# instance ttl_for(fault timeout) instead.
LEASE_TTL = 3.0


def ttl_for(fault_timeout: float) -> float:
    """The lease TTL that lets a standby take over within ``fault_timeout``: expiry (at most
    ``ttl`` after the last renewal) plus one standby tick (``ttl / TICKS_PER_TTL``)."""
    return fault_timeout * TICKS_PER_TTL / (TICKS_PER_TTL + 1)


class LeaseState(str, Enum):
    STANDBY = "standby"
    ACTIVE = "active"


@dataclass(frozen=True)
class LeaseValue:
    holder: str | None
    expires: float  # wall clock
    term: int

    def dumps(self) -> bytes:
        return json.dumps({"holder": self.holder, "expires": self.expires,
                           "term": self.term}).encode()


def parse_lease(raw: bytes | None) -> LeaseValue:
    """A value that does not parse counts as expired, term 0 (a lease of before issue 42 has
    no term: 0 as well)."""
    try:
        obj = json.loads(raw or b"")
        holder = obj.get("holder")
        expires = float(obj.get("expires", 0))
        term = obj.get("term", 0)
        return LeaseValue(holder if isinstance(holder, str) else None, expires,
                          term if isinstance(term, int) and term >= 0 else 0)
    except (ValueError, TypeError, AttributeError):
        return LeaseValue(None, 0.0, 0)


class Lease:
    """A ``Part``: ``start`` spawns the renewal loop, ``stop`` ends it and gives the lease
    back (a clean stop hands over at once; a crash hands over at expiry)."""

    def __init__(self, bus: Bus, service: str, holder_id: str, ttl: float, log: Any,
                 on_acquired: Callable[[int], None] | None = None,
                 on_lost: Callable[[str | None], None] | None = None) -> None:
        if ttl <= 0:
            raise ValueError(f"lease ttl must be positive, got {ttl}")
        self.bus = bus
        self.key = lease_key(service)
        self.holder_id = holder_id
        self.ttl = ttl
        self.log = log
        self.on_acquired = on_acquired
        self.on_lost = on_lost
        self.state = LeaseState.STANDBY
        self.term = 0                    # this instance's term while ACTIVE, the last seen else
        self.holder: str | None = None   # who holds it, as last read
        self.expires = 0.0
        self.acquired = 0                # how many times this instance took it
        # the last try failed (the bus did not answer): a take right after an outage, which
        # ``on_acquired`` may want to know (the health monitor's silence was its own)
        self.outage = False
        # when the bus last answered a check (wall clock, as the lease's times are) and the
        # lease this instance replaced at its last take: together they tell whether another
        # instance was acting while this one was cut off (``acted_while_cut_off``)
        self.answered = 0.0
        self.taken_from: LeaseValue | None = None
        self._kv: Any = None
        self._probe: Any = None  # the bucket with a tick-long request timeout (standby checks)
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def acting(self) -> bool:
        return self.state is LeaseState.ACTIVE and time.time() < self.expires

    async def start(self) -> None:
        """The first try before returning: a lone instance acts from its first message."""
        self._kv = await self.bus.kv()
        # A standby's check gives up within a tick and a failed one is tried again at once:
        # it takes the lease as soon as the bucket answers again after its stream leader's
        # host was lost (with nats-py's 5 s request timeout that took 12 s, not ~6). The
        # holder's renewals keep the long timeout: a slow answer under load must not depose
        # it (its own clock stops it acting when its lease runs out anyway).
        self._probe = await self.bus.kv(timeout=max(1.0, self.ttl / TICKS_PER_TTL))
        self._stopping = False
        await self._try()
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            # Bounded, and the loop checks the flag: on Python 3.11 asyncio.wait_for (inside
            # nats-py's request) swallows a cancel that lands as the reply does, and a loop
            # that renews several times a second then never ends (a service's stop hung
            # for ever in the test suite under load)
            await asyncio.wait({self._task}, timeout=self.ttl + 5.0)
            self._task = None
        await self.release()

    async def _loop(self) -> None:
        took = 0.0
        while not self._stopping:
            # a tick apart, the time a failed check took included (it waited out its
            # timeout: the next one goes at once; one refused at once waits the tick)
            tick = self.ttl / TICKS_PER_TTL
            await asyncio.sleep(max(0.05, tick - took) if self.outage else tick)
            t0 = time.monotonic()
            await self._try()
            took = time.monotonic() - t0

    async def _try(self) -> None:
        try:
            await self.tick()
            self.outage, self.answered = False, time.time()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the bus is down: stop acting, keep trying
            was, self.outage = self.outage, True
            self._to(LeaseState.STANDBY)
            # once per outage (a check a tick: dozens in a leader election)
            (self.log.debug if was else self.log.warning)(
                "lease check failed", key=self.key, error=str(e)[:200])

    def _to(self, state: LeaseState) -> None:
        old, self.state = self.state, state
        if old is state:
            return
        if state is LeaseState.ACTIVE:
            self.acquired += 1
            self.log.info("lease acquired", key=self.key, term=self.term, ttl=self.ttl)
            if self.on_acquired is not None:
                self.on_acquired(self.term)
        else:
            self.log.info("lease lost", key=self.key, term=self.term, holder=self.holder)
            if self.on_lost is not None:
                self.on_lost(self.holder)

    async def tick(self) -> None:
        """Renew (ACTIVE) or try to take (STANDBY) the lease once."""
        now = time.time()
        kv = self._kv if self.state is LeaseState.ACTIVE or self._probe is None else self._probe
        try:
            entry = await kv.get(self.key)
        except (KeyNotFoundError, NotFoundError):
            entry = None
        cur = parse_lease(entry.value if entry is not None else None)
        mine = self.state is LeaseState.ACTIVE and cur.holder == self.holder_id \
            and cur.term == self.term
        if not mine and cur.holder not in (None, self.holder_id) and cur.expires > now:
            self.holder, self.expires, self.term = cur.holder, cur.expires, cur.term
            self._to(LeaseState.STANDBY)
            return
        # a renewal keeps the term; a take (even of our own expired lease) raises it
        term = cur.term if mine else cur.term + 1
        new = LeaseValue(self.holder_id, now + self.ttl, term)
        try:
            if entry is None or entry.value is None:
                await kv.create(self.key, new.dumps())
            else:
                await kv.update(self.key, new.dumps(), last=entry.revision)
        except KeyWrongLastSequenceError:
            self._to(LeaseState.STANDBY)  # another instance took or renewed it first
            return
        if not mine:
            self.taken_from = cur
        self.holder, self.expires, self.term = self.holder_id, new.expires, term
        self._to(LeaseState.ACTIVE)

    def acted_while_cut_off(self) -> float:
        """At a take right after an outage (``on_acquired``): how long another instance
        acted while this one could not reach the quorum, in seconds since the bus last
        answered this one (0: none did). The lease taken was renewed by another holder more
        than two ticks after that answer: it was alive on the side with the quorum (a
        partition) and heard what this instance could not. A holder lost with its host (the
        outage being the election after it) renewed last within a tick of that answer."""
        prev = self.taken_from
        if (not self.outage or prev is None or prev.holder in (None, self.holder_id)
                or self.answered <= 0):
            return 0.0
        renewed = prev.expires - self.ttl  # the holders of one service share the ttl
        if renewed <= self.answered + 2 * self.ttl / TICKS_PER_TTL:
            return 0.0
        return max(0.0, time.time() - self.answered)

    async def release(self) -> None:
        """Give the lease back (expires 0, the term kept so the next taker's is higher)."""
        if self.state is not LeaseState.ACTIVE or self._kv is None:
            return
        self.state = LeaseState.STANDBY
        try:
            entry = await self._kv.get(self.key)
            cur = parse_lease(entry.value)
            if cur.holder == self.holder_id:
                await self._kv.update(self.key, LeaseValue(None, 0.0, cur.term).dumps(),
                                      last=entry.revision)
                self.log.info("lease released", key=self.key, term=cur.term)
        except Exception as e:
            self.log.warning("lease release failed", key=self.key, error=str(e)[:200])

    def status(self) -> dict[str, Any]:
        return {"key": self.key, "state": self.state.value, "acting": self.acting,
                "term": self.term, "holder": self.holder, "ttl": self.ttl,
                "instance": self.holder_id}
