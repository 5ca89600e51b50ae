"""#42 item 2 (part): `kvtier mlperf compare` places a run summary (mlpstorage's or kvtier's layout) beside the
published v3.0 KV rows, per option and per rank, and names an option the run lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import DatasetError
from kvtier.results.published import compare, load_summary, published, render


def summary(tmp_path: Path, options: dict[str, dict[str, object]]) -> Path:
    p = tmp_path / "kvcache_run_summary_20261203_004558.json"
    p.write_text(json.dumps({"schema_version": "1.0", "options": options, "partial_failure": False}))
    return p


def option(tok: float, read: float, ranks: int, **extra: object) -> dict[str, object]:
    return {"aggregated_avg_throughput_tokens_per_sec": tok, "aggregated_read_bandwidth_gbps": read,
            "aggregated_write_bandwidth_gbps": 0.4, "aggregated_device_read_p95_ms": 395.1, "rank_count": ranks,
            "trial_count": 3, "partial_failure": False, "missing_files": [], **extra}  # fmt: skip


def test_the_published_rows_name_their_source_and_hold_the_two_quoted_rows():
    rows = {(r.submitter, r.system): r for r in published().rows}
    hpe, sam = rows["HPE", "K3000-kvcache"], rows["SAMSUNG", "MEMORY_AE"]
    assert hpe.ranks == 32 and hpe.options[1].model_dump() == {"tokens_per_sec": 8749, "read_gbps": 151.7,
                                                                "p95_read_latency_ms": 463144}  # fmt: skip
    assert sam.ranks == 1 and sam.options[3].read_gbps == 14.1
    assert all(r.source.startswith("mlcommons/storage_results_v3.0") for r in rows.values())


def test_a_run_is_placed_beside_each_row_in_total_and_per_rank(tmp_path: Path):
    c = compare(load_summary(summary(tmp_path, {"1": option(1626.0, 30.34, 2), "2": option(562.0, 2.8, 1),
                                                "3": option(372.0, 14.1, 1)})))  # fmt: skip
    hpe = next(r for r in c.options["1"].rows if r.submitter == "HPE")
    assert hpe.run_over_row_tokens == round(1626 / 8749, 4) and hpe.run_over_row_read == round(30.34 / 151.7, 4)
    assert hpe.run_over_row_tokens_per_rank == round((1626 / 2) / (8749 / 32), 4)
    sam = next(r for r in c.options["2"].rows if r.submitter == "SAMSUNG")
    assert sam.run_over_row_tokens == 1.0 and sam.run_over_row_read_per_rank == 1.0
    assert c.missing_options == []
    text = "\n".join(render(c))
    assert "per request" in text and "never divided" in text and "SAMSUNG MEMORY_AE (1 rank)" in text


def test_an_option_the_run_lacks_is_named_and_a_partial_option_said(tmp_path: Path):
    c = compare(load_summary(summary(tmp_path, {"1": option(10.0, 1.0, 1, partial_failure=True,
                                                                missing_files=["rank_1"])})))  # fmt: skip
    assert c.missing_options == [2, 3]
    assert any("option 3 is not in this run" in n for n in c.notes)
    assert any("option 1: partial_failure (1 rank results missing)" in n for n in c.notes)


@pytest.mark.parametrize(
    "body,needle",
    [("[]", "no 'options'"), ('{"options": {"1": {"rank_count": 2}}}', "options.1.aggregated_avg_throughput"),
     ('{"options": {"1": 5}}', "options.1: expected an object"), ("{", "not JSON")],
)  # fmt: skip
def test_a_file_that_is_not_a_run_summary_is_named(tmp_path: Path, body: str, needle: str):
    p = tmp_path / "s.json"
    p.write_text(body)
    with pytest.raises(DatasetError, match=needle):
        load_summary(p)


def test_the_summarys_p95_is_put_beside_the_rows_and_a_summary_without_it_gets_no_ratio(tmp_path: Path):
    with_p95 = option(813.0, 13.5, 1, aggregated_p95_latency_ms=133183.0)
    c = compare(load_summary(summary(tmp_path, {"1": with_p95, "2": option(1.0, 1.0, 1)})))
    sam = next(r for r in c.options["1"].rows if r.submitter == "SAMSUNG")
    assert sam.run_over_row_p95 == 1.0 and c.options["1"].run.p95_latency_ms == 133183.0
    assert all(r.run_over_row_p95 is None for r in c.options["2"].rows)  # no aggregated_p95_latency_ms: no ratio
    assert "P95 latency 133,183.0 ms (storage time per request, as published)" in "\n".join(render(c))


PUBLISHED = Path(__file__).resolve().parents[2] / "fixtures" / "mlperf_published" / "HPE_K3000-kvcache_summary.json"


def test_a_published_runs_own_summary_is_x1_against_its_own_row():
    """#57: fed a published run's own summary.json, compare put it at x0.0098 of SAMSUNG's tok/s while its read was
    x0.59: it divided aggregated_storage_throughput_tokens_per_sec (40.2 for HPE's option 1) by a column that is
    aggregated_avg_throughput_tokens_per_sec (8,749), and read no P95 from it. Against its own row every figure is
    now the published one, to the row's rounding (tok/s and P95 to the unit, GiB/s to 0.1)."""
    c = compare(load_summary(PUBLISHED))
    assert c.missing_options == []
    for o in ("1", "2", "3"):
        run = c.options[o].run
        hpe = next(r for r in c.options[o].rows if r.submitter == "HPE")
        assert abs(run.tokens_per_sec - hpe.tokens_per_sec) <= 0.5, (o, run.tokens_per_sec, hpe.tokens_per_sec)
        assert abs(run.read_gbps - hpe.read_gbps) <= 0.05, (o, run.read_gbps, hpe.read_gbps)
        assert run.p95_latency_ms is not None and abs(run.p95_latency_ms - hpe.p95_read_latency_ms) <= 0.5
        assert hpe.run_over_row_tokens_per_rank == hpe.run_over_row_tokens  # 32 ranks on both sides
    assert c.options["1"].run.storage_tokens_per_sec == pytest.approx(40.2077, abs=1e-4)  # shown, not compared


def test_kvtier_report_puts_an_mlperf_run_beside_the_published_rows():
    from kvtier.report.html import _published

    text = _published({"1": option(1626.0, 30.34, 2), "2": option(562.0, 2.8, 1)})
    assert "HPE K3000-kvcache (32 ranks)" in text and "option 3 is not in this run" in text
    assert _published({"1": {"aggregated_read_bandwidth_gbps": 1.5}}).startswith("no option with the figures")
