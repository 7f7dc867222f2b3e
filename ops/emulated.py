"""`ceaseless up --hosts H`: the job's parts on emulated hosts (issue 42).

``HostRun`` holds the hosts (``hosts.py``), where everything went (``placement.py``) and
each host's state, and does what `up` needs of them: the nats-servers' addresses and how
each is run, a service instance's and a pod's command prefix and environment (its host's
address for gloo), a host's injection (``ceaseless inject host-loss|partition``: the
actuator's ``on_host_inject``) and ``hosts.json`` in the run dir, which `ceaseless status`
reads. A host's state moves UP -> CUT -> UP (a partition healed) or UP -> LOST, and LOST ->
UP only by ``inject host-return`` (a replacement machine with its name, address and disk:
its server and instances are started again by `up`'s own restart loops, which skip only
what is on a lost host).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from enum import Enum
from pathlib import Path
from typing import Any

from schemas.messages import Inject, InjectAction
from plumbing import logs
from services.actuator.base import PodHost

from .hosts import Hosts, Unavailable, kill_all
from .placement import Placement, host_for_new_pod

log = logs.get("hosts")

HOSTS_FILE = "hosts.json"
# a host's loss waits this long after its injection is answered (the answer may go through
# that host's nats-server)
ANSWER_FIRST_S = 0.2


class HostState(str, Enum):
    up = "up"
    cut = "cut"     # partitioned: its processes alive, its link down
    lost = "lost"   # every process killed: nothing is restarted or placed there again


class HostRun:
    def __init__(self, hosts: Hosts, placement: Placement, run_dir: Path) -> None:
        self.hosts, self.placement, self.run_dir = hosts, placement, run_dir
        self.state = {h: HostState.up for h in hosts.names()}
        self.pods: dict[str, str] = {}  # running pods -> host
        self.sup: Any = None   # ServiceSupervisor, BusServers, actuator: set by `up`
        self.srv: Any = None
        self.act: Any = None
        self.events: list[str] = []  # for `up`'s log
        self._heals: set[asyncio.Task] = set()
        self._losing: set[str] = set()  # lost, its processes not killed yet (answer first)

    # ------------------------------------------------------------------ placing
    def servers(self) -> tuple[list[str], list[list[str]]]:
        """(address, command prefix) of each nats-server."""
        hs = [self.hosts[h] for h in self.placement.servers]
        return [h.addr for h in hs], [h.argv([]) for h in hs]

    def instance_prefix(self, instance: str) -> list[str]:
        return self.hosts[self.placement.instances[instance]].argv([])

    def instance_down(self, instance: str) -> bool:
        return self.state[self.placement.instances[instance]] == HostState.lost

    def where(self, pod: str) -> PodHost:
        """A pod's host: its placement, else (a pod started later) the live host with the
        fewest pods. Its prefix, gloo's address (the host's) and its namespace (a pod forked
        from the zygote is forked into it)."""
        h = self.placement.pods.get(pod)
        live = [x for x, s in self.state.items() if s == HostState.up
                and (not self.placement.pod_hosts or x in self.placement.pod_hosts)]
        if h is None or h not in live:
            h = host_for_new_pod(self.pods, live)
        self.pods[pod] = h
        self.write()
        host = self.hosts[h]
        # CEASELESS_HOST: the pods of a host send their heartbeats in one message through
        # one of them (agent/hostbeat.py, issue 45)
        return PodHost(host.argv([]), {"CEASELESS_GLOO_HOSTNAME": host.addr,
                                       "CEASELESS_HOST": h}, host.netns)

    def exited(self, pod: str, code: int) -> None:
        if self.pods.pop(pod, None) is not None:
            self.write()

    # ------------------------------------------------------------------ injections
    async def on_inject(self, inj: Inject) -> str | None:
        """Run a host's injection; a refusal (why), or None."""
        name = inj.host or ""
        if name not in self.state:
            return f"no host {name!r} (hosts: {', '.join(self.state)})"
        if inj.action == InjectAction.host_return:
            return self.restore(name)
        if self.state[name] != HostState.up:
            return f"host {name} is {self.state[name].value}"
        if inj.action == InjectAction.partition:
            if (why := self.hosts.can_cut()) is not None:
                return why
            self.state[name] = HostState.cut
            # answered first, as a loss is: `up`'s own client may be on that host's server
            t = asyncio.create_task(self._cut_soon(name, float(inj.for_s or 0)))
            self._heals.add(t)
            t.add_done_callback(self._heals.discard)
            return None
        self.state[name] = HostState.lost  # from now on nothing is placed or restarted there
        self._losing.add(name)
        # answered first: the server the answer goes through may be on that host
        t = asyncio.create_task(self._lose_soon(name))
        self._heals.add(t)
        t.add_done_callback(self._heals.discard)
        return None

    async def _cut_soon(self, name: str, for_s: float) -> None:
        await asyncio.sleep(ANSWER_FIRST_S)
        try:
            self.hosts.cut(name)
        except Unavailable as e:
            self.state[name] = HostState.up
            self._say(f"host {name} could not be cut off: {e}")
            self.write()
            return
        self._say(f"host {name} cut off for {for_s:g}s (its processes run on)")
        self.write()
        await self._heal_after(name, for_s)

    async def _lose_soon(self, name: str) -> None:
        await asyncio.sleep(ANSWER_FIRST_S)
        try:
            self.lose(name)
        finally:
            self._losing.discard(name)

    def restore(self, name: str) -> str | None:
        """A lost host back (``inject host-return``): its link healed where it was cut, then
        it is UP again, so `up`'s loops start its nats-server again (same ports and store:
        it rejoins and catches up) and its service instances (standbys now), and new pods
        may go there. A refusal (why), or None."""
        if self.state[name] != HostState.lost:
            return f"host {name} is {self.state[name].value}: only a lost host returns"
        if name in self._losing:
            return f"host {name} is being lost: its processes are not killed yet"
        if self.hosts.is_cut(name):
            self.hosts.heal(name)
        if self.srv is not None:
            for s in self.placement.on(name)["servers"]:
                self.srv.down.discard(int(s[1:]) - 1)
        self.state[name] = HostState.up
        self._say(f"host {name} returned: link up, its server and service instances start "
                  "again, pods may be placed there")
        self.write()
        return None

    def lose(self, name: str) -> list[int]:
        """Cut the host's link (where it has one), then kill every process on it at once,
        by pid; nothing of it is restarted. Returns the pids killed."""
        if self.hosts.mode == "netns":
            self.hosts.cut(name)
        self.state[name] = HostState.lost
        pids: list[int] = []
        on = self.placement.on(name)
        if self.srv is not None:
            for s in on["servers"]:
                i = int(s[1:]) - 1
                self.srv.down.add(i)
                if self.srv.servers[i].proc.poll() is None:
                    pids.append(self.srv.servers[i].proc.pid)
        if self.sup is not None:
            for inst in on["instances"]:
                p = self.sup.procs.get(inst)
                if p is not None and p.poll() is None:
                    pids.append(p.pid)
        if self.act is not None:
            running = self.act.running()
            pids += [running[p] for p, h in self.pods.items() if h == name and p in running]
        hit = kill_all(pids)
        self._say(f"host {name} lost: link cut, {len(hit)} processes killed "
                  f"({', '.join(on['servers'] + on['instances'])}, pods "
                  f"{', '.join(sorted(p for p, h in self.pods.items() if h == name)) or '-'})")
        self.write()
        return hit

    async def _heal_after(self, name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        if self.state.get(name) == HostState.cut:
            self.hosts.heal(name)
            self.state[name] = HostState.up
            self._say(f"host {name} healed after {seconds:g}s")
            self.write()

    def _say(self, what: str) -> None:
        log.warning(what)
        self.events.append(what)

    # ------------------------------------------------------------------ status, end
    def describe(self) -> dict[str, Any]:
        urls = self.srv.url.split(",") if self.srv is not None else []
        return {
            "mode": self.hosts.mode, "why": self.hosts.why if self.hosts.mode != "netns" else "",
            "hosts": {h.name: {"addr": h.addr, "netns": h.netns, "state": self.state[h.name].value}
                      for h in self.hosts.hosts},
            "servers": {f"s{i + 1}": {"host": h, "url": urls[i] if i < len(urls) else None}
                        for i, h in enumerate(self.placement.servers)},
            "instances": dict(self.placement.instances),
            "pods": dict(sorted(self.pods.items())),
            # where pods may go: every host, or those that are not control hosts
            "pod_hosts": list(self.placement.pod_hosts or self.hosts.names()),
            "updated": time.time(),
        }

    def write(self) -> None:
        p = self.run_dir / HOSTS_FILE
        tmp = p.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.describe(), indent=2) + "\n")
        os.replace(tmp, p)

    async def close(self) -> None:
        for t in list(self._heals):
            t.cancel()
        await asyncio.gather(*self._heals, return_exceptions=True)
        self.hosts.destroy()


def read_hosts(run_dir: str | Path) -> dict[str, Any] | None:
    p = Path(run_dir) / HOSTS_FILE
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


async def bus_leaders(bus: Any) -> dict[str, Any]:
    """Each stream's leader and replicas as JetStream's API reports them (a KV bucket is
    the stream ``KV_<bucket>``); server names ``<cluster>-sK`` are given as ``sK``."""
    def short(name: str | None) -> str | None:
        return name.rsplit("-", 1)[-1] if name else name

    out: dict[str, Any] = {}
    for si in await bus.js.streams_info():
        c = si.cluster
        out[si.config.name] = {
            "leader": short(c.leader) if c is not None else None,
            "replicas": [{"server": short(r.name), "current": r.current}
                         for r in (c.replicas or [])] if c is not None else [],
        }
    return out


def placement_status(hosts: dict[str, Any], leases: dict[str, Any]) -> dict[str, Any]:
    """``hosts.json`` with each instance's host and whether it is the active one (its lease)."""
    active = {v["active"] for v in leases.values() if v}
    return {**hosts, "instances": {i: {"host": h, "active": i in active}
                                   for i, h in hosts.get("instances", {}).items()}}


def active_servers(placement: Placement, services: list[str]) -> list[int]:
    """Indexes of the nats-servers on the host of the active service instances (instance 0
    of each service starts active)."""
    active = {placement.instances[s] for s in services if s in placement.instances}
    return [i for i, h in enumerate(placement.servers) if h in active]


async def lead_elsewhere(bus: Any, avoid: set[str], timeout: float, log: Any) -> dict[str, Any]:
    """Ask every stream (and KV bucket) led by a server in ``avoid`` (full server names) to
    elect another leader, until none is or ``timeout``. Why: a standby can take a lease, and
    anyone write a plan, only once the bucket has a leader. Where the host of the active
    instances also held the leaders, its loss cost a Raft election (nats-server's 4-9 s,
    not configurable) before the standbys could act: the downtime of a lost control-plane
    host was the election's, not the lease's. Best effort: a leader that stays is logged."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    asked: dict[str, float] = {}  # stream -> when its leader was last asked to step down
    stay: list[str] = []
    while True:
        stay = [si.config.name for si in await bus.js.streams_info()
                if si.cluster is not None and si.cluster.leader in avoid]
        if not stay or loop.time() > deadline:
            break
        for name in stay:  # again after 2 s: a new election may have picked it again
            if loop.time() - asked.get(name, -10.0) < 2.0:
                continue
            asked[name] = loop.time()
            try:
                await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{name}", b"",
                                     timeout=2.0)
            except Exception as e:  # answered late or refused: the next look decides
                log.warning("stream leader step-down not answered", stream=name,
                            error=str(e)[:200])
        await asyncio.sleep(0.25)
    if stay:
        log.warning("stream leaders still on the active instances' server", streams=stay)
    return {"moved": sorted(set(asked) - set(stay)), "stayed": stay}
