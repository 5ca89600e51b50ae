"""#56: how benchmarks/sim_vs_vllm.py judges a twin's row: per turn against vLLM, and against vLLM's own spread."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import sim_vs_vllm as svv


def test_the_worst_turn_decides_and_each_quantile_is_kept():
    real = {"ttft": {0: [0.10, 0.10, 0.20], 1: [0.02] * 5}}
    twin = {"ttft": {0: [0.11, 0.11, 0.22], 1: [0.03] * 5, 2: [0.5]}}  # turn 2: vLLM never reached it
    got = svv.turn_errors(real, twin, "concurrency 1", "sim")
    assert got["p50"] == pytest.approx(0.5) and got["p95"] == pytest.approx(0.5)  # turn 1: 0.03 against 0.02
    assert got["bias"] == pytest.approx(0.3)  # turn 0 +10 %, turn 1 +50 %: the twin leans high
    assert {(t, q) for t, q, _, _ in got["quantiles"]} == {(0, "p50"), (0, "p95"), (1, "p50"), (1, "p95")}


def test_a_row_is_met_within_the_aims_or_within_vllms_own_spread():
    row = {"p50_err": 0.30, "p95_err": 0.10, "source_diff": 0.01}
    assert not svv.meets(row)  # p50 30 %: past the 15 % aim
    assert svv.meets(row, {"p50": 0.35, "p95": 0.05, "source": 0.0})  # vLLM missed itself by 35 %
    assert not svv.meets(row, {"p50": 0.20, "p95": 0.40, "source": 0.0})  # its spread is smaller than the twin's miss
    assert not svv.meets({**row, "p50_err": 0.1, "source_diff": 0.04})  # a source 0.04 off
    assert svv.meets({**row, "p50_err": 0.1})


def _row(family: str, conc: int, p50: float, bias: float, floor: dict | None = None) -> dict:
    shares = {"local_cache_hit": 0.8, "local_compute": 0.2}
    row = {"family": family, "offload": "none", "concurrency": conc, "requests": (10, 10), "p50_err": p50,
           "p95_err": 0.1, "p50_bias": bias, "source_diff": 0.0, "vllm": shares, "sim": shares}  # fmt: skip
    return row | ({"floor": floor} if floor else {})


def test_the_families_table_ends_with_its_figures_and_says_where_the_twin_leans():
    floor = {"p50": 0.4, "p95": 0.1, "bias": 0.01, "source": 0.0}
    rows = [_row("a", 1, 0.05, 0.02, floor), _row("a", 4, 0.30, -0.25, floor), _row("b", 4, 0.5, -0.35, floor)]
    out = svv.families_table(rows, [1, 4])
    assert out[-1] == ("sim_vs_vllm_families rows=3 worst_p50_err=0.500 worst_p95_err=0.100 worst_source_diff=0.000 "
                       "rows_met=1 rows_within_floor=2 floor_p50=0.400 floor_p95=0.100 floor_source=0.000")  # fmt: skip
    assert "concurrency 4: the twin's p50 bias, median over 2 rows -30.0%; vLLM against itself +1.0%" in out
    assert sum(line.startswith("| a |") or line.startswith("| b |") for line in out) == 3
    assert svv.families_table([_row("a", 1, 0.05, 0.0)], [1])[-1].endswith("rows_met=1")  # one vLLM: no floor
