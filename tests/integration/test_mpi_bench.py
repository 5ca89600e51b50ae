"""kvtier bench over real mpirun ranks on this host: per-rank folders, seeds and result files, one shared
window, an aggregate whose sums equal the per-rank sums and whose percentiles are those of the union of
every rank's samples; a rank that cannot start stops the run before the load, naming it; a rank killed
mid-run leaves a partial aggregate of the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.results import load
from kvtier.results.aggregate import BenchAggregate
from tests.conftest import NEEDS_MPI, TINY_TEMPLATES, kvtier_cmd

pytestmark = [*NEEDS_MPI, pytest.mark.slow, pytest.mark.serial]  # ranks share one window: run alone

BENCH = ["--model", "tiny-1b", "--gpu-mem-gb", "0", "--cpu-mem-gb", "0.25", "--max-concurrent-allocs", "2"]
BENCH += ["--generation-mode", "none", "--progress", "none", "--noise-mb", "64", "--io-chunk-mb", "8"]


def mpirun(n: int, args: list[str], timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    """Plain mpirun (without --enable-recovery, whose exit status is 0 whatever the ranks return)."""
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ["mpirun", *root, "--oversubscribe", "-np", str(n), *kvtier_cmd(), "bench", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)  # type: ignore[call-overload]


def test_two_ranks_share_one_window_and_pool_exactly(tmp_path: Path):
    out = tmp_path / "out.json"
    cache = tmp_path / "cache"
    p = mpirun(
        2,
        [*BENCH, "--num-users", "3", "--duration", "6", "--seed", "7", "--cache-dir", str(cache), "--output", str(out)]
        + ["--request-log", str(tmp_path / "req.jsonl")],
    )
    assert p.returncode == 0, p.stdout + p.stderr
    agg = json.loads(out.read_text())
    ranks = [json.loads((tmp_path / f"out.rank_{r}.json").read_text()) for r in (0, 1)]
    assert agg["benchmark"] == "kvtier bench mpi" and agg["status"] == "complete" and agg["lost_ranks"] == []
    assert [r["seed"] for r in ranks] == [7, 8] and agg["seed"] == 7
    assert sorted(x.name for x in cache.iterdir()) == ["rank_0", "rank_1"]
    # one window: the ranks started together and loaded until the same deadline
    assert agg["skew"]["start_s"] < 0.5 and agg["skew"]["stop_s"] < 3
    assert agg["window"]["deadline_unix_s"] - agg["window"]["start_unix_s"] == pytest.approx(6)
    # sums equal the per-rank sums
    t = agg["totals"]
    assert t["requests_completed"] == sum(r["requests_completed"] for r in ranks) > 0
    assert t["total_tokens_generated"] == sum(r["total_tokens_generated"] for r in ranks)
    for tier, b in t["tier_bytes"].items():
        assert b["written"] == sum(r["tiers"][tier]["write"]["bytes"] for r in ranks if tier in r["tiers"])
        assert b["read"] == sum(r["tiers"][tier]["read"]["bytes"] for r in ranks if tier in r["tiers"])
    mp = agg["mlperf"]
    assert mp["storage_throughput_tokens_per_sec_sum"] == pytest.approx(
        sum(r["summary"]["storage_throughput_tokens_per_sec"] for r in ranks), rel=1e-6
    )
    for op in ("read", "write"):  # the MLPerf table's sums and highest p95 (results/mlperf.py, the one formula)
        key = f"tier_storage_{op}_bandwidth_gbps"
        assert mp[f"{key}_sum"] == pytest.approx(sum(r["summary"]["cache_stats"][key] for r in ranks), abs=1e-6)
    p95s = [r["summary"]["cache_stats"]["storage_read_p95_ms"] for r in ranks]
    assert mp["storage_read_p95_ms_max"] == max(p for p in p95s if p is not None)
    # pooled percentiles are those of the union of the ranks' raw end-to-end latencies
    union = np.concatenate([np.asarray(r["end_to_end_latencies"], dtype=np.float64) for r in ranks]) * 1e3
    e2e = agg["latency"]["end_to_end_latency_ms"]
    assert e2e["count"] == union.size
    for name, q in (("p50", 50), ("p95", 95), ("max", 100)):
        assert e2e[name] == pytest.approx(float(np.percentile(union, q)), abs=2e-3)
    # ... and those of the union of the per-rank request logs
    logs = [[json.loads(x) for x in (tmp_path / f"req.rank_{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    assert [{x["rank"] for x in rows} for rows in logs] == [{0}, {1}]
    ok_ms = np.asarray([x["e2e_ms"] for rows in logs for x in rows if x["status"] == "ok"])
    assert ok_ms.size == e2e["count"] and e2e["p95"] == pytest.approx(float(np.percentile(ok_ms, 95)), abs=2e-3)
    assert agg["ranks"][1]["result_file"] == str(tmp_path / "out.rank_1.json")
    typed = load(out)  # the aggregate reads back into its typed model, every key validated
    assert isinstance(typed, BenchAggregate) and typed.totals.requests_completed == t["requests_completed"]
    from kvtier.report.html import write_report  # and kvtier report shows it beside a rank's own result

    info = write_report([str(out), str(tmp_path / "out.rank_0.json")], str(tmp_path / "r.html"))
    page = (tmp_path / "r.html").read_text()
    assert (
        "MPI bench runs (aggregates)" in page and "ranks reported" in page and info["results"] == ["out", "out.rank_0"]
    )


def test_a_rank_that_cannot_start_stops_the_run_before_the_load(tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "rank_1").write_text("a file where rank 1's folder should be")
    out = tmp_path / "out.json"
    p = mpirun(2, [*BENCH, "--num-users", "2", "--duration", "3", "--cache-dir", str(cache), "--output", str(out)])
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "the MPI run cannot start: rank 1 (" in p.stderr and "cannot create" in p.stderr, p.stderr
    assert not out.exists() and not (tmp_path / "out.rank_0.json").exists()


def test_a_killed_rank_leaves_a_partial_aggregate_of_the_others(tmp_path: Path):
    out = tmp_path / "out.json"
    args = [*BENCH, "--num-users", "2", "--duration", "6", "--seed", "3", "--cache-dir", str(tmp_path / "c")]
    args += ["--output", str(out), "--mpi-timeout", "10", "--cpu-mem-gb", "0"]  # entries land in files at once
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ["mpirun", *root, "--oversubscribe", "--enable-recovery", "-np", "2", *kvtier_cmd(), "bench", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        victim = None
        deadline = time.monotonic() + 60
        while victim is None and time.monotonic() < deadline:  # rank 1, once the load has started
            time.sleep(0.2)
            for d in Path("/proc").iterdir():
                if not d.name.isdigit():
                    continue
                try:
                    env = (d / "environ").read_bytes()
                    cmdline = (d / "cmdline").read_bytes()
                except OSError:
                    continue
                if b"OMPI_COMM_WORLD_RANK=1\0" in env and str(out).encode() in cmdline and b"mpirun" not in cmdline:
                    # its load has begun: entry files beside the marker in its run folder
                    if any(len(os.listdir(run)) > 1 for run in (tmp_path / "c" / "rank_1").glob("kvtier-run-*")):
                        victim = int(d.name)
        assert victim is not None, "rank 1 never started its load"
        time.sleep(1)
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    agg = json.loads(out.read_text())
    assert agg["status"] == "partial" and agg["lost_ranks"] == [1] and agg["ranks_reported"] == 1
    assert [w["code"] for w in agg["warnings"]][:1] == ["ranks-lost"]
    rank0 = json.loads((tmp_path / "out.rank_0.json").read_text())
    assert agg["totals"]["requests_completed"] == rank0["requests_completed"]
    assert not (tmp_path / "out.rank_1.json").exists()
    del stdout, stderr


def test_num_clients_runs_mpirun_itself(tmp_path: Path):
    out = tmp_path / "out.json"
    p = subprocess.run(
        kvtier_cmd()
        + ["bench", *BENCH, "--num-users", "2", "--duration", "6", "--num-clients", "2", "--seed", "1"]
        + ["--cache-dir", str(tmp_path / "c"), "--output", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    agg = json.loads(out.read_text())
    assert agg["ranks_launched"] == 2 and agg["ranks_reported"] == 2 and agg["status"] == "complete"
    assert "mpirun" in p.stderr and "--num-clients" not in p.stderr.split("mpirun", 1)[1]


def test_mpirun_without_mpi4py_is_a_clear_error(tmp_path: Path):
    env = {**os.environ, "OMPI_COMM_WORLD_SIZE": "2", "PYTHONPATH": str(tmp_path)}
    (tmp_path / "mpi4py").mkdir()
    (tmp_path / "mpi4py" / "__init__.py").write_text("raise ImportError('no MPI library here')\n")
    p = subprocess.run(
        [sys.executable, "-m", "kvtier", "bench", *BENCH, "--num-users", "1", "--duration", "1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 4 and "mpi4py is not installed: pip install 'kvtier[mpi]'" in p.stderr


def test_ctrl_c_to_mpirun_leaves_partial_results_everywhere(tmp_path: Path):
    """SIGINT to mpirun reaches every rank (Open MPI 4: SIGCONT, then SIGTERM after odls_base_sigkill_timeout,
    then SIGKILL after as long again): each writes its partial result and rank 0 the partial aggregate of both,
    before the teardown (removing the files took over a second here: with the teardown first the aggregate was
    missing in 2 of 4 runs). The timeout is 2 s here rather than 1, so a loaded machine cannot fail the test.
    The tiers live in memory (a tmpfs mount, as root): the subject is the signal's path, and a rank in an
    uninterruptible disk write defers even SIGKILL (CI once saw mpirun still waiting 90 s after the SIGINT)."""
    from tests.conftest import _mount

    out = tmp_path / "out.json"
    cache = tmp_path / "c"
    mounted = _mount("tmpfs", 1024, cache)  # without root: the disk, as before
    cache.mkdir(exist_ok=True)
    args = [*BENCH, "--num-users", "2", "--duration", "60", "--cache-dir", str(cache), "--storage-capacity-gb", "0.4",
            "--output", str(out)]  # fmt: skip
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = ["mpirun", *root, "--oversubscribe", "-np", "2", *kvtier_cmd(), "bench", *args]
    env = {**os.environ, "OMPI_MCA_odls_base_sigkill_timeout": "2"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not list(cache.glob("rank_1/kvtier-run-*")):
            time.sleep(0.2)  # rank 1's tier exists: set-up is under way
        time.sleep(4)  # into the load window
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=90)
        except subprocess.TimeoutExpired:  # say what is still running, and in which state, before failing
            ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,wchan:24,etime,args"], capture_output=True, text=True)
            left = [line for line in ps.stdout.splitlines() if "kvtier" in line or "mpirun" in line or "orted" in line]
            pytest.fail("mpirun still running 90 s after SIGINT:\n" + "\n".join(left))
    finally:
        if proc.poll() is None:
            proc.kill()
        if mounted:
            subprocess.run(["umount", "-l", str(cache)], capture_output=True)
    agg = json.loads(out.read_text())
    ranks = [json.loads((tmp_path / f"out.rank_{r}.json").read_text()) for r in (0, 1)]
    assert [r["status"] for r in ranks] == ["partial", "partial"]
    assert agg["status"] == "partial" and agg["ranks_reported"] == 2 and agg["lost_ranks"] == []
    assert {w["code"] for w in agg["warnings"]} == {"rank-not-complete"}
    assert agg["totals"]["requests_completed"] == sum(r["requests_completed"] for r in ranks)


def test_without_output_or_seed_every_rank_takes_rank_0s(tmp_path: Path):
    """No --output, no --seed: rank 0 names the files and draws the seed, and every rank uses them."""
    p = mpirun(2, [*BENCH, "--num-users", "2", "--duration", "5", "--cache-dir", str(tmp_path / "c")], cwd=tmp_path)
    assert "Traceback" not in p.stderr, p.stderr  # the status may be partial: names and seeds are the point
    agg_files = sorted(tmp_path.glob("kvtier_bench_*.json"))
    stems = {f.name.split(".")[0] for f in agg_files}
    assert len(agg_files) == 3 and len(stems) == 1  # aggregate + rank_0 + rank_1, one name
    (stem,) = stems
    agg = json.loads((tmp_path / f"{stem}.json").read_text())
    seeds = [json.loads((tmp_path / f"{stem}.rank_{r}.json").read_text())["seed"] for r in (0, 1)]
    assert seeds == [agg["seed"], agg["seed"] + 1]


def test_two_ranks_on_a_shared_redis_namespace_hit_each_others_entries(tmp_path: Path):
    """#31: ranks of one run write one shared key space (--remote-namespace shared:NAME): the aggregate counts
    the reads a rank served from entries another rank wrote (the system prompts every user shares)."""
    import shutil

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (scripts/install-tools.sh redis-server)")
    pytest.importorskip("redis", reason="redis-py is not installed (the test extra installs it)")
    import redis

    from kvtier.localservers import redis_server

    out = tmp_path / "out.json"
    cfg = tmp_path / "shared.yaml"  # short turns, and every conversation opens with one of 8 system prompts
    cfg.write_text(json.dumps({"user_templates": TINY_TEMPLATES,
                               "prefix_cache": {"num_system_prompts": 8, "system_prompt_hit_probability": 1.0},
                               "conversation": {"end_conversation_probability": 0.9}}))  # fmt: skip
    with redis_server() as srv:
        args = [a if a != "0.25" else "0" for a in BENCH]  # no CPU tier: entries go to Redis
        p = mpirun(
            2,
            [*args, "--num-users", "3", "--duration", "4", "--seed", "7", "--cache-dir", str(tmp_path / "cache"),
             "--redis-url", srv.url, "--redis-mem-gb", "0.2", "--remote-namespace", "shared:mpi31",
             "--config", str(cfg), "--output", str(out)],
        )  # fmt: skip
        left = len(list(redis.Redis.from_url(srv.url).scan_iter("kvtier:shared:mpi31:*")))
    assert p.returncode == 0, p.stdout + p.stderr
    agg = json.loads(out.read_text())
    ranks = [json.loads((tmp_path / f"out.rank_{r}.json").read_text()) for r in (0, 1)]
    cross = [r["summary"]["cache_stats"]["remote_cross_writer_hits"] for r in ranks]
    assert agg["totals"]["remote_cross_writer_hits"] == sum(cross) > 0, cross
    assert left > 0  # the run left the namespace to its TTL


RANK_WAITS = """
import os, sys, time
from mpi4py import MPI
MPI.COMM_WORLD.barrier()
with open(os.path.join(sys.argv[2], "rank%d.pid" % MPI.COMM_WORLD.Get_rank()), "w") as f:
    f.write(str(os.getpid()))  # a file each: the ranks' stdout interleaves
for _ in range(600):
    if os.path.exists(sys.argv[1]):
        break
    time.sleep(0.05)
MPI.COMM_WORLD.barrier()
"""


def _listening() -> list[tuple[str, int]]:
    """(local address, pid) of every listening TCP socket, from ``ss -ltnp``."""
    import re

    out = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        parts = line.split()
        for pid in re.findall(r"pid=(\d+)", line):
            found.append((parts[3], int(pid)))
    return found


def test_ranks_on_one_host_listen_on_no_port(tmp_path: Path):
    """#58 item 5: every rank mpirun started on one host listened on 0.0.0.0 and [::] (Open MPI's TCP transport).
    On one host the ranks talk through shared memory now: none of them listens on anything (ss -ltnp, while they
    run). mpirun's own out-of-band listener is Open MPI 4.1's, on every address whatever it is told
    (docs/security.md)."""
    from kvtier.mpi import mpirun_argv

    script, go = tmp_path / "rank.py", tmp_path / "go"
    script.write_text(RANK_WAITS)
    p = subprocess.Popen(mpirun_argv([sys.executable, str(script), str(go), str(tmp_path)], 2))
    try:
        pids = [tmp_path / "rank0.pid", tmp_path / "rank1.pid"]
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() for f in pids) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks = {int(f.read_text()) for f in pids}  # both past the first barrier: wired up
        assert len(ranks) == 2
        held = [(addr, pid) for addr, pid in _listening() if pid in ranks]
        assert held == []
    finally:
        go.write_text("")
        assert p.wait(timeout=60) == 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_mpirun_and_its_ranks_end_when_kvtier_is_killed(tmp_path: Path):
    """#58 item 8: after SIGKILL of `kvtier bench --num-clients 2`, mpirun and both ranks ran on to the end of
    their duration (and `mlperf run` left its trials running). mpirun now gets SIGTERM when kvtier dies, and
    passes it to its ranks."""
    cmd = [*kvtier_cmd(), "bench", *BENCH, "--num-users", "2", "--duration", "120", "--num-clients", "2"]
    cmd += ["--cache-dir", str(tmp_path / "cache"), "--output", str(tmp_path / "out.json")]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        runner: list[int] = []
        while time.monotonic() < deadline and len([c for r in runner for c in _children(r)]) < 2:
            runner = _children(p.pid)  # mpirun, once started; then its two ranks
            time.sleep(0.2)
        ranks = [c for r in runner for c in _children(r)]
        assert runner and len(ranks) >= 2, "mpirun and its ranks did not start"
        p.kill()
        p.wait(timeout=10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(x) for x in runner + ranks):
            time.sleep(0.2)
        assert not [x for x in runner + ranks if _alive(x)], "mpirun or a rank outlived kvtier"
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever is left of its session: kvtier, mpirun, the ranks
        except ProcessLookupError:
            pass
