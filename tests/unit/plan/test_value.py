"""#41 item 7: ``plan value`` values a tier by the GPU time it saves *net of its fetches* (the placement model's
hit_rate x (reprefill - fetch)), not by the prefill it avoids. The records stand in for a replay folder's (the
integration test, tests/integration/test_replay_sim.py, reads a real one)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.plan.value import economics, value_report
from kvtier.results.records import RequestRecord


def _result(wall_s: float, twin=None):  # type: ignore[no-untyped-def]
    """What value_report reads of a replay's result beside its records."""
    return SimpleNamespace(wall_s=wall_s, summary=SimpleNamespace(twin=twin))


def _report(monkeypatch: pytest.MonkeyPatch, fetch_s: float, store_gb: float):  # type: ignore[no-untyped-def]
    """One hour of replay: 1,000 tokens recomputed in 1 s (1,000 tokens/s measured) and 1,000 served from ``cpu``,
    whose fetch took ``fetch_s``; $2 per GPU-hour, $0.5 per GB-month."""
    rows = [RequestRecord(status="ok", prompt_sources={"cpu": 1000, "recomputed": 1000},
                          server_ttft_parts={"fetch": fetch_s, "recompute": 1.0})]  # fmt: skip
    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows, _result(3600.0)))
    (t,) = value_report(Path("replay"), gpu_cost=2.0, store_cost=0.5, store_gb={"cpu": store_gb}).tiers
    return t


def test_a_tier_whose_fetch_costs_what_recompute_does_does_not_pay(monkeypatch: pytest.MonkeyPatch):
    """It avoided 1 s of prefill per hour and spent 1 s fetching: nothing saved, so it does not pay at any storage
    cost, and no hit rate breaks even (valued on the prefill avoided, it 'paid' against a tiny store)."""
    t = _report(monkeypatch, fetch_s=1.0, store_gb=0.001)
    assert t.prefill_s_avoided_per_hour == pytest.approx(1.0) and t.fetch_s_per_hour == pytest.approx(1.0)
    assert t.gpu_s_saved_per_hour == pytest.approx(0.0)
    assert t.value_usd_per_hour == 0.0 and t.pays is False and t.breakeven_hit_rate is None


def test_a_tier_is_valued_on_what_it_saves_net_of_fetch(monkeypatch: pytest.MonkeyPatch):
    t = _report(monkeypatch, fetch_s=0.1, store_gb=0.01)
    assert t.gpu_s_saved_per_hour == pytest.approx(0.9)
    assert t.value_usd_per_hour == pytest.approx(round(2.0 * 0.9 / 3600, 6))
    cost = 0.5 * 0.01 / 730
    assert t.pays is True and t.cost_usd_per_hour == pytest.approx(cost, abs=1e-6)
    assert t.breakeven_hit_rate == pytest.approx(0.5 * cost / (2.0 * 0.9 / 3600), rel=1e-3)


def test_a_tier_slower_than_recompute_loses_money_and_says_so(monkeypatch: pytest.MonkeyPatch):
    t = _report(monkeypatch, fetch_s=3.0, store_gb=0.01)
    assert t.gpu_s_saved_per_hour == pytest.approx(-2.0)
    assert t.value_usd_per_hour < 0 and t.pays is False and t.breakeven_hit_rate is None
    # the hit rate and the fetch as one pair: a 50 % hit rate that made the fleet slower is said so
    assert t.in_time is not None and t.in_time.startswith("hits, but the fleet got slower: it served 50.0% ")
    assert "3.00x the prefill they replaced" in t.in_time
    assert _report(monkeypatch, fetch_s=0.1, store_gb=0.01).in_time.startswith("pays in time")  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "value,cost,pays,breakeven",
    [(None, 1.0, None, None), (1.0, None, None, None), (-1.0, None, False, None), (0.0, 0.0, False, None),
     (2.0, 1.0, True, 0.25), (1.0, 2.0, False, 1.0)],
)  # fmt: skip
def test_economics_rules(value: float | None, cost: float | None, pays: bool | None, breakeven: float | None):
    e = economics(0.5, value, cost)
    assert e["pays"] is pays and e["breakeven_hit_rate"] == breakeven


def test_a_requests_file_with_an_unbounded_decomposition_is_refused_by_file_and_line(tmp_path: Path):
    """#41 item 4, the reading side: what the client drops cannot come back through a planted requests.jsonl —
    NaN, Infinity, 401-digit counts and unknown part names are a DatasetError naming the line, read bounded."""
    from kvtier.errors import DatasetError
    from kvtier.results.records import read_records

    good = {"status": "ok", "prompt_sources": {"gpu": 1}, "server_ttft_parts": {"queue": 0.1}, "server_ttft_s": 0.1}
    for bad in ('"server_ttft_parts": {"queue": NaN}', '"server_ttft_s": Infinity', '"prompt_sources": {"gpu": '
                + "9" * 401 + "}", '"server_ttft_parts": {"' + "x" * 5000 + '": 0.1}'):  # fmt: skip
        f = tmp_path / "requests.jsonl"
        f.write_text(json.dumps(good) + "\n{" + bad + "}\n")
        with pytest.raises(DatasetError, match=r"requests.jsonl:2: the TTFT decomposition"):
            read_records(f)
    f.write_text(json.dumps(good) + "\n" + json.dumps({"itl_s": [0.1] * 4_000_000}) + "\n")
    with pytest.raises(DatasetError, match=r"requests.jsonl:2: a record longer than"):
        read_records(f)
    f.write_text(json.dumps(good) + "\n")
    assert read_records(f) == [(1, RequestRecord.model_validate(good))]
    f.write_text(json.dumps(good | {"ttft": 0.1}) + "\n")  # a key no record has: named, not skipped
    with pytest.raises(DatasetError, match=r"requests.jsonl:1: ttft: unknown key"):
        read_records(f)


@pytest.mark.parametrize(
    "sources,says",
    [({"gpu": 900, "recomputed": 100}, "--gpu-kv-gb"), ({"recomputed": 1000}, "no prefix was reused")],
)
def test_a_replay_no_offload_tier_served_is_refused_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, sources: dict[str, int], says: str
):
    """#44 item 2: the README's sim held every prefix in its modelled GPU, and `plan value` printed an empty table
    with exit 0. Nothing to value is an error that says why (the GPU held everything: the flag to change; or
    nothing was reused)."""
    from kvtier.errors import DatasetError

    rows = [RequestRecord(status="ok", prompt_sources=sources, server_ttft_parts={"recompute": 0.1})]
    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows, _result(60.0)))
    with pytest.raises(DatasetError, match="no offload tier served any of the 1 ok requests") as e:
        value_report(Path("replay"))
    assert says in str(e.value)


def _engine_rows() -> list[RequestRecord]:
    """Two requests measured in the engine: each hit's fetch split among its tiers by their reads' own time."""
    eng = {"id": "e", "load_io_s": {"cpu": 0.01, "storage": 0.03}}
    return [
        RequestRecord(status="ok", prompt_sources={"cpu": 500, "storage": 500, "recomputed": 1000},
                      server_ttft_parts={"fetch": 0.4, "recompute": 1.0}, decomposition="measured-in-engine",
                      engine=eng),
        RequestRecord(status="ok", prompt_sources={"cpu": 1000, "gpu": 1000}, server_ttft_parts={"fetch": 0.1},
                      decomposition="measured-in-engine", engine={"id": "f", "load_io_s": {"cpu": 0.02}}),
    ]  # fmt: skip


def test_an_engine_measured_replay_charges_each_tier_its_own_measured_loads(monkeypatch: pytest.MonkeyPatch):
    """#53 item 3: a hit's fetch is what the engine measured for it, divided among its tiers by their reads' time
    (not by tokens): the storage tier's reads took 3x the CPU's in the first request, so it bears 3/4 of its 0.4 s."""
    rows = _engine_rows()
    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows, _result(3600.0)))
    r = value_report(Path("replay"))
    assert r.decomposition == "measured-in-engine"
    by = {t.tier: t for t in r.tiers}
    assert by["storage"].fetch_s_per_hour == pytest.approx(0.3) and by["cpu"].fetch_s_per_hour == pytest.approx(0.2)
    assert "measured in the engine" in next(i.note for i in r.inputs if i.name == "fetch")


def test_a_ladder_beside_an_engine_measured_replay_is_its_error_on_it(monkeypatch: pytest.MonkeyPatch, tmp_path):
    """#53 item 3: with --ladder, the measured fetch per tier and recompute beside the ladder's curves for the same
    requests; a tier the ladder has no curve for says so."""
    from kvtier.plan.value import ladder_check
    from kvtier.results.ladder import FetchModel, PrefillModel

    rows = _engine_rows()
    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows, _result(3600.0)))
    timing = SimpleNamespace(
        prefill=PrefillModel(overhead_s=0.5, s_per_token=0.001),  # compute only: 1,000 new tokens -> 1 s
        fetch_for=lambda t: FetchModel(tier="cpu", overhead_s=0.0, s_per_token=0.0001) if t == "cpu" else None,
    )
    monkeypatch.setattr("kvtier.results.ladder.load_fitted", lambda path, flag: (None, SimpleNamespace(timing=timing)))
    check = {c.part: c for c in ladder_check(Path("replay"), tmp_path / "ladder.json")}
    assert check["recompute"].measured_s == pytest.approx(1.0) and check["recompute"].ladder_s == pytest.approx(1.0)
    assert check["recompute"].error == pytest.approx(0.0)
    cpu = check["fetch:cpu"]  # measured 0.1 + 0.1; predicted 500 x 1e-4 + 1000 x 1e-4
    assert (cpu.requests, cpu.measured_s, cpu.ladder_s) == (2, pytest.approx(0.2), pytest.approx(0.15))
    assert cpu.error == pytest.approx(-0.25)
    assert check["fetch:storage"].ladder_s is None and check["fetch:storage"].error is None


def test_a_calibrated_twins_replay_values_each_tier_within_its_measured_error(monkeypatch: pytest.MonkeyPatch):
    """#56 item 5: against a calibrated sim the prefill avoided and the fetch are the twin's times, each off by the
    twin's measured ratio, so the saving between them is bounded as a difference: [avoided x low - fetch x high,
    avoided x high - fetch x low]; a tier whose value's interval holds the store's cost (or zero) is a tie; a time the
    twin did not predict (a given prefill rate) carries no band; a replay of a real server has none."""
    from kvtier.results.ladder import TwinError
    from kvtier.results.replay import TwinBand

    err = TwinError(ratio_low=0.8, ratio_high=1.25, points=20, basis="test")
    twin = TwinBand(error=err, origin="ladder.json", ttft_s={})

    def rows(fetch_s: float) -> list[RequestRecord]:  # 1,000 tokens recomputed in 1 s, 1,000 served from cpu
        return [RequestRecord(status="ok", prompt_sources={"cpu": 1000, "recomputed": 1000},
                              server_ttft_parts={"fetch": fetch_s, "recompute": 1.0})]  # fmt: skip

    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows(0.1), _result(3600.0, twin)))
    value = 2.0 * 0.9 / 3600  # 0.9 GPU s saved an hour at $2/GPU-hour
    rep = value_report(Path("replay"), gpu_cost=2.0, store_cost=1.0, store_gb={"cpu": 730 * value * 0.99})
    (t,) = rep.tiers
    assert rep.twin_error == err and t.pays is True and t.pays_tie is True  # 0.99 of the value: within the error
    assert t.prefill_s_avoided_per_hour_band == pytest.approx((0.8, 1.25))
    assert t.fetch_s_per_hour_band == pytest.approx((0.08, 0.125))
    assert t.gpu_s_saved_per_hour_band == pytest.approx((0.8 - 0.125, 1.25 - 0.08))
    assert t.latency_saved_per_hit_s_band == pytest.approx((0.675, 1.17))
    assert t.value_usd_per_hour_band == pytest.approx((2 * 0.675 / 3600, 2 * 1.17 / 3600), rel=1e-3)
    (cheap,) = value_report(Path("replay"), gpu_cost=2.0, store_cost=1.0, store_gb={"cpu": 730 * value / 2}).tiers
    assert cheap.pays is True and cheap.pays_tie is False  # half the value: it pays across the whole interval
    # a fetch nearly as long as the prefill it replaces: 0.05 s saved, but within the error anything -0.39 to 0.49
    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows(0.95), _result(3600.0, twin)))
    (close,) = value_report(Path("replay"), gpu_cost=2.0).tiers
    assert close.gpu_s_saved_per_hour == pytest.approx(0.05) and close.pays is None and close.pays_tie is True
    assert close.gpu_s_saved_per_hour_band == pytest.approx((0.8 - 0.95 * 1.25, 1.25 - 0.95 * 0.8))
    (given,) = value_report(Path("replay"), prefill_tps=1000.0, gpu_cost=2.0).tiers  # the rate is not the twin's
    assert given.prefill_s_avoided_per_hour_band is None
    assert given.gpu_s_saved_per_hour_band == pytest.approx((1.0 - 0.95 * 1.25, 1.0 - 0.95 * 0.8))
    monkeypatch.setattr("kvtier.plan.value.decomposed_records", lambda folder: (rows(0.1), _result(3600.0)))
    (real,) = value_report(Path("replay"), gpu_cost=2.0).tiers
    assert real.gpu_s_saved_per_hour_band is None and real.pays_tie is False
