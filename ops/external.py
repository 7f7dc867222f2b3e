"""`ceaseless up --bus URLS`: attach to a bus that runs elsewhere (issue 42, the Ray path).

The bus is a NATS cluster run per node (docs/cluster.md, "The control plane on several Ray
nodes"): `up` starts no nats-server, uses the credentials it is given (``--bus-creds``
for itself and its services, ``--pod-creds`` for the pods, default the same) and the CA of
``CEASELESS_TLS_CA`` for ``tls://`` URLs. ``--services here`` runs one instance of each
service on this node (``<service>-<node>``, a standby's lease TTL: one acts per job
whichever node it is on), ``--services external`` none (run elsewhere)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path

from plumbing.bus import Credentials, split_urls
from schemas.subjects import check_id


@dataclass
class ExternalBus:
    """``BusServers``' face for a bus `up` did not start: nothing to restart or stop."""

    url: str
    servers: list = field(default_factory=list)
    down: set = field(default_factory=set)

    def restart_dead(self) -> list[int]:
        return []

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class BusAccess:
    bus: ExternalBus
    creds_path: Path | None   # `up`'s and its services' identity (None: an open bus)
    creds: Credentials | None
    pod_creds: Path | None    # the pods'


def attach(url: str, creds: str | None, pod_creds: str | None) -> BusAccess:
    """The external bus and who `up`, its services and the pods are on it; a clear error
    (ValueError) for what cannot work."""
    urls = split_urls(url)
    if not urls:
        raise ValueError(f"--bus {url!r}: no URL")
    bad = [u for u in urls if not u.startswith(("nats://", "tls://"))]
    if bad:
        raise ValueError(f"--bus: not a nats:// or tls:// URL: {', '.join(bad)}")
    path = Path(creds).resolve() if creds else None
    loaded = None
    if path is not None:
        try:
            loaded = Credentials.load(path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--bus-creds {creds}: {type(e).__name__}: {e}") from e
    pods = Path(pod_creds).resolve() if pod_creds else path
    if pods is not None and not pods.is_file():
        raise ValueError(f"--pod-creds {pods}: no such file")
    return BusAccess(ExternalBus(",".join(urls)), path, loaded, pods)


def node_name(given: str | None) -> str:
    """This driver's (and its service instances') node name: ``--node``, else the host's
    name, made a valid id."""
    name = given or socket.gethostname().split(".")[0]
    if given is None:
        name = "".join(c if c.isalnum() or c in "_-" else "-" for c in name)[:48] or "node"
    return check_id(name, "--node")
