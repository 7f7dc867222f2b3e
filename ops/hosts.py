"""Emulated hosts on one machine (issue 42): make and destroy them, run a command on one,
cut and heal its link. Nothing else (where things go: ``placement.py``).

Two modes:

* ``netns`` (root, iproute2): host ``i`` is a network namespace joined to this (root)
  namespace by a veth pair addressed inside 127.0.0.0/8: the root side carries
  ``127.X.i.1/24``, the namespace side ``127.X.i.2/24``, the host's address (``X`` a second
  octet no interface here uses yet). Addresses of 127/8 off ``lo`` need:

  - ``route_localnet`` on both ends of each pair (else the kernel drops them as martians);
  - in each namespace, its ``local 127.0.0.0/8 dev lo`` route narrowed to ``127.0.0.1``,
    else every 127.X address is its own loopback and nothing leaves the namespace;
  - in the root namespace, a route for each namespace's /24 in the ``local`` table (there
    ``local 127.0.0.0/8 dev lo`` would take the replies, and it stays as it is: only
    127.X.i.0/24 is routed to the veth, and only while it exists);
  - in each namespace, a route to ``127.X.0.0/16`` via its root-side address with an
    explicit source: 127/8 addresses get host scope, so the kernel would otherwise pick
    0.0.0.0 as the source of a routed packet;
  - forwarding on the root-side veths only (``net.ipv4.conf.<veth>.forwarding``), so the
    namespaces reach each other through this one without touching ``net.ipv4.ip_forward``.

  Every sysctl set in this namespace is recorded with its previous value and restored by
  ``destroy()``, which also deletes the veths and namespaces (their routes go with them);
  ``destroy()`` is safe after a partial ``create()`` and idempotent. A cut link is the
  root-side veth down plus a ``blackhole`` route for the host's /24 (silence, as a pulled
  cable gives, not the root namespace's loopback answering in the host's place).

* ``loopback`` (not root, or no namespaces here): host ``i`` is the address ``127.0.1.i``
  in this namespace. Processes bind it (gloo, nats-server), nothing isolates it: a link
  cannot be cut (``cut`` raises ``Unavailable``), a host can still be lost (its processes
  killed).

Names carry ``up``'s pid (``ceaseless-<pid>-<letter>``): namespaces of a process that no
longer exists (SIGKILLed before it could clean up) are swept by the next ``Hosts.make``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

LETTERS = "abcdefghijklmnopqrstuvwxyz"
MAX_HOSTS = len(LETTERS)


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip netns``, not permitted), or what
    was asked needs them (a partition in loopback mode)."""


@dataclass
class Namespace:
    name: str
    veth: str       # root side
    peer: str       # namespace side
    root_addr: str  # the root side's address
    addr: str       # the namespace's own address: where its processes bind
    net: str        # its /24


@dataclass
class Netns:
    """``n`` namespaces joined to this one (see the module doc); ``Netns.create(n)``."""

    tag: str
    octet: int = 0
    namespaces: list[Namespace] = field(default_factory=list)
    _sysctls: list[tuple[str, str]] = field(default_factory=list)  # (key, previous value)
    _links: list[str] = field(default_factory=list)

    @staticmethod
    def check() -> None:
        """Raise ``Unavailable`` (the reason) unless namespaces can be made here."""
        if os.geteuid() != 0:
            raise Unavailable("network namespaces need root")
        for tool in ("ip", "ss"):
            if shutil.which(tool) is None:
                raise Unavailable(f"no `{tool}` command (iproute2)")
        r = _run(["ip", "netns", "list"], check=False)
        if r.returncode != 0:
            raise Unavailable(f"`ip netns` is not available: {r.stderr.strip()[:200]}")

    @classmethod
    def create(cls, n: int, tag: str | None = None) -> "Netns":
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"1 to {MAX_HOSTS} namespaces, not {n}")
        cls.check()
        sweep_stale()
        self = cls(tag=tag or str(os.getpid()))
        try:
            self.octet = _free_octet(seed=os.getpid())
            for i in range(n):
                self._add(i)
        except subprocess.CalledProcessError as e:
            self.destroy()
            raise Unavailable(f"cannot create namespaces: {' '.join(e.cmd)}: "
                              f"{(e.stderr or '').strip()[:300]}") from None
        except BaseException:
            self.destroy()
            raise
        return self

    def _add(self, i: int) -> None:
        letter = LETTERS[i]
        ns = Namespace(name=f"ceaseless-{self.tag}-{letter}", veth=f"cl{self.tag}{letter}0",
                       peer=f"cl{self.tag}{letter}1",
                       root_addr=f"127.{self.octet}.{i + 1}.1",
                       addr=f"127.{self.octet}.{i + 1}.2",
                       net=f"127.{self.octet}.{i + 1}.0/24")
        _run(["ip", "netns", "add", ns.name])
        self.namespaces.append(ns)
        _run(["ip", "link", "add", ns.veth, "type", "veth", "peer", "name", ns.peer])
        self._links.append(ns.veth)
        _run(["ip", "link", "set", ns.peer, "netns", ns.name])
        self._sysctl(f"net.ipv4.conf.{ns.veth}.route_localnet", "1")
        self._sysctl(f"net.ipv4.conf.{ns.veth}.forwarding", "1")
        _run(["ip", "addr", "add", f"{ns.root_addr}/24", "dev", ns.veth])
        _run(["ip", "link", "set", ns.veth, "up"])
        _run(["ip", "route", "add", ns.net, "dev", ns.veth, "src", ns.root_addr,
              "table", "local"])
        inside = [
            ["ip", "link", "set", "lo", "up"],
            ["sysctl", "-qw", f"net.ipv4.conf.{ns.peer}.route_localnet=1"],
            ["ip", "addr", "add", f"{ns.addr}/24", "dev", ns.peer],
            ["ip", "link", "set", ns.peer, "up"],
            # the order keeps 127.0.0.1 local throughout
            ["ip", "route", "replace", "local", "127.0.0.1", "dev", "lo", "table", "local"],
            ["ip", "route", "del", "local", "127.0.0.0/8", "dev", "lo", "table", "local"],
            ["ip", "route", "add", f"127.{self.octet}.0.0/16", "via", ns.root_addr,
             "dev", ns.peer, "src", ns.addr],
        ]
        for cmd in inside:
            _run(["ip", "netns", "exec", ns.name, *cmd])

    def _sysctl(self, key: str, value: str) -> None:
        path = Path("/proc/sys") / key.replace(".", "/")
        old = path.read_text().strip()
        path.write_text(value)
        self._sysctls.append((key, old))

    def exec(self, ns: Namespace, *cmd: str, timeout: float = 10) -> str:
        return _run(["ip", "netns", "exec", ns.name, *cmd], timeout=timeout).stdout

    def cut(self, ns: Namespace) -> None:
        """Nothing reaches the namespace and nothing leaves it; its processes live on."""
        _run(["ip", "route", "replace", "blackhole", ns.net, "table", "local"])
        _run(["ip", "link", "set", ns.veth, "down"])

    def heal(self, ns: Namespace) -> None:
        _run(["ip", "link", "set", ns.veth, "up"])
        # a device set down loses its routes: the one that takes the /24 out of 127/8 too
        _run(["ip", "route", "replace", ns.net, "dev", ns.veth, "src", ns.root_addr,
              "table", "local"])

    def destroy(self) -> None:
        """Restore the sysctls, delete the veths and the namespaces (best effort, each)."""
        for key, old in reversed(self._sysctls):
            try:
                (Path("/proc/sys") / key.replace(".", "/")).write_text(old)
            except OSError:
                pass
        self._sysctls.clear()
        for ns in self.namespaces:  # a blackhole left by a cut is not the veth's
            _run(["ip", "route", "del", "blackhole", ns.net, "table", "local"], check=False)
        for link in self._links:
            _run(["ip", "link", "del", link], check=False)
        self._links.clear()
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns.name], check=False)
        self.namespaces.clear()


@dataclass(frozen=True)
class Host:
    name: str              # h1, h2, ...
    addr: str              # where its processes bind and are reached
    netns: str | None      # its namespace (None: loopback mode)

    def argv(self, cmd: list[str]) -> list[str]:
        """``cmd`` run on this host: ``ip netns exec`` execs it (no fork), so the pid a
        caller records and kills is the command's own."""
        return ["ip", "netns", "exec", self.netns, *cmd] if self.netns else list(cmd)


class Hosts:
    """``H`` emulated hosts, ``h1`` .. ``hH`` (see the module doc); ``mode`` is ``netns``
    or ``loopback`` and ``why`` says why loopback where namespaces were wanted."""

    def __init__(self, hosts: list[Host], netns: Netns | None, why: str = "") -> None:
        self.hosts, self._netns, self.why = hosts, netns, why
        self._cut: set[str] = set()

    @property
    def mode(self) -> str:
        return "netns" if self._netns is not None else "loopback"

    @classmethod
    def make(cls, n: int, namespaces: bool = True) -> "Hosts":
        if not 1 <= n <= MAX_HOSTS:
            raise ValueError(f"--hosts takes 1 to {MAX_HOSTS} hosts, not {n}")
        why = "namespaces not asked for"
        if namespaces:
            try:
                ns = Netns.create(n)
            except Unavailable as e:
                why = str(e)
            else:
                return cls([Host(f"h{i + 1}", x.addr, x.name)
                            for i, x in enumerate(ns.namespaces)], ns)
        return cls([Host(f"h{i + 1}", f"127.0.1.{i + 1}", None) for i in range(n)], None, why)

    def __getitem__(self, name: str) -> Host:
        for h in self.hosts:
            if h.name == name:
                return h
        raise KeyError(f"no host {name!r} (hosts: {', '.join(h.name for h in self.hosts)})")

    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def can_cut(self) -> str | None:
        """Why no host's link can be cut here (None: it can)."""
        try:
            self._ns(self.names()[0])
        except Unavailable as e:
            return str(e)
        return None

    def _ns(self, name: str) -> Namespace:
        if self._netns is None:
            raise Unavailable(f"hosts are loopback addresses here ({self.why}): a host's link "
                              "cannot be cut without network namespaces (run as root)")
        return self._netns.namespaces[self.names().index(self[name].name)]

    def cut(self, name: str) -> None:
        ns = self._ns(name)
        self._netns.cut(ns)  # type: ignore[union-attr]
        self._cut.add(name)

    def heal(self, name: str) -> None:
        if name in self._cut:
            self._netns.heal(self._ns(name))  # type: ignore[union-attr]
            self._cut.discard(name)

    def is_cut(self, name: str) -> bool:
        return name in self._cut

    def exec(self, name: str, *cmd: str, timeout: float = 10) -> str:
        return _run(self[name].argv(list(cmd)), timeout=timeout).stdout

    def destroy(self) -> None:
        if self._netns is not None:
            self._netns.destroy()
        self._cut.clear()


def kill_all(pids: list[int]) -> list[int]:
    """SIGKILL every pid (and the process group it leads, where it leads one: a process
    started in a session of its own takes its children with it); the pids that were alive."""
    hit = []
    for pid in pids:
        try:
            if os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
            hit.append(pid)
        except ProcessLookupError:
            pass
    return hit


def sweep_stale() -> list[str]:
    """Delete the namespaces (and their veths) of a ``ceaseless-<pid>-x`` whose pid is gone."""
    r = _run(["ip", "netns", "list"], check=False)
    gone = []
    for line in r.stdout.splitlines():
        m = re.match(r"ceaseless-(\d+)-([a-z])\b", line.strip())
        if m is None or _alive(int(m.group(1))):
            continue
        _run(["ip", "link", "del", f"cl{m.group(1)}{m.group(2)}0"], check=False)
        _run(["ip", "netns", "del", m.group(0)], check=False)
        gone.append(m.group(0))
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _free_octet(seed: int) -> int:
    """A second octet X in 20..239 with no 127.X address on any interface and no route of
    the local table inside 127.X (another run's namespaces, or anyone's)."""
    used = _run(["ip", "-o", "-4", "addr", "show"]).stdout + \
        _run(["ip", "-4", "route", "show", "table", "local"]).stdout
    taken = {int(x) for x in re.findall(r"(?<![\d.])127\.(\d+)\.", used)}
    for k in range(220):
        x = 20 + (seed + k) % 220
        if x not in taken:
            return x
    raise Unavailable("no free 127.X.0.0/16 range")


def _run(cmd: list[str], check: bool = True, timeout: float = 10) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)
