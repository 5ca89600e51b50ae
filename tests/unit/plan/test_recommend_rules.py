"""#41 item 6: a trial's TTFT p95 is read from its file; an impossible one (negative, not finite) is left out and
said, never counted as meeting the SLO (a p95 of -1 s "met" any SLO). The recommendation over a real sweep is in
tests/integration/test_plan_sweep.py."""

from __future__ import annotations

import pytest

from kvtier.plan.recommend import slo_verdict


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("-inf"), float("inf")])
def test_an_impossible_p95_never_meets_the_slo(bad: float):
    p95, meets, note = slo_verdict([bad], 0.5)
    assert p95.mean is None and meets is None and "1 trial(s) with an impossible TTFT p95 left out" in note
    p95, meets, note = slo_verdict([bad, 0.9, 0.8], 0.5)  # the real trials decide: they miss it
    assert p95.n == 2 and meets is False and "impossible" in note


def test_real_trials_meet_or_miss_by_the_intervals_upper_end():
    p95, meets, note = slo_verdict([0.30, 0.32, 0.31], 0.5)
    assert meets is True and p95.high is not None and p95.high <= 0.5 and note == ""
    _, meets, note = slo_verdict([0.4], 0.5)
    assert meets is True and note == "one trial: no interval"
    _, meets, _ = slo_verdict([0.4, None], None)
    assert meets is None
