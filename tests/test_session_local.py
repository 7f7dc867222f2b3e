"""The Session without a cluster: single-process mode, and what it refuses."""

from __future__ import annotations

import os

import pytest


def test_a_script_under_torchrun_is_refused(monkeypatch):
    """Issue 23: a Ceaseless script under torchrun without Ceaseless' environment would run
    N independent single-process jobs; it is refused with what to do instead."""
    import agent

    for k in [k for k in os.environ if k.startswith("CEASELESS_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match="ceaseless up"):
        agent.Session.from_env(global_batch_size=8)
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.delenv("RANK")
    s = agent.Session.from_env(global_batch_size=8)  # one process: fine
    assert (s.rank, s.world_size, s.is_member) == (0, 1, True)
