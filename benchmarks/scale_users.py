"""The reference's load at scale: 50, 100, 200 and 500 users of llama3.1-8b at --max-concurrent-allocs 0
(MLPerf workload 2's flags: one worker per user up to 500, --cpu-mem-gb 0), open arrival, on one disk.

Per row: requests completed, failed, dropped at the queue (open arrival, --max-queued), stores dropped (no
tier could take them), peak RSS, and host CPU per device GB (the process's user + system seconds over the
bytes the device moved, from the result's device section, else kvtier's own storage bytes). Before the
reference's load came to kvtier this was a failure storm (100 users: 18 of 29 failed tier_full; 200: 881 of
899; 500: 4032 of 4048), each run still "complete".

Last line: ``scale_users max_failed_pct=<worst row> rows=<n>`` (aim: <= 1 on every row).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path


def run(users: int, duration: float, seed: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        out = Path(d) / "r.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier",
                "bench",
                "--model",
                "llama3.1-8b",
                "--num-users",
                str(users),
                "--duration",
                str(duration),
                "--gpu-mem-gb",
                "0",
                "--cpu-mem-gb",
                "0",
                "--max-concurrent-allocs",
                "0",
                "--generation-mode",
                "none",
                "--seed",
                str(seed),
                "--cache-dir",
                d,
                "--output",
                str(out),
                "--progress",
                "none",
            ],  # fmt: skip
            check=False,
            capture_output=True,
        )
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        r = json.loads(out.read_text())
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    dev = (r.get("device") or {}).get("totals") or {}
    moved = float(dev.get("read_bytes", 0) + dev.get("write_bytes", 0))
    if not moved:
        moved = sum(
            float(t[op]["bytes"]) for name, t in r["tiers"].items() if name == "storage" for op in ("read", "write")
        )
    ok, failed = r["requests_completed"], r["requests_failed"]
    return {
        "users": users,
        "status": r["status"],
        "completed": ok,
        "failed": failed,
        "failed_pct": 100.0 * failed / (ok + failed) if ok + failed else 0.0,
        "dropped_requests": (r.get("load") or {}).get("requests_dropped", 0),
        "stores_dropped": r["summary"]["cache_stats"].get("stores_dropped", 0),
        "rss_gib": r["memory"]["peak_rss_bytes"] / 2**30,
        "cpu_s_per_device_gb": cpu / (moved / 1e9) if moved else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", default="50,100,200,500")
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=42)
    a = ap.parse_args()
    rows = [run(int(u), a.duration, a.seed) for u in a.users.split(",")]
    print(f"{'users':>6} {'status':>9} {'completed':>9} {'failed':>6} {'failed %':>8} {'queue-dropped':>13} "
          f"{'stores dropped':>14} {'RSS GiB':>7} {'CPU s/device GB':>15}")  # fmt: skip
    for x in rows:
        print(f"{x['users']:>6} {x['status']:>9} {x['completed']:>9} {x['failed']:>6} {x['failed_pct']:>8.2f} "
              f"{x['dropped_requests']:>13} {x['stores_dropped']:>14} {x['rss_gib']:>7.2f} "
              f"{x['cpu_s_per_device_gb']:>15.3f}")  # fmt: skip
    print(f"scale_users max_failed_pct={max(x['failed_pct'] for x in rows):.2f} rows={len(rows)}")


if __name__ == "__main__":
    main()
