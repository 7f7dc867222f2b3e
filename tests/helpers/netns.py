"""Network namespaces joined to this one by veth pairs, addressed inside 127.0.0.0/8.

``Netns.create(n)`` makes ``n`` namespaces; namespace ``i`` gets a veth pair whose root
side carries ``127.X.(i+1).1/24`` and whose namespace side carries ``127.X.(i+1).2/24``
(``X`` a second octet no interface here uses yet). Addresses of 127/8 off ``lo`` need:

* ``route_localnet`` on both ends of each pair (else the kernel drops them as martians);
* in each namespace, its ``local 127.0.0.0/8 dev lo`` route narrowed to ``127.0.0.1``,
  else every 127.X address is its own loopback and nothing leaves the namespace;
* in the root namespace, a route for each namespace's /24 in the ``local`` table (there
  ``local 127.0.0.0/8 dev lo`` would take the replies, and it stays as it is: only
  127.X.(i+1).0/24 is routed to the veth, and only while it exists);
* in each namespace, a route to ``127.X.0.0/16`` via its root-side address with an
  explicit source: 127/8 addresses get host scope, so the kernel would otherwise pick
  0.0.0.0 as the source of a routed packet;
* forwarding on the root-side veths only (``net.ipv4.conf.<veth>.forwarding``), so the
  namespaces reach each other through this one without touching ``net.ipv4.ip_forward``.

Every sysctl set in this namespace is recorded with its previous value and restored by
``destroy()``, which also deletes the veths and namespaces (their routes go with them);
``destroy()`` is safe to call after a partial ``create()``. Needs root and ``ip``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


class Unavailable(RuntimeError):
    """Namespaces cannot be made here (not root, no ``ip netns``, not permitted)."""


@dataclass
class Namespace:
    name: str
    veth: str       # root side
    peer: str       # namespace side
    root_addr: str  # the root side's address: where the pods reach the bus
    addr: str       # the namespace's own address: where its pods bind gloo


@dataclass
class Netns:
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
        cls.check()
        tag = tag or str(os.getpid())
        self = cls(tag=tag)
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
        letter = "abcdefgh"[i]
        ns = Namespace(name=f"ceaseless-{self.tag}-{letter}", veth=f"cl{self.tag}{letter}0",
                       peer=f"cl{self.tag}{letter}1",
                       root_addr=f"127.{self.octet}.{i + 1}.1",
                       addr=f"127.{self.octet}.{i + 1}.2")
        net = f"127.{self.octet}.{i + 1}.0/24"
        _run(["ip", "netns", "add", ns.name])
        self.namespaces.append(ns)
        _run(["ip", "link", "add", ns.veth, "type", "veth", "peer", "name", ns.peer])
        self._links.append(ns.veth)
        _run(["ip", "link", "set", ns.peer, "netns", ns.name])
        self._sysctl(f"net.ipv4.conf.{ns.veth}.route_localnet", "1")
        self._sysctl(f"net.ipv4.conf.{ns.veth}.forwarding", "1")
        _run(["ip", "addr", "add", f"{ns.root_addr}/24", "dev", ns.veth])
        _run(["ip", "link", "set", ns.veth, "up"])
        _run(["ip", "route", "add", net, "dev", ns.veth, "src", ns.root_addr, "table", "local"])
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

    def destroy(self) -> None:
        """Restore the sysctls, delete the veths and the namespaces (best effort, each)."""
        for key, old in reversed(self._sysctls):
            try:
                (Path("/proc/sys") / key.replace(".", "/")).write_text(old)
            except OSError:
                pass
        self._sysctls.clear()
        for link in self._links:
            _run(["ip", "link", "del", link], check=False)
        self._links.clear()
        for ns in self.namespaces:
            _run(["ip", "netns", "del", ns.name], check=False)
        self.namespaces.clear()


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
