"""How fast does the I/O trace mode (``kvtier bench --io-trace-log``) produce rows? Three layers, side by
side in one run, each ``--repeats`` times (the median counts; these machines are noisy):

* writer: ``IOTraceWriter.io`` alone from one thread, rows of kvtier's own shape (the cost the trace adds
  to every operation: a tuple under a lock; formatting and writing happen on the writer thread, and are
  included because the run waits for ``close()``);
* engine: the waterfall (TieredStore over NullTiers: GPU 1 GiB > CPU 2 GiB > storage 8 GiB) with the
  writer as its I/O log, one thread putting then reading 200 MiB entries — every put demotes down the
  tiers once they are full, so each put costs about five rows;
* bench: the whole ``kvtier bench --io-trace-log`` with no think time and no generation time
  (llama3.1-8b, 8 users), rows / load seconds as the result's ``io_trace.rows_per_sec`` records it.

``--zst`` writes the traces compressed (the zstd extra). The aim (#14) is >= 200k rows/s for generating
the trace; the bench line shows what the workload logic itself costs per row on top.

Last line: ``trace_speed writer_rows_per_s=.. engine_rows_per_s=.. bench_rows_per_s=..``
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
from _common import REPO, median

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.null import NullTier
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.tracefile import IOTraceWriter

GiB, MiB = 1024**3, 1024**2


def writer_rate(path: str, rows: int) -> float:
    w = IOTraceWriter(path)
    t0 = time.perf_counter()
    for i in range(rows):
        w.io("write" if i % 3 == 0 else "read", "storage", f"conv_u{i % 97}_{i:05d}_turn_1", "request", 248381440)
    stats = w.close()
    dt = time.perf_counter() - t0
    assert stats["rows"] == rows, stats
    return rows / dt


def engine_rate(path: str, entries: int) -> float:
    store = TieredStore([NullTier("gpu", GiB), NullTier("cpu", 2 * GiB), NullTier("storage", 8 * GiB)], StoreConfig())
    w = IOTraceWriter(path)
    store.io_log = w
    buf = aligned_buffer(4096)

    def source() -> list[memoryview]:
        return []

    t0 = time.perf_counter()
    for i in range(entries):
        key = f"conv_u{i % 97}_{i:06d}_turn_1"
        store.put(key, source, 200 * MiB, buf)
        store.get(key, buf)
    stats = w.close()
    return int(stats["rows"]) / (time.perf_counter() - t0)


def bench_rate(work: Path, duration: int, zst: bool) -> float:
    cfg = work / "no_think.yaml"
    cfg.write_text(
        "user_templates:\n"
        + "".join(f"  {p}: {{think_time_range: [0, 0]}}\n" for p in ("chatbot", "coding", "document"))
    )
    out, trace = work / "r.json", work / ("t.csv.zst" if zst else "t.csv")
    cmd = [sys.executable, "-m", "kvtier", "bench", "--model", "llama3.1-8b", "--num-users", "8"]
    cmd += ["--duration", str(duration), "--gpu-mem-gb", "1", "--cpu-mem-gb", "2", "--storage-capacity-gb", "20"]
    cmd += ["--generation-mode", "none", "--config", str(cfg), "--seed", "1", "--progress", "none"]
    cmd += ["--cache-dir", str(work), "--io-trace-log", str(trace), "--output", str(out)]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return float(json.loads(out.read_text())["io_trace"]["rows_per_sec"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=300_000, help="rows of the writer test")
    ap.add_argument("--entries", type=int, default=30_000, help="entries the engine test puts and reads")
    ap.add_argument("--duration", type=int, default=8, help="seconds of each bench run")
    ap.add_argument("--zst", action="store_true", help="write .csv.zst traces")
    a = ap.parse_args()
    ext = ".csv.zst" if a.zst else ".csv"
    rates: dict[str, list[float]] = {"writer": [], "engine": [], "bench": []}
    with tempfile.TemporaryDirectory(prefix="kvtier-trace-speed-") as tmp:
        work = Path(tmp)
        for i in range(a.repeats):
            rates["writer"].append(writer_rate(str(work / f"w{ext}"), a.rows))
            rates["engine"].append(engine_rate(str(work / f"e{ext}"), a.entries))
            rates["bench"].append(bench_rate(work, a.duration, a.zst))
            print(f"repeat {i + 1}: " + "  ".join(f"{k} {v[-1]:,.0f} rows/s" for k, v in rates.items()), flush=True)
    m = {k: median(v) for k, v in rates.items()}
    print(
        f"trace_speed writer_rows_per_s={m['writer']:.0f} engine_rows_per_s={m['engine']:.0f} "
        f"bench_rows_per_s={m['bench']:.0f}"
    )


if __name__ == "__main__":
    main()
