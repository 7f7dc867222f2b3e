"""Where each part of a job runs over emulated hosts (issue 42): a pure function.

By default the first host runs the first nats-server, the active instance of every service
and rank 0: the worst host to lose. The other hosts take, round-robin, the other servers,
the standby instances, the other ranks and the spares, each kind starting after the last
one placed so they spread. With one host everything is on it. A pod started later (a
replacement spare) goes to the live host with the fewest pods, the later host on a tie, so
not back to the first host while another has room.

With ``control`` K > 0 the first K hosts are the control plane's, as dedicated
coordination nodes are (etcd's, a NATS cluster's): they run the nats-servers (server i on
host i mod K) and the service instances (instance i of every service on host i mod K: each
control host a whole control plane, the first one active), and no pod; the pods go
round-robin over the other hosts. Losing a majority of the control hosts then takes the
bus's JetStream quorum and nothing that trains (issue 42: "two of three hosts lost").
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    servers: tuple[str, ...]      # the host of nats-server i
    instances: dict[str, str]     # service instance (``scaler``, ``scaler-s1``...) -> host
    pods: dict[str, str]          # pod id -> host (the pods ``up`` starts first)
    pod_hosts: tuple[str, ...] = ()  # where pods may go (a later one too); () every host

    def on(self, host: str) -> dict[str, list[str]]:
        """What ``host`` runs: servers (``s1``..), instances and pods."""
        return {"servers": [f"s{i + 1}" for i, h in enumerate(self.servers) if h == host],
                "instances": sorted(k for k, h in self.instances.items() if h == host),
                "pods": sorted(k for k, h in self.pods.items() if h == host)}


def instance_name(service: str, i: int) -> str:
    """Instance ``i`` of a service: 0 is the one that starts active (named as the service)."""
    return service if i == 0 else f"{service}-s{i}"


def place(hosts: list[str], servers: int, services: list[str], standbys: int,
          workers: int, spares: int, control: int = 0) -> Placement:
    """Hosts of ``servers`` nats-servers, each service's ``standbys + 1`` instances, the
    pods ``w0..`` (``w<r>`` starts as rank r) and ``s0..`` (spares); ``control`` > 0: the
    first ``control`` hosts run the servers and instances only (module doc)."""
    if not hosts:
        raise ValueError("no hosts to place on")
    if min(servers, workers) < 1 or min(standbys, spares) < 0:
        raise ValueError("at least one server and one worker; no negative counts")
    if not 0 <= control < len(hosts):
        raise ValueError(f"control hosts must leave a host for the pods: {control} of "
                         f"{len(hosts)} hosts")
    if control:
        ctl, rest = hosts[:control], hosts[control:]
        return Placement(
            servers=tuple(ctl[i % control] for i in range(servers)),
            instances={instance_name(s, i): ctl[i % control]
                       for i in range(standbys + 1) for s in services},
            pods={p: rest[k % len(rest)] for k, p in enumerate(
                [f"w{r}" for r in range(workers)] + [f"s{k}" for k in range(spares)])},
            pod_hosts=tuple(rest))
    first, rest = hosts[0], hosts[1:] or hosts[:1]
    turn = 0

    def nxt() -> str:
        nonlocal turn
        h = rest[turn % len(rest)]
        turn += 1
        return h

    srv = [first] + [nxt() for _ in range(servers - 1)]
    turn = 0
    inst = {}
    for s in services:
        inst[instance_name(s, 0)] = first
    for i in range(1, standbys + 1):
        for s in services:
            inst[instance_name(s, i)] = nxt()
    turn = 0
    pods = {"w0": first}
    for r in range(1, workers):
        pods[f"w{r}"] = nxt()
    for k in range(spares):
        pods[f"s{k}"] = nxt()
    return Placement(servers=tuple(srv), instances=inst, pods=pods)


def host_for_new_pod(pods: dict[str, str], live: list[str]) -> str:
    """The live host with the fewest pods (``pods``: pod -> host of the running ones); on
    a tie the later one (the first host is the one the default placement loads most)."""
    if not live:
        raise ValueError("no live host to start a pod on")
    count = {h: 0 for h in live}
    for h in pods.values():
        if h in count:
            count[h] += 1
    return min(reversed(live), key=lambda h: count[h])
