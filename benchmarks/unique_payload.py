"""What unique data costs a writer (engine/noise.py: every 4 KiB block unique), three ways side by side in one
run on one directory, alternating the order because these machines are noisy:

* ``in place`` — kvtier's writes: a writer buffer filled from the noise once, only each block's 8-byte stamp
  rewritten per chunk;
* ``copied`` — kvtier's writes before: each chunk copied from the noise into the writer's buffer and stamped;
* ``sliced`` — the zero-copy slices of the noise it wrote before that (at most noise-buffer / 4 KiB distinct
  blocks per run: not unique, the floor of what a write can cost).

One writer thread (the worst case: it cannot overlap a copy with its write) and then ``--writers`` threads,
each writing ``--entries`` entries of ``--entry-mb`` through FileTier with O_DIRECT in chunks of 64 MiB.
Reported per mode: device GB/s and the process's CPU seconds per GB (all threads).

Last line: ``unique_payload writers=1 ratio=<in place/sliced GB/s> writers=N ratio=<...>
cpu_ms_per_gb_unique=<in place, 1 writer> cpu_ms_per_gb_copied=<1 writer> cpu_ms_per_gb_sliced=<1 writer>``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.file import FileTier
from kvtier.engine.noise import NoiseBuffer

MiB = 1 << 20


def sliced(noise: NoiseBuffer, key: str, n: int, chunk: int) -> Iterator[memoryview]:
    """The old source: aligned slices of the noise buffer, no copy, no stamp."""
    off, rem = noise.offset_for(key), n
    while rem > 0:
        m = min(rem, chunk, noise.nbytes - off)
        yield noise._view[off : off + m]
        rem -= m
        off = (off + m) % noise.nbytes


def measure(tier: FileTier, noise: NoiseBuffer, mode: str, tag: str, writers: int, entries: int, entry: int,
            bufs: list[memoryview]) -> tuple[float, float]:  # fmt: skip
    """(GB/s, CPU s per GB) of ``writers`` threads writing ``entries`` entries each."""

    def work(w: int) -> None:
        for i in range(entries):
            k = f"{tag}-{w}-{i}"
            if mode == "sliced":
                src: Iterable[memoryview] = sliced(noise, k, entry, len(bufs[w]))
            elif mode == "copied":
                src = noise.chunks(k, entry, out=bufs[w])
            else:
                src = noise.chunks(k, entry, len(bufs[w]))
            tier.write(k, src, entry)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    c0, t0 = time.process_time(), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    gb = writers * entries * entry / 1e9
    for w in range(writers):
        for i in range(entries):
            tier.delete(f"{tag}-{w}-{i}")
    return gb / dt, cpu / gb


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the device under test (default: a temp dir in /var/tmp)")
    ap.add_argument("--entry-mb", type=int, default=128)
    ap.add_argument("--entries", type=int, default=8, help="entries per writer per measurement")
    ap.add_argument("--writers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=6)
    a = ap.parse_args()
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="kvtier-payload-", dir="/var/tmp"))
    tier = FileTier(base, capacity_bytes=1 << 50, direct_io="on")
    noise = NoiseBuffer(256 * MiB, seed=1)
    bufs = [aligned_buffer(64 * MiB) for _ in range(max(1, a.writers))]
    ratios: dict[int, float] = {}
    cpu1: dict[str, float] = {}
    modes = ("in place", "copied", "sliced")
    try:
        for writers in sorted({1, a.writers}):
            got: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
            for rep in range(a.reps):
                order = modes[rep % 3 :] + modes[: rep % 3]  # each mode first, middle and last in turn
                for mode in order if rep % 2 == 0 else order[::-1]:
                    got[mode].append(measure(tier, noise, mode, f"{mode[0]}{rep}", writers, a.entries,
                                             a.entry_mb * MiB, bufs))  # fmt: skip
            bw = {m: median([g[0] for g in v]) for m, v in got.items()}
            cpu = {m: median([g[1] for g in v]) for m, v in got.items()}
            ratios[writers] = bw["in place"] / bw["sliced"]
            if writers == 1:
                cpu1 = cpu
            print(f"{writers} writer(s): " + ", ".join(f"{m} {bw[m]:.2f} GB/s at {cpu[m] * 1e3:.0f} ms CPU/GB"
                                                       for m in modes), flush=True)  # fmt: skip
    finally:
        tier.close()
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    print(
        "unique_payload "
        + " ".join(f"writers={w} ratio={r:.2f}" for w, r in sorted(ratios.items()))
        + f" cpu_ms_per_gb_unique={cpu1['in place'] * 1e3:.0f} cpu_ms_per_gb_copied={cpu1['copied'] * 1e3:.0f}"
        + f" cpu_ms_per_gb_sliced={cpu1['sliced'] * 1e3:.0f}"
    )


if __name__ == "__main__":
    main()
