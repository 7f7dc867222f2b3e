"""The supervisor's side of ``ceaseless inject`` (issue 41): every injection is answered.

The supervisor signals what it executes itself: kill (SIGKILL), hang (SIGSTOP: the whole
process stops, heartbeats included, as a stuck node would) and resume (SIGCONT), and
answers on ``decision``. The rest, and anything at a step, its pod runs and answers itself
(``agent/inject.py``); refused here is only what no pod could answer: injection not
enabled, a rank nobody holds, a pod that is not running. A pod's refusal reaches `up`'s
log from here too (the pod's own log is not the operator's). A host's injection
(host-loss, partition, host-return: issue 42) goes to ``act.on_host_inject``, set by `up` when it runs
emulated hosts, which returns a refusal or None; without one it is refused.
"""

from __future__ import annotations

import signal
from typing import Any

from schemas.messages import HOST_ACTIONS, Decision, Inject, InjectAction, Plan
from plumbing import logs
from plumbing.bounded import BoundedSet
from plumbing.bus import Envelope
from plumbing.plan_wire import read_value
from schemas import PLAN_KEY

log = logs.get("actuator")


class InjectDesk:
    def __init__(self, act: Any) -> None:
        self.act = act  # the LocalActuator (or RayActuator): plan, running, kill, signal
        self._passed = BoundedSet(1024)  # request ids handed to a pod: its answer is logged

    async def on_inject(self, inj: Inject, env: Envelope) -> None:
        act = self.act
        if not act.allow_inject:
            return await self._answer(inj, "the job does not enable injection")
        if inj.action in HOST_ACTIONS:
            handler = getattr(act, "on_host_inject", None)
            if handler is None:
                return await self._answer(inj, "this job runs no emulated hosts "
                                               "(`ceaseless up --hosts H`)")
            try:
                refusal = await handler(inj)
            except Exception as e:  # a failed cut or kill: said, never a crash
                refusal = f"failed: {type(e).__name__}: {str(e)[:300]}"
            return await self._answer(inj, refusal, host=inj.host)
        pod = inj.pod
        if pod is None:
            plan = await self._plan_naming(inj.rank)
            pod = plan.pod_of(inj.rank) if plan is not None else None
            if pod is None:
                return await self._answer(inj, f"no member holds rank {inj.rank} " + (
                    "yet: the job has no plan" if plan is None else f"in plan g{plan.generation}"))
        if pod not in act.running():
            return await self._answer(inj, f"{pod} is not running")
        if inj.by_pod:
            self._passed.add(inj.request_id)
            log.info("injection passed to its pod, which answers", pod=pod,
                     action=inj.action.value, at_step=inj.at_step)
            return
        log.info("inject", action=inj.action.value, pod=pod)
        if inj.action == InjectAction.kill:
            ok = await act.kill(pod)
        else:
            ok = act.signal(pod, signal.SIGSTOP if inj.action == InjectAction.hang
                            else signal.SIGCONT)
        await self._answer(inj, None if ok else f"{pod} is not running", pod)

    async def on_decision(self, d: Decision, env: Envelope) -> None:
        """A pod's answer to an injection passed to it, in `up`'s log."""
        if d.request_id not in self._passed:
            return
        if d.accepted:
            log.info("injection accepted", reason=d.reason, pods=d.pods)
        else:
            log.warning("injection refused", reason=d.reason, pods=d.pods)

    async def _plan_naming(self, rank: int | None) -> Plan | None:
        """The newest plan, from the KV when ours does not name ``rank`` (the scaler writes
        the KV before it publishes: the plan may be on its way to us)."""
        plan = self.act.plan
        if plan is not None and plan.pod_of(rank) is not None:
            return plan
        try:
            kv = await self.act.bus.kv()
            stored = await read_value(kv, (await kv.get(PLAN_KEY)).value, plan)
        except Exception:
            return plan  # no plan stored yet, or unreadable: ours stands
        if plan is None or stored.generation > plan.generation:
            self.act.plan = plan = stored
        return plan

    async def _answer(self, inj: Inject, refusal: str | None, pod: str | None = None,
                      host: str | None = None) -> None:
        sig = {InjectAction.kill: "SIGKILL", InjectAction.hang: "SIGSTOP"}.get(inj.action,
                                                                             "SIGCONT")
        if refusal is None and host is not None:
            reason = f"inject {inj.action.value}: host {host} " + (
                "lost (link cut, every process killed)" if inj.action == InjectAction.host_loss
                else "returned (its server and instances start again)"
                if inj.action == InjectAction.host_return else f"cut off for {inj.for_s:g}s")
        elif refusal is None:
            reason = f"inject {inj.action.value}: {sig} sent to {pod}"
        else:
            reason = f"inject {inj.action.value}: {refusal}"
            log.warning("injection refused", action=inj.action.value, reason=refusal,
                        rank=inj.rank, pod=inj.pod, host=inj.host)
        await self.act.bus.publish(self.act.bus.subjects.decision, Decision(
            request_id=inj.request_id, accepted=refusal is None, reason=reason,
            pods=[pod] if pod else [],
            generation=self.act.plan.generation if self.act.plan is not None else None))
