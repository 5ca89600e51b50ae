"""How soon after --duration a loaded bench's load phase ends: in-flight I/O stops at its next chunk.

llama3.1-8b, 200 users, --max-concurrent-allocs 16, --cpu-mem-gb 0, file tier only (entries of tens of MB
to GBs), --duration 4, ``--repeats`` runs; the figure is the load phase's length past the duration
(``load_duration_s - duration``) and the whole run's (``elapsed_s - duration``), medians. This was a timed
unit test once; on a loaded machine it failed by chance, so the tests judge the deadline from the run's own
records (tests/e2e/test_bench_cli.py) and the seconds are measured here.

Last line: ``stop_latency load_s_after_duration=<median> elapsed_s_after_duration=<median>``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0)
    a = ap.parse_args()
    load, whole = [], []
    for i in range(a.repeats):
        with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
            out = Path(d) / "r.json"
            cmd = [sys.executable, "-m", "kvtier", "bench", "--model", "llama3.1-8b", "--num-users", "200",
                   "--duration", str(a.duration), "--gpu-mem-gb", "0", "--cpu-mem-gb", "0",
                   "--max-concurrent-allocs", "16", "--generation-mode", "none", "--seed", str(42 + i),
                   "--cache-dir", d, "--output", str(out), "--progress", "none"]  # fmt: skip
            subprocess.run(cmd, check=True, capture_output=True)
            r = json.loads(out.read_text())
            load.append(r["load_duration_s"] - a.duration)
            whole.append(r["elapsed_s"] - a.duration)
            print(f"run {i}: load phase +{load[-1]:.3f} s, whole run +{whole[-1]:.3f} s past the duration", flush=True)
    print(f"stop_latency load_s_after_duration={median(load):.3f} elapsed_s_after_duration={median(whole):.3f}")


if __name__ == "__main__":
    main()
