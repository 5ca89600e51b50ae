"""How long a user waits after a bench's window closes, and on what: #59 item 3 (aim: at most 5 s in both regimes).

Each regime is ``kvtier bench`` with the issue's flags (llama3.1-8b, 20 users, ``--max-concurrent-allocs 8
--generation-mode none --gpu-mem-gb 0``, 45 s), storage only (``--cpu-mem-gb 0``) and with a 4 GB CPU tier,
``--repeats`` runs each, its cache folder on the disk (``--dir``, default /var/tmp). The wait is measured from
outside: the process's exit (wall clock) minus the window's close (the result's ``load_start_unix_s`` plus the
duration). Its parts come from the result: the load phase past the duration (in-flight I/O finishing or being
cut), the rest of the run's own clock, the teardown (``teardown.seconds``: closing the tiers, removing the entry
files) and what is left (building and writing the result, the interpreter's exit).

Last line: ``stop_latency overrun_s_storage=<median> overrun_s_cpu=<median> load_s_after_duration=<median of all>
teardown_s=<median of all>``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, settle


def one(a: argparse.Namespace, cpu_gb: float, seed: int) -> dict[str, float]:
    settle(Path(a.dir))  # the last run's trims and writeback are not this run's wait
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, "-m", "kvtier", "bench", "--model", a.model, "--num-users", str(a.users),
               "--duration", str(a.duration), "--gpu-mem-gb", "0", "--cpu-mem-gb", f"{cpu_gb:g}",
               "--max-concurrent-allocs", str(a.max_concurrent_allocs), "--generation-mode", "none",
               "--seed", str(seed), "--cache-dir", d, "--output", str(out), "--progress", "none"]  # fmt: skip
        subprocess.run(cmd, check=True, capture_output=True, timeout=a.duration * 10 + 300)
        exited = time.time()
        r = json.loads(out.read_text())
    closed = r["load_start_unix_s"] + a.duration
    return {
        "overrun": exited - closed,
        "load_after": r["load_duration_s"] - a.duration,
        "run_after": r["elapsed_s"] - r["load_duration_s"],
        "teardown": r["teardown"]["seconds"],
        "storage_gb": r["teardown"]["storage_bytes"] / 1e9,
        "entries": r["teardown"]["storage_entries"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--duration", type=int, default=45)
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--max-concurrent-allocs", type=int, default=8)
    ap.add_argument("--dir", default="/var/tmp", help="where the runs' cache folders go (the disk under test)")
    a = ap.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"storage": [], "cpu": []}
    for i in range(a.repeats):
        for regime, cpu_gb in (("storage", 0.0), ("cpu", 4.0)):
            r = one(a, cpu_gb, 42 + i)
            rows[regime].append(r)
            rest = r["overrun"] - r["load_after"] - r["run_after"] - r["teardown"]
            print(f"{regime:>7} run {i}: waited {r['overrun']:.2f} s after the window: load phase "
                  f"+{r['load_after']:.2f}, run tail {r['run_after']:.2f}, teardown {r['teardown']:.2f} "
                  f"({r['entries']} entries, {r['storage_gb']:.1f} GB), the rest {rest:.2f}", flush=True)  # fmt: skip
    every = [r for v in rows.values() for r in v]
    print(
        f"stop_latency overrun_s_storage={median([r['overrun'] for r in rows['storage']]):.2f} "
        f"overrun_s_cpu={median([r['overrun'] for r in rows['cpu']]):.2f} "
        f"load_s_after_duration={median([r['load_after'] for r in every]):.2f} "
        f"teardown_s={median([r['teardown'] for r in every]):.2f}"
    )


if __name__ == "__main__":
    main()
