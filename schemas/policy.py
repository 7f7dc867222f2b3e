"""The elastic scaling policy of a job, and the scale state the scaler keeps in KV.

A policy comes from a TOML (or YAML, with PyYAML installed) file, ``CEASELESS_POLICY`` (the
file's path) or scaler flags; flags win over the file. Every field is validated here, so a
policy the scaler starts with is consistent: an unknown key or an impossible combination
is refused with the reason.

    # policy.toml
    min_replicas = 2
    max_replicas = 8
    replica_increment_step = 1        # or: replica_discrete_values = [2, 4, 8]
    scale_up_snooze_s = 30            # no scale-up within 30 s of the last change
    scaling_timeout_s = 60            # a joiner not training by then is dropped
    graceful_shutdown_timeout_s = 30  # a leaving replica still running by then is stopped
    lr_warmup_steps = 10              # lr_factor ramps to a new value over 10 steps
    [per_scale.2]                     # at 2 replicas, scale the learning rate by 0.8
    lr_factor = 0.8

The global batch is constant at every world size (docs/elastic.md, "Batch arithmetic and
learning rate"): a per-scale override changes the learning rate, never the batch size.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .messages import MAX_MEMBERS

POLICY_ENV = "CEASELESS_POLICY"
SCALE_KEY = "scale"  # KV key of ScaleState (written by the scaler only)
SCRIPT_KEY = "script"  # KV key of ScriptInfo (written by the script's rank 0)
DEPARTURES_KEY = "departures"  # KV key of Departures (written by the scaler only)
MAX_REPLICAS = MAX_MEMBERS  # a plan's bound: every replica is a member


class PerScale(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    lr_factor: Annotated[float, Field(gt=0, le=1000)] = 1.0


class ScalingPolicy(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 64
    replica_increment_step: Annotated[int, Field(ge=1, le=MAX_REPLICAS)] = 1
    replica_discrete_values: Annotated[list[Annotated[int, Field(ge=1, le=MAX_REPLICAS)]],
                                       Field(max_length=256)] | None = None
    scale_up_snooze_s: Annotated[float, Field(ge=0, le=86400)] = 10.0
    scaling_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 60.0
    graceful_shutdown_timeout_s: Annotated[float, Field(gt=0, le=86400)] = 30.0
    # How far ahead of the members' current step a planned change is scheduled: enough for
    # the plan to reach every member before it starts the step the change applies from.
    transition_lead_s: Annotated[float, Field(ge=0, le=60)] = 0.05
    lr_warmup_steps: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    per_scale: dict[Annotated[int, Field(ge=1, le=MAX_REPLICAS)], PerScale] = {}

    @model_validator(mode="after")
    def _consistent(self) -> "ScalingPolicy":
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas "
                             f"({self.max_replicas})")
        if self.replica_discrete_values is not None:
            v = self.replica_discrete_values
            if not v or sorted(set(v)) != v:
                raise ValueError("replica_discrete_values must be a non-empty, strictly "
                                 "increasing list")
            if v[0] < self.min_replicas or v[-1] > self.max_replicas:
                raise ValueError(f"replica_discrete_values {v} must lie within "
                                 f"[min_replicas, max_replicas] = [{self.min_replicas}, "
                                 f"{self.max_replicas}]")
            if self.replica_increment_step != 1:
                raise ValueError("give replica_increment_step or replica_discrete_values, "
                                 "not both")
        return self

    def sizes(self, limit: int | None = None) -> list[int]:
        """Every replica count the policy allows (at most ``limit``), ascending."""
        top = self.max_replicas if limit is None else min(limit, self.max_replicas)
        if self.replica_discrete_values is not None:
            return [v for v in self.replica_discrete_values if v <= top]
        return list(range(self.min_replicas, top + 1, self.replica_increment_step))

    def allowed(self, n: int) -> bool:
        return n in self.sizes()

    def lr_factor(self, world_size: int) -> float:
        p = self.per_scale.get(world_size)
        return p.lr_factor if p is not None else 1.0


def load_policy(path: str | os.PathLike[str] | None = None, **overrides: Any) -> ScalingPolicy:
    """The policy from ``path`` (or ``$CEASELESS_POLICY``), with non-None ``overrides``
    (scaler flags) on top. No file: the defaults plus the overrides."""
    data: dict[str, Any] = {}
    path = path or os.environ.get(POLICY_ENV) or None
    if path:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as e:
            raise ValueError(f"cannot read policy file {p}: {e.strerror}") from None
        data = _parse(p, text)
        if not isinstance(data, dict):
            raise ValueError(f"policy file {p} must hold a table/mapping at the top level")
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ScalingPolicy.model_validate(data)
    except ValueError as e:
        where = f" in {path}" if path else ""
        raise ValueError(f"invalid scaling policy{where}: {e}") from None


def _parse(p: Path, text: str) -> Any:
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise ValueError(f"{p} is YAML but PyYAML is not installed (pip install pyyaml), "
                             "or write the policy as TOML") from None
        try:
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ValueError(f"policy file {p} is not valid YAML: {e}") from None
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"policy file {p} is not valid TOML: {e}") from None


class PendingRelease(BaseModel):
    """A release (priority or capacity remove) waiting for its slots to be free."""

    model_config = ConfigDict(extra="forbid")
    request_id: Annotated[str, Field(max_length=128)]
    count: Annotated[int, Field(ge=1, le=MAX_REPLICAS)]
    freed: list[str] = []       # pods already gone (stopped spares, exited members)
    leaving: list[str] = []     # members leaving at a planned step, spares being stopped
    pods: list[str] = []        # the pods the request named (Priority.pods), if any
    since: float = 0.0          # wall time of the request
    subject: str = ""


class ScaleState(BaseModel):
    """KV ``scale``: the replica count the job should have and why (the scaler's only
    elastic state; everything else is rebuilt from the plan and heartbeats)."""

    model_config = ConfigDict(extra="forbid")
    target: Annotated[int, Field(ge=1, le=MAX_REPLICAS)]
    reason: Annotated[str, Field(max_length=2048)] = ""
    request_id: Annotated[str, Field(max_length=128)] | None = None
    updated: float = 0.0
    releases: Annotated[list[PendingRelease], Field(max_length=256)] = []


class Departure(BaseModel):
    """A member to plan out at a step boundary (a preemption notice, a straggler to swap for
    a spare) or, with ``slowness``, to give a smaller share of the micro-batches."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    pod: Annotated[str, Field(min_length=1, max_length=64)]
    why: Literal["preempted", "straggler"] = "preempted"
    incident: Annotated[str, Field(max_length=128)] | None = None
    slowness: Annotated[float, Field(ge=1, le=1e6)] | None = None


class Departures(BaseModel):
    """KV ``departures`` (issue 32): the scaler's notices not planned yet, so that a scaler
    restarted (or another taking the lease) goes on with them instead of letting a preempted
    pod leave as a crash at its deadline."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    leaving: Annotated[list[Departure], Field(max_length=4096)] = []
    sharing: Annotated[list[Departure], Field(max_length=4096)] = []


class ScriptInfo(BaseModel):
    """KV ``script``: what the training script itself runs, written by rank 0 at its first
    step (``agent/script_batch.py``): its global batch, micro-batch size and step total.
    ``ceaseless status`` and ``ceaseless up`` show it; a scaler started with
    ``--batch-from-script`` (``ceaseless up`` without ``--global-batch-size`` /
    ``--micro-batch-size``) sizes the plans it makes from then on with this batch."""

    model_config = ConfigDict(extra="forbid")
    global_batch_size: Annotated[int, Field(ge=1, le=2**40)]
    micro_batch_size: Annotated[int, Field(ge=1, le=2**40)]
    total: Annotated[int, Field(ge=0, le=2**53)] | None = None  # s.steps(total)
    pod: Annotated[str, Field(max_length=64)] = ""
    # The DDP drop-in (agent.ddp): the script divided its batch by this world size once, so
    # the scaler keeps the job at it (a fault without a live spare waits for a replacement
    # instead of shrinking; capacity and priority requests are refused). None: elastic.
    fixed_world_size: Annotated[int, Field(ge=1, le=2**20)] | None = None

    @model_validator(mode="after")
    def _divides(self) -> "ScriptInfo":
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size {self.global_batch_size} is not a multiple "
                             f"of micro_batch_size {self.micro_batch_size}")
        return self
