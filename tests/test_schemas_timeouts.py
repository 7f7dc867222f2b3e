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
        "collective_timeout": 8.0}
    with pytest.raises(ValueError, match="CEASELESS_RECOVERY_TIMEOUT='x' is not a number"):
        agent_timeouts_from_env({"CEASELESS_RECOVERY_TIMEOUT": "x"})
