"""The guards' events of ``ceaseless chaos --guards`` (issue 32): each one goes through the
job's own guard, not around it.

* ``nan``: a non-finite loss on one member at a step a few ahead (``inject nan``): survived
  when every member trained past it; the step must be in the run's ``skipped_steps`` unless
  a later total loss undid it (the restarted job computed it again, clean, from an earlier
  checkpoint: ``nan_outcome``). The fault-free reference then runs *after* the chaos run,
  with the steps the final trajectory skipped made non-finite (skipping a step changes the trajectory: the reference must skip it too), so the result
  is still compared bit for bit.
* ``slow``: one member's compute slowed ``SLOW_FACTOR`` times (``inject slow``): survived
  when the health monitor found the straggler (over ``STRAGGLER_WINDOW`` s) and a spare took
  its rank at a step boundary.
* ``preempt``: a preemption notice with a deadline (``inject preempt``): survived when the
  pod left at a step boundary and a spare took its rank, with no fault incident.
* ``bitflip``: one bit of one member's parameters flipped (``inject bitflip``; the chaos run
  verifies every ``VERIFY_EVERY`` steps): survived when the replicas rolled back and, with
  three or more, the pod that differed was replaced; else when training went on.
"""

from __future__ import annotations

import time
from typing import Any

GUARD_KINDS = ("nan", "slow", "preempt", "bitflip")
SPARES_NEEDED = {"slow": 1, "preempt": 1, "bitflip": 1}
SLOW_FACTOR = 6.0
PREEMPT_DEADLINE = 60.0
VERIFY_EVERY = 10
NAN_AHEAD = 5            # steps ahead of the newest member's: it cannot have passed it yet
STRAGGLER_WINDOW = 3.0     # `up --straggler-window` of a chaos run with `slow` events
STRAGGLER_TIMEOUT = 120.0  # the straggler window and the swap at a step boundary


async def inject(ch: Any, ev: Any, out: Any) -> None:
    """One guard event on the running job ``ch`` (an ``ops.chaos.Chaos``)."""
    from schemas.messages import Inject, InjectAction

    plan = ch.plan()
    gen, step = plan.generation, ch.step()
    t0 = time.monotonic()
    rank, h = ch._victim(ev)
    out.target = f"rank {rank} ({h.pod})"
    bus = ch.c.bus
    if ev.kind == "nan":
        k = step + NAN_AHEAD
        await bus.publish(bus.subjects.inject, Inject(action=InjectAction.nan, pod=h.pod,
                                                      at_step=k))
        ch.nan_steps.append(k)
        ch.nan_events.append((k, len(ch.restarts)))
        out.injected, out.target = True, f"{out.target} at step {k}"
        ch.say(f"#{ev.index} nan: {out.target} (g{gen})")
        await ch._progress(out, k, t0, steps=2)
        return
    ch.victims.add(h.pod)
    if ev.kind == "slow":
        msg = Inject(action=InjectAction.slow, pod=h.pod, factor=SLOW_FACTOR)
    elif ev.kind == "preempt":
        msg = Inject(action=InjectAction.preempt, pod=h.pod, deadline_s=PREEMPT_DEADLINE)
    else:
        msg = Inject(action=InjectAction.bitflip, pod=h.pod)
    await bus.publish(bus.subjects.inject, msg)
    out.injected = True
    ch.say(f"#{ev.index} {ev.kind}: {out.target} at step {step} (g{gen})")
    if ev.kind == "bitflip" and len(plan.members) < 3:  # no majority: rolled back only
        await ch._progress(out, step + VERIFY_EVERY, t0)
        return
    timeout = STRAGGLER_TIMEOUT if ev.kind == "slow" else None
    await ch._recovered(out, gen, {h.pod}, step, t0, timeout=timeout)


async def inject_reference(c: Any, nan_steps: list[int]) -> None:
    """The reference run: the chaos run's non-finite steps, published (to every pod) before
    they come. The verdict checks they were skipped there too."""
    from schemas.messages import Inject, InjectAction

    if not nan_steps:
        return
    await c.wait_for(lambda: any(h.step >= 0 for h in c.hb.values()), 120,
                     "the reference's first step")
    for k in sorted(set(nan_steps)):
        await c.bus.publish(c.bus.subjects.inject,
                            Inject(action=InjectAction.nan, rank=0, at_step=k))


def nan_outcome(injected: list[tuple[int, int]], restarts: list[dict],
                skipped: list[int]) -> tuple[list[int], list[str]]:
    """What the final trajectory must skip, and the failures of the ``nan`` events.

    ``injected``: each non-finite step with the number of total-loss restarts before its
    injection; ``restarts``: ``Chaos.restarts`` (``from_step``: the checkpoint resumed);
    ``skipped``: the final run's ``skipped_steps``. A step after the checkpoint of a later
    restart was undone by that total loss: the restarted job computed it again, clean (the
    injection died with the pods), which is right; every other injected step must be in the
    final skips, and nothing else may be. The reference then skips exactly the final skips,
    so the verdict stays bit for bit whatever the total losses undid."""
    final = sorted(set(skipped))
    failures = []
    for k, before in sorted(set(injected)):
        undone = any(k > (r.get("from_step") if r.get("from_step") is not None else -1)
                     for r in restarts[before:])
        if k not in final and not undone:
            failures.append(f"non-finite step {k} was not skipped (skipped steps {final})")
    extra = sorted(set(final) - {k for k, _ in injected})
    if extra:
        failures.append(f"steps {extra} skipped with no non-finite loss injected there")
    return final, failures


def verdict(s: dict, ref: dict, ch: Any) -> list[str]:
    """The failures of the guards' events: every injected non-finite step skipped unless a
    total loss undid it (``nan_outcome``), and the reference skipping the same."""
    want, out = nan_outcome(ch.nan_events, ch.restarts, s.get("skipped_steps") or [])
    if want and sorted(ref.get("skipped_steps") or []) != want:
        out.append(f"the reference skipped {ref.get('skipped_steps')}, not {want} (it passed "
                   "a step before its injection arrived): not comparable")
    return out
