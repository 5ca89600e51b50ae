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


def _point(name: str, cpu: float, p95s: list[float], slo: float = 0.5, cost: float | None = None):  # type: ignore[no-untyped-def]
    from kvtier.plan.recommend import PointStats, interval

    p95, meets, note = slo_verdict(p95s, slo)
    none = interval([])
    return PointStats(point=name, cpu_gb=cpu, nvme_gb=0, concurrency=4, trials=len(p95s), trials_not_complete=0,
                      ttft_p95_s=p95, ttft_p50_s=none, gpu_hit_share=none, offload_hit_share=none,
                      requests_per_s=none, cost_usd_per_hour=cost, meets_slo=meets, note=note)  # fmt: skip


def test_an_interval_is_clipped_at_what_the_quantity_can_be_and_says_so():
    """#44 item 6: two noisy trials gave `0.587 ± 5.067 s`, an interval far below zero seconds."""
    from kvtier.plan.recommend import interval

    i = interval([0.05, 1.2], lo=0.0)
    assert i.low == 0.0 and i.clipped and i.high is not None and i.high > 1.2 and i.sd is not None
    s = interval([0.9, 1.0], lo=0.0, hi=1.0)
    assert s.high == 1.0 and s.clipped and s.low is not None and s.low < 0.9
    assert not interval([0.30, 0.32, 0.31], lo=0.0).clipped


def test_a_cheaper_point_that_may_meet_the_slo_makes_the_pick_a_tie_with_the_trials_that_would_tell():
    """#44 item 6: the sweep's pick flipped under load. The pick meets the SLO by its interval's upper end; a cheaper
    point whose interval reaches below the SLO without meeting it may meet it too: a tie, not a winner, with the
    trials it would need at its spread now; a cheaper point clearly above the SLO is no contender."""
    from kvtier.plan.recommend import picks_of, trials_to_separate

    small = _point("cpu0-nvme0-c4", 0, [0.40, 0.62], cost=0.0)  # mean 0.51, interval ~ -0.9..2.0: may meet 0.5
    big = _point("cpu2-nvme0-c4", 2, [0.20, 0.22, 0.21], cost=0.01)  # meets
    (pick,) = picks_of([small, big], 0.5)
    assert pick.point == "cpu2-nvme0-c4" and pick.tie_with == "cpu0-nvme0-c4"
    assert "a tie, not a winner" in pick.sentence and "may meet it too" in pick.sentence
    n = trials_to_separate(small.ttft_p95_s, 0.5)
    assert pick.trials_to_separate == n and n is not None and n > 2 and f"about {n} trials" in pick.sentence
    far = _point("cpu0-nvme0-c4", 0, [0.90, 0.95, 0.92], cost=0.0)  # clearly misses: no contender
    (pick,) = picks_of([far, big], 0.5)
    assert pick.tie_with is None and pick.sentence.endswith("the cheapest by cost")
    (none,) = picks_of([small], 0.5)  # nothing meets it, and the one point may
    assert none.point is None and none.tie_with == "cpu0-nvme0-c4" and "may meet it too" in none.sentence
    at = _point("x", 0, [0.4, 0.6])  # its mean is the SLO: no number of trials would tell
    assert trials_to_separate(at.ttft_p95_s, 0.5) is None
