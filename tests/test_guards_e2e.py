"""Issue 32, the non-finite guard: a step whose loss (or gradient) is not finite on any rank
is skipped on every rank alike, listed in summary.json's ``skipped_steps``, and a run with
the same injected NaN gives the same result twice (real pods under ``ceaseless up``)."""

from __future__ import annotations

import pytest

from harness import log_events, run_job

pytestmark = [pytest.mark.timeout(300)]
STEPS, AT = 30, 12


async def _nan(c):
    from schemas.messages import Inject, InjectAction

    await c.wait_rank_step(1, 2)
    await c.bus.publish(c.bus.subjects.inject, Inject(action=InjectAction.nan, rank=1,
                                                      at_step=AT))


async def test_an_injected_nan_step_is_skipped_on_every_rank_and_repeats(tmp_path):
    a = await run_job(tmp_path, "a", 2, 0, fault=_nan, steps=STEPS)
    b = await run_job(tmp_path, "b", 2, 0, fault=_nan, steps=STEPS)
    clean = await run_job(tmp_path, "clean", 2, 0, steps=STEPS)
    for s in (a, b):
        assert s["final_step"] == STEPS - 1 and s["skipped_steps"] == [AT], s
        assert s["incidents"] == [] and s["lost_steps"] == 0
        assert s["losses"][str(AT)] is None  # not finite: no loss to show
    assert a["param_sha256"] == b["param_sha256"]  # the same skip, the same result
    assert clean["skipped_steps"] == [] and clean["param_sha256"] != a["param_sha256"]
    warned = {r["step"]: r["ranks"] for pod in ("w0", "w1")
              for r in log_events(tmp_path / "a", pod, "non-finite loss: the step's update is "
                                  "skipped on every rank")}
    assert warned == {AT: [1]}  # every rank names rank 1, whose local loss was NaN
