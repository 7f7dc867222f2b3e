"""Members to plan out at a step boundary, kept in KV ``departures`` so a scaler taking the
lease goes on with the notices the last one had not planned yet: ``leaving`` (a preemption
notice, a straggler with a spare to swap in) and ``sharing`` (a straggler without one: its
micro-batches shared out to the others)."""

from __future__ import annotations

from typing import Any

from nats.js.errors import KeyNotFoundError, NotFoundError

from schemas.policy import DEPARTURES_KEY, Departure, Departures


class DepartureBook:
    """(Under the scaler's lock.) Read once per lease term (``reset`` on taking it),
    written when it changes."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self.kv: Any = None  # the job's bucket, set when the scaler starts
        # pod -> (why, the fault's incident or None): "preempted", "straggler"
        self.preempting: dict[str, tuple[str, str | None]] = {}
        # stragglers without a spare: pod -> (slowness, incident)
        self.sharing: dict[str, tuple[float, str]] = {}
        self.loaded = False
        self.saved: Departures | None = None

    def reset(self) -> None:
        self.loaded = False

    def now(self) -> Departures:
        return Departures(
            leaving=[Departure(pod=p, why=w, incident=i)
                     for p, (w, i) in sorted(self.preempting.items())],
            sharing=[Departure(pod=p, why="straggler", incident=i, slowness=max(1.0, r))
                     for p, (r, i) in sorted(self.sharing.items())])

    async def sync(self) -> None:
        if not self.loaded:
            self.loaded = True
            try:
                entry = await self.kv.get(DEPARTURES_KEY)
                stored = (Departures.model_validate_json(entry.value) if entry.value
                          else Departures())
            except (KeyNotFoundError, NotFoundError):
                stored = Departures()
            except ValueError as e:
                self.log.error("KV departures do not validate; ignoring them",
                               error=str(e)[:300])
                stored = Departures()
            for d in stored.leaving:
                self.preempting.setdefault(d.pod, (d.why, d.incident))
            for d in stored.sharing:
                self.sharing.setdefault(d.pod, (d.slowness or 1.0, d.incident or ""))
            if stored.leaving or stored.sharing:
                self.log.info("notices taken over from KV", leaving=len(stored.leaving),
                              sharing=len(stored.sharing))
            self.saved = stored
        now = self.now()
        if now != self.saved:
            try:
                await self.kv.put(DEPARTURES_KEY, now.model_dump_json().encode())
            except Exception as e:  # kept in memory; written again at the next decision
                self.log.warning("could not write KV departures", error=str(e)[:200])
                return
            self.saved = now
