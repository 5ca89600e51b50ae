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
    assert {(t, q) for t, q, _, _ in got["quantiles"]} == {(0, "p50"), (0, "p95"), (1, "p50"), (1, "p95")}


def test_a_row_is_met_within_the_aims_or_within_vllms_own_spread():
    row = {"p50_err": 0.30, "p95_err": 0.10, "source_diff": 0.01}
    assert not svv.meets(row)  # p50 30 %: past the 15 % aim
    assert svv.meets(row, {"p50": 0.35, "p95": 0.05, "source": 0.0})  # vLLM missed itself by 35 %
    assert not svv.meets(row, {"p50": 0.20, "p95": 0.40, "source": 0.0})  # its spread is smaller than the twin's miss
    assert not svv.meets({**row, "p50_err": 0.1, "source_diff": 0.04})  # a source 0.04 off
    assert svv.meets({**row, "p50_err": 0.1})
