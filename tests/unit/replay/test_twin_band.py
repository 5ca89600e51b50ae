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
