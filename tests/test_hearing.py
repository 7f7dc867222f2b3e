"""The rule that tells a service instance's own outage from the pods' silence
(services/common/hearing.py, issue 42): pure, on a clock the test moves."""

from __future__ import annotations

import time

import pytest

from services.common.hearing import Ear, Hearing, quiet

FT = 3.5


def test_no_pod_heard_for_a_fault_timeout_is_the_instances_own_outage():
    h = Hearing(FT, now=100.0)
    h.heard(100.5)
    assert not h.deaf(100.5 + FT) and h.state is Ear.HEARING
    assert h.deaf(100.5 + FT + 0.1) and h.state is Ear.DEAF
    assert h.status(100.5 + FT + 0.1)["state"] == "deaf"


def test_the_first_pod_heard_after_the_gap_restarts_the_count_for_every_pod():
    """The incident: nothing heard for 15 s (a partition, then a stuck route); w0 is heard
    again, w2 a heartbeat interval later. Neither is silent: each has a full fault timeout
    from the end of the gap, and the pod never heard again (killed meanwhile) is silent a
    fault timeout after it."""
    h = Hearing(FT, now=0.0)
    h.heard(10.0)                # the last heartbeat before the cut, from any pod
    assert h.deaf(10.0 + FT + 1)
    assert h.heard(25.0) == pytest.approx(15.0)  # w0: the gap it ends
    assert not h.deaf(25.2) and h.since == 25.0
    w2_last, w1_last = 9.9, 5.0  # as this view last heard them, before the cut
    assert quiet(w2_last, h.since, 25.2) == pytest.approx(0.2)  # not silent (else 15.3 s)
    assert quiet(w1_last, h.since, 25.0 + FT + 0.1) > FT  # silent, counted from the gap's end
    assert quiet(None, h.since, 25.0 + FT + 0.1) > FT     # never heard: the same
    assert h.heard(25.3) is None and h.since == 25.0     # heartbeats go on: nothing moves


def test_a_heartbeat_relayed_late_moves_nothing_back():
    h = Hearing(FT, now=0.0)
    h.heard(5.0)
    assert h.heard(4.0) is None and h.last == 5.0


def test_a_new_jobs_first_pod_is_no_outage_unless_one_was_found():
    """Services start seconds before their job's pods: the first heartbeat ends no gap. A
    restarted instance that found no pod at all for a fault timeout (``deaf``) counts
    silence from the first pod it hears."""
    fresh = Hearing(FT, now=0.0)
    assert fresh.heard(10.0) is None and fresh.since == 0.0
    blind = Hearing(FT, now=0.0)
    assert blind.deaf(FT + 1)
    assert blind.heard(10.0) == pytest.approx(10.0) and blind.since == 10.0
    assert not blind.deaf(10.1)


def test_a_fault_timeout_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        Hearing(0.0, now=0.0)


def test_a_watched_outage_is_the_longest_stretch_no_pod_was_heard():
    """Issue 45: an outage found by a PING that was not answered in time is, once it is
    answered, the longest stretch in which no pod was heard, from the last one heard before
    it: a reader that fell behind heard pods all along (a few ms); a paused server's stretch
    is its pause; a gap already forgiven as deafness is not forgiven twice."""
    h = Hearing(FT, now=0.0)
    h.heard(1.0)
    h.watch("link")               # at 1.2: the PING was not answered
    for t in (1.3, 1.35, 1.4):    # pods heard all along (the backlog being read)
        h.heard(t)
    assert h.unwatch("link", 1.45) == pytest.approx(0.3)  # 1.0 -> 1.3, the longest
    h.watch("link")
    h.watch("link")               # a second failure changes nothing
    h.heard(3.4)                  # paused 1.4 -> 3.4 (under FT: no deafness)
    h.heard(3.45)
    assert h.unwatch("link", 3.5) == pytest.approx(2.0)
    assert h.unwatch("lease", 3.9) == pytest.approx(0.45)  # not watched: the last stretch
    h.watch("link")
    assert h.heard(3.45 + FT + 1) == pytest.approx(FT + 1)  # deafness ends: forgiven there
    assert h.unwatch("link", 3.45 + FT + 1.1) == pytest.approx(0.1)  # not twice
    t = 3.45 + FT + 1.1
    h.watch("link")               # the PING and the lease renewals fail together
    h.watch("lease")
    assert h.unwatch("link", t + 2.0) == pytest.approx(2.1)  # from the last pod heard
    h.forgave(t + 2.0)            # (the monitor's grace) ...
    h.heard(t + 2.1)
    assert h.unwatch("lease", t + 2.2) == pytest.approx(0.1)  # ... not forgiven again


def test_the_scaler_heard_again_by_an_aged_heartbeat_gives_every_pod_a_fault_timeout_from_now():
    """After a stretch with no pod heard (a partition), the first heartbeat heard may be an
    old one (a monitor's view, cut off too, carries its age). Silence must count from when it
    was heard, not from its own time: a spare not heard yet was judged dead at once before,
    and the job shrank for "no live spare" (CI, two of three bus hosts lost)."""
    from plumbing import logs
    from schemas.messages import AgentState, Heartbeat, Member, Plan, Role
    from services.scaler.liveness import Liveness

    ft = 0.2
    live = Liveness(ft, lambda *a, **k: None, logs.get("test"))
    plan = Plan(generation=1, members=[Member(pod="w0", rank=0)], world_size=1,
                global_batch_size=1, micro_batch_size=1, shares={0: 1})

    def beat(pod: str, role: Role, age: float = 0.0) -> None:
        live.heartbeat(Heartbeat(pod=pod, role=role, generation=1 if role == Role.worker else 0,
                                 rank=0 if role == Role.worker else None,
                                 state=AgentState.training if role == Role.worker
                                 else AgentState.waiting), "hb", age)

    beat("w0", Role.worker)
    beat("s0", Role.spare)
    assert live.alive_spares(plan) == ["s0"]
    time.sleep(ft * 3)
    assert live.deaf(time.monotonic())  # nobody heard for a fault timeout: the scaler's own
    beat("w0", Role.worker, age=ft * 1.2)  # heard again, by a heartbeat aged by a view
    assert not live.deaf(time.monotonic())
    assert live.alive_spares(plan) == ["s0"]  # its silence counts from now
    time.sleep(ft * 1.5)
    assert live.alive_spares(plan) == []  # and a fault timeout later it is silent indeed
