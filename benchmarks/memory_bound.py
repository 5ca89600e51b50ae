"""Peak RSS of a bench run against the documented bound.

Runs ``kvtier bench`` (llama3.1-8b, 50 users, --max-concurrent-allocs 8, CPU tier as given) in a
child process and reads the result's ``memory`` section: peak RSS (VmHWM of the process) and the
bound noise buffer + io_slots x io_chunk + the writers' buffers (the noise they hold) + CPU tier capacity + 256 MiB.
Last line: ``memory_bound peak_rss_gib=... bound_gib=... ok=true|false``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="cache directory (default: a temp dir in /var/tmp)")
    ap.add_argument("--duration", type=float, default=30)
    ap.add_argument("--cpu-mem-gb", type=float, default=2)
    ap.add_argument("--users", type=int, default=50)
    ap.add_argument("--max-concurrent-allocs", type=int, default=8)
    a = ap.parse_args()
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="kvtier-membound-", dir="/var/tmp"))
    out = base / "result.json"
    try:
        cmd = [
            sys.executable,
            "-m",
            "kvtier",
            "bench",
            "--model",
            "llama3.1-8b",
            "--num-users",
            str(a.users),
            "--max-concurrent-allocs",
            str(a.max_concurrent_allocs),
            "--duration",
            str(a.duration),
            "--gpu-mem-gb",
            "0",
            "--cpu-mem-gb",
            str(a.cpu_mem_gb),
            "--generation-mode",
            "none",
            "--seed",
            "42",
            "--cache-dir",
            str(base),
            "--output",
            str(out),
            "--progress",
            "none",
        ]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0 or not out.exists():
            raise SystemExit(f"bench failed ({p.returncode}): {p.stderr[-2000:]}")
        r = json.loads(out.read_text())
    finally:
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    m = r["memory"]
    gib = 2**30
    print(
        f"requests completed {r['requests_completed']}, read {r['summary']['storage_read_bytes_per_sec'] / 1e9:.2f} "
        f"GB/s, write {r['summary']['storage_write_bytes_per_sec'] / 1e9:.2f} GB/s"
    )
    print(
        f"bound = noise {m['noise_buffer_bytes'] / gib:.3f} + {m['io_slots']} x {m['io_chunk_bytes'] / gib:.3f} "
        f"+ writers' buffers {(m.get('writer_buffer_bytes') or 0) / gib:.3f} "
        f"+ cpu tier {m['cpu_tier_capacity_bytes'] / gib:.3f} + 0.25 GiB"
    )
    print(
        f"memory_bound peak_rss_gib={m['peak_rss_bytes'] / gib:.3f} bound_gib={m['bound_bytes'] / gib:.3f} "
        f"ok={'true' if m['within_bound'] else 'false'}"
    )


if __name__ == "__main__":
    main()
