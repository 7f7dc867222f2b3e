"""Is a silence the pods' or this instance's own? (issue 42, docs/cluster.md "Two of three
hosts lost")

A service instance (the health monitor, the scaler) judges the pods by the heartbeats it
hears. When it hears none at all, that says nothing about the pods: after a partition its
nats-server's route to the pods' server stays stuck for seconds after JetStream answers
again (a cut link sends no reset), and an instance that took its lease then judged a view
that had heard nothing for 15 s: the scaler's once-a-term reconcile faulted a live member,
the monitor declared the rest lost, and the training state was lost.

``Hearing`` keeps the rule (no I/O; times are the caller's monotonic clock):

* no pod heard for a fault timeout (counted from ``since`` at the earliest) is the
  instance's own outage (``deaf``): nothing is judged on silence while it lasts;
* the first pod heard after such a gap ends it (``heard`` returns the gap) and ``since``
  moves there: every pod gets a full fault timeout from it, so the pods heard a heartbeat
  interval later are not silent either (``quiet``: how long a pod counts as silent).
* an outage found another way (the server did not answer a PING, a lease renewal failed)
  is ``watch``-ed: ``unwatch`` returns the longest stretch in which no pod was heard from
  the last pod heard before it to its end, the silence that was the bus's. A stretch in
  which pods were heard is one in which the bus carried their heartbeats (a reader that
  merely fell behind: issue 45), so a pod silent then is silent; silence before and after
  the outage counts too.

Every pod silent at once means, at worst, that every pod died: then no live pod holds the
training state and no plan can bring it back, so reading that as deafness costs nothing;
reading deafness as every pod lost costs the job.
"""

from __future__ import annotations

from enum import Enum
from typing import Any


def quiet(last: float | None, since: float, now: float) -> float:
    """How long a pod last heard at ``last`` (None: never) counts as silent at ``now``, its
    silence counted from ``since`` at the earliest."""
    return now - (since if last is None else max(last, since))


class Ear(str, Enum):
    HEARING = "hearing"
    DEAF = "deaf"  # no pod heard for a fault timeout: no pod is silent


class Hearing:
    """One instance's hearing of the pods (on one event loop: not shared between threads)."""

    def __init__(self, fault_timeout: float, now: float) -> None:
        if fault_timeout <= 0:
            raise ValueError(f"fault_timeout must be positive, got {fault_timeout}")
        self.fault_timeout = fault_timeout
        self.since = now                # silence is counted from here at the earliest
        self.last: float | None = None  # when a pod was last heard (any pod)
        self.state = Ear.HEARING
        # outages being watched (``watch``): name -> the longest stretch no pod was heard
        self._watches: dict[str, float] = {}
        self._forgiven = now  # stretches up to here were forgiven (``forgave``): not twice

    def _quiet_from(self) -> float:
        return self.since if self.last is None else max(self.last, self.since)

    def heard(self, at: float) -> float | None:
        """A pod was heard at ``at``. Returns the gap it ends (no pod heard for more than a
        fault timeout before it: silence now counts from ``at``), else None. The first pod
        ever heard ends a gap only where an outage was found (``deaf``) before it: a new
        job's pods start seconds after its services, which is no outage."""
        start, first = self._quiet_from(), self.last is None
        gap = at - start
        if first or at > self.last:
            self.last = at
        if gap > self.fault_timeout and (not first or self.state is Ear.DEAF):
            self.since, self.state = at, Ear.HEARING
            for name in self._watches:  # the caller forgives this gap: not twice
                self._watches[name] = 0.0
            return gap
        if self._watches:
            stretch = at - max(start, self._forgiven)
            for name, longest in self._watches.items():
                if stretch > longest:
                    self._watches[name] = stretch
        return None

    def watch(self, name: str) -> None:
        """An outage (``name``) was found: from now on, and from the last pod heard before
        it, the longest stretch with no pod heard is kept (a second call changes nothing)."""
        self._watches.setdefault(name, 0.0)

    def watching(self, name: str) -> bool:
        return name in self._watches

    def unwatch(self, name: str, now: float) -> float:
        """The outage ``name`` ended at ``now``: the longest stretch no pod was heard in it
        (its last, up to ``now``, included: the only one if it was not watched)."""
        return max(self._watches.pop(name, 0.0),
                   now - max(self._quiet_from(), self._forgiven))

    def forgave(self, now: float) -> None:
        """The caller forgave the silence up to ``now`` (an outage's ``unwatch``): another
        outage watched meanwhile does not count those stretches again."""
        self._forgiven = max(self._forgiven, now)
        for name in self._watches:
            self._watches[name] = 0.0

    def listening_from(self, at: float) -> None:
        """This instance could not hear anything until ``at`` (its feed was cut: a view that
        stopped coming): silence counts from ``at`` at the earliest."""
        if at > self.since:
            self.since, self.state = at, Ear.HEARING

    def deaf(self, now: float) -> bool:
        """No pod heard for a fault timeout: the silence is this instance's own (DEAF until
        a pod is heard)."""
        self.state = Ear.DEAF if now - self._quiet_from() > self.fault_timeout else Ear.HEARING
        return self.state is Ear.DEAF

    def status(self, now: float) -> dict[str, Any]:
        return {"state": self.state.value, "quiet_s": round(now - self._quiet_from(), 3),
                "since_s": round(now - self.since, 3)}
