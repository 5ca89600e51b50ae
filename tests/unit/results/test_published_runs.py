"""#57 item 1: every published MLPerf v3.0 KV run kvtier could read is in published_v3.yaml, each figure the key of
its summary (or rank files) that the file says, and the file says what is missing."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from kvtier.results.published import published
from kvtier.results.ranks import read_run_folder

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "mlperf_published"
COLUMNS = {
    "tokens_per_sec": "aggregated_avg_throughput_tokens_per_sec",
    "storage_tokens_per_sec": "aggregated_storage_throughput_tokens_per_sec",
    "read_gbps": "aggregated_read_bandwidth_gbps",
    "write_gbps": "aggregated_write_bandwidth_gbps",
    "p95_latency_ms": "aggregated_p95_latency_ms",
}


def test_every_figure_is_its_summarys_key_at_full_precision():
    runs = published().runs
    assert len(runs) == 23 and len([r for r in runs if r.published]) == 21
    for run in runs:
        summary = json.loads((FIXTURES / run.path / run.summary).read_text())
        assert (run.ranks, run.hosts, run.trials) == (
            summary["total_ranks"],
            summary["host_count"],
            summary["trials_per_option"],
        )
        assert sorted(run.options) == sorted(int(o) for o in summary["options"])
        for o, fig in run.options.items():
            theirs = summary["options"][str(o)]
            for col, key in COLUMNS.items():
                assert getattr(fig, col) == theirs[key], (run.path, o, col)
            assert fig.partial_failure == theirs["partial_failure"]
            assert fig.missing_rank_results == len(theirs.get("missing_files", []))


def test_rank_figures_are_the_rank_files_and_the_device_p95_their_max():
    with_ranks = [r for r in published().runs if r.rank_files]
    assert len(with_ranks) >= 3
    for run in with_ranks:
        folder = read_run_folder(FIXTURES / run.path)
        assert len(folder.ranks) == len(run.rank_files) == run.ranks * run.trials * len(run.options)
        for rec, (o, t, k, requests, seconds, rd, wd, name) in zip(folder.ranks, run.rank_files, strict=True):
            s, c = rec.file.summary, rec.file.summary.cache_stats
            assert (rec.option, rec.trial, rec.rank, rec.path.rsplit("/", 1)[1]) == (o, t, k, name)
            assert (s.total_requests, s.elapsed_time) == (requests, seconds)
            assert (c.storage_read_device_p95_ms, c.storage_write_device_p95_ms) == (rd, wd)
        for o, fig in run.options.items():
            mine = [f for f in run.rank_files if f[0] == o]
            assert fig.device_read_p95_ms == max(f[5] for f in mine if f[5] is not None)
            assert fig.device_write_p95_ms == max(f[6] for f in mine if f[6] is not None)


def test_the_file_says_how_many_runs_are_in_and_which_rows_are_missing():
    text = resources.files("kvtier").joinpath("mlperf/published_v3.yaml").read_text()
    assert "What is in: 23 run folders" in text
    for missing in ("Nutanix wsclient01", "Nebius nebius-kvcache-b300", "Everpure_FBEXA_file_51hosts_30"):
        assert f"#   {missing}" in text or missing in text
