"""The same ``kvtier bench`` from two checkouts, side by side (A B A B ...: these machines are noisy, so the
pairs alternate and the ratio is the median of the pairs'): does a change of structure cost anything?

``--before SRC`` is the other checkout's ``src/`` (e.g. a ``git worktree`` of the earlier commit); this
checkout's ``src/`` is "after". Each run: a fresh cache folder under ``--dir``, the same flags, seed and
duration (llama3.1-8b, ``--num-users`` 8, ``--cpu-mem-gb`` 0, ``--max-concurrent-allocs`` 4 unless given).
Printed per pair: requests completed, storage throughput (tokens/s), storage read and write bandwidth, storage
read device p95. Last line:
``bench_ab pairs=… throughput_ratio=… read_bw_ratio=… write_bw_ratio=… read_p95_ratio=… status=…``
(after / before, medians over the pairs; status: the runs' statuses, all ``complete`` when they agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, settle


def flags(a: argparse.Namespace) -> list[str]:
    return ["--model", "llama3.1-8b", "--num-users", str(a.num_users), "--gpu-mem-gb", "0",
            "--cpu-mem-gb", str(a.cpu_mem_gb), "--max-concurrent-allocs", str(a.max_concurrent_allocs),
            "--generation-mode", "none", "--seed", "42", "--progress", "none"]  # fmt: skip


def one(src: str, directory: str, duration: int, flag_list: list[str]) -> dict[str, float | str | None]:
    settle(Path(directory))  # the last run's dirty pages, page cache and trims gone before this one starts
    with tempfile.TemporaryDirectory(dir=directory, prefix="kvtier-ab-") as d:
        out = Path(d) / "r.json"
        env = {**os.environ, "PYTHONPATH": src}
        cmd = [sys.executable, "-m", "kvtier", "bench", *flag_list, "--duration", str(duration), "--cache-dir", d,
               "--output", str(out)]  # fmt: skip
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=duration + 300)
        if not out.exists():
            raise SystemExit(f"{src}: no result (exit {p.returncode}): {p.stderr[-2000:]}")
        r = json.loads(out.read_text())
    s, c = r["summary"], r["summary"]["cache_stats"]
    return {
        "status": r["status"],
        "requests": r["requests_completed"],
        "throughput": s["storage_throughput_tokens_per_sec"],
        "read_bw": c["tier_storage_read_bandwidth_gbps"],
        "write_bw": c["tier_storage_write_bandwidth_gbps"],
        "read_p95": c.get("storage_read_device_p95_ms"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="the other checkout's src/ folder")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--duration", type=int, default=10, help="seconds of each run")
    ap.add_argument("--dir", default="/var/tmp", help="where the runs' cache folders go (a real disk)")
    ap.add_argument("--num-users", type=int, default=8)
    ap.add_argument("--cpu-mem-gb", type=float, default=0, help="a CPU tier in front of the disk (default none)")
    ap.add_argument("--max-concurrent-allocs", type=int, default=4)
    a = ap.parse_args()
    after = str(REPO / "src")
    ratios: dict[str, list[float]] = {k: [] for k in ("throughput", "read_bw", "write_bw", "read_p95")}
    states = set()
    for i in range(a.pairs):
        runs = {}
        order = ("before", "after") if i % 2 == 0 else ("after", "before")  # ABBA: neither side always first
        for side in order:
            runs[side] = one(a.before if side == "before" else after, a.dir, a.duration, flags(a))
        b, f = runs["before"], runs["after"]
        states |= {str(b["status"]), str(f["status"])}
        print(
            f"pair {i}: requests {b['requests']} / {f['requests']}, throughput {b['throughput']:.0f} / "
            f"{f['throughput']:.0f} tokens/s, read {b['read_bw']:.3f} / {f['read_bw']:.3f} GiB/s, write "
            f"{b['write_bw']:.3f} / {f['write_bw']:.3f} GiB/s, read device p95 {b['read_p95']} / {f['read_p95']} ms "
            "(before / after)",
            flush=True,
        )
        for k in ratios:
            if b[k] and f[k] is not None:
                ratios[k].append(float(f[k]) / float(b[k]))  # type: ignore[arg-type]
    med = {k: (f"{statistics.median(v):.3f}" if v else "n/a") for k, v in ratios.items()}
    print(
        f"bench_ab pairs={a.pairs} throughput_ratio={med['throughput']} read_bw_ratio={med['read_bw']} "
        f"write_bw_ratio={med['write_bw']} read_p95_ratio={med['read_p95']} status={','.join(sorted(states))}"
    )


if __name__ == "__main__":
    main()
