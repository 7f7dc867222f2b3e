"""The timeout hierarchy (schemas/timeouts.py) and where it is enforced."""

from __future__ import annotations

import pytest

from agent.config import AgentConfig
from schemas.timeouts import DEFAULTS, TimeoutConfigError, check_timeouts


def test_defaults_are_consistent():
    assert check_timeouts() == DEFAULTS


@pytest.mark.parametrize("given, needle", [
    ({"heartbeat_interval": 0.6}, "heartbeat_interval (0.6s) must be < suspect_timeout"),
    ({"stall_timeout": 1.0}, "fault_timeout (1.5s) must be < stall_timeout (1s)"),
    ({"collective_timeout": 5.0}, "stall_timeout (10s) must be <= collective_timeout (5s)"),
    ({"recovery_timeout": 20.0}, "collective_timeout (30s) must be <= recovery_timeout"),
    ({"fault_timeout": -1.0}, "fault_timeout must be positive"),
])
def test_violations_are_named(given, needle):
    with pytest.raises(TimeoutConfigError) as e:
        check_timeouts(**given)
    assert needle in str(e.value)


def test_unknown_name_is_an_error():
    with pytest.raises(TypeError, match="unknown timeouts: fault"):
        check_timeouts(fault=1.0)


def test_agent_config_refuses_a_collective_timeout_above_recovery():
    with pytest.raises(TimeoutConfigError, match="recovery_timeout"):
        AgentConfig(nats_url="nats://127.0.0.1:1", pod="w0", collective_timeout=90.0)


def test_up_refuses_inconsistent_timeouts(capsys):
    from ops.cli import main

    code = main(["up", "--fault-timeout", "5", "--stall-timeout", "2", "--steps", "1"])
    assert code == 2
    assert "fault_timeout (5s) must be < stall_timeout (2s)" in capsys.readouterr().err


def test_partial_checks_only_what_is_given():
    # the monitor owns suspect < fault < stall; a short stall is fine if fault is shorter
    check_timeouts(True, suspect_timeout=0.1, fault_timeout=0.3, stall_timeout=0.4)
    with pytest.raises(TimeoutConfigError, match="fault_timeout"):
        check_timeouts(True, suspect_timeout=0.1, fault_timeout=0.3, stall_timeout=0.3)


def test_agent_timeouts_from_the_environment():
    from schemas.timeouts import agent_timeouts_from_env

    assert agent_timeouts_from_env({}) == {}
    assert agent_timeouts_from_env({"CEASELESS_COLLECTIVE_TIMEOUT": "8"}) == {
        "collective_timeout": 8.0, "recovery_timeout": DEFAULTS["recovery_timeout"]}
    with pytest.raises(ValueError, match="CEASELESS_RECOVERY_TIMEOUT='x' is not a number"):
        agent_timeouts_from_env({"CEASELESS_RECOVERY_TIMEOUT": "x"})


def test_a_collective_timeout_set_alone_carries_the_recovery_timeout(monkeypatch):
    """Issue 41 (5a): CEASELESS_COLLECTIVE_TIMEOUT=120 alone was refused ("must be <=
    recovery_timeout (60s)"), by `up` and by every pod: the recovery timeout now follows
    it; both set and inconsistent, the refusal names the variable to set."""
    from schemas.timeouts import agent_timeouts_from_env

    env = {"CEASELESS_COLLECTIVE_TIMEOUT": "120"}
    got = agent_timeouts_from_env(env)
    check_timeouts(**got)  # what `up` checks
    assert got["recovery_timeout"] >= got["collective_timeout"]
    for k in [k for k in __import__("os").environ if k.startswith("CEASELESS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CEASELESS_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("CEASELESS_COLLECTIVE_TIMEOUT", "120")
    cfg = AgentConfig.from_env()  # what every pod builds
    assert cfg.collective_timeout == 120 and cfg.recovery_timeout == got["recovery_timeout"]
    monkeypatch.setenv("CEASELESS_RECOVERY_TIMEOUT", "60")
    with pytest.raises(TimeoutConfigError, match="set CEASELESS_RECOVERY_TIMEOUT to at least 120"):
        AgentConfig.from_env()
