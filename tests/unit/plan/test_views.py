"""kvtier plan views: the prediction's queue model and the storage view's I/O trace."""

from __future__ import annotations

import pytest

from kvtier.plan.views import _by_turn, _predict, bandwidth_fetch, ladder_prefill, preset_prefill, write_storage_trace
from kvtier.results.ladder import DecodeModel, PrefillModel, Timing
from kvtier.results.records import RequestRecord
from kvtier.tracefile import read_trace


def row(t: float, session: str, turn: int, gpu: int, cpu: int, recomputed: int, ttft: float = 0.1, **more):
    return RequestRecord(status="ok", **more, **{
        "start_unix_s": t, "session": session, "turn": turn, "ttft_s": ttft, "prompt_tokens": gpu + cpu + recomputed,
        "prompt_sources": {"gpu": gpu, "cpu": cpu, "recomputed": recomputed},
        "server_ttft_parts": {"queue": 0.0, "fetch": 0.01}, "server_ttft_s": ttft - 0.001,
    })  # fmt: skip


def test_prediction_is_fetch_then_a_fifo_prefill():
    # two requests arrive together: the second waits for the first's prefill (one modelled GPU)
    rows = [row(0.0, "a", 0, 0, 0, 1000), row(0.0, "b", 0, 0, 512, 488)]
    pred = _predict(rows, bandwidth_fetch({"cpu": 1e9}, 1000), preset_prefill(10_000, 0.005))
    assert pred[0] == pytest.approx((0.005 + 0.1, 0.0))
    fetch = 512 * 1000 / 1e9
    assert pred[1] == pytest.approx((0.105 + 0.005 + 0.0488, fetch))  # behind the first, though its fetch ended
    # a tier without a measured bandwidth predicts nothing for the rows it served
    assert _predict(rows, bandwidth_fetch({}, 1000), preset_prefill(10_000, 0.005))[1] is None
    views = _by_turn(rows, pred, None)
    assert views[0].requests == 2 and views[0].ttft_error == pytest.approx((0.105 + 0.1588) / 2 / 0.1 - 1, abs=1e-3)


def test_storage_trace_reads_what_the_tier_served_and_writes_each_new_chunk_once(tmp_path):
    rows = [row(1.0, "s", 0, 0, 0, 600), row(2.0, "s", 1, 0, 512, 300), row(3.0, "s", 2, 256, 512, 100)]
    n = write_storage_trace(rows, 10, tmp_path / "t.csv")
    t = read_trace(str(tmp_path / "t.csv"))
    ops = [("R" if o == 0 else "W") for o in t.op.tolist()]
    # turn 0: 2 new chunks written; turn 1: chunks 0,1 read, chunk 2 written; turn 2: chunks 1,2 read (0 on GPU)
    assert n == len(ops) == 2 + 3 + 2 and ops == ["W", "W", "R", "R", "W", "R", "R"]
    assert set(t.size.tolist()) == {2560}


def test_admission_waits_for_the_gpu_kv_held_by_earlier_requests():
    # capacity 1500 tokens: the second request (1000 + 8) waits until the first (1000 + 8) has finished decoding
    rows = [row(0.0, "a", 0, 0, 0, 1000, max_tokens=8, completion_tokens=8),
            row(0.0, "b", 0, 0, 0, 1000, max_tokens=8, completion_tokens=8)]  # fmt: skip
    pred = _predict(rows, bandwidth_fetch({}, 1000), preset_prefill(10_000, 0.0), gpu_tokens=1500, tpot_s=0.01)
    first_done = 0.1 + 7 * 0.01  # its prefill, then 7 more tokens
    assert pred[0] == pytest.approx((0.1, 0.0))
    assert pred[1] == pytest.approx((first_done + 0.1, 0.0))
    roomy = _predict(rows, bandwidth_fetch({}, 1000), preset_prefill(10_000, 0.0), gpu_tokens=10_000, tpot_s=0.01)
    assert roomy[1] == pytest.approx((0.2, 0.0))  # both fit: only the prefill FIFO


def test_a_ladders_prefill_keeps_its_fixed_cost_off_the_gpu_fifo():
    # the measured model: compute on the one GPU (with attention over the cached tokens), the fixed cost beside it
    t = Timing(source="measured", origin="l.json", decode=DecodeModel(tpot_s=0.01),
               prefill=PrefillModel(overhead_s=0.02, s_per_token=1e-4, s_per_token_pair=1e-8))  # fmt: skip
    rows = [row(0.0, "a", 0, 0, 0, 1000), row(0.0, "b", 0, 3000, 0, 1000)]
    pred = _predict(rows, bandwidth_fetch({}, 1000), ladder_prefill(t))
    first = 1000 * 1e-4 + 1e-8 * 1000 * 500
    second = 1000 * 1e-4 + 1e-8 * 1000 * (3000 + 500)  # its new tokens attend over its 3000 cached ones
    assert pred[0] == pytest.approx((first + 0.02, 0.0))
    assert pred[1] == pytest.approx((first + second + 0.02, 0.0))  # behind the first's compute, not its fixed cost


def test_an_uncapped_replay_that_misses_by_far_names_max_tokens_cap():
    """#58 item 18: `plan views` on an uncapped replay printed errors of +82,209 % and did not say why."""
    from kvtier.plan.views import _uncapped
    from kvtier.results.plan import TurnView

    def turn(err: float) -> TurnView:
        return TurnView(turn=2, requests=5, measured_ttft_s=0.05, measured_fetch_s=None,
                        predicted_ttft_s=0.05 * (1 + err), predicted_fetch_s=None, ttft_error=err,
                        storage_ttft_s=None, storage_fetch_s=None, storage_ttft_error=None)  # fmt: skip

    (said,) = _uncapped([turn(0.1), turn(822.09)], None)
    assert "--max-tokens-cap" in said and "+82209%" in said
    assert _uncapped([turn(822.09)], 16) == []  # capped: the errors are the model's, said turn by turn
    assert _uncapped([turn(0.4)], None) == []  # uncapped but close: nothing to explain
