"""Agent configuration, from ``CEASELESS_*`` environment variables (set by ``ceaseless up``)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, replace
from typing import Any

from schemas import check_id
from schemas.messages import Role
from schemas.timeouts import DEFAULTS as TIMEOUTS

FALLBACK_EXIT_CODE = 75  # "in-process recovery gave up / I was fenced: restart me as a spare"


def _flag(name: str, default: bool = False) -> bool:
    v = os.environ.get(name)
    if v is None:
        return default
    return v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class AgentConfig:
    """The effective configuration, computed once and frozen (``with_overrides`` makes a
    new one, validated again). ``backend`` is the user's choice (``CEASELESS_BACKEND``); the
    backend in use follows the registered model (``Membership.backend``)."""

    nats_url: str
    job: str = "demo"
    pod: str = ""
    role: Role = Role.worker
    creds_path: str | None = None
    run_dir: str | None = None
    allow_inject: bool = False
    # the machine this pod runs on (CEASELESS_HOST): its heartbeats go through the host's
    # relay, one message per host and interval (agent/hostbeat.py, issue 45); None: each its own
    host: str | None = None
    heartbeat_interval: float = TIMEOUTS["heartbeat_interval"]
    collective_slice: float = 0.05     # abort flag checked between slices of a wait
    # A collective that takes longer is a peer error.
    collective_timeout: float = TIMEOUTS["collective_timeout"]
    # A gradient all-reduce waiting longer than this reports peer_error (every heartbeat
    # interval while it waits): the monitor then declares members whose heartbeats stopped
    # (a SIGSTOPped or frozen pod) at its suspect timeout instead of the fault timeout. 0: off.
    stuck_report_after: float = 0.5
    store_timeout: float = 30.0
    recovery_timeout: float = TIMEOUTS["recovery_timeout"]  # one in-process attempt
    # A member whose training thread reaches no step boundary and no collective for this
    # long reports itself hung (agent/watchdog.py). 0: the collective timeout.
    stall_timeout: float = 0.0
    # compare the replicas' state every N committed steps, keep the agreed one, roll back on
    # a disagreement (agent/verify.py; `ceaseless up --verify-every`); 0: off
    verify_every: int = 0
    # A step whose loss or gradient is not finite (or a loss spike) is skipped on every rank;
    # "rollback": also go back to the last verified copy and compute the steps after it
    # again, that step still skipped (the state may have gone bad before the symptom).
    on_nonfinite: str = "skip"
    # The loss-spike guard: a step whose loss is over this factor times the median of the
    # last committed ones is skipped as a non-finite one is (0: off).
    loss_spike: float = 0.0
    # The longest a member may work alone (``with s.solo():``, a rank-0 evaluation) while its
    # peers wait in the collective; past it the monitor calls the member hung.
    solo_max: float = 3600.0
    max_attempts: int = 3              # then exit FALLBACK_EXIT_CODE
    backend: str | None = None         # gloo | nccl | None (nccl when CUDA is available)
    # A member whose slot a planned shrink releases exits 0 at once (False: s.steps() just
    # returns and the script ends by itself).
    exit_on_release: bool = True
    # Spares follow the committed state (agent/shadow.py): a promoted spare needs no state
    # transfer. Gloo (CPU) groups only; off: spares receive the state when promoted.
    shadow_spares: bool = True
    # A fault plan that keeps this pod's rank and world size does not discard the step being
    # computed when no member needs state: it is finished and all-reduced in the new group
    # (agent/prejoin.py). Off: every fault plan aborts the step.
    resume_in_place: bool = True
    # The gradient all-reduce starts in buckets during the backward of the last micro-batch
    # (agent/grad_sync.py), as DDP's does. Off: one bucketed all-reduce in s.step().
    overlap: bool = True
    # One span per step's gradient sync (the last backward, the buckets' all-reduce, the
    # exposed wait), for `ceaseless trace steps`: CEASELESS_TRACE_STEPS=1. Off by default.
    trace_steps: bool = False
    # Gradient bucket size (MiB) of the all-reduce, as DDP's bucket_cap_mb (25): smaller
    # buckets start earlier in the backward, larger ones cost fewer calls.
    bucket_mb: float = 25.0
    # Sharded models: replicas of this many ranks, each rank one shard of the model and
    # optimizer (FSDP2 over ``Session.mesh``; ``ceaseless up --shard-size``). 1: unsharded.
    shard_size: int = 1
    # `ceaseless up` was given no batch (--global-batch-size / --micro-batch-size): the
    # scaler takes the script's (KV ``script``), so a first plan made with the default is
    # no mismatch to warn about (CEASELESS_BATCH_FROM_SCRIPT=1).
    batch_from_script: bool = False

    def __post_init__(self) -> None:
        if self.shard_size > 1:
            # A rank holds 1/k of the state: a spare cannot follow rank 0 (it does not know
            # its shard yet), a step is not resumed in a new group (FSDP's own collectives
            # ran in the old one), and the gradients are summed once, after the backward
            # (FSDP reduce-scatters them during it).
            for off in ("shadow_spares", "resume_in_place", "overlap"):
                object.__setattr__(self, off, False)
        check_id(self.job, "job name")
        check_id(self.pod, "pod id")
        if self.host is not None:
            check_id(self.host, "host (CEASELESS_HOST)")
        fault = TIMEOUTS["fault_timeout"]
        if not (0 < self.heartbeat_interval < fault):
            raise ValueError(f"heartbeat_interval must be in (0, {fault:g}) s: below the fault "
                             "timeout")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be positive (CEASELESS_BUCKET_MB, got {self.bucket_mb})")
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1 (CEASELESS_SHARD_SIZE, got {self.shard_size})")
        if not self.solo_max > 0:
            raise ValueError(f"solo_max must be positive (CEASELESS_SOLO_MAX, got {self.solo_max})")
        if not (0 < self.collective_slice < self.collective_timeout):
            raise ValueError("collective_slice must be positive and below collective_timeout")
        check_guards(self.on_nonfinite, self.verify_every, self.loss_spike)
        if self.stuck_report_after < 0:
            raise ValueError("stuck_report_after must be >= 0 (0 turns it off)")
        from schemas.timeouts import check_timeouts

        # The agent's part of the hierarchy (the monitor's side is checked there).
        check_timeouts(True, heartbeat_interval=self.heartbeat_interval,
                       collective_timeout=self.collective_timeout,
                       recovery_timeout=self.recovery_timeout)

    def with_overrides(self, **overrides: Any) -> "AgentConfig":
        """A copy with ``overrides`` (``Session.from_env(..., shard_size=2)``), checked as the
        environment's values are; unknown names are refused."""
        unknown = sorted(set(overrides) - set(self.__dataclass_fields__))
        if unknown:
            raise TypeError(f"unknown session settings {unknown}")
        return replace(self, **overrides)

    @classmethod
    def from_env(cls) -> "AgentConfig | None":
        """None when no bus is configured: the session then runs single-process."""
        url = os.environ.get("CEASELESS_NATS_URL")
        if not url:
            return None
        pod = os.environ.get("CEASELESS_POD") or os.environ.get("HOSTNAME") or socket.gethostname()
        env = os.environ.get
        from schemas.timeouts import agent_timeouts_from_env

        timeouts = agent_timeouts_from_env()  # a collective timeout alone carries recovery's
        return cls(
            nats_url=url,
            job=env("CEASELESS_JOB", cls.job),
            pod=pod.replace(".", "-")[:64],
            role=Role(env("CEASELESS_ROLE", cls.role)),
            creds_path=env("CEASELESS_CREDS"),
            run_dir=env("CEASELESS_RUN_DIR"),
            allow_inject=_flag("CEASELESS_ALLOW_INJECT"),
            host=(env("CEASELESS_HOST") or "").replace(".", "-")[:64] or None,
            heartbeat_interval=float(env("CEASELESS_HEARTBEAT_INTERVAL", cls.heartbeat_interval)),
            collective_timeout=timeouts.get("collective_timeout", cls.collective_timeout),
            stuck_report_after=float(env("CEASELESS_STUCK_REPORT_AFTER", cls.stuck_report_after)),
            recovery_timeout=timeouts.get("recovery_timeout", cls.recovery_timeout),
            solo_max=float(env("CEASELESS_SOLO_MAX", cls.solo_max)),
            stall_timeout=float(env("CEASELESS_STALL_TIMEOUT", cls.stall_timeout)),
            verify_every=int(env("CEASELESS_VERIFY_EVERY") or cls.verify_every),
            on_nonfinite=env("CEASELESS_ON_NONFINITE") or cls.on_nonfinite,
            loss_spike=float(env("CEASELESS_LOSS_SPIKE") or cls.loss_spike),
            max_attempts=int(env("CEASELESS_MAX_ATTEMPTS", cls.max_attempts)),
            backend=env("CEASELESS_BACKEND") or None,
            exit_on_release=_flag("CEASELESS_EXIT_ON_RELEASE", cls.exit_on_release),
            shadow_spares=_flag("CEASELESS_SHADOW_SPARES", cls.shadow_spares),
            resume_in_place=_flag("CEASELESS_RESUME_IN_PLACE", cls.resume_in_place),
            overlap=_flag("CEASELESS_OVERLAP", cls.overlap),
            trace_steps=_flag("CEASELESS_TRACE_STEPS", cls.trace_steps),
            bucket_mb=float(env("CEASELESS_BUCKET_MB") or cls.bucket_mb),
            shard_size=int(env("CEASELESS_SHARD_SIZE") or cls.shard_size),
            batch_from_script=_flag("CEASELESS_BATCH_FROM_SCRIPT", cls.batch_from_script),
        )


def check_guards(on_nonfinite: str, verify_every: int, loss_spike: float) -> None:
    """The guards' settings (the agent's, and `ceaseless up`'s before it starts anything)."""
    if on_nonfinite not in ("skip", "rollback"):
        raise ValueError(f"on_nonfinite must be skip or rollback (CEASELESS_ON_NONFINITE, "
                         f"--on-nonfinite; got {on_nonfinite!r})")
    if on_nonfinite == "rollback" and verify_every <= 0:
        raise ValueError("on_nonfinite=rollback goes back to the last verified copy: it needs "
                         "verification on (CEASELESS_VERIFY_EVERY, --verify-every N > 0)")
    if loss_spike != 0 and not loss_spike > 1:
        raise ValueError(f"loss_spike must be 0 (off) or over 1 (CEASELESS_LOSS_SPIKE, "
                         f"--loss-spike; got {loss_spike:g})")


def refuse_foreign_launcher() -> None:
    """Without Ceaseless' environment the session runs single-process. Under torchrun (or any
    launcher that starts several ranks) that would be N independent jobs, each training the
    whole batch alone and writing the same files: refuse, saying what to run instead."""
    world = os.environ.get("WORLD_SIZE", "")
    if os.environ.get("TORCHELASTIC_RUN_ID") or (world.isdigit() and int(world) > 1):
        raise RuntimeError(
            f"this Ceaseless script runs under a launcher (WORLD_SIZE={world or '?'}, "
            f"RANK={os.environ.get('RANK', '?')}) without Ceaseless' environment: each process "
            "would train alone. Launch it with `ceaseless up -- python SCRIPT ...` (or the "
            "compose stack), not torchrun; to run one process, unset WORLD_SIZE/RANK.")
