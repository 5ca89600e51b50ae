"""What the CLI says to a person: a misspelt flag or command gets the closest spelling, mlperf datasize says
where it looked for --cache-dir, and a launch --dry-run line carries every variable the process gets."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.conftest import kvtier_cmd


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*kvtier_cmd(), *args], capture_output=True, text=True, timeout=120)


def test_a_misspelt_flag_or_command_suggests_the_closest():
    p = run("bench", "--num-usres", "3")
    assert p.returncode == 2 and "--num-usres: did you mean --num-users?" in p.stderr
    p = run("replay", "--max-requets", "3")
    assert p.returncode == 2 and "did you mean --max-requests?" in p.stderr
    p = run("bnech")
    assert p.returncode == 2 and "bnech: did you mean bench?" in p.stderr


def test_mlperf_datasize_says_where_it_looked(tmp_path: Path):
    p = run("mlperf", "datasize", "--cache-dir", str(tmp_path / "absent"))
    assert p.returncode == 0 and f"no directory at {tmp_path / 'absent'}" in p.stderr


def test_a_dry_run_line_reproduces_the_process_and_launch_sizes_are_the_commands(tmp_path: Path):
    p = run("launch", "--engine", "sim", "--tier", "cpu", "--dry-run", "--output", str(tmp_path / "o"), "--",
            "--model", "m", "--dataset", "d.jsonl")  # fmt: skip
    assert p.returncode == 0, p.stderr
    first = p.stdout.splitlines()[0]
    assert first.startswith("DO_NOT_TRACK=1 ") and " cache-server " in first and "--cpu-offload-gb 2" in first
    # the sim profile fixes its cache server's size: that, not the host's default, is what is recorded
    assert "# cache sidecar L1 2 GB (the profile's sidecar command (--cpu-offload-gb))" in p.stderr


def test_the_mlperf_shim_runs_kvtier_bench_as_python3_kv_cache_py(tmp_path: Path):
    """The wrappers call `python3 kv-cache.py ARGS` by path: the shim runs kvtier bench with that argv, under
    the system python3 too (it re-executes kvtier's own interpreter)."""
    import json
    import shutil

    p = run("mlperf", "shim", str(tmp_path / "bin"))
    assert p.returncode == 0, p.stderr
    cache = tmp_path / "cache"
    cache.mkdir()
    out = tmp_path / "r.json"
    py = shutil.which("python3") or "python3"
    q = subprocess.run(
        [py, str(tmp_path / "bin" / "kv-cache.py"), "--model", "tiny-1b", "--num-users", "2", "--duration", "1",
         "--gpu-mem-gb", "0", "--cpu-mem-gb", "0.01", "--generation-mode", "none", "--cache-dir", str(cache),
         "--output", str(out), "--progress", "none"],  # fmt: skip
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    r = json.loads(out.read_text())  # a 1 s run may complete no request (then failed, exit 1): the argv is the point
    assert r["benchmark"] == "kvtier bench" and r["config"]["num_users"] == 2 and r["config"]["cpu_mem_gb"] == 0.01
    assert q.returncode == (0 if r["status"] == "complete" else 1), q.stderr
