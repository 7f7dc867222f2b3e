"""The straggler rule as a pure function (services/health_monitor/stragglers.py, issue 41 item
6), property-tested: a member x5 slower among 2 or 3 is declared within a window and a half
of simulated time whatever the noise, the load that slows every member alike, and a
minority of noisy samples; a run without one declares nobody. Times are simulated (ticks of
the monitor's check), never waited for."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as hs

from services.health_monitor import stragglers as sg

TICK = 0.25          # the monitor's straggler check, as in the monitor
NOISE = (0.9, 1.1)  # every sample's noise (and a quarter of the straggler's look fast)


def test_a_member_is_judged_against_the_others_not_itself():
    rule = sg.Rule()
    # two members: the median of both would be the slower one (never declared)
    v = sg.judge(sg.Pace(0.15), [sg.Pace(0.03)], rule)
    assert v.slow and v.ratio == pytest.approx(5.0)
    assert not sg.judge(sg.Pace(0.03), [sg.Pace(0.15)], rule).slow
    # the figures: x5 on a member faster than the others is 3.2x them at most, and
    # that noise puts under the factor; against its own earlier pace it is x5
    me, others = sg.Pace(0.085, base=0.018), [sg.Pace(0.029, 0.029), sg.Pace(0.03, 0.029)]
    assert not sg.judge(sg.Pace(0.085), others, rule).slow
    v = sg.judge(me, others, rule)
    assert v.slow and "own earlier" in v.why and v.ratio == pytest.approx(0.085 / 0.0295)
    # tiny steps jitter: over the factor but not min_s slower
    assert not sg.judge(sg.Pace(0.004, 0.001), [sg.Pace(0.001, 0.001)], rule).slow


def test_bad_settings_and_input_are_refused():
    for kw in ({"factor": 1.0}, {"window": 0}, {"fraction": 0}, {"min_s": -1}):
        with pytest.raises(ValueError, match="straggler rule"):
            sg.Rule(**kw)
    with pytest.raises(ValueError, match="at least one other"):
        sg.judge(sg.Pace(1.0), [], sg.Rule())


paces = hs.builds(sg.Pace, hs.floats(0.001, 10), hs.one_of(hs.none(), hs.floats(0.001, 10)))


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.sampled_from([0.01, 0.03, 0.05, 0.2, 0.5]),
                          hs.sampled_from([None, 0.0, 0.01, 0.03, 0.1])), min_size=2, max_size=12))
def test_judging_every_member_at_once_gives_each_ones_own_verdict(pairs):
    """The monitor judges every member at once (``judge_all``, one sort: judging each alone
    was O(N² log N), seconds per check at thousands of members): each verdict is exactly the
    one ``judge`` gives that member against the others (repeated values, members without a
    steady pace, a single other with one)."""
    paces = [sg.Pace(c, b) for c, b in pairs]
    rule = sg.Rule()
    assert sg.judge_all(paces, rule) == [sg.judge(p, paces[:i] + paces[i + 1:], rule)
                                         for i, p in enumerate(paces)]
    with pytest.raises(ValueError, match="at least one other"):
        sg.judge_all(paces[:1], rule)


@settings(max_examples=300, deadline=None)
@given(hs.lists(paces, min_size=2, max_size=8), hs.floats(0.01, 100))
def test_the_verdict_does_not_depend_on_the_units(ps, k):
    """Every member k times slower (a load on the whole machine): the same verdicts (min_s
    aside: it is the one absolute figure)."""
    rule = sg.Rule(min_s=0.0)
    scaled = [sg.Pace(p.compute * k, None if p.base is None else p.base * k) for p in ps]
    for i in range(len(ps)):
        a = sg.judge(ps[i], ps[:i] + ps[i + 1:], rule)
        b = sg.judge(scaled[i], scaled[:i] + scaled[i + 1:], rule)
        if abs(a.ratio / max(a.ratio, b.ratio) - 1) < 1e-9:  # float rounding at the edge
            assert a.slow == b.slow


@settings(max_examples=300, deadline=None)
@given(hs.lists(hs.floats(0.001, 10), min_size=2, max_size=8), hs.floats(0.5, 2.0))
def test_members_at_one_pace_are_never_slow(bases, load):
    """Every member at its own steady pace (times any common load): nobody is slow."""
    ps = [sg.Pace(b * load, b) for b in bases]
    slow_a = [sg.judge(ps[i], ps[:i] + ps[i + 1:], sg.Rule()).why for i in range(len(ps))
              if sg.judge(ps[i], ps[:i] + ps[i + 1:], sg.Rule()).slow]
    assert all("own earlier" not in w for w in slow_a)  # only an inherently slower member


def _simulate(n: int, base: list[float], noise: list[float], load: list[float],
              slow_from: float | None, glitches: set[int], rule: sg.Rule,
              until: float) -> tuple[float | None, list[str]]:
    """Members heartbeat every tick; member 1 computes x5 from ``slow_from`` (but at the
    ``glitches`` ticks, where it looks fast); every member is slowed by ``load`` (the other
    job). Returns when member 1 is first due (None: never) and who else ever was."""
    tr = sg.Tracker(rule)
    pods = [f"w{i}" for i in range(n)]
    due_at, others_due = None, []
    ticks = int(until / TICK)
    for k in range(ticks):
        t = k * TICK
        compute = []
        for i in range(n):
            c = base[i] * load[k % len(load)] * noise[(k * n + i) % len(noise)]
            if i == 1 and slow_from is not None and t >= slow_from and k not in glitches:
                c *= 5
            compute.append(c)
            tr.observe(pods[i], 1, c)
        ps = [sg.Pace(compute[i], tr.base(pods[i], 1, t)) for i in range(n)]
        for i in range(n):
            v = sg.judge(ps[i], ps[:i] + ps[i + 1:], rule)
            tr.mark(pods[i], 1, t, v.slow)
            if tr.due(pods[i], t):
                if i == 1 and due_at is None:
                    due_at = t
                elif i != 1:
                    others_due.append(pods[i])
    return due_at, others_due


scenario = dict(
    n=hs.sampled_from([2, 3]),
    # members of unequal speeds (x2 at most: no straggler by itself, noise included): x5 on a
    # faster one can be under x3 the others'
    base=hs.tuples(hs.floats(0.03, 2.0), hs.lists(hs.floats(0.7, 1.4), min_size=3,
                                                   max_size=3)).map(
        lambda b: [b[0] * h for h in b[1]]),
    noise=hs.lists(hs.floats(*NOISE), min_size=1, max_size=50),
    load=hs.lists(hs.floats(1.0, 4.0), min_size=1, max_size=1).map(lambda x: x * 40)
    | hs.lists(hs.floats(1.0, 1.5), min_size=1, max_size=40),
    # a steady pace first (a new generation's history starts empty)
    onset=hs.floats(0.3 * sg.WINDOW_S, 2 * sg.WINDOW_S),
    glitch_every=hs.integers(4, 100),
)


@settings(max_examples=200, deadline=None)
@given(**scenario)
def test_a_x5_straggler_is_declared_within_a_window_and_a_half(n, base, noise, load, onset,
                                                               glitch_every):
    """x5 at the defaults: due after most of a window and within a window and a half, among
    2 and 3 members, under a load that varies (another job on the same cores), with up to a
    quarter of its samples looking fast; nobody else is ever due."""
    rule = sg.Rule()
    glitches = set(range(0, 10_000, glitch_every))
    until = onset + 1.5 * rule.window
    due, others = _simulate(n, base, noise, load, onset, glitches, rule, until + TICK)
    assert others == []
    assert due is not None, "never declared"
    assert onset + rule.fraction * rule.window - 2 * TICK <= due <= until


@settings(max_examples=200, deadline=None)
@given(**scenario)
def test_nobody_is_declared_without_a_straggler(n, base, noise, load, onset, glitch_every):
    due, others = _simulate(n, base, noise, load, None, set(), sg.Rule(), 4 * sg.WINDOW_S)
    assert due is None and others == []


@settings(max_examples=100, deadline=None)
@given(hs.lists(hs.tuples(hs.floats(0, 1e4), hs.floats(0.001, 10), hs.booleans()),
                max_size=600))
def test_what_the_tracker_keeps_is_bounded(events):
    rule = sg.Rule(window=1.0)
    tr = sg.Tracker(rule)
    for t, c, slow in sorted(events):
        tr.observe("w0", 1, c)
        tr.mark("w0", 1, t, slow)
        h = tr._h["w0"]  # fixed-size rings: nothing grows with the run
        assert len(h.calm.vals) == sg.HORIZON * sg.SAMPLES_PER_WINDOW
        assert len(h.marks.vals) == sg.MARKS_PER_WINDOW
        assert len(h.calm.values(t)) <= len(h.calm.vals)
    tr.forget("w0")
    assert len(tr) == 0


def test_a_new_generation_starts_a_new_history():
    rule = sg.Rule(window=1.0)
    tr = sg.Tracker(rule)
    for k in range(40):
        tr.observe("w0", 1, 0.05)
        tr.mark("w0", 1, k * 0.1, k < 10)
    assert not tr.due("w0", 3.9) and tr.base("w0", 1, 3.9) == 0.05
    for k in range(40, 60):
        tr.observe("w0", 1, 0.5)
        tr.mark("w0", 1, k * 0.1, True)
    assert tr.due("w0", 5.9) and tr.base("w0", 1, 5.9) == 0.05  # slow paces are not its own
    assert tr.base("w0", 1, 5.9 + sg.HORIZON) is None  # too old to be its pace now
    tr.observe("w0", 2, 0.5)  # a new plan: its share of the work changed
    assert tr.base("w0", 2, 6.0) is None and not tr.due("w0", 6.0)
    tr.unmark("w0")
    assert not tr.due("w0", 4.0)


def test_up_refuses_a_rule_that_cannot_work_before_it_starts_anything(tmp_path, capsys):
    from ops.cli import main

    for flags in (["--straggler-factor", "0.5"], ["--straggler-window", "0"]):
        assert main(["up", "--run-dir", str(tmp_path / "r"), *flags]) == 2
        assert "straggler rule" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
