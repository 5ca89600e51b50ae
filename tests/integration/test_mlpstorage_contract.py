"""#42 item 1: mlpstorage 3.0's kvcache benchmark runs `kvtier mlperf shim`'s folder unchanged.

The command lines are the ones mlpstorage builds (mlpstorage_py/benchmarks/kvcache.py ``_execute_run`` and
mlpstorage_py/utils.py ``generate_mpi_prefix_cmd``, mlpstorage 3.0.26 at hazemawadalla/storage a56caea), written
out here; mlpstorage splits its command with shlex and runs it. What is checked is what its aggregation
(``_aggregate_option_results``) reads: ``<trial>/rank_<r>/kvcache_results_*.json``, ``summary.cache_stats``'s storage
bandwidths and device p95s, ``summary``'s throughputs. docs/mlperf.md shows the real mlpstorage run."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.mlperf.shim import write_shim

SMALL = """\
user_templates:
  chatbot: {context_range: [64, 512], generation_range: [8, 64], think_time_range: [0.01, 0.05]}
  coding: {context_range: [256, 2048], generation_range: [8, 64], think_time_range: [0.01, 0.05]}
  document: {context_range: [256, 1024], generation_range: [8, 64], think_time_range: [0.01, 0.05]}
"""


def option_args(model: str, users: int, duration: int, cpu_mem_gb: float, allocs: int) -> str:
    """``_build_option_kvcache_args`` in OPEN mode (user values over the option's), in its order."""
    return (f"--model {model} --num-users {users} --duration {duration} --gpu-mem-gb 0 --cpu-mem-gb {cpu_mem_gb} "
            f"--max-concurrent-allocs {allocs} --generation-mode none")  # fmt: skip


def wrapper_command(shim: Path, trial_dir: Path, cache: Path, config: Path, ranks: int, kv_args: str) -> str:
    """mlpstorage's ``wrapper_cmd`` for one trial on one host (``--hosts localhost``, ``--num-processes N``,
    ``--allow-run-as-root`` when root)."""
    prefix = f"mpirun -n {ranks} -host localhost:{ranks} --npernode {ranks} --bind-to none --map-by socket"
    if os.geteuid() == 0:
        prefix += " --allow-run-as-root"
    prefix += " --mca orte_abort_on_non_zero_status 0"
    return (f"{prefix} {sys.executable} {shim / 'mlperf_wrapper.py'} --rank-output-base {trial_dir}"
            f" --rank-cache-base {cache} --seed-base 42 --config {config} {kv_args}")  # fmt: skip


def aggregate(trial_dir: Path, ranks: int) -> dict[str, object]:
    """What mlpstorage's aggregation takes from one trial: per rank the file it globs and the keys it reads."""
    rows, missing = [], []
    for r in range(ranks):
        found = sorted((trial_dir / f"rank_{r}").glob("kvcache_results_*.json"))
        if not found:
            missing.append(r)
            continue
        data = json.loads(found[0].read_text())
        s, c = data["summary"], data["summary"]["cache_stats"]
        rows.append({
            "read_gbps": c["tier_storage_read_bandwidth_gbps"], "write_gbps": c["tier_storage_write_bandwidth_gbps"],
            "avg_tok_s": s["avg_throughput_tokens_per_sec"], "storage_tok_s": s["storage_throughput_tokens_per_sec"],
            "read_p95": c["storage_read_device_p95_ms"], "write_p95": c["storage_write_device_p95_ms"],
            "result": data,
        })  # fmt: skip
    return {"rows": rows, "missing": missing}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write_shim(tmp_path / "bin")
    (tmp_path / "small.yaml").write_text(SMALL)
    return tmp_path


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed")
@pytest.mark.slow
@pytest.mark.serial  # two ranks' benches share the machine: alone, so each completes requests in its window
def test_mlpstorage_runs_the_shim_on_every_rank_and_finds_each_result(folder: Path):
    trial = folder / "results" / "option_1" / "trial_0"
    trial.mkdir(parents=True)  # mlpstorage makes the trial folder before it starts the ranks
    cmd = wrapper_command(folder / "bin", trial, folder / "cache", folder / "small.yaml", 2,
                          option_args("tiny-1b", 3, 6, 0, 16))  # fmt: skip
    # mpirun interleaves the two ranks' output byte by byte: a box-drawing character can arrive cut in two
    p = subprocess.run(shlex.split(cmd), capture_output=True, text=True, errors="replace", timeout=180,
                       env={**os.environ, "KVTIER_MLPERF_DELAY_S": "0"})  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    agg = aggregate(trial, 2)
    assert agg["missing"] == [], p.stderr[-3000:]
    rows = agg["rows"]
    assert isinstance(rows, list)
    for rank, row in enumerate(rows):
        r = row["result"]
        assert r["status"] == "complete" and r["seed"] == 42 + rank  # the base plus the rank
        assert r["config"]["cache_dir"] == str(folder / "cache" / f"rank_{rank}")
        assert r["config"]["num_users"] == 3 and r["config"]["cpu_mem_gb"] == 0
        assert r["benchmark"] == "kvtier bench"  # each rank one instance, not a rank of kvtier's own MPI mode
        assert row["write_gbps"] > 0 and row["avg_tok_s"] > 0 and row["write_p95"] is not None
        assert row["storage_tok_s"] == r["summary"]["storage_throughput_tokens_per_sec"]
        (own,) = (trial / f"rank_{rank}").glob("kvtier_result_*.json")  # kvtier's own result, beside it
        assert (
            json.loads(own.read_text())["summary"]["cache_stats"]["tier_storage_write_bandwidth_gbps"]
            == (row["write_gbps"])
        )
    assert sorted(p.name for p in (folder / "cache").iterdir()) == ["rank_0", "rank_1"]
    assert [x.name for x in trial.rglob(".kvcache_*")] == []  # nothing staged is left behind


def test_a_rank_whose_run_fails_leaves_no_result_for_the_aggregation(folder: Path):
    trial = folder / "results" / "option_1" / "trial_0"
    cmd = (f"{sys.executable} {folder / 'bin' / 'mlperf_wrapper.py'} --rank-output-base {trial} --rank-cache-base "
           f"{folder / 'cache'} --seed-base 42 --config {folder / 'small.yaml'} "
           + option_args("llama-9000", 3, 6, 0, 16))  # fmt: skip
    p = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KVTIER_MLPERF_DELAY_S": "0"})  # fmt: skip
    assert p.returncode == 2 and "--model: unknown model 'llama-9000'" in p.stderr
    assert "without a result" in p.stderr
    assert aggregate(trial, 1)["missing"] == [0]  # mlpstorage lists it missing: partial_failure, never zeros


def test_a_stopped_rank_keeps_its_partial_result_apart(folder: Path):
    trial = folder / "results" / "option_1" / "trial_0"
    cmd = (f"{sys.executable} {folder / 'bin' / 'mlperf_wrapper.py'} --rank-output-base {trial} --rank-cache-base "
           f"{folder / 'cache'} --seed-base 42 --config {folder / 'small.yaml'} --start-delay 0 --end-delay 30 "
           + option_args("tiny-1b", 2, 120, 0, 16))  # fmt: skip
    proc = subprocess.Popen(shlex.split(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list((folder / "cache" / "rank_0").glob("kvtier-run-*/*.kv")):
            time.sleep(0.1)  # an entry written: the load is under way (its folder alone is set-up, before the
            # bench takes SIGTERM over: CI once saw a rank stopped there keep no result)
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)  # what mpirun sends its ranks when mlpstorage is stopped
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode != 0, err[-2000:]
    assert aggregate(trial, 1)["missing"] == [0]
    assert not list((trial / "rank_0").glob("kvcache_*.json"))  # nothing under a name mlpstorage reads
    (kept,) = (trial / "rank_0").glob("kvtier_result_*.json")  # partial; failed if no request had completed yet
    assert json.loads(kept.read_text())["status"] in ("partial", "failed")
    assert str(kept) in out.replace("\n", "")  # the bench's closing lines name the file that is there
    assert "end delay" not in out  # a stopped rank does not wait out the end delay
