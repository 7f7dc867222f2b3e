"""Does the bus have a JetStream quorum? What `up` says and `ceaseless status` shows (issue 42).

A bus of N clustered nats-servers answers JetStream (KV ``plan``, the leases, the job
stream, the rendezvous store) only while a majority of them reach each other: JetStream's
raft groups need ``N // 2 + 1`` of their peers (the streams' replicas, min(N, 3), the same
majority for N <= 3). Without it every write fails (times out, or 503 "JetStream system
temporarily unavailable"), so no lease is taken or renewed and no plan is written: the
services plan nothing and training goes on in the generation it has, over gloo.

``probe`` asks each server whether it answers (a TCP connection and the INFO line every
nats-server sends first); ``judge`` (pure) turns what answered into a verdict and its line;
``QuorumWatch`` says it once per change: no quorum; a majority back but JetStream not
answering yet (after a partition the servers' routes and raft groups take seconds to come
back and elect); JetStream answering again, and after how long. Seen
from one place (`up`'s machine) a server may answer while its peers do not reach it: the
line counts the servers that answer here, JetStream's own errors say the rest.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from urllib.parse import urlsplit

PROBE_S = 0.5  # a server that sends nothing in this long counts as unreachable


def majority(n: int) -> int:
    """The servers a bus of ``n`` needs to answer JetStream."""
    if n < 1:
        raise ValueError(f"a bus has at least one server, not {n}")
    return n // 2 + 1


class Quorum(str, Enum):
    ok = "quorum"       # a majority answers
    lost = "no quorum"


@dataclass(frozen=True)
class Verdict:
    state: Quorum
    reachable: tuple[str, ...]  # the servers that answered (``s1``..)
    total: int

    @property
    def has_quorum(self) -> bool:
        return self.state is Quorum.ok

    def line(self) -> str:
        n, of = len(self.reachable), self.total
        who = f" ({', '.join(self.reachable)})" if self.reachable else ""
        if self.has_quorum:
            return f"the bus has JetStream quorum: {n} of {of} servers reachable{who}"
        return (f"the bus has no JetStream quorum: {n} of {of} servers reachable{who}, "
                f"{majority(of)} needed; no lease can be taken and no plan written until "
                "a majority is back (training goes on in its generation)")

    def as_dict(self) -> dict:
        return {"quorum": self.has_quorum, "reachable": list(self.reachable),
                "servers": self.total, "needed": majority(self.total), "line": self.line()}


def judge(answered: dict[str, bool]) -> Verdict:
    """``answered``: server name -> did it answer. Quorum: a majority answered."""
    up = tuple(name for name, ok in answered.items() if ok)
    total = len(answered)
    state = Quorum.ok if len(up) >= majority(total) else Quorum.lost
    return Verdict(state, up, total)


class Watch(str, Enum):
    ok = "quorum"
    lost = "no quorum"
    electing = "majority back, JetStream not answering yet"


class QuorumWatch:
    """Says each change once: ``observe`` returns the line to log (None: no change).

    OK -> LOST (fewer than a majority answer) -> ELECTING (a majority answers again, but
    JetStream does not yet: its routes and raft groups come back, then elect leaders) ->
    OK (JetStream answers). ``js_ok`` (did a JetStream read answer; None: not asked) matters
    only on the way back: while OK, a failing read is an ordinary election after one lost
    server and says nothing. The first verdict is said only when it is a loss."""

    def __init__(self) -> None:
        self.state: Watch | None = None
        self.lost_at: float | None = None   # the caller's clock
        self.back_at: float | None = None   # when a majority answered again

    def observe(self, verdict: Verdict, now: float, js_ok: bool | None = None) -> str | None:
        old = self.state
        if not verdict.has_quorum:
            new = Watch.lost
        elif old in (Watch.lost, Watch.electing) and js_ok is False:
            new = Watch.electing
        else:
            new = Watch.ok
        self.state = new
        if new is old or (old is None and new is Watch.ok):
            return None
        if new is Watch.lost:
            self.lost_at, self.back_at = now, None
            return verdict.line()
        lost_for = now - self.lost_at if self.lost_at is not None else 0.0
        n = f"{len(verdict.reachable)} of {verdict.total} servers reachable " \
            f"({', '.join(verdict.reachable)})"
        if new is Watch.electing:
            self.back_at = now
            return (f"the bus has a majority again: {n} after {lost_for:.1f}s; JetStream "
                    "does not answer yet (its routes and leaders come back): still no plan")
        waited = f", JetStream answering {now - self.back_at:.1f}s after the majority" \
            if self.back_at is not None else ""
        self.lost_at = self.back_at = None
        return (f"the bus has JetStream quorum again: {n}, {lost_for:.1f}s without"
                f"{waited}")


def server_names(url: str) -> dict[str, tuple[str, int]]:
    """``s1``.. -> (host, port) of each server of a comma-separated bus URL."""
    out = {}
    for i, u in enumerate(x.strip() for x in url.split(",") if x.strip()):
        p = urlsplit(u if "//" in u else f"nats://{u}")
        out[f"s{i + 1}"] = (p.hostname or "127.0.0.1", p.port or 4222)
    return out


async def answers(host: str, port: int, timeout: float = PROBE_S) -> bool:
    """Does a nats-server answer there (its INFO line within ``timeout``)?"""
    writer = None
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        first = await asyncio.wait_for(reader.readexactly(4), timeout)
        return first == b"INFO"
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError):
        return False
    finally:
        if writer is not None:
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), timeout)
            except (OSError, asyncio.TimeoutError):
                pass


async def probe(url: str, down: set[str] = frozenset(), timeout: float = PROBE_S) -> Verdict:
    """Every server of ``url`` asked at once; those in ``down`` (a lost host's: killed) are
    not asked and count as unreachable."""
    servers = server_names(url)
    names = [n for n in servers if n not in down]
    got = await asyncio.gather(*(answers(*servers[n], timeout) for n in names))
    ok = dict(zip(names, got))
    return judge({n: ok.get(n, False) for n in servers})
