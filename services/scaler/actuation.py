"""The scaler's requests to the actuator (start, stop, kill), each stamped with the lease
term of the scaler that sends it: the actuator refuses an older term than one it has acted
on (a deposed scaler's), and a standby sends none (issue 42)."""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from plumbing.bus import Bus
from schemas.messages import ActuatorAction, ActuatorCommand, ActuatorReply


class Actuation:
    def __init__(self, bus: Bus, log: Any, term: Callable[[], int | None], *,
                 timeout: float, fence_timeout: float) -> None:
        self.bus = bus
        self.log = log
        self.term = term  # the scaler's current term (None while a standby)
        self.timeout = timeout
        self.fence_timeout = fence_timeout

    async def actuate(self, cmd: ActuatorCommand) -> tuple[list[str], str]:
        """(the pods it names, "") or ([], why not)."""
        term = self.term()
        if term is None:
            return [], "not the lease holder"
        try:
            reply = await self.bus.request(self.bus.subjects.actuator,
                                           cmd.model_copy(update={"term": term}), ActuatorReply,
                                           timeout=self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            return [], f"no actuator answered: {type(e).__name__}"
        return (reply.pods, "") if reply.ok else ([], reply.error or "actuator refused")

    async def fence(self, pod: str, incident: str) -> None:
        """Kill a faulted member (best effort: its peers fence it out of the group anyway)."""
        term = self.term()
        if term is None:  # deposed meanwhile: the holder fences
            return
        cmd = ActuatorCommand(action=ActuatorAction.kill, pod=pod, reason=f"fenced: {incident}",
                              term=term)
        try:
            reply = await self.bus.request(self.bus.subjects.actuator, cmd, ActuatorReply,
                                           timeout=self.fence_timeout)
            self.log.info("fence requested", pod=pod, incident=incident, ok=reply.ok,
                          error=reply.error or None)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("fence failed (best effort)", pod=pod, incident=incident,
                             error=f"{type(e).__name__}: {str(e)[:160]}")
