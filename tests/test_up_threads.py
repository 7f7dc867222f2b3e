"""`ceaseless up` shares a machine's cores out among its pods (OMP_NUM_THREADS), as torchrun
does, unless the operator chose: torch's default of a thread per core in every process made
two co-located CPU pods 20-50x slower per step."""

from __future__ import annotations

import pytest

from ops.cluster import UpOptions, _default_threads, pod_threads


@pytest.mark.parametrize("cores,workers,max_replicas,want", [
    (2, 2, None, 1), (16, 8, None, 2), (16, 2, None, 8), (16, 2, 8, 2), (1, 4, None, 1),
    (64, 3, None, 21)])
def test_pod_threads_shares_the_cores(cores, workers, max_replicas, want):
    assert pod_threads(cores, workers, max_replicas) == want


def test_the_operators_choice_wins(monkeypatch):
    opts = UpOptions(workers=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    env: dict[str, str] = {}
    assert _default_threads(env, opts, ray=False) == "" and "OMP_NUM_THREADS" not in env
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _default_threads(env, opts, ray=True) == "" and "OMP_NUM_THREADS" not in env
    note = _default_threads(env, opts, ray=False)
    assert env["OMP_NUM_THREADS"] == str(pod_threads(__import__("os").cpu_count() or 1, 2, None))
    assert "OMP_NUM_THREADS=" in note
