"""kvtier report and kvtier compare on real results: two short bench runs, two replays against a real sim
(offload none and cpu), and an MLPerf run summary in its own layout."""

from __future__ import annotations

import dataclasses
import json
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from kvtier.bench import run
from kvtier.config.bench import BenchConfig
from kvtier.config.tuning import Tuning
from tests.conftest import TINY_TEMPLATES, kvtier_cmd, replay_summary
from tests.integration.test_launch import conversations
from tests.integration.test_sim import start_sim, stop_sim


def _bench(d: Path, name: str, **kw: Any) -> Path:
    (d / f"cache-{name}").mkdir()
    values: dict[str, Any] = {
        "model": "tiny-1b", "num_users": 3, "duration": 1.5, "gpu_mem_gb": 0, "cpu_mem_gb": 0.004,
        "generation_mode": "none", "seed": 2, "cache_dir": str(d / f"cache-{name}"), "output": str(d / f"{name}.json"),
        "progress": "none", "noise_mb": 16, "io_chunk_mb": 4,
        "tuning": Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
    }  # fmt: skip
    values.update(kw)
    run(BenchConfig.model_validate(values))
    return d / f"{name}.json"


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("report")
    out = {"small": _bench(d, "small"), "large": _bench(d, "large", cpu_mem_gb=0.05)}
    out["users"] = _bench(d, "users", num_users=4)
    data = conversations(d / "data", users=6, turns=4, max_tokens=8)
    for mode, extra in (("none", ()), ("cpu", ("--cpu-offload-gb", "0.5"))):
        sim = start_sim(d, "--offload", mode, "--gpu-kv-gb", "0.05", *extra)
        try:
            p = subprocess.run(
                [*kvtier_cmd(), "replay", "--base-url", f"{sim.base}/v1", "--model", "tiny-1b", "--dataset", str(data),
                 "--num-rounds", "4", "--min-chunk-rounds", "0", "--concurrency", "3", "--output", str(d / mode),
                 "--gap-scale", "0",
                 "--scrape-interval", "0.3", "--progress", "plain", "--progress-interval", "0.4"],
                capture_output=True, text=True, timeout=240,
            )  # fmt: skip
        finally:
            stop_sim(sim)
        assert p.returncode == 0, p.stderr
        out[mode] = d / mode
        (d / f"{mode}.stderr").write_text(p.stderr)
    summary = {
        "schema_version": "1.0", "benchmark": "kvtier mlperf run", "run_datetime": "2026-11-30T18:00:00+00:00",
        "mode": "closed", "interrupted": False, "total_ranks": 2, "trials_per_option": 3, "partial_failure": False,
        "verdict": [], "options": {"1": {"option": 1, "aggregated_read_bandwidth_gbps": 1.5,
                                         "aggregated_write_bandwidth_gbps": 0.5,
                                         "aggregated_avg_throughput_tokens_per_sec": 2000.0,
                                         "aggregated_storage_throughput_tokens_per_sec": 1234.0, "rank_count": 2,
                                         "trial_count": 3}},
    }  # fmt: skip
    (d / "mlperf").mkdir()
    (d / "mlperf" / "kvcache_run_summary.json").write_text(json.dumps(summary))
    out["mlperf"] = d / "mlperf"
    return out


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def test_one_offline_html_file_from_every_kind(results: dict[str, Path], tmp_path: Path):
    out = tmp_path / "r.html"
    args = [str(results[k]) for k in ("small", "large", "none", "cpu", "mlperf")]
    p = subprocess.run(
        [*kvtier_cmd(), "report", *args, "--html", str(out), "--png-dir", str(tmp_path / "png")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    text = out.read_text()
    tags = _Tags()
    tags.feed(text)
    names = [t for t, _ in tags.tags]
    assert "script" not in names and "link" not in names and "iframe" not in names
    assert "http://" not in text and "https://" not in text  # nothing to fetch: it opens offline
    imgs = [a["src"] or "" for t, a in tags.tags if t == "img"]
    assert imgs and all(s.startswith("data:image/png;base64,") for s in imgs)
    for heading in ("Tier latency by percentile", "Throughput and tier fill over time", "TTFT distribution",
                    "TTFT by turn", "Sessions", "MLPerf submission runs"):  # fmt: skip
        assert heading in text, heading
    assert "option 1 read GiB/s" in text and "What differs" in text
    assert len(list((tmp_path / "png").glob("*.png"))) == len(imgs)
    assert f"{len(imgs)} plots" in p.stdout
    widths = [int.from_bytes(f.read_bytes()[16:20], "big") for f in (tmp_path / "png").glob("*.png")]  # IHDR
    assert widths and min(widths) >= 1000, widths
    # each kind's verdict and counts, in words
    assert "requests ok / failed" in text and "criteria passed)" in text and "failures by cause" in text
    assert "requests ok / failed / cut" in text and "--num-rounds 4" in text
    assert "no submission rule broken" in text


def test_the_differences_are_said_in_words(results: dict[str, Path]):
    from kvtier.report.figures import sentences
    from kvtier.report.html import load_all

    none, cpu = load_all([str(results["none"]), str(results["cpu"])])
    assert none.records is not None and none.records.ttft_s.size == none.result.summary.requests_total
    found = sentences(none, cpu, threshold_pct=0.0, most=50)
    assert found and all(s.startswith("cpu: ") and " vs none (" in s for s in found)
    # the sentence's sign agrees with the figures it states
    f, b = cpu.figure("TTFT p50 s"), none.figure("TTFT p50 s")
    assert f is not None and b is not None and f.value is not None and b.value is not None
    line = next(s for s in found if s.startswith("cpu: TTFT p50 s "))
    assert ("+" in line.split(" vs ")[0]) == (f.value > b.value)


def test_compare_bench_results_and_trials(results: dict[str, Path]):
    p = subprocess.run([*kvtier_cmd(), "compare", str(results["small"]), str(results["large"])],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "throughput tokens/s" in p.stdout and "x)" in p.stdout and "configs differ in: " in p.stdout
    assert "cpu_mem_gb" in p.stdout
    trials = f"{results['small']},{results['small']}"
    p = subprocess.run([*kvtier_cmd(), "compare", trials, str(results["large"])], capture_output=True, text=True,
                       timeout=60)  # fmt: skip
    assert p.returncode == 0 and "±0%" in p.stdout and "median over trials" in p.stdout
    p = subprocess.run([*kvtier_cmd(), "compare", str(results["small"]), str(results["users"])],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 2 and "NOT COMPARABLE: users: num_users: 3 vs 4" in p.stderr
    p = subprocess.run([*kvtier_cmd(), "compare", str(results["small"]), str(results["users"]), "--force"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0
    p = subprocess.run([*kvtier_cmd(), "compare", str(results["small"]), str(results["none"])],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert p.returncode == 3 and "one kind at a time" in p.stderr


def test_compare_replays_and_replay_compare_agree(results: dict[str, Path]):
    a = subprocess.run([*kvtier_cmd(), "compare", str(results["none"]), str(results["cpu"])],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    b = subprocess.run([*kvtier_cmd(), "replay", "compare", str(results["none"]), str(results["cpu"])],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert a.returncode == b.returncode and a.stdout == b.stdout and "later-turn TTFT p95 s" in a.stdout
    assert "configs differ in: " not in a.stdout or "concurrency" not in a.stdout


def test_replay_says_its_progress_and_its_reuse_opportunity(results: dict[str, Path]):
    err = (results["none"].parent / "none.stderr").read_text()
    lines = [ln for ln in err.splitlines() if ln.startswith("[kvtier replay] t=")]
    assert lines and "requests=" in lines[-1] and "/24 " in lines[-1]  # 6 users x 4 turns
    assert "kvtier replay: reuse opportunity of " in err and "history " in err
    summary = replay_summary(results["none"] / "summary.json")
    r = summary["reuse_opportunity"]
    assert r["requests"] == 24 and r["kv_model"] == "tiny-1b" and r["kv_bytes_per_token"] == 24576
    assert r["history_reuse_tokens"] + r["cross_session_reuse_tokens"] + r["new_tokens"] == r["prompt_tokens"]
    assert r["history_reuse_fraction"] > 0.5  # each turn resends the conversation so far


def test_the_offload_tiers_own_counters_are_beside_the_client_figures(results: dict[str, Path]):
    cpu = replay_summary(results["cpu"] / "summary.json")["server_metrics"][0]
    assert cpu["lmcache_lookup_requested_tokens"] > 0 and cpu["lmcache_chunks_loaded"] is not None
    assert 0 <= cpu["lmcache_lookup_hit_tokens"] <= cpu["lmcache_lookup_requested_tokens"]
    assert cpu["lmcache_l1_usage_bytes_max"] > 0  # the CPU tier held chunks at some scrape
    assert cpu["lmcache_chunks_stored"] is None  # the sim replica does not expose it: null, never a made-up 0
    none = replay_summary(results["none"] / "summary.json")["server_metrics"][0]
    assert not none["lmcache_lookup_requested_tokens"]  # no offload tier: nothing looked up there


def test_compare_is_quiet_on_a_closed_pipe_and_takes_an_mpi_aggregate(results: dict[str, Path], tmp_path: Path):
    """`kvtier compare A B | head -0`: no traceback, exit 0. An MPI aggregate compares as a bench run (its
    figures have the bench's names); cosmetic fields (progress_interval, output) are never differences."""
    p = subprocess.Popen([*kvtier_cmd(), "compare", str(results["small"]), str(results["large"])],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before kvtier writes
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 0 and "Traceback" not in err and "BrokenPipe" not in err
    from kvtier.report.compare import compare
    from kvtier.report.html import load_all

    small, large = load_all([str(results["small"]), str(results["large"])])
    agg = dataclasses.replace(small, kind="bench-mpi")  # a stand-in: the same figures under the aggregate's kind
    c = compare([[small], [agg]])
    assert c.comparable and not c.differs and any(r.name == "throughput tokens/s" for r in c.rows)
    loud = large.result.model_copy(update={"config": large.result.config.model_copy(update={"progress_interval": 3})})
    c = compare([[small], [dataclasses.replace(large, result=loud)]])
    assert "progress_interval" not in c.differs and "cpu_mem_gb" in c.differs


def test_a_synthetic_replay_and_hostile_labels_make_a_report(results: dict[str, Path], tmp_path: Path):
    """#28 low 4: every replay --synthetic result was refused (its config said dataset_format synthetic);
    mathtext in a label or device name crashed matplotlib; a timeline point without t_s crashed the plot."""
    sim = start_sim(tmp_path, "--gpu-kv-gb", "0.05")
    try:
        p = subprocess.run(
            [*kvtier_cmd(), "replay", "--base-url", f"{sim.base}/v1", "--model", "tiny-1b", "--synthetic",
             "--users", "2", "--turns", "2", "--isl", "32", "--osl", "4", "--output", str(tmp_path / "syn"),
             "--progress", "none"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        stop_sim(sim)
    assert p.returncode == 0, p.stderr
    bench = json.loads(results["small"].read_text())
    dev = bench.get("device") or {}
    dev["devices"] = ["$\\frac$ nvme0n1"]
    dev["timeline"] = [*(dev.get("timeline") or []), {"devices": {}}]  # a point that says no time
    bench["device"] = dev
    hostile = tmp_path / "hostile.json"
    hostile.write_text(json.dumps(bench))
    html = tmp_path / "r.html"
    p = subprocess.run(
        [*kvtier_cmd(), "report", str(tmp_path / "syn"), str(hostile), "--labels", "syn $x^2$,$\\frac$",
         "--html", str(html)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert "$\\frac$" in html.read_text()


def test_the_plots_read_as_they_were_asked_to(results: dict[str, Path], monkeypatch):
    """#58 item 19: "where TTFT went" panels of several results share one y scale, with one legend beside them
    (none on the bars); TTFT by turn is on a log axis; a QoS class without requests says so in its slot."""
    import matplotlib.pyplot as plt

    from kvtier.report import plots
    from kvtier.report.html import load_all

    figs: list[Any] = []
    monkeypatch.setattr(plots, "_png", lambda fig, right_in=0.0: figs.append(fig) or b"")
    try:
        replays = load_all([str(results["none"]), str(results["cpu"])])
        assert plots.ttft_parts(replays) is not None
        axes = [a for a in figs[-1].axes if a.get_visible()]
        assert len(axes) == 2 and axes[0].get_shared_y_axes().joined(axes[0], axes[1])
        assert axes[0].get_ylim() == axes[1].get_ylim()
        assert figs[-1].legends and all(a.get_legend() is None for a in axes)
        assert plots.ttft_by_turn(replays) is not None and figs[-1].axes[0].get_yscale() == "log"
        bench = load_all([str(results["small"])])
        q = bench[0].bench.summary.qos_metrics
        empty = [c for c in ("interactive", "responsive", "batch") if c not in q or q[c].no_data]
        assert empty and len(empty) < 3, q  # one class served, the others not: their slots say so
        assert plots.qos(bench) is not None
        assert [t.get_text() for t in figs[-1].axes[0].texts].count("no requests") == len(empty)
    finally:
        for f in figs:
            plt.close(f)


def test_the_replay_line_says_a_missing_degradation_in_words(results: dict[str, Path], capsys):
    """#58 item 21: a run with no later turn printed "degradation median None %"."""
    from kvtier.cli.replay import print_outcome
    from kvtier.results import load

    r = load(results["none"])
    print_outcome(r, "out")  # type: ignore[arg-type]
    line = capsys.readouterr().out.splitlines()[0]
    assert "degradation median " in line and " %;" in line and "None" not in line
    r.summary.ttft_degradation.median_pct = None  # type: ignore[union-attr]
    print_outcome(r, "out")  # type: ignore[arg-type]
    assert "degradation median — (no later turn); sessions" in capsys.readouterr().out
