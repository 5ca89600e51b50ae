"""The paged CPU tier (#31): does it still copy at memory speed, and does it ever refuse a write for holes?

1. Speed: MemoryTier write (kvtier's stamped noise, straight into the pages) and read (gathered through a
   reused buffer) of one entry against ``np.copyto`` of the same size into a preallocated array, both warm;
   each repetition's reference is the mean of a copy just before and just after (these machines are noisy),
   median of the ratios, at two
   page sizes: 2 MiB (one huge page) and 32 MiB (kvtier bench's default for llama3.1-8b: 256 tokens of its
   KV, LMCache's chunk).
2. Holes: one sequence of writes of 100-250 MiB entries into a 512 MiB tier, the oldest entry deleted
   whenever a write does not fit (an LRU's eviction). Counted: writes refused although the tier's free
   bytes could hold them. The paged tier is measured; a first-fit extent arena (what the CPU tier was, its
   rule replayed here on offsets only, no bytes) is counted on the same sequence for comparison.
3. Internal waste: the unused part of each entry's last page over the held pages, at the end of (2).

The write is also timed from the same bytes unstamped (a list of views of the noise buffer, scattered into
the pages): that isolates the pages' cost from the stamp's (engine/noise.py; ~15 ms a GB of one core).

The speed test runs twice in one run, each in a fresh process: under glibc's own threshold for streaming copies
(stock), and under the one ``kvtier bench`` sets for itself (engine/backend.py ``NT_COPY_BYTES``).

The write is timed a third way, on one thread: a write of 32 MiB or more that has the tier to itself is otherwise
copied by two threads, a half each (engine/noise.py ``SPLIT_BYTES``).

Last line: ``cpu_tier_pages write_ratio=… write_one_thread_ratio=… write_unstamped_ratio=… read_ratio=…
stock_write_ratio=… stock_write_unstamped_ratio=… stock_read_ratio=… refused_with_room_paged=…
refused_with_room_extent=… waste=…``
(ratios: the lower of the two page sizes; unprefixed: as kvtier bench runs).
"""

from __future__ import annotations

import argparse
import bisect
import random
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, median

sys.path.insert(0, str(REPO / "src"))
from kvtier.engine import noise as noise_mod
from kvtier.engine.backend import aligned_buffer, round_up
from kvtier.engine.memory import MemoryTier
from kvtier.engine.noise import NoiseBuffer
from kvtier.errors import TierFullError

MiB = 1 << 20


def ratios(size: int, page: int, reps: int) -> tuple[float, float]:
    noise = NoiseBuffer(size, seed=1)
    tier = MemoryTier(size + 16 * page, page_bytes=page)
    assert tier.page_bytes == page, (tier.page_bytes, page)
    buf = aligned_buffer(64 * MiB)  # the reader's reused buffer (kvtier's I/O chunk)
    src = np.frombuffer(noise._view, dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    np.copyto(dst, src)  # warm both
    tier.write("w", noise.chunks("w", size, size), size)
    tier.delete("w")
    w, r = [], []

    def ref() -> float:
        t = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t

    plain_src = [memoryview(noise._view)[i : i + 64 * MiB] for i in range(0, size, 64 * MiB)]
    p, one = [], []
    for _ in range(reps):  # the copy before and after ours, averaged: drift affects both sides alike
        before = ref()
        t = time.perf_counter()
        tier.write("x", noise.chunks("x", size, size), size)
        ours_w = time.perf_counter() - t
        t = time.perf_counter()
        tier.read("x", buf)
        ours_r = time.perf_counter() - t
        tier.delete("x")
        t = time.perf_counter()
        tier.write("y", plain_src, size)  # the same bytes unstamped: the pages' own cost, without the stamp's
        ours_p = time.perf_counter() - t
        tier.delete("y")
        split, noise_mod.SPLIT_BYTES = noise_mod.SPLIT_BYTES, 1 << 62  # the same write, one thread only
        try:
            t = time.perf_counter()
            tier.write("z", noise.chunks("z", size, size), size)
            ours_1 = time.perf_counter() - t
        finally:
            noise_mod.SPLIT_BYTES = split
        tier.delete("z")
        base = (before + ref()) / 2
        w.append(base / ours_w)
        r.append(base / ours_r)
        p.append(base / ours_p)
        one.append(base / ours_1)
    tier.close()
    PLAIN.append(median(p))
    ONE_THREAD.append(median(one))
    return median(w), median(r)


PLAIN: list[float] = []  # the unstamped write's ratio, per page size
ONE_THREAD: list[float] = []  # the write's ratio with its copy never shared (engine/noise.py SPLIT_BYTES)


class FirstFit:
    """The extent arena the CPU tier was: first fit over [0, size), coalescing on free (offsets only)."""

    def __init__(self, size: int) -> None:
        self.starts, self.lens, self.free_bytes = [0], [size], size

    def alloc(self, n: int) -> int | None:
        for i, length in enumerate(self.lens):
            if length >= n:
                start = self.starts[i]
                if length == n:
                    del self.starts[i], self.lens[i]
                else:
                    self.starts[i], self.lens[i] = start + n, length - n
                self.free_bytes -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.lens.insert(i, n)
        if i + 1 < len(self.starts) and start + n == self.starts[i + 1]:
            self.lens[i] += self.lens.pop(i + 1)
            self.starts.pop(i + 1)
        if i > 0 and self.starts[i - 1] + self.lens[i - 1] == self.starts[i]:
            self.lens[i - 1] += self.lens.pop(i)
            self.starts.pop(i)
        self.free_bytes += n


def holes(writes: int, seed: int) -> tuple[int, int, float]:
    rng = random.Random(seed)
    sizes = [rng.randint(100, 250) * MiB + rng.randint(0, MiB) for _ in range(writes)]
    cap, page = 512 * MiB, 32 * MiB
    # the paged tier, with bytes (the noise source fills its pages)
    noise = NoiseBuffer(64 * MiB, seed=2)
    tier = MemoryTier(cap, page_bytes=page)
    held: deque[str] = deque()
    paged_refused = 0
    for i, n in enumerate(sizes):
        key = f"e{i}"
        while True:
            try:
                tier.write(key, noise.chunks(key, n, 64 * MiB), n)
                held.append(key)
                break
            except TierFullError:
                if tier.capacity_bytes - tier.stored_bytes() >= tier.stored_size(n):
                    paged_refused += 1  # room by bytes, refused anyway: would be a bug of the pages
                tier.delete(held.popleft())
    waste = tier.waste_bytes() / max(tier.stored_bytes(), 1)
    tier.close()
    # the first-fit arena on the same sequence
    arena, at, order = FirstFit(cap), {}, deque()
    extent_refused = 0
    for i, n in enumerate(sizes):
        n = round_up(n)
        while (start := arena.alloc(n)) is None:
            if arena.free_bytes >= n:
                extent_refused += 1  # the bytes are free, in holes
            old = order.popleft()
            arena.free(*at.pop(old))
        at[i] = (start, n)
        order.append(i)
    return paged_refused, extent_refused, waste


def speed(size_mb: int, reps: int) -> tuple[float, float, float, float]:
    """(write, unstamped write, read, write on one thread) ratios, the lower of the two page sizes, printed per
    page size."""
    worst_w = worst_r = float("inf")
    for page in (2 * MiB, 32 * MiB):
        w, r = ratios(size_mb * MiB, page, reps)
        print(f"  page {page // MiB} MiB, {size_mb} MiB entry: write {w:.2f} (on one thread {ONE_THREAD[-1]:.2f}, "
              f"unstamped bytes {PLAIN[-1]:.2f}), read {r:.2f} of np.copyto", flush=True)  # fmt: skip
        worst_w, worst_r = min(worst_w, w), min(worst_r, r)
    return worst_w, min(PLAIN), worst_r, min(ONE_THREAD)


def speed_in_child(a: argparse.Namespace, env: dict[str, str]) -> tuple[float, float, float, float]:
    """The speed test in a fresh process under ``env`` (glibc reads its tunables at a process's start)."""
    import subprocess

    cmd = [sys.executable, __file__, "--speed-only", "--size-mb", str(a.size_mb), "--reps", str(a.reps)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, check=True)
    print(p.stdout.rstrip("\n").rsplit("\n", 1)[0], flush=True)
    w, u, r, one = (float(x) for x in p.stdout.strip().splitlines()[-1].split())
    return w, u, r, one


def main() -> None:
    import os

    from kvtier.engine.backend import NT_COPY_TUNABLE, nt_copy_environ

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=256, help="entry size of the speed test")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--writes", type=int, default=400, help="writes of the holes test")
    ap.add_argument("--speed-only", action="store_true", help=argparse.SUPPRESS)  # a child: one speed test
    a = ap.parse_args()
    if a.speed_only:
        print(*speed(a.size_mb, a.reps))
        return
    # side by side in one run: glibc's own threshold (stock), then kvtier bench's (it re-executes under it)
    stock_env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" or NT_COPY_TUNABLE not in v}
    print("stock glibc (copies stream above its own threshold):")
    sw, su, sr, _ = speed_in_child(a, stock_env)
    print("as kvtier bench runs (copies of 1 MiB and more stream):")
    w, u, r, one = speed_in_child(a, nt_copy_environ(stock_env) or stock_env)
    paged, extent, waste = holes(a.writes, seed=7)
    print(f"{a.writes} writes of 100-250 MiB into 512 MiB (32 MiB pages): refused with room: paged {paged}, "
          f"first-fit extents {extent}; pages' internal waste {waste:.1%}")  # fmt: skip
    print(
        f"cpu_tier_pages write_ratio={w:.2f} write_one_thread_ratio={one:.2f} write_unstamped_ratio={u:.2f} "
        f"read_ratio={r:.2f} "
        f"stock_write_ratio={sw:.2f} stock_write_unstamped_ratio={su:.2f} stock_read_ratio={sr:.2f} "
        f"refused_with_room_paged={paged} refused_with_room_extent={extent} waste={waste:.3f}"
    )


if __name__ == "__main__":
    main()
