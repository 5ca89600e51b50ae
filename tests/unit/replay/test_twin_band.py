"""#56 item 5: a replay against a calibrated sim carries the twin's measured error onto the TTFT it reports, read
from the sim's /v1/models entry; any other server, or an entry whose error is malformed, gives no band (the
real-sim path is in tests/integration/test_ladder.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.replay.results import twin_band

ERR = {"ratio_low": 0.8, "ratio_high": 1.5, "points": 24, "checked_rows": 0, "basis": "the ladder's points"}


def _server(timing: Any, model: str = "m") -> dict[str, Any]:
    item = {"id": model, "object": "model", "max_model_len": 4096}
    if timing is not None:
        item["kvtier_timing"] = timing
    return {"models": {"object": "list", "data": [item]}, "replica": None, "max_model_len": 4096}


def test_a_calibrated_sims_error_bands_the_replays_ttft() -> None:
    ttft = {"count": 10, "p50": 0.1, "p95": 0.4, "p99": None}
    band = twin_band(_server({"source": "measured", "origin": "/x/ladder.json", "error": ERR}), "m", ttft)
    assert band is not None and band["origin"] == "/x/ladder.json"
    assert band["ttft_s"] == {"p50": pytest.approx((0.08, 0.15)), "p95": pytest.approx((0.32, 0.6))}
    assert band["error"].ratio_high == 1.5


@pytest.mark.parametrize(
    "timing",
    [None, "measured", {"source": "measured"}, {"error": {**ERR, "ratio_low": 1.5}},
     {"error": {**ERR, "ratio_high": float("inf")}}, {"error": {**ERR, "basis": "x" * 5000}}],
)  # fmt: skip
def test_no_band_from_a_server_that_gives_no_well_formed_error(timing: Any) -> None:
    assert twin_band(_server(timing), "m", {"p50": 0.1}) is None


def test_the_band_is_the_served_models() -> None:
    timing = {"source": "measured", "origin": "l.json", "error": ERR}
    assert twin_band(_server(timing, model="other"), "m", {"p50": 0.1}) is None
    assert twin_band({"models": None}, "m", {"p50": 0.1}) is None


def test_the_report_shows_a_twins_p95_as_its_error_allows() -> None:
    """kvtier report puts the band beside the twin's own p95, so a reader sees both on one page."""
    from types import SimpleNamespace

    from kvtier.report.figures import replay_figures
    from kvtier.results.envelope import Distribution
    from kvtier.results.replay import TwinBand

    dist = Distribution(count=10, mean=0.2, p50=0.1, p90=0.3, p95=0.4, p99=0.5, p999=0.5, p9999=0.5, max=0.5)
    twin = TwinBand.model_validate({"error": ERR, "origin": "l.json", "ttft_s": {"p95": (0.32, 0.6)}})
    s = SimpleNamespace(ttft_s=dist, requests_ok=10, twin=twin, ttft_degradation=SimpleNamespace(median_pct=None),
                        tpot_s_mean=None, e2e_s=dist, requests_per_s=1.0, output_tokens_per_s=1.0,
                        sessions=SimpleNamespace(complete=1), requests_failed=0)  # fmt: skip
    r = SimpleNamespace(summary=s, reuse_opportunity=None, server_metrics=[])
    figs = {f.name: f.value for f in replay_figures(r, None)}
    assert figs["TTFT p95 s"] == 0.4
    assert figs["TTFT p95 s within the twin's error, low"] == 0.32
    assert figs["TTFT p95 s within the twin's error, high"] == 0.6
    s.twin = None
    assert not any("twin" in f.name for f in replay_figures(r, None))
