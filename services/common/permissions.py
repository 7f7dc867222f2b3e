"""One NATS identity per role, each allowed only its subjects (enforced by nats-server).

Roles: ``agent`` (every training process: the least trusted, it runs user code),
``health_monitor``, ``scaler``, ``state_broker`` and ``operator`` (``ceaseless up``, its
actuator and the CLI: inject, capacity, priority). What each may publish:

* agent: its heartbeats, reports and recovery summaries; its answers to injections
  (``decision``); the c10d store bucket; the KV key ``done``; read access to the plan key and
  to single messages of the job's stream (the last transfer plan it may have missed while
  reconnecting). Never ``plan``, ``inject``, ``capacity``,
  ``priority``, ``fault`` or the ``plan`` key.
* health_monitor: ``fault``, ``health`` (its view of the heartbeats), ``job_failed``.
* state_broker: ``transfer``, ``state_lost``, and the KV key ``committed`` (the job's
  committed high-water mark: a restarted broker reads it).
* scaler: ``plan``, ``decision``, actuator requests, and the KV keys ``plan`` (and a large
  plan's parts, ``plan_parts.>``), ``scaler_lease``, ``scale`` and ``departures`` (the only writer of membership and of the
  target size).
* operator: everything.

Services may use the JetStream API (they create the stream and buckets when they start);
agents only the read/watch calls they need. Everyone may use ``_INBOX.>`` (replies) and the
NATS services protocol (``$SRV.>``). Subscriptions are open within the job: reading the bus
is not what this guards against.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from schemas.policy import DEPARTURES_KEY, SCALE_KEY
from schemas.subjects import (COMMITTED_KEY, LEASE_KEY, PLAN_KEY, PLAN_PARTS_PREFIX, Subjects,
                              lease_key)

from plumbing.bus import Credentials

ROLES = ("agent", "health_monitor", "scaler", "state_broker", "operator")
SERVICE_ROLES = ("health_monitor", "scaler", "state_broker")

_COMMON_PUB = ["_INBOX.>", "$SRV.>", "$JS.API.INFO", "$JS.ACK.>", "$JS.FC.>"]
_COMMON_SUB = ["_INBOX.>", "$SRV.>"]


def role_permissions(role: str, job: str) -> dict[str, Any] | None:
    """nats-server ``permissions`` for ``role`` in ``job`` (None: no restriction)."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; one of {', '.join(ROLES)}")
    if role == "operator":
        return None
    s = Subjects(job)
    kv, store = s.kv_bucket, s.store_bucket
    sub = _COMMON_SUB + [s.all]
    if role == "agent":
        pub = _COMMON_PUB + [
            s.heartbeat("*"), s.report("*"), s.recovery,
            s.hostbeat("*", "*"), s.heartbeats("*"),  # a host's pods, its relay (issue 45)
            s.decision,  # its answer to an injection it runs (agent/inject.py)
            f"$KV.{store}.>", f"$KV.{kv}.done", f"$KV.{kv}.solo.>", f"$KV.{kv}.script",  # agent
            # read and watch the two buckets (ordered consumers), nothing else of JetStream
            *(f"$JS.API.{api}.KV_{b}{suffix}" for b in (kv, store)
              for api, suffix in (("STREAM.INFO", ""), ("STREAM.MSG.GET", ""),
                                  ("DIRECT.GET", ".>"), ("CONSUMER.CREATE", ""),
                                  ("CONSUMER.CREATE", ".>"), ("CONSUMER.DELETE", ".>"),
                                  ("CONSUMER.INFO", ".>"))),
            # the job stream's last transfer plan, after a reconnect (agent/catchup.py)
            f"$JS.API.STREAM.MSG.GET.{s.stream}",
        ]
        sub = _COMMON_SUB + [s.plan, s.transfer, s.state_lost, s.inject, s.all]
        return {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    # the KV keys each service alone writes
    keys = {"health_monitor": [lease_key("health_monitor")],
            "state_broker": [COMMITTED_KEY, lease_key("state_broker")],
            "scaler": [PLAN_KEY, f"{PLAN_PARTS_PREFIX}.>", LEASE_KEY, SCALE_KEY, DEPARTURES_KEY]}
    own = {
        "health_monitor": [s.fault, s.health, s.job_failed],
        "state_broker": [s.transfer, s.state_lost],
        "scaler": [s.plan, s.decision, s.actuator],
    }[role] + [f"$KV.{kv}.{k}" for k in keys[role]]
    pub = _COMMON_PUB + own + ["$JS.API.>", s.service_status("*")]
    # The JetStream API is open to services (stream/bucket creation at start-up), so the
    # keys of the other services (and the plan subject) are denied explicitly.
    perms: dict[str, Any] = {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    deny = [f"$KV.{kv}.{k}" for r, ks in keys.items() if r != role for k in ks]
    perms["publish"]["deny"] = deny + ([] if role == "scaler" else [s.plan])
    return perms


def write_role_credentials(directory: Path) -> dict[str, tuple[Path, Credentials]]:
    """A fresh random password per role, each in ``directory/<role>.json`` (mode 0600)."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    out: dict[str, tuple[Path, Credentials]] = {}
    for role in ROLES:
        creds = Credentials(user=role, password=secrets.token_urlsafe(24))
        path = directory / f"{role}.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"user": creds.user, "password": creds.password}, f)
            f.write("\n")
        os.chmod(path, 0o600)
        out[role] = (path, creds)
    return out


def authorization_block(users: list[tuple[Credentials, dict[str, Any] | None]]) -> str:
    """The nats-server ``authorization`` block for ``users`` (JSON is valid NATS config)."""
    entries = []
    for creds, perms in users:
        e: dict[str, Any] = {"user": creds.user, "password": creds.password}
        if perms is not None:
            e["permissions"] = perms
        entries.append(e)
    return "authorization " + json.dumps({"users": entries}, indent=1)
