"""The host events of ``ceaseless chaos --kinds host`` (issue 42): whole emulated hosts lost,
partitioned and given back, on a chaos run that ``ceaseless up`` starts with
``--hosts 3 --bus-servers 3 --standbys 1`` (``UP_ARGS``: h1 runs a nats-server, the active
instance of every service and rank 0; ops/placement.py).

* ``host_loss``: a host (any of them, h1 included: ``pick_host``) is lost (``inject
  host-loss``: its link cut, every process on it killed at once); survived when the job
  trains on without its members. Then it returns (``inject host-return``: a replacement
  machine with its name, address and disk) and the event ends only once its nats-server is
  a current replica of every stream again: so a later host event can lose another host
  (or the same) with a quorum left, "a second host lost after the first was replaced".
* ``partition``: a host's link cut for ``PARTITION_S`` with its processes alive
  (namespaces only: ``expand`` leaves it out in loopback mode); its members fenced and
  replaced, or, if the heal came before any fault was declared, training paused and went
  on; survived when the job trains on after the heal and the host's server is current.
* ``host_during_recovery``: a member killed, and as soon as the replacement plan is out
  (the promoted spare entering it), a host lost: the promoted spare's, where the spares
  elsewhere can replace its members; then the host returns as above.

A host is only lost when the ready spares on the other hosts can take every member it
holds (``pick_host``): else the job shrinks, and the result is no longer comparable bit for
bit with the fault-free run. Which host is a pure function of the placement and the
event's seeded draw; the schedule itself stays ops/chaos.py's ``make_schedule``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

HOST_KINDS = ("host_loss", "partition", "host_during_recovery")
HOST_GROUP = "host"            # `--kinds host`: every host kind this machine can run
NEEDS_NAMESPACES = ("partition",)
SPARES_NEEDED = {"host_loss": 1, "partition": 1, "host_during_recovery": 2}
UP_ARGS = ["--hosts", "3", "--bus-servers", "3", "--standbys", "1"]
# The done-when list's partition (issue 42); one that heals before anything is declared
# pauses training, which is survived too.
PARTITION_S = 10.0
ANSWER_TIMEOUT = 30.0   # `up`'s answer to a host injection (its client may be failing over)
CURRENT_TIMEOUT = 120.0  # a returned or healed host's server a current replica again
PICK_TIMEOUT = 120.0     # a host whose members the spares elsewhere can replace


class HostEventFailed(RuntimeError):
    """A host event not survived (the chaos run records it as a failure, as any other)."""


def expand(kinds: list[str], why_no_namespaces: str | None) -> list[str]:
    """``--kinds`` with ``host`` replaced by the host kinds this machine can run: all of
    them with network namespaces, else (``why_no_namespaces``) not the partition."""
    out: list[str] = []
    for k in kinds:
        if k == HOST_GROUP:
            out += [h for h in HOST_KINDS
                    if why_no_namespaces is None or h not in NEEDS_NAMESPACES]
        else:
            out.append(k)
    return list(dict.fromkeys(out))


def namespaces_missing() -> str | None:
    """Why ``up --hosts`` would fall back to loopback addresses here (None: it would not)."""
    from .hosts import Netns, Unavailable

    try:
        Netns.check()
    except Unavailable as e:
        return str(e)
    return None


def up_args(kinds: list[str]) -> list[str]:
    """What the chaos run's ``up`` needs for these event kinds."""
    return list(UP_ARGS) if set(kinds) & set(HOST_KINDS) else []


def pick_host(up: list[str], pods: dict[str, str], members: set[str], spares: set[str],
              u: float, prefer: str | None = None) -> str | None:
    """The host to lose: among the hosts ``up``, those whose members (``pods``: pod ->
    host) the ready ``spares`` on the other hosts can all replace; ``prefer`` if it is one,
    else the ``u``-th (u in [0, 1)) of those holding a member (a host of spares and standbys
    only when none does: replacements fill the least loaded hosts, so such a host is often
    the one just given back). None: no host can be lost without a shrink."""
    def on(h: str) -> int:
        return sum(1 for p in members if pods.get(p) == h)

    ok = [h for h in up if on(h) <= sum(1 for p in spares if pods.get(p) != h)]
    if not ok:
        return None
    if prefer in ok:
        return prefer
    ok = [h for h in ok if on(h)] or ok
    return ok[int(u * len(ok)) % len(ok)]


# ----------------------------------------------------------------------------- the run
def _hosts(ch: Any) -> dict[str, Any]:
    from .emulated import read_hosts

    return read_hosts(ch.c.job_dir()) or {}


def _state(ch: Any, name: str) -> str | None:
    return (_hosts(ch).get("hosts") or {}).get(name, {}).get("state")


def _choice(ch: Any, u: float, prefer: str | None = None) -> str | None:
    hosts = _hosts(ch)
    plan = ch.plan()
    if not hosts or plan is None:
        return None
    members = {m.pod for m in plan.members}
    up = [h for h, v in hosts.get("hosts", {}).items() if v.get("state") == "up"]
    spares = {h.pod for h in ch.spares()} - members
    return pick_host(up, hosts.get("pods", {}), members, spares, u, prefer)


def _on(ch: Any, name: str) -> tuple[set[str], set[str]]:
    """(members of the latest plan, every pod) on host ``name``."""
    pods = {p for p, h in _hosts(ch).get("pods", {}).items() if h == name}
    plan = ch.plan()
    return {m.pod for m in plan.members} & pods, pods


async def _host_inject(ch: Any, action: str, name: str, for_s: float | None = None,
                       state: str = "") -> None:
    """Publish a host injection and wait for `up`'s answer (or, if this tool's client
    missed it while failing over, for hosts.json to show the host in ``state``)."""
    from schemas.messages import Inject, InjectAction

    inj = Inject(action=InjectAction(action), host=name, for_s=for_s)
    n = len(ch.decisions)
    await ch.c.bus.publish(ch.c.bus.subjects.inject, inj)
    d = await ch.wait(lambda: next((x for x in ch.decisions[n:] if x.request_id == inj.request_id),
                                   None) or (state and _state(ch, name) == state),
                      ANSWER_TIMEOUT, f"`up`'s answer to inject {action} --host {name}")
    if d is not True and not d.accepted:
        raise HostEventFailed(f"inject {action} --host {name} refused: {d.reason}")


async def _server_current(ch: Any, name: str) -> str:
    """Wait until the servers of host ``name`` are current replicas (or leaders) of every
    stream and KV bucket; their names."""
    from .emulated import bus_leaders

    servers = [s for s, v in _hosts(ch).get("servers", {}).items() if v.get("host") == name]
    if not servers:
        return ""
    deadline = time.monotonic() + CURRENT_TIMEOUT
    last: Any = None
    while True:
        try:
            last = await bus_leaders(ch.c.bus)
        except Exception as e:  # a leader election under way
            last = f"{type(e).__name__}"
        if isinstance(last, dict) and last and all(
                v["leader"] in servers or all(any(r["server"] == s and r["current"]
                                                  for r in v["replicas"]) for s in servers)
                for v in last.values()):
            return ", ".join(servers)
        if time.monotonic() > deadline:
            raise HostEventFailed(f"{', '.join(servers)} of {name} not current again after "
                               f"{CURRENT_TIMEOUT:.0f}s: {last}")
        await asyncio.sleep(0.5)


async def _give_back(ch: Any, name: str, out: Any) -> None:
    """``inject host-return``, then wait for its server to be current again."""
    t = time.monotonic()
    # the loss first, whole: `up` kills the host's processes right after it answers, and
    # until then a return is refused while hosts.json still says "up", which the wait for
    # the answer took for the return (the host stayed lost; the next host loss then took the
    # bus's quorum, and nothing could be planned again)
    await ch.wait(lambda: _state(ch, name) == "lost", ANSWER_TIMEOUT, f"{name} lost")
    await _host_inject(ch, "host-return", name, state="up")
    servers = await _server_current(ch, name)
    out.detail = "; ".join(x for x in (out.detail, f"{name} returned, "
                           + (f"{servers} current again " if servers else "")
                           + f"in {time.monotonic() - t:.1f}s") if x)


async def _lose(ch: Any, ev: Any, name: str, out: Any, step: int) -> set[str]:
    members, pods = _on(ch, name)
    ch.victims.update(pods)
    await _host_inject(ch, "host-loss", name, state="lost")
    out.injected = True
    what = ", ".join(sorted(pods)) or "no pod"
    out.target = (out.target + " + " if out.target else "") + f"{name} ({what})"
    return members


async def inject(ch: Any, ev: Any, out: Any) -> None:
    """One host event on the running job ``ch`` (an ``ops.chaos.Chaos``)."""
    plan = ch.plan()
    gen, step = plan.generation, ch.step()
    if ev.kind == "host_during_recovery":
        return await _during_recovery(ch, ev, out, gen, step)
    name = await ch.wait(lambda: _choice(ch, ev.u), PICK_TIMEOUT,
                         "a host whose members the spares on other hosts can replace")
    gen, step = ch.plan().generation, ch.step()
    out.at_step = step
    t0 = time.monotonic()
    if ev.kind == "host_loss":
        members = await _lose(ch, ev, name, out, step)
        ch.say(f"#{ev.index} host_loss: {out.target} at step {step} (g{gen})")
        if members:
            await ch._recovered(out, gen, members, step, t0)
        else:
            await ch._progress(out, step, t0)
        await _give_back(ch, name, out)
        return
    if ev.kind != "partition":
        raise HostEventFailed(f"unknown host event {ev.kind!r}")
    members, pods = _on(ch, name)
    await _host_inject(ch, "partition", name, for_s=PARTITION_S, state="cut")
    out.injected, out.target = True, f"{name} ({', '.join(sorted(pods)) or 'no pod'})"
    ch.say(f"#{ev.index} partition: {out.target} for {PARTITION_S:g}s at step {step} (g{gen})")
    await ch.wait(lambda: _state(ch, name) == "up", PARTITION_S + ANSWER_TIMEOUT,
                  f"{name} healed")
    fenced = members - {m.pod for m in ch.plan().members}
    # its pods the monitor declared lost and that still run (a dropped spare waits for
    # ever): removed, as a cluster manager removes what it declared dead; `up` replaces them
    for pod, pid in ch.pods():
        if pod in pods and pod in ch.faulted:
            ch.victims.add(pod)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    await ch._progress(out, max(step, ch.step()), t0)
    out.detail = (f"fenced and replaced: {', '.join(sorted(fenced))}" if fenced else
                  "healed before any member was replaced: training paused and went on")
    servers = await _server_current(ch, name)
    if servers:
        out.detail += f"; {servers} current again"


async def _during_recovery(ch: Any, ev: Any, out: Any, gen: int, step: int) -> None:
    """A member killed; once the plan that replaces it is out, a host lost (the promoted
    spare's where the others can replace its members)."""
    out.at_step = step
    t0 = time.monotonic()
    rank, h = ch._victim(ev)
    ch.victims.add(h.pod)
    try:
        os.kill(h.pid, signal.SIGKILL)
    except ProcessLookupError:
        raise HostEventFailed(f"{h.pod} (pid {h.pid}) is already gone") from None
    out.injected, out.target = True, f"rank {rank} ({h.pod})"
    await ch.wait(lambda: ch.plan().generation > gen or ch.finished(), 60,
                  "the replacement plan")
    new = ch.plan()
    promoted = new.pod_of(rank)
    prefer = _hosts(ch).get("pods", {}).get(promoted or "")
    name = _choice(ch, ev.u2, prefer=prefer)
    victims = {h.pod}
    if name is None or ch.finished():
        out.detail = "no host could be lost without a shrink: the kill only"
        ch.say(f"#{ev.index} host_during_recovery: {out.target} at step {step} (g{gen}); "
               + out.detail)
        await ch._recovered(out, gen, victims, step, t0)
        return
    members = await _lose(ch, ev, name, out, step)
    victims |= members
    ch.say(f"#{ev.index} host_during_recovery: {out.target} at step {step} (g{gen}), the host "
           f"lost while g{new.generation} was entered"
           + (f" (the promoted {promoted}'s)" if name == prefer else ""))
    await ch._recovered(out, new.generation if members else gen, victims, step, t0)
    await _give_back(ch, name, out)
