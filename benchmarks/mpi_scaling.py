"""Does splitting one load over MPI ranks lose anything? Device bytes/s of 1, 2 and 4 ranks sharing this
host's disk over the same total users and the same total I/O slots, side by side in one run; then the
time rank 0 takes to pool 10^6 request samples into exact percentiles.

Each configuration runs ``--repeats`` times in alternating order (1, 2, 4, 4, 2, 1, ...) because these
machines are noisy; the median counts. Device bytes/s = bytes the storage tier completed (reads and
writes, every rank) / the load window. llama3.1-8b, --cpu-mem-gb 0 (every access goes to the file tier,
O_DIRECT), generation none; N ranks get --num-users U/N and --max-concurrent-allocs M/N each.

Merge: rank 0's ``aggregate`` (bench/mpi.py) fed the 4-rank run's real per-rank results with synthetic
raw samples, 10^6 requests in all (end-to-end and storage time per request, and as many storage reads
and writes): the time to concatenate and summarize them, as the aggregate records it
(``latency.merge_seconds``); moving the arrays between ranks is not included.

Last line: ``mpi_scaling bytes_per_s_1=.. bytes_per_s_2=.. bytes_per_s_4=.. ratio_4_vs_1=.. merge_s_1e6=..``
(aims: ratio >= 0.9, merge < 2 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_tool


def run(n: int, users: int, allocs: int, duration: int, work: Path, i: int) -> tuple[float, dict]:
    cache, out = work / f"c{n}-{i}", work / f"r{n}-{i}.json"
    args = ["--model", "llama3.1-8b", "--num-users", str(users // n), "--duration", str(duration)]
    args += ["--gpu-mem-gb", "0", "--cpu-mem-gb", "0", "--max-concurrent-allocs", str(max(1, allocs // n))]
    args += ["--generation-mode", "none", "--seed", str(100 + i), "--progress", "none"]
    args += ["--cache-dir", str(cache), "--output", str(out)]
    kv = [sys.executable, "-m", "kvtier", "bench", *args]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    cmd = kv if n == 1 else ["mpirun", *root, "--oversubscribe", "-np", str(n), *kv]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=duration * 10 + 300)
    if p.returncode != 0 or not out.exists():
        raise SystemExit(f"{n} rank(s) failed ({p.returncode}):\n{p.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    shutil.rmtree(cache, ignore_errors=True)
    if n == 1:
        st = doc["tiers"].get("storage", {"read": {"bytes": 0}, "write": {"bytes": 0}})
        return (st["read"]["bytes"] + st["write"]["bytes"]) / doc["load_duration_s"], doc
    b = doc["totals"]["tier_bytes"].get("storage", {"read": 0, "written": 0})
    window = doc["window"]["deadline_unix_s"] - doc["window"]["start_unix_s"]
    return (b["read"] + b["written"]) / window, doc


def merge_time(agg_doc: dict, work: Path, total: int) -> float:
    sys.path.insert(0, str(REPO / "src"))
    from kvtier.bench.mpi import aggregate
    from kvtier.config.bench import BenchConfig
    from kvtier.results.envelope import utc_now

    rng = np.random.default_rng(1)
    got = {}
    per = total // len(agg_doc["ranks"])
    for rank in agg_doc["ranks"]:
        result = json.loads(Path(rank["result_file"]).read_text())
        samples = {
            name: rng.integers(1_000_000, 2_000_000_000, per, dtype=np.int64)
            for name in (
                "e2e",
                "storage",
                "storage.read",
                "storage.write",
                "storage.read.device",
                "storage.write.device",
            )
        }
        got[rank["rank"]] = {
            "rank": rank["rank"],
            "host": rank["host"],
            "result": result,
            "result_file": None,
            "samples": samples,
        }
    cfg = BenchConfig.model_validate(agg_doc["config"])
    agg = aggregate(cfg, len(got), agg_doc["seed"], agg_doc["window"], got, utc_now())
    assert agg.latency.end_to_end_latency_ms["count"] == per * len(got)
    return agg.latency.merge_seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--users", type=int, default=8, help="total users (divisible by 4)")
    ap.add_argument("--allocs", type=int, default=8, help="total --max-concurrent-allocs (divisible by 4)")
    ap.add_argument("--duration", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=None)
    a = ap.parse_args()
    ensure_tool("mpirun")
    work = Path(tempfile.mkdtemp(prefix="kvtier-mpi-", dir=a.workdir))
    rates: dict[int, list[float]] = {1: [], 2: [], 4: []}
    last4: dict | None = None
    try:
        i = 0
        for rep in range(a.repeats):
            for n in (1, 2, 4) if rep % 2 == 0 else (4, 2, 1):
                rate, doc = run(n, a.users, a.allocs, a.duration, work, i)
                i += 1
                rates[n].append(rate)
                if n == 4:
                    last4 = doc
                    lost = doc["lost_ranks"]
                    print(f"4 ranks: start skew {doc['skew']['start_s']:.3f} s, lost {lost}", flush=True)
                print(f"{n} rank(s), {a.users // n} users and {max(1, a.allocs // n)} allocs each: "
                      f"{rate / 1e9:.3f} GB/s", flush=True)  # fmt: skip
        assert last4 is not None
        merge = merge_time(last4, work, 1_000_000)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {n: statistics.median(v) for n, v in rates.items()}
    ratio = med[4] / med[1]
    print(
        f"mpi_scaling bytes_per_s_1={med[1]:.0f} bytes_per_s_2={med[2]:.0f} bytes_per_s_4={med[4]:.0f} "
        f"ratio_4_vs_1={ratio:.3f} merge_s_1e6={merge:.3f}"
    )


if __name__ == "__main__":
    main()
