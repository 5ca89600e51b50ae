"""#42 item 2 (part): `kvtier mlperf compare` places a run summary (mlpstorage's or kvtier's layout) beside the
published v3.0 KV rows, per option and per rank, and names an option the run lacks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import DatasetError
from kvtier.results.published import compare, load_summary, published, render, run_model


def summary(tmp_path: Path, options: dict[str, dict[str, object]]) -> Path:
    p = tmp_path / "kvcache_run_summary_20261203_004558.json"
    p.write_text(json.dumps({"schema_version": "1.0", "options": options, "partial_failure": False}))
    return p


def option(tok: float, read: float, ranks: int, **extra: object) -> dict[str, object]:
    return {"aggregated_avg_throughput_tokens_per_sec": tok, "aggregated_read_bandwidth_gbps": read,
            "aggregated_write_bandwidth_gbps": 0.4, "aggregated_device_read_p95_ms": 395.1, "rank_count": ranks,
            "trial_count": 3, "partial_failure": False, "missing_files": [], **extra}  # fmt: skip


def test_the_published_rows_name_their_source_and_hold_the_quoted_rows():
    rows = {(r.submitter, r.system): r for r in published().rows}
    hpe, sam = rows["HPE", "K3000-kvcache"], rows["SAMSUNG", "MEMORY_AE"]
    assert (
        hpe.ranks == 32 and round(hpe.options[1].tokens_per_sec) == 8749 and round(hpe.options[1].read_gbps, 1) == 151.7
    )
    assert round(hpe.options[1].p95_latency_ms or 0) == 463144
    assert sam.ranks == 1 and round(sam.options[3].read_gbps, 1) == 14.1
    assert sam.options[1].device_read_p95_ms is not None and hpe.options[1].device_read_p95_ms is None  # rank files
    assert all(r.source.startswith("mlcommons/storage_results_v3.0@068d91f:closed/") for r in rows.values() if
               r.division == "closed")  # fmt: skip


def test_a_run_is_placed_beside_each_row_in_total_and_per_rank(tmp_path: Path):
    c = compare(load_summary(summary(tmp_path, {"1": option(1626.0, 30.34, 2), "2": option(562.3616049961796,
                2.7553612537506953, 1), "3": option(372.0, 14.1, 1)})))  # fmt: skip
    hpe = next(r for r in c.options["1"].rows if r.submitter == "HPE")
    assert hpe.run_over_row_tokens == round(1626 / hpe.tokens_per_sec, 4)
    assert hpe.run_over_row_tokens_per_rank == round((1626 / 2) / (hpe.tokens_per_sec / 32), 4)
    assert not hpe.comparable and hpe.why_not == "9-64 ranks (32), this run 2-8 ranks"
    sam = next(r for r in c.options["2"].rows if r.submitter == "SAMSUNG")
    assert sam.run_over_row_tokens == 1.0 and sam.run_over_row_read_per_rank == 1.0
    assert c.missing_options == []
    text = "\n".join(render(c))
    assert "never divided" in text and "SAMSUNG MEMORY_AE (1 rank)" in text


def test_the_run_is_placed_among_every_published_row_and_the_comparable_ones(tmp_path: Path):
    rows = published().rows
    top = max(r.options[1].tokens_per_sec for r in rows if 1 in r.options)
    c = compare(load_summary(summary(tmp_path, {"1": option(top + 1, 0.0, 1)})))
    (tok, per_rank, read, _) = c.options["1"].placements
    assert (tok.figure, tok.place, tok.of) == ("tok/s", 1, len(rows) + 1)  # above every published row
    assert read.place == read.of  # below every one: 0 GiB/s
    singles = [r for r in rows if r.ranks == 1 and 1 in r.options]
    assert tok.of_comparable == len(singles) + 1 and tok.among_comparable == 1
    assert per_rank.figure == "tok/s per rank"
    c70 = compare(load_summary(summary(tmp_path, {"1": option(1.0, 0.0, 48)})), model="llama3.1-70b-instruct")
    (farm,) = [r for r in c70.options["1"].rows if r.comparable]
    assert farm.model == "llama3.1-70b-instruct" and farm.partial_failure  # the open 70b run lost ranks: said


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
    with_p95 = option(813.0, 13.5, 1, aggregated_p95_latency_ms=133183.2481597113)
    c = compare(load_summary(summary(tmp_path, {"1": with_p95, "2": option(1.0, 1.0, 1)})))
    sam = next(r for r in c.options["1"].rows if r.submitter == "SAMSUNG")
    assert sam.run_over_row_p95 == 1.0 and c.options["1"].run.p95_latency_ms == 133183.2481597113
    assert all(r.run_over_row_p95 is None for r in c.options["2"].rows)  # no aggregated_p95_latency_ms: no ratio
    assert "P95 133,183 ms (storage time per request, as published)" in "\n".join(render(c))


FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mlperf_published"
PUBLISHED = FIXTURES / "closed/HPE/results/K3000-kvcache/kv_cache/llama3.1-8b/run/20260807_155647/summary.json"


def test_every_published_runs_own_summary_is_x1_against_its_own_row():
    """#57: fed a published run's own summary.json, compare put it at x0.0098 of SAMSUNG's tok/s while its read was
    x0.59: it divided aggregated_storage_throughput_tokens_per_sec (40.2 for HPE's option 1) by a column that is
    aggregated_avg_throughput_tokens_per_sec (8,749), and read no P95 from it. Now every published run, against its
    own row, is x1 on every column."""
    for row in published().rows:
        path = FIXTURES / row.path / row.summary
        c = compare(load_summary(path), model=run_model(path))
        for o in row.options:
            mine = next(r for r in c.options[str(o)].rows if r.source == row.source)
            assert mine.comparable, (row.path, mine.why_not)
            ratios = (mine.run_over_row_tokens, mine.run_over_row_read, mine.run_over_row_tokens_per_rank,
                      mine.run_over_row_read_per_rank, mine.run_over_row_p95, mine.run_over_row_write)  # fmt: skip
            assert all(x == 1.0 for x in ratios if x is not None) and ratios[0] == ratios[4] == 1.0, (row.path, o)
    c = compare(load_summary(PUBLISHED))
    assert c.options["1"].run.storage_tokens_per_sec == pytest.approx(40.2077, abs=1e-4)  # shown, not compared


def test_kvtier_report_puts_an_mlperf_run_beside_the_published_rows():
    from kvtier.report.html import _published

    text = _published({"1": option(1626.0, 30.34, 2), "2": option(562.0, 2.8, 1)})
    assert "HPE K3000-kvcache (32 ranks)" in text and "option 3 is not in this run" in text
    assert _published({"1": {"aggregated_read_bandwidth_gbps": 1.5}}).startswith("no option with the figures")
