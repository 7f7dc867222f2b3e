"""The scaler's view of the pods (one job: who is alive, where, at which step): rebuilt
from heartbeats (the monitor's health view or the pods' own), lifecycle exits and the
faults the scaler accepted, and whether it hears the pods at all (``hearing``: no pod heard
for a fault timeout is the scaler's own outage, services/common/hearing.py). No I/O: the
scaler feeds it and asks it."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

from plumbing.bounded import BoundedSet
from services.common.hearing import Ear, Hearing, quiet
from schemas.messages import MAX_PODS, AgentState, Heartbeat, Lifecycle, Plan, Role
from schemas.timeouts import VIEW_INTERVAL

GONE_STATES = (AgentState.done, AgentState.leaving)
MAX_TRACKED = MAX_PODS

Ignore = Callable[..., None]  # Service._ignore: (subject, reason, level=..., **kw)


@dataclass
class PodSeen:
    role: Role
    generation: int
    state: AgentState
    rank: int | None
    last: float  # monotonic time of the last heartbeat
    step: int = -1
    step_time: float | None = None  # the agent's median, or estimated from the view's steps
    since: float = 0.0  # monotonic time this generation was first heard of


def now_alive(seen: PodSeen, fault_timeout: float) -> bool:
    return time.monotonic() - seen.last <= fault_timeout


class Liveness:
    """(On the event loop only.) ``pods``: the last heartbeat of each pod; ``dead``: faulted
    or exited non-zero, never used again; ``dropped``: declared faulted while not a member
    (``dropped_n`` counts additions, so a decision pass sees something new); ``done``:
    exited 0, or a released spare."""

    def __init__(self, fault_timeout: float, ignore: Ignore, log: Any) -> None:
        self.fault_timeout = fault_timeout
        self._ignore = ignore
        self.log = log
        self.pods: dict[str, PodSeen] = {}
        self.dead = BoundedSet(MAX_TRACKED)
        self.dropped = BoundedSet(MAX_TRACKED)
        self.dropped_n = 0
        self.done = BoundedSet(MAX_TRACKED)
        self._dead_logged = BoundedSet(MAX_TRACKED)
        self.hearing = Hearing(fault_timeout, time.monotonic())
        # until when the heartbeats' source has been heard (HeartbeatFeed.horizon): silence
        # is measured up to there, never over a stretch the scaler could not listen
        self.horizon: Callable[[float], float] = lambda now: now

    # ------------------------------------------------------------------ inputs
    def heartbeat(self, hb: Heartbeat, subject: str, age: float = 0.0) -> bool:
        """True when a decision is due now (a pod appeared, or entered a generation or
        changed state: capacity may suffice, a transition in flight may be complete)."""
        self._hear(time.monotonic() - age)  # (a faulted pod's too: the bus carries)
        seen = self.pods.get(hb.pod)
        if hb.pod in self.dead:
            if hb.pod not in self._dead_logged:  # it heartbeats until killed: log once
                self._dead_logged.add(hb.pod)
                self._ignore(subject, "heartbeat of a faulted pod", pod=hb.pod)
            return False
        if seen is not None and hb.generation < seen.generation:
            self._ignore(subject, f"stale generation {hb.generation} < {seen.generation}",
                         level="debug", pod=hb.pod)
            return False
        new = (seen is None or now_alive(seen, self.fault_timeout) is False
               or seen.generation != hb.generation or seen.state != hb.state)
        if seen is None and len(self.pods) >= MAX_TRACKED:
            self.forget_silent()
        same = seen is not None and seen.generation == hb.generation
        last = time.monotonic() - age
        self.pods[hb.pod] = PodSeen(role=hb.role, generation=hb.generation, state=hb.state,
                                    rank=hb.rank, last=last, step=hb.step,
                                    step_time=hb.step_time or (seen.step_time if same else None),
                                    since=seen.since if same else last)
        return new

    def beats(self, pods: list[str], gens: list[int], steps: list[int],
              ages: list[float]) -> bool:
        """The monitor's compact listing: liveness and steps of pods already known here (a
        pod in another generation waits for its full heartbeat). True: one came back."""
        now, ft, kick = time.monotonic(), self.fault_timeout, False
        for pod, g, step, age in zip(pods, gens, steps, ages):
            seen = self.pods.get(pod)
            if seen is None or seen.generation != g or step < seen.step:
                continue
            last = now - age
            if last > seen.last:
                self._hear(last)
                kick = kick or now - seen.last > ft  # silent until now: alive again
                if seen.step_time is None and step > seen.step >= 0:
                    # full heartbeats (with the agent's step time) come seldom in the view
                    seen.step_time = (last - seen.last) / (step - seen.step)
                seen.last, seen.step = last, step
        return kick

    def _hear(self, at: float) -> None:
        gap = self.hearing.heard(at)
        if gap is not None:
            # from now, not from the heartbeat's own time: one aged by a view (a monitor cut
            # off too) would leave the pods heard after it less than a fault timeout, and a
            # spare not heard yet was judged dead at once (CI: a shrink for "no live spare")
            self.hearing.listening_from(time.monotonic())
            if self.pods:
                self.log.warning("pods heard again after none was: silence counts from now",
                                 silent_s=round(gap, 3))

    def resumed(self, at: float) -> None:
        """The heartbeats' source was cut until ``at`` (the monitor's view stopped coming):
        every pod gets a full fault timeout from ``at``."""
        self.hearing.listening_from(at)
        self.log.info("listening to the pods again: silence counts from now")

    def quiet(self, s: PodSeen | None, now: float) -> float:
        """How long a pod counts as silent: up to the feed's horizon, from the later of its
        last heartbeat and the scaler's ``hearing.since``."""
        return quiet(s.last if s else None, self.hearing.since, self.horizon(now))

    def deaf(self, now: float) -> bool:
        """No pod heard for a fault timeout: the scaler's own outage (its server's route to
        the pods' may be stuck), so its view judges no pod silent (logged once)."""
        was = self.hearing.state
        if not self.hearing.deaf(self.horizon(now)):
            return False
        if was is not Ear.DEAF:
            self.log.warning("no pod heard at all: the silence is the scaler's own; no member "
                             "is judged silent until a pod is heard", pods=len(self.pods))
        return True

    def forget_silent(self) -> None:
        now = time.monotonic()
        for pod in [p for p, s in self.pods.items() if now - s.last > 10 * self.fault_timeout]:
            del self.pods[pod]

    def exited(self, ev: Lifecycle) -> None:
        seen = self.pods.pop(ev.pod, None)
        if ev.exit_code == 0 or (seen is not None and seen.state == AgentState.done):
            # (a non-zero exit after the pod said it was done is its script's failure after
            # the loop, not a fault: nothing to plan, as the health monitor decides too)
            self.done.add(ev.pod)
        else:
            self.dead.add(ev.pod)  # the health monitor's fault triggers the plan
        self.log.info("pod exited", pod=ev.pod, exit_code=ev.exit_code)

    def drop(self, pod: str) -> None:
        """Declared faulted while not a member: never used again."""
        self.dead.add(pod)
        self.dropped.add(pod)
        self.dropped_n += 1
        self.pods.pop(pod, None)

    def released(self, pod: str) -> None:
        """A released spare: not a spare any more, whether or not it was stopped."""
        self.done.add(pod)
        self.pods.pop(pod, None)

    # ------------------------------------------------------------------ views
    def alive(self, pod: str, now: float) -> bool:
        s = self.pods.get(pod)
        return (s is not None and pod not in self.dead and pod not in self.done
                and s.state not in GONE_STATES and self.quiet(s, now) <= self.fault_timeout)

    def alive_spares(self, plan: Plan | None, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        members = {m.pod for m in plan.members} if plan else set()
        fenced = set(plan.fenced) if plan else set()
        return sorted(
            p for p, s in self.pods.items()
            if self.alive(p, now) and p not in members and p not in fenced
            and s.state == AgentState.waiting
            and (plan is not None or s.role == Role.spare))

    def alive_waiting_workers(self, now: float) -> list[str]:
        return sorted(p for p, s in self.pods.items()
                      if self.alive(p, now) and s.role == Role.worker
                      and s.state == AgentState.waiting)

    def gone(self, pod: str, now: float) -> bool:
        if pod in self.done or pod in self.dead:
            return True
        s = self.pods.get(pod)
        if s is None:
            return True
        return self.quiet(s, now) > self.fault_timeout or (
            s.state in GONE_STATES and now - s.last > 1.0)

    def not_entered(self, plan: Plan) -> list[str]:
        """Members of ``plan`` not (yet) training in its generation: a transition in flight."""
        out = []
        for m in plan.members:
            s = self.pods.get(m.pod)
            if s is None or s.generation < plan.generation or s.state not in (
                    AgentState.training, AgentState.done):  # done: it trained to the end
                if m.pod not in self.done:
                    out.append(m.pod)
        return out

    def apply_step(self, plan: Plan, now: float, lead_s: float) -> int | None:
        """The first step of the new generation: after the step the members are computing
        now, far enough ahead (``lead_s``) for the plan to reach all of them. None while no
        member's step time is known yet and its generation is young: the heartbeats seen
        lag, and with fast steps a guess lands in the past (the members then discard the
        step they were computing; seen in CI as a release at step 2 placed while the
        members computed step 7)."""
        best, times, young = -1, [], False
        for m in plan.members:
            s = self.pods.get(m.pod)
            if s is None:
                continue
            young = young or now - s.since < 2 * VIEW_INTERVAL + 0.5
            est = s.step
            if s.step_time:  # heartbeats lag: estimate where the member is by now
                est += int((now - s.last) / s.step_time)
                times.append(s.step_time)
            best = max(best, est)
        times.sort()
        st = times[len(times) // 2] if times else None
        if st is None and young:
            return None
        ahead = 1 + (max(1, math.ceil(lead_s / st)) if st else 2)
        return max(0, best + ahead)
