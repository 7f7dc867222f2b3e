"""The health monitor's repeated-failure rule (services/health_monitor/repeats.py), pure."""

from __future__ import annotations

from hypothesis import given, strategies as st

from services.health_monitor.repeats import Failure, RepeatDetector, signature

TB = ('ValueError: bad batch at 0x7f3a2b\nTraceback (most recent call last):\n'
      '  File "/job/train.py", line 40, in <module>\n    check(x)\n'
      '  File "/job/train.py", line 12, in check\n    raise ValueError(...)\n')


def test_the_same_error_at_the_same_step_on_a_second_pod_is_a_bug():
    d = RepeatDetector()
    assert d.observe(Failure("w0", "exception", 1, 5, TB)) is None
    assert d.observe(Failure("w0", "exception", 1, 5, TB)) is None      # the same pod again
    # another address in the message: the same bug
    first = d.observe(Failure("w1", "exception", 1, 5, TB.replace("0x7f3a2b", "0x55aa")))
    assert first is not None and first.pod == "w0"


def test_another_step_place_or_injected_fault_is_no_repeat():
    d = RepeatDetector()
    d.observe(Failure("w0", "exception", 1, 5, TB))
    assert d.observe(Failure("w1", "exception", 1, 6, TB)) is None       # another step
    assert d.observe(Failure("w1", "exception", 1, 5,
                             TB.replace("line 12", "line 13"))) is None  # another place
    inj = "InjectedFault: injected exception at step 6\nTraceback ..."
    assert d.observe(Failure("w0", "exception", 1, 5, inj)) is None
    assert d.observe(Failure("w1", "exception", 2, 5, inj)) is None
    stall = "no step boundary for 3.0 s (injected)"
    assert d.observe(Failure("w0", "hang", 1, 5, stall)) is None
    assert d.observe(Failure("w1", "hang", 2, 5, stall)) is None


def test_a_hang_repeats_only_in_a_later_generation():
    d = RepeatDetector()
    assert d.observe(Failure("w0", "hang", 1, 7, "step 7 not advanced")) is None
    assert d.observe(Failure("w1", "hang", 1, 7, "absent")) is None  # the same incident
    assert d.observe(Failure("s0", "hang", 2, 7, "absent")).pod == "w0"


@given(st.lists(st.tuples(st.sampled_from(["w0", "w1", "w2"]), st.integers(0, 3),
                          st.integers(1, 3)), max_size=30))
def test_a_repeat_names_an_earlier_failure_of_another_pod_with_the_same_signature(events):
    d = RepeatDetector(max_entries=2)
    seen: list[Failure] = []
    for pod, step, gen in events:
        f = Failure(pod, "exception", gen, step, TB)
        first = d.observe(f)
        if first is not None:
            assert first.pod != f.pod and signature(first) == signature(f)
            assert first in seen
        seen.append(f)
    assert len(d._first) <= 2
