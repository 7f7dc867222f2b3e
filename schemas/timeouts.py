"""The timeout hierarchy every part must agree on, checked where a configuration starts.

    heartbeat interval < suspect timeout < fault timeout < stall timeout
                       <= collective timeout <= recovery attempt timeout

Why: a heartbeat must be able to arrive a few times before a pod is called silent; a pod
whose step stands still must be told apart from one that is merely silent; a collective must
not give up on a peer the monitor still calls alive and merely slow; one recovery attempt
must outlast the collective waits inside it. An inconsistent configuration is refused with
the reason, never silently adjusted.
"""

from __future__ import annotations

DEFAULTS = {"heartbeat_interval": 0.25, "suspect_timeout": 0.5, "fault_timeout": 1.5,
            "stall_timeout": 10.0, "collective_timeout": 30.0, "recovery_timeout": 60.0}
# Not part of the hierarchy: how often the health monitor publishes its health view of every
# pod to the scaler and the state broker (services/common/heartbeats.py).
VIEW_INTERVAL = 0.5
_ORDER = [("heartbeat_interval", "<", "suspect_timeout"),
          ("suspect_timeout", "<", "fault_timeout"),
          ("fault_timeout", "<", "stall_timeout"),
          ("stall_timeout", "<=", "collective_timeout"),
          ("collective_timeout", "<=", "recovery_timeout")]


# The agents read theirs from the environment (agent/config.py); `ceaseless up`'s pods
# inherit its own, so `up` checks these and hands the collective timeout to the monitor.
AGENT_ENV = {"collective_timeout": "CEASELESS_COLLECTIVE_TIMEOUT",
             "recovery_timeout": "CEASELESS_RECOVERY_TIMEOUT"}


# Where each timeout is set, named in a refusal (the fix is to set the other one too).
WHERE = {**AGENT_ENV, "fault_timeout": "--fault-timeout", "stall_timeout": "--stall-timeout",
         "heartbeat_interval": "CEASELESS_HEARTBEAT_INTERVAL"}


def recovery_for(collective_timeout: float) -> float:
    """The recovery timeout that goes with a collective timeout when only that one is set:
    the default's ratio to it (an attempt outlasts the collective waits inside it), never
    below the default."""
    ratio = DEFAULTS["recovery_timeout"] / DEFAULTS["collective_timeout"]
    return max(DEFAULTS["recovery_timeout"], ratio * collective_timeout)


def agent_timeouts_from_env(env: dict[str, str] | None = None) -> dict[str, float]:
    """The agent timeouts set in ``env`` (default ``os.environ``); ValueError if one is not
    a number. A collective timeout set alone carries the recovery timeout with it
    (``recovery_for``): ``CEASELESS_COLLECTIVE_TIMEOUT=120`` alone is consistent."""
    import os

    env = os.environ if env is None else env
    out = {}
    for k, v in AGENT_ENV.items():
        if env.get(v):
            try:
                out[k] = float(env[v])
            except ValueError:
                raise ValueError(f"{v}={env[v]!r} is not a number of seconds") from None
    if "collective_timeout" in out and "recovery_timeout" not in out:
        out["recovery_timeout"] = recovery_for(out["collective_timeout"])
    return out


class TimeoutConfigError(ValueError):
    """The timeouts contradict each other (the message says which and why)."""


def check_timeouts(partial: bool = False, **given: float | None) -> dict[str, float]:
    """Validate the hierarchy over ``given`` (missing or None values take the defaults);
    returns the full set. With ``partial`` only the given values are compared with each
    other (a process that owns part of the chain, e.g. the health monitor, checks its part).
    Raises TimeoutConfigError naming every violated pair."""
    unknown = set(given) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown timeouts: {', '.join(sorted(unknown))}")
    t = {k: float(given[k]) if given.get(k) is not None else v for k, v in DEFAULTS.items()}
    bad = [f"{k} must be positive (got {v})" for k, v in t.items() if not v > 0]
    names = [a for a, _, _ in _ORDER] + [_ORDER[-1][2]]
    chain = [n for n in names if given.get(n) is not None] if partial else names
    for a, b in zip(chain, chain[1:]):
        ia, ib = names.index(a), names.index(b)
        op = "<" if any(o == "<" for _, o, _ in _ORDER[ia:ib]) else "<="
        ok = t[a] < t[b] if op == "<" else t[a] <= t[b]
        if not ok:
            bad.append(f"{a} ({t[a]:g}s) must be {op} {b} ({t[b]:g}s)"
                       f"{_fix(a, b, op, t)}")
    if bad:
        raise TimeoutConfigError("inconsistent timeouts: " + "; ".join(bad))
    return t


def _fix(a: str, b: str, op: str, t: dict[str, float]) -> str:
    """What to set: both ends, where each is set."""
    wa, wb = WHERE.get(a), WHERE.get(b)
    if not (wa and wb):
        return ""
    return f" (set {wb} {'above' if op == '<' else 'to at least'} {t[a]:g}, or {wa} lower)"
