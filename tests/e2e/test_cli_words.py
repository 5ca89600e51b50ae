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


def test_a_flag_cut_short_is_refused_except_by_the_reference_drop_in():
    """#58 item 21: `kvtier plan bytes --mod X` was silently `--model X`. A flag cut short is now an error with the
    suggestion; kvtier bench keeps argparse's abbreviations (the MLPerf reference's command lines may use them)."""
    p = run("plan", "bytes", "--mod", "llama3.1-8b")
    assert p.returncode == 2 and "--mod: did you mean --model?" in p.stderr
    assert run("plan", "bytes", "--model", "llama3.1-8b").returncode == 0
    p = run("bench", "--num-use", "2", "--help")
    assert p.returncode == 0, p.stderr


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


def test_the_shims_hint_names_the_folder_absolute(tmp_path: Path):
    """Given a relative folder, the printed mlpstorage command named it relative (a newcomer's trial): mlpstorage
    runs from its own folder, so the hint gives the absolute path."""
    p = subprocess.run([*kvtier_cmd(), "mlperf", "shim", "bin"], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert f"--kvcache-bin-path {tmp_path.resolve() / 'bin' / 'kv-cache.py'} ..." in p.stdout, p.stdout


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


def test_a_replay_against_nothing_says_connection_refused_and_leaves_no_folder(tmp_path):
    """#58 item 21: it said `ClientConnectorError` and left an empty output folder."""
    import socket
    from pathlib import Path

    with socket.socket() as s:  # a loopback port nothing listens on (bound, read, let go)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = Path(__file__).resolve().parents[2].parent / "shared/data/lmcache_agent_trace/miniswe"
    out = tmp_path / "out"
    p = run("replay", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "m", "--dataset", str(data),
            "--max-requests", "2", "--output", str(out))  # fmt: skip
    assert p.returncode == 2 and "connection refused: is the server running?" in p.stderr, p.stderr
    assert not out.exists()
