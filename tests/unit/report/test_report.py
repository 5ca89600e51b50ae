"""Results load back into their typed models; errors name the file and the key; one percentile rule."""

from __future__ import annotations

import json
import subprocess

import numpy as np
import pytest

from kvtier.errors import DatasetError
from kvtier.results import load
from kvtier.results.bench import BenchResult
from kvtier.results.envelope import SCHEMA_VERSION, Status, StopCode, exit_code
from kvtier.stats import PERCENTILE_NAMES, percentile, summarize, summarize_ns_as_ms


def test_a_bench_result_file_loads_as_written(tiny_bench_result):
    result, path = tiny_bench_result
    loaded = load(path)
    assert isinstance(loaded, BenchResult) and loaded == result
    assert loaded.result_schema_version == SCHEMA_VERSION and loaded.benchmark == "kvtier bench"
    assert loaded.host.directories["cache_dir"].fs_type and loaded.host.libraries["numpy"] == np.__version__


@pytest.mark.parametrize(
    "edit,needle",
    [
        (lambda d: d.update(result_schema_version=1), "result_schema_version: 1; this kvtier reads version"),
        (lambda d: d["summary"]["cache_stats"].update(colour="red"), "summary.cache_stats.colour: unknown key"),
        (lambda d: d["summary"].update(requests_per_second="fast"), "summary.requests_per_second"),
        (lambda d: d["stop_reason"].update(code="bored"), "stop_reason.code"),
        (lambda d: d["warnings"].append({"code": "Not A Code", "message": "x"}), "warnings.0.code"),
        (lambda d: d.update(benchmark="kvtier nope"), "benchmark: not a kvtier result"),
    ],
)
def test_bad_files_name_the_key(tiny_bench_result, tmp_path, edit, needle):
    d = json.loads(tiny_bench_result[1].read_text())
    d["warnings"] = []
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d))
    with pytest.raises(DatasetError) as e:
        load(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(DatasetError, match="cannot read"):
        load(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("[1, 2]")
    with pytest.raises(DatasetError, match="expected a JSON object"):
        load(tmp_path / "x.json")
    with pytest.raises(DatasetError, match="without summary.json, launch.json or kvcache_run_summary.json"):
        load(tmp_path)


def test_replay_compare_of_hostile_files_says_one_line(tmp_path):
    """`kvtier replay compare {}`: exit 3 and one line naming the file, no traceback."""
    from tests.conftest import kvtier_cmd

    (tmp_path / "empty.json").write_text("{}")
    (tmp_path / "cut.json").write_text('{"benchmark": "kvtier replay",\n')
    for name, needle in (("empty.json", "not a kvtier result (None); expected a result kvtier wrote (a bench result"),
                         ("cut.json", "cut.json:2: not valid JSON")):  # fmt: skip
        p = subprocess.run(
            kvtier_cmd() + ["replay", "compare", str(tmp_path / name), str(tmp_path / "empty.json")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 3 and needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize(
    "status,stop,rc",
    [
        (Status.complete, StopCode.duration, 0),
        (Status.complete, StopCode.dataset_finished, 0),
        (Status.partial, StopCode.interrupted, 130),
        (Status.partial, StopCode.terminated, 143),
        (Status.partial, StopCode.device_full, 5),
        (Status.failed, StopCode.startup_failed, 6),
        (Status.partial, StopCode.internal_error, 1),
        (Status.failed, StopCode.dataset_finished, 1),
    ],
)
def test_exit_codes_come_from_status_and_stop_code(status, stop, rc):
    assert exit_code(status, stop) == rc


def test_one_percentile_definition():
    xs = [1, 2, 3, 4, 10]
    s = summarize(xs)
    assert s["count"] == 5 and s["mean"] == 4.0 and s["max"] == 10.0
    assert s["p50"] == 3.0 and s["p90"] == pytest.approx(7.6)  # rank q/100*(n-1), linear between neighbours
    assert [s[p] for p in PERCENTILE_NAMES] == [
        round(float(np.percentile(xs, q)), 4) for q in (50, 90, 95, 99, 99.9, 99.99)
    ]
    assert percentile(xs, 95) == pytest.approx(8.8) and percentile([], 95) is None
    assert summarize_ns_as_ms([1_500_000, 2_500_000])["p50"] == 2.0  # ns in, ms out
    assert summarize([])["p95"] is None and summarize([])["count"] == 0  # nulls, never zeros


def test_write_json_never_follows_a_planted_temp_file(tmp_path):
    from kvtier.results.io import write_json

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "r.json"
    (tmp_path / "r.json.tmp").symlink_to(victim)  # where an older writer put its temporary file
    write_json({"a": 1}, out)
    assert json.loads(out.read_text()) == {"a": 1} and victim.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.json.tmp", "victim.txt"]  # no temp left


def test_outside_text_in_plan_tables_and_progress_is_never_markup():
    """#28 low 2: a name with rich markup (or a stray closing tag, which crashes rich) prints as written."""
    import io

    from rich.console import Console

    from kvtier.cli.plan import _table
    from kvtier.progress import ProgressOutput

    t = _table("model [bold]x[/bold]", ["name", "value"])
    t.add_row("[/] [red]evil[/red]", "1")
    buf = io.StringIO()
    Console(file=buf, width=120).print(t)
    assert "[/] [red]evil[/red]" in buf.getvalue() and "model [bold]x[/bold]" in buf.getvalue()
    out = io.StringIO()
    with ProgressOutput("live", out) as p:
        p.show("replay [/] of [red]x", ["a"], ["[/]"], "line")
    assert "replay [/] of [red]x" in " ".join(out.getvalue().split())  # wrapped to the table, printed as written


def test_result_files_are_written_atomically_and_never_through_a_planted_link(tmp_path):
    """#28 low 6: every result file goes through one atomic writer; a symlink planted at the old fixed
    temporary name, or at the target itself, never makes kvtier write into the file it points at."""
    import os

    from kvtier.results.io import write_text_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    out = tmp_path / "kvcache_run_summary.json"
    os.symlink(victim, out.with_suffix(".tmp"))  # the name the mlperf summary used to be staged under
    write_text_atomic(out, '{"a": 1}')
    assert victim.read_text() == "keep me" and out.read_text() == '{"a": 1}' and not out.is_symlink()
    link = tmp_path / "report.html"
    os.symlink(victim, link)  # a link planted at the target: replaced by the new file, its target untouched
    write_text_atomic(link, "<html></html>", "--html")
    assert victim.read_text() == "keep me" and not link.is_symlink() and link.read_text() == "<html></html>"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()) == []


def test_a_working_set_point_without_requests_and_a_storm_time_of_1e308_are_named_not_crashed_on():
    """#58 item 13: `kvtier report` crashed with a KeyError on a reuse working-set point missing `requests`, and a
    storm timeline at t=1e308 broke the plot. Both are now refused as the file is read, the key named."""
    from pydantic import ValidationError

    from kvtier.results.launch import StormPoint
    from kvtier.results.replay import ReuseWorkingSetPoint

    with pytest.raises(ValidationError, match="requests"):
        ReuseWorkingSetPoint.model_validate({"tokens": 3584, "bytes": None})
    assert ReuseWorkingSetPoint.model_validate({"requests": 3, "tokens": 3584, "bytes": None}).requests == 3
    with pytest.raises(ValidationError, match="t\n.*less than or equal to 10000000"):
        StormPoint.model_validate({"t": 1e308, "requests": 1, "offload_hit_rate": 0.5, "ttft_s_p95": 0.1})
    with pytest.raises(ValidationError, match="offload_hit_rate"):
        StormPoint.model_validate({"t": 1.0, "requests": 1, "offload_hit_rate": 1e308, "ttft_s_p95": 0.1})
    from kvtier.results.launch import FaultOutcome

    window = {"requests": 4, "failed": 0, "offload_hit_rate": 0.5, "ttft_s_p95": 0.1, "queue_s_mean": None,
              "queue_s_p95": None}  # fmt: skip
    fault = {"kind": "sidecar", "at_s": 5.0, "down_unix_s": 1.8e9, "up_unix_s": 1.8e9 + 2, "downtime_s": 2.0,
             "error": None, "basis": "prompt_sources", "baseline": window, "zero_hit_s": 3.0, "storm": window,
             "recovered_after_s": 6.0, "recovered_at": 0.9, "timeline": []}  # fmt: skip
    assert FaultOutcome.model_validate(fault).zero_hit_s == 3.0
    for key in ("zero_hit_s", "recovered_after_s", "downtime_s", "at_s", "down_unix_s", "up_unix_s"):
        with pytest.raises(ValidationError, match=key):  # every time of a fault is bounded, not only the timeline's
            FaultOutcome.model_validate({**fault, key: 1e308})
