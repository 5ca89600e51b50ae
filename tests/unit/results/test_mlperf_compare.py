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
    return {"aggregated_storage_throughput_tokens_per_sec": tok, "aggregated_read_bandwidth_gbps": read,
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
    [("[]", "no 'options'"), ('{"options": {"1": {"rank_count": 2}}}', "options.1.aggregated_storage_throughput"),
     ('{"options": {"1": 5}}', "options.1: expected an object"), ("{", "not JSON")],
)  # fmt: skip
def test_a_file_that_is_not_a_run_summary_is_named(tmp_path: Path, body: str, needle: str):
    p = tmp_path / "s.json"
    p.write_text(body)
    with pytest.raises(DatasetError, match=needle):
        load_summary(p)


def test_kvtiers_summary_carries_the_published_p95_and_it_is_put_beside_the_rows(tmp_path: Path):
    with_p95 = option(813.0, 13.5, 1, kvtier={"storage_read_p95_ms": 133183.0})
    c = compare(load_summary(summary(tmp_path, {"1": with_p95, "2": option(1.0, 1.0, 1)})))
    sam = next(r for r in c.options["1"].rows if r.submitter == "SAMSUNG")
    assert sam.run_over_row_p95 == 1.0 and c.options["1"].run.storage_read_p95_ms == 133183.0
    assert all(r.run_over_row_p95 is None for r in c.options["2"].rows)  # mlpstorage's: device p95 only
    assert "P95 read latency 133,183.0 ms (per request, as published)" in "\n".join(render(c))


def test_kvtier_report_puts_an_mlperf_run_beside_the_published_rows():
    from kvtier.report.html import _published

    text = _published({"1": option(1626.0, 30.34, 2), "2": option(562.0, 2.8, 1)})
    assert "HPE K3000-kvcache (32 ranks)" in text and "option 3 is not in this run" in text
    assert _published({"1": {"aggregated_read_bandwidth_gbps": 1.5}}).startswith("no option with the figures")
