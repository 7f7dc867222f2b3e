from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from schemas.messages import Role


@dataclass
class PodSpec:
    pod: str
    role: Role
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


class PodHost(NamedTuple):
    """Where a pod runs (`up --hosts`, issue 42): the command prefix that runs it on its host
    (``ip netns exec NS``; empty for a loopback host), the environment it needs there, and
    the host's network namespace (None: none), which a pod forked from the zygote enters
    instead of the prefix."""

    prefix: list[str]
    env: dict[str, str]
    netns: str | None = None


class PodProcess(Protocol):
    """A running pod as an actuator holds it: ``asyncio.subprocess.Process`` (exec'd) or
    ``prefork.ForkedPod`` (forked from the zygote)."""

    pid: int

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class Actuator(Protocol):
    async def start(self, role: Role, count: int = 1) -> list[str]:
        """Start ``count`` pods of ``role``; returns their new pod ids."""

    async def stop(self, pod: str, grace_s: float = 5.0) -> bool:
        """Ask a pod to exit (SIGTERM), then kill it after ``grace_s``."""

    async def kill(self, pod: str) -> bool:
        """Kill a pod at once (fencing). Returns False if it was not running."""

    def running(self) -> dict[str, int]:
        """Pod id -> pid of every running pod."""
