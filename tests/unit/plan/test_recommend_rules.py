"""#41 item 6: a trial's TTFT p95 is read from its file; an impossible one (negative, not finite) is left out and
said, never counted as meeting the SLO (a p95 of -1 s "met" any SLO). The recommendation over a real sweep is in
tests/integration/test_plan_sweep.py."""

from __future__ import annotations

import pytest

from kvtier.plan.recommend import slo_verdict


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("-inf"), float("inf")])
def test_an_impossible_p95_never_meets_the_slo(bad: float):
    p95, meets, note, _ = slo_verdict([bad], 0.5)
    assert p95.mean is None and meets is None and "1 trial(s) with an impossible TTFT p95 left out" in note
    p95, meets, note, _ = slo_verdict([bad, 0.9, 0.8], 0.5)  # the real trials decide: they miss it
    assert p95.n == 2 and meets is False and "impossible" in note


def test_real_trials_meet_or_miss_by_the_intervals_upper_end():
    p95, meets, note, _ = slo_verdict([0.30, 0.32, 0.31], 0.5)
    assert meets is True and p95.high is not None and p95.high <= 0.5 and note == ""
    _, meets, note, _ = slo_verdict([0.4], 0.5)
    assert meets is True and note == "one trial: no interval"
    _, meets, _, _ = slo_verdict([0.4, None], None)
    assert meets is None


def _point(name: str, cpu: float, p95s: list[float], slo: float = 0.5, cost: float | None = None, twin=None):  # type: ignore[no-untyped-def]
    from kvtier.plan.recommend import PointStats, interval

    p95, meets, note, wide = slo_verdict(p95s, slo, twin)
    none = interval([])
    return PointStats(point=name, cpu_gb=cpu, nvme_gb=0, concurrency=4, trials=len(p95s), trials_not_complete=0,
                      ttft_p95_s=p95, ttft_p50_s=none, gpu_hit_share=none, offload_hit_share=none,
                      requests_per_s=none, cost_usd_per_hour=cost, meets_slo=meets, note=note, twin_error=twin,
                      ttft_p95_s_with_twin=wide)  # fmt: skip


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


def _twin(low: float, high: float):  # type: ignore[no-untyped-def]
    from kvtier.results.ladder import TwinError

    return TwinError(ratio_low=low, ratio_high=high, points=12, basis="test")


def test_a_twins_error_widens_the_interval_the_slo_is_decided_on():
    """#56 item 5: trials against a calibrated sim meet the SLO only if the twin's measured error keeps them under
    it: the trials' own interval (0.40-0.42 s) meets 0.5 s, but a twin that reads real servers up to 1.3x slower
    puts the real p95 up to ~0.55 s."""
    p95, meets, _, wide = slo_verdict([0.40, 0.41, 0.42], 0.5)
    assert meets is True and wide is None
    p95, meets, _, wide = slo_verdict([0.40, 0.41, 0.42], 0.5, _twin(0.9, 1.3))
    assert meets is False and wide is not None and p95.high is not None and p95.low is not None
    assert wide.high == pytest.approx(p95.high * 1.3, rel=1e-4) and wide.low == pytest.approx(p95.low * 0.9, rel=1e-4)
    _, meets, _, _ = slo_verdict([0.30, 0.31, 0.32], 0.5, _twin(0.9, 1.3))  # 0.33 x 1.3 < 0.5: met with the error
    assert meets is True
    _, meets, note, wide = slo_verdict([0.3], 0.5, _twin(0.8, 1.5))  # one trial: the twin's band alone
    assert meets is True and wide is not None and wide.high == pytest.approx(0.45) and "twin's error only" in note


def test_a_pick_the_twins_error_cannot_separate_is_a_tie_no_trials_would_settle():
    """#56 item 5: a cheaper point whose p95 is under the SLO in the sim but over it within the twin's error is a
    tie with the dearer point that meets it, and no number of trials settles it (they narrow the trials' spread,
    never the calibration's error); without the twin the cheaper point simply wins."""
    from kvtier.plan.recommend import picks_of

    twin = _twin(0.9, 1.3)
    small = _point("cpu0-nvme0-c4", 0, [0.43, 0.44, 0.45], cost=0.0, twin=twin)
    big = _point("cpu2-nvme0-c4", 2, [0.20, 0.21, 0.22], cost=0.01, twin=twin)
    (pick,) = picks_of([small, big], 0.5)
    assert pick.point == "cpu2-nvme0-c4" and pick.tie_with == "cpu0-nvme0-c4" and pick.trials_to_separate is None
    assert "no number of trials narrows" in pick.sentence and "with the twin's error" in pick.sentence
    (alone,) = picks_of(
        [_point("a", 0, [0.43, 0.44, 0.45], cost=0.0), _point("b", 2, [0.2, 0.21, 0.22], cost=0.01)], 0.5
    )
    assert alone.point == "a" and alone.tie_with is None
    # a point whose mean is clear of the SLO even within the twin's error, with a wide spread: trials would tell
    noisy = _point("cpu0-nvme0-c4", 0, [0.2, 0.5, 0.3], cost=0.0, twin=twin)
    (pick,) = picks_of([noisy, big], 0.5)
    assert pick.tie_with == "cpu0-nvme0-c4" and pick.trials_to_separate is not None
    assert "the twin's error kept" in pick.sentence


def test_a_point_above_the_slo_even_within_the_twins_error_needs_trials_to_clear_it_over_that_error():
    """The other side: a noisy point whose mean is over the SLO even at the twin's lowest ratio (0.7 x 0.9 > 0.5)
    may still meet it by its trials' spread; the trials that would tell are those for its interval to leave the SLO
    over that ratio (0.5 / 0.9), and the widest error of several trials is the one a point carries."""
    from types import SimpleNamespace

    from kvtier.plan.recommend import _twin_of, picks_of, trials_to_separate

    twin = _twin(0.9, 1.3)
    noisy = _point("cpu0-nvme0-c4", 0, [0.3, 1.1, 0.7], cost=0.0, twin=twin)
    big = _point("cpu2-nvme0-c4", 2, [0.20, 0.21, 0.22], cost=0.01, twin=twin)
    (pick,) = picks_of([noisy, big], 0.5)
    assert pick.tie_with == "cpu0-nvme0-c4"
    assert pick.trials_to_separate == trials_to_separate(noisy.ttft_p95_s, 0.5 / 0.9) is not None
    trials = [SimpleNamespace(summary=SimpleNamespace(twin=SimpleNamespace(error=e))) for e in (twin, _twin(0.7, 1.1))]
    both = _twin_of(trials, None)  # type: ignore[arg-type]
    assert both is not None and (both.ratio_low, both.ratio_high) == (0.7, 1.3) and "widest of the errors" in both.basis
    assert _twin_of(trials, _twin(0.95, 1.05)) == _twin(0.95, 1.05)  # the ladder read now, where it loads
    assert _twin_of([SimpleNamespace(summary=SimpleNamespace(twin=None))], twin) is None  # type: ignore[list-item]
