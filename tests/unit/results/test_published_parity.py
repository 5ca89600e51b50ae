"""#57 item 2: kvtier's MLPerf aggregation, over the submitters' own rank files, reproduces their published
summary.json to the last bit; the run folder reader names what is missing and refuses what is not a run."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtier.errors import DatasetError
from kvtier.results import load
from kvtier.results.mlperf import MlpstorageRunSummary
from kvtier.results.ranks import Instance, RankFile, option_figures, parity, read_run_folder

PUBLISHED = Path(__file__).resolve().parents[2] / "fixtures" / "mlperf_published"
SAMSUNG = PUBLISHED / "closed/SAMSUNG/results/MEMORY_AE/kv_cache/llama3.1-8b/run/20260721_002332"
RUNS = sorted(p.parent for p in PUBLISHED.glob("*/*/results/*/kv_cache/*/run/*/option_1"))  # rank files carried


@pytest.mark.parametrize("folder", RUNS, ids=lambda p: p.parts[-5])
def test_every_published_figure_is_reproduced_from_the_rank_files(folder: Path):
    run = read_run_folder(folder)
    assert run.options() == [1, 2, 3] and not run.missing and run.summary is not None
    for o in run.options():
        assert [len(t) for t in run.trials(o)] == [run.summary["total_ranks"]] * 3  # every rank of three trials
    checks = parity(run)
    assert len(checks) == 15  # 5 figures x 3 options: the v3.0 summaries' aggregated_* keys
    # to the last bit; where not, the same double when a trial's ranks are summed in another order (the
    # submitter's mlpstorage read its rank files in another order: GalaxSphere-3Tier0 and -4Tier0, one figure each)
    assert [(c.option, c.key) for c in checks if not (c.exact or c.order_only)] == []
    assert all(c.rel_err is not None and c.rel_err < 1e-15 for c in checks)


def test_the_rank_files_read_are_the_published_ones():
    run = read_run_folder(SAMSUNG)
    for r in run.ranks:
        source = r.file.model_extra["source"]  # the fixture's own record of where it came from
        assert source == f"{SAMSUNG.relative_to(PUBLISHED)}/{r.path}"


def test_a_sum_in_another_rank_order_is_told_from_a_different_figure():
    run = read_run_folder(PUBLISHED / "closed/Suzhou_Zishan_Longlin/results/GalaxSphere-3Tier0/kv_cache/llama3.1-8b/run"
                          / "20260724_084036")  # fmt: skip
    (odd,) = [c for c in parity(run) if not c.exact]
    assert (odd.option, odd.key, odd.order_only) == (1, "aggregated_write_bandwidth_gbps", True)
    assert odd.published == 40.543301706958324 and odd.recomputed == 40.54330170695832  # one unit in the last place


def test_a_changed_rank_figure_is_caught(tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(SAMSUNG, run_dir)
    (f,) = (run_dir / "option_2" / "trial_1" / "rank_0").glob("kvcache_results_*.json")
    data = json.loads(f.read_text())
    data["summary"]["avg_throughput_tokens_per_sec"] += 0.001
    f.write_text(json.dumps(data))
    bad = [(c.option, c.key, c.order_only) for c in parity(read_run_folder(run_dir)) if not c.exact]
    assert bad == [(2, "aggregated_avg_throughput_tokens_per_sec", False)]


def test_ranks_are_summed_within_a_trial_and_their_p95s_maxed_across_trials():
    def inst(read: float, io95: float, dev95: float | None) -> Instance:
        return Instance(read, 0.5, dev95, None, 10.0, 1.0, "complete", io_p95_ms=io95)

    fig = option_figures(
        [[inst(1.0, 100.0, 5.0), inst(2.0, 300.0, None)], [inst(4.0, 200.0, 7.0), inst(2.0, 50.0, 1.0)]]
    )
    assert fig["aggregated_read_bandwidth_gbps"] == 4.5  # (3 + 6) / 2
    assert fig["aggregated_avg_throughput_tokens_per_sec"] == 20.0
    assert fig["aggregated_p95_latency_ms"] == 300.0 and fig["aggregated_device_read_p95_ms"] == 7.0
    assert fig["aggregated_device_write_p95_ms"] is None  # no rank had one: said, not 0


def test_a_rank_folder_without_a_result_is_named_and_a_bare_folder_refused(tmp_path: Path):
    run_dir = tmp_path / "run"
    shutil.copytree(SAMSUNG, run_dir)
    (f,) = (run_dir / "option_1" / "trial_2" / "rank_0").glob("kvcache_results_*.json")
    f.unlink()
    run = read_run_folder(run_dir)
    assert run.missing == ["option_1/trial_2/rank_0"] and len(run.trials(1)) == 2
    with pytest.raises(DatasetError, match="not an MLPerf KV cache run"):
        read_run_folder(tmp_path / "run" / "option_1" / "trial_0")
    (f,) = (run_dir / "option_3" / "trial_0" / "rank_0").glob("kvcache_results_*.json")
    (f.parent / "kvcache_results_x.json").write_text("{}")
    with pytest.raises(DatasetError, match="2 result files"):
        read_run_folder(run_dir)
    (f.parent / "kvcache_results_x.json").unlink()
    f.write_text("[1]")
    with pytest.raises(DatasetError, match=f"{f.name}: not a rank result"):
        read_run_folder(run_dir)


def test_a_full_rank_file_reads_with_its_lists_and_other_keys_kept():
    with (next(SAMSUNG.glob("option_1/trial_0/rank_0/*.json"))).open() as f:
        data = json.load(f)
    data["end_to_end_latencies"] = [0.36, 3.18]  # the lists the fixtures leave out
    data["summary"]["qos_metrics"] = {"interactive": {"total_requests": 358}}
    rank = RankFile.model_validate(data)
    assert rank.summary.total_requests == 1495 and rank.model_extra["end_to_end_latencies"] == [0.36, 3.18]


def test_the_published_summary_loads_as_mlpstorage_wrote_it():
    r = load(SAMSUNG)  # the folder: its summary.json
    assert isinstance(r, MlpstorageRunSummary) and r.total_ranks == 1 and r.trials_per_option == 3
    assert r.options["1"].aggregated_p95_latency_ms == 133183.2481597113


def test_compare_takes_the_device_p95_from_the_rank_files_beside_a_summary_without_it():
    from kvtier.results.published import load_summary

    opts = load_summary(SAMSUNG / "summary.json")  # a v3.0 summary: no device p95 key
    assert opts["1"].aggregated_device_read_p95_ms == 13585.38871474957  # the highest rank file's, of 3 trials


def test_kvtier_report_shows_a_published_run_folder_with_its_rank_files():
    from kvtier.report.html import load_all, status_rows

    (item,) = load_all([str(SAMSUNG)])
    rows = dict(status_rows(item))
    assert item.kind == "mlperf" and rows["written by"].startswith("mlpstorage")
    assert rows["the summary from its rank files"].startswith("15 of 15 figures reproduced exactly")
    assert "device read p95 13,349–13,585 ms" in rows["option 1: 3 rank files"]
