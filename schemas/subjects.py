"""Every NATS subject and KV name Ceaseless uses. The one place they are spelled.

Subjects are ``ceaseless.<job>.<kind>[.<pod>]``. Job and pod ids are restricted to
characters that are safe as NATS subject tokens and KV keys (see ``ID_PATTERN``).
"""

from __future__ import annotations

import re

PREFIX = "ceaseless"
ID_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
_ID_RE = re.compile(ID_PATTERN)


def check_id(value: str, what: str = "id") -> str:
    if not _ID_RE.match(value):
        raise ValueError(f"invalid {what} {value!r}: must match {ID_PATTERN}")
    return value


class Subjects:
    """Subject names of one job."""

    def __init__(self, job: str = "demo") -> None:
        self.job = check_id(job, "job name")
        self.base = f"{PREFIX}.{job}"

    @classmethod
    def template(cls) -> "Subjects":
        """Subjects spelled with ``<job>`` (the schema export's index, docs): never a real
        job's, ``<job>`` is no valid id."""
        s = cls.__new__(cls)
        s.job, s.base = "<job>", f"{PREFIX}.<job>"
        return s

    def of_kind(self, kind: str, pod: str = "*") -> str:
        """The subject messages of ``kind`` (``BY_KIND``'s keys) are published on; a per-pod
        kind's for ``pod``."""
        attr = getattr(self, kind)
        return attr(pod) if callable(attr) else attr

    # -- agent -> control plane
    def heartbeat(self, pod: str = "*") -> str:
        return f"{self.base}.heartbeat.{pod}"

    def heartbeats(self, host: str = "*") -> str:
        """A host's relay -> health monitor: its pods' heartbeats in one ``HeartbeatBatch``."""
        return f"{self.base}.heartbeats.{host}"

    def hostbeat(self, host: str = "*", pod: str = "*") -> str:
        """A pod -> its host's relay: its ``Heartbeat`` (read by the relay only)."""
        return f"{self.base}.hostbeat.{host}.{pod}"

    def report(self, pod: str = "*") -> str:
        """Agent-reported errors (exception, peer reset, digest mismatch). Added to the contract."""
        return f"{self.base}.report.{pod}"

    @property
    def recovery(self) -> str:
        return f"{self.base}.recovery"

    # -- control plane
    @property
    def fault(self) -> str:
        return f"{self.base}.fault"

    @property
    def health(self) -> str:
        """Health monitor -> scaler, state broker: the heartbeats it read (``HealthView``)."""
        return f"{self.base}.health"

    @property
    def plan(self) -> str:
        return f"{self.base}.plan"

    @property
    def transfer(self) -> str:
        return f"{self.base}.transfer"

    @property
    def state_lost(self) -> str:
        return f"{self.base}.state_lost"

    @property
    def job_failed(self) -> str:
        """Health monitor -> launcher, operator: the failure is the script's (``JobFailed``)."""
        return f"{self.base}.job_failed"

    @property
    def decision(self) -> str:
        """Scaler's answer to capacity/priority requests (accepted or refused, with why)."""
        return f"{self.base}.decision"

    # -- infrastructure / operator
    @property
    def capacity(self) -> str:
        return f"{self.base}.capacity"

    @property
    def priority(self) -> str:
        return f"{self.base}.priority"

    @property
    def inject(self) -> str:
        return f"{self.base}.inject"

    def lifecycle(self, pod: str = "*") -> str:
        """Actuator -> bus: a pod process started or exited."""
        return f"{self.base}.lifecycle.{pod}"

    @property
    def actuator(self) -> str:
        """Request/reply: commands to the actuator (start/stop/kill)."""
        return f"{self.base}.actuator"

    def service_status(self, service: str) -> str:
        return f"{self.base}.svc.{service}.status"

    @property
    def all(self) -> str:
        return f"{self.base}.>"

    def audit_subjects(self) -> list[str]:
        """Subjects kept in the job's JetStream stream (everything but heartbeats)."""
        return [
            self.report(), self.recovery, self.fault, self.plan, self.transfer,
            self.state_lost, self.job_failed, self.decision, self.capacity, self.priority, self.inject,
            self.lifecycle(),
        ]

    # -- JetStream names
    @property
    def stream(self) -> str:
        return f"CEASELESS_{self.job.replace('-', '_').upper()}"

    @property
    def kv_bucket(self) -> str:
        return f"ceaseless_{self.job.replace('-', '_')}"

    @property
    def store_bucket(self) -> str:
        """c10d store keys of every generation (sibling bucket with a TTL)."""
        return f"ceaseless_{self.job.replace('-', '_')}_store"

    def kind_of(self, subject: str) -> str | None:
        """The message kind a subject carries, or None if it is not one of this job's."""
        if not subject.startswith(self.base + "."):
            return None
        rest = subject[len(self.base) + 1:].split(".")
        if rest[0] in ("heartbeat", "heartbeats", "report", "lifecycle") and len(rest) == 2:
            return rest[0]
        if rest[0] == "svc":
            return "svc"
        if len(rest) == 1:
            return rest[0]
        return None


PLAN_KEY = "plan"
# The parts of a plan too large to send whole (schemas.messages.PlanRef, issue 45): written
# by the scaler only, content-addressed (a plan's parts never change once written).
PLAN_PARTS_PREFIX = "plan_parts"


def plan_part_key(digest: str, i: int) -> str:
    """KV key of part ``i`` of the plan with SHA-256 ``digest``."""
    return f"{PLAN_PARTS_PREFIX}.{digest}.{i}"

LEASE_KEY = "scaler_lease"
# The job's end as its acting Ray driver saw it ({holder, code, reason}; services/actuator/
# ray_adopt.py): standby drivers stop instead of taking the lease over
ACTUATOR_END_KEY = "actuator_end"
COMMITTED_KEY = "committed"  # schemas.messages.HighWater, written by the state broker only


def lease_key(service: str) -> str:
    """The KV key of a service's lease (issue 42): ``{holder, expires, term}``, written only
    by that service's instances (services/common/lease.py). The scaler's keeps its old name."""
    return LEASE_KEY if service == "scaler" else f"{service}_lease"
