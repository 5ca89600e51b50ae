"""kvtier's file tier against fio on the same directory, and its CPU tier against np.copyto.

For each entry size (default 64 MiB and 1 GiB), in one run and on one directory, alternating the
order in each repetition (ABBA) because these machines are noisy:
  * fio sequential write then read: direct=1, ioengine=psync (one synchronous request per job, as
    kvtier issues them), bs = kvtier's I/O chunk, numjobs = kvtier workers, each job writing
    total/jobs bytes as files of the entry size with an fsync at the end of each file, and
    fallocate=none (kvtier allocates blocks as it writes, too);
  * kvtier's FileTier writing and then reading the same total bytes as entries of that size, with
    the same number of worker threads, each with its reused aligned buffer.
Ratio = kvtier bandwidth / fio bandwidth; the reported figure is the median over repetitions.
Transparent huge pages: kvtier's buffers ask for them (madvise); fio's malloc'd buffers only get
them with THP=always, and on these machines O_DIRECT runs ~2.5x faster from huge pages. So, as
root, THP is set to 'always' for the run and restored after (--no-thp-always leaves it alone).
CPU tier: MemoryTier write and read of one entry (in 32 MiB pages, kvtier bench's default for
llama3.1-8b) vs np.copyto of the same size into a preallocated array (both warm), median of repetitions.
A write of 32 MiB or more that has the CPU tier to itself is copied by two threads, a half each (engine/noise.py
SPLIT_BYTES); the write is also timed with that off (``cpu_one_thread``), against the same one-thread np.copyto.

Both write data no array can deduplicate or compress: kvtier's stamped noise (engine/noise.py: every 4 KiB
block unique, each writer's buffer filled once and only its stamps rewritten per chunk), fio with
refill_buffers, randrepeat=0, dedupe_percentage=0, buffer_compress_percentage=0. What one GB of unique data
costs a core is printed three ways: stamped in place (the writes), the stamped copy (the CPU tier's fill) and a
plain memcpy of the same bytes.

Last line: ``io_vs_fio write=<min over sizes> read=<min over sizes> cpu=<min of write, read>
cpu_one_thread=<the same, the write on one thread>``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ensure_tool, median

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.file import FileTier
from kvtier.engine.noise import NoiseBuffer

MiB = 1024**2


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    try:
        text = THP.read_text()
        return text[text.index("[") + 1 : text.index("]")]
    except (OSError, ValueError):
        return "unknown"


def set_thp(mode: str) -> bool:
    try:
        THP.write_text(mode + "\n")
        return True
    except OSError:
        return False


def drop_page_cache() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        pass


def fio_bandwidth(fio: str, directory: Path, rw: str, entry: int, total: int, jobs: int, bs: int) -> float:
    per_job = total // jobs
    nfiles = max(1, per_job // entry)
    cmd = [
        fio,
        "--name=kv",
        f"--directory={directory}",
        f"--rw={rw}",
        "--direct=1",
        "--ioengine=psync",
        f"--bs={bs}",
        f"--numjobs={jobs}",
        f"--size={nfiles * entry}",
        f"--nrfiles={nfiles}",
        f"--filesize={entry}",
        "--file_service_type=sequential",
        "--fsync_on_close=1",
        "--group_reporting",
        "--output-format=json",
        "--allow_file_create=1",
        "--fallocate=none",
        # fio writes data as unique and incompressible as kvtier's (engine/noise.py): fresh random buffers for
        # every write, no dedupable or compressible share, no repeated random seed
        "--refill_buffers=1",
        "--randrepeat=0",
        "--dedupe_percentage=0",
        "--buffer_compress_percentage=0",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def kvtier_bandwidth(
    tier: FileTier, noise: NoiseBuffer, op: str, entry: int, total: int, jobs: int, chunk: int, bufs: list[memoryview]
) -> float:
    n_entries = max(jobs, total // entry)
    keys = [f"e{i}" for i in range(n_entries)]
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for k in keys[w::jobs]:
                if op == "write":
                    tier.write(k, noise.chunks(k, entry, chunk), entry)  # stamped in place (bufs: the reads')
                else:
                    tier.read(k, bufs[w])
        except BaseException as e:  # noqa: BLE001 - any failure in a worker thread is reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(jobs)]
    c0 = time.process_time()
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dt = time.perf_counter() - t0
    CPU_S_PER_GB.setdefault(op, []).append((time.process_time() - c0) / (n_entries * entry / 1e9))
    if errors:
        raise errors[0]
    return n_entries * entry / dt


CPU_S_PER_GB: dict[str, list[float]] = {}
"""kvtier's process CPU seconds (all threads: the stamped copy, syscalls) per GB moved, per operation."""


def cpu_ratios(size: int, reps: int) -> tuple[float, float]:
    """The CPU tier's write and read of one entry against np.copyto, in 32 MiB pages (kvtier bench's page for
    llama3.1-8b: 256 tokens of its KV); the measurement is benchmarks/cpu_tier_pages.py's."""
    from cpu_tier_pages import ONE_THREAD, ratios

    w, r = ratios(size, 32 * MiB, reps)
    CPU_ONE_THREAD.append(ONE_THREAD[-1])
    return w, r


CPU_ONE_THREAD: list[float] = []
"""The CPU tier's write ratio with its pieces copied on one thread (a lone write's are split in two otherwise)."""


def stamp_cost(reps: int) -> tuple[float, float, float]:
    """Seconds of one core per GB for kvtier's data (engine/noise.py): stamped in place in a writer buffer (a
    write's), the stamped copy (the CPU tier's fill, and writes before), and a plain memcpy of the same bytes
    from the noise buffer. Returns (in place, stamped copy, plain copy) s/GB, medians."""
    noise = NoiseBuffer(256 * MiB, seed=3)
    out = aligned_buffer(64 * MiB)
    for _ in noise.chunks("warm", 64 * MiB, 64 * MiB):  # the writer buffer's one fill, outside the figure
        pass
    in_place, stamped, plain = [], [], []
    for r in range(reps):
        t = time.process_time()
        for _ in noise.chunks(f"p{r}", 512 * MiB, 64 * MiB):
            pass
        in_place.append((time.process_time() - t) / (512 * MiB / 1e9))
        t = time.process_time()
        for _ in noise.chunks(f"s{r}", 512 * MiB, out=out):
            pass
        stamped.append((time.process_time() - t) / (512 * MiB / 1e9))
        t = time.process_time()
        for i in range(8):
            o = (i * 32 * MiB) % (192 * MiB)
            out[:] = noise._view[o : o + 64 * MiB]
        plain.append((time.process_time() - t) / (512 * MiB / 1e9))
    return median(in_place), median(stamped), median(plain)


def main() -> None:
    from kvtier.engine.backend import nt_copy_environ

    env = nt_copy_environ(os.environ)  # as kvtier bench runs: copies of 1 MiB and more stream (engine/backend.py)
    if env is not None:
        os.execve(sys.executable, [sys.executable, __file__, *sys.argv[1:]], env)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", help="directory on the device under test (default: a temp dir in /var/tmp)")
    ap.add_argument("--entry-mb", default="64,1024", help="entry sizes, MiB, comma separated")
    ap.add_argument("--total-mb", type=int, default=2048, help="bytes per measurement, MiB")
    ap.add_argument("--jobs", type=int, default=2, help="fio jobs = kvtier worker threads")
    ap.add_argument("--chunk-mb", type=int, default=64, help="kvtier I/O chunk = fio bs, MiB")
    ap.add_argument("--reps", type=int, default=5, help="pairs per measurement (median reported)")
    ap.add_argument("--cpu-mb", type=int, default=256, help="CPU tier entry size, MiB")
    ap.add_argument(
        "--no-thp-always",
        dest="thp_always",
        action="store_false",
        help="leave transparent huge pages as they are (fio then uses 4 KiB pages if THP=madvise)",
    )
    a = ap.parse_args()

    fio = ensure_tool("fio")
    thp_before = thp_mode()
    # kvtier asks for huge pages itself (madvise); fio's malloc'd buffers only get them when THP
    # is 'always'. Huge pages change O_DIRECT speed here by ~2.5x, so give fio the same for the
    # run (root only) and restore the setting afterwards.
    thp_changed = a.thp_always and thp_before not in ("always", "unknown") and set_thp("always")
    print(
        f"transparent huge pages: {thp_mode()}" + (f" (was {thp_before}, restored at exit)" if thp_changed else ""),
        flush=True,
    )
    base = Path(a.dir) if a.dir else Path(tempfile.mkdtemp(prefix="kvtier-iovsfio-", dir="/var/tmp"))
    chunk = a.chunk_mb * MiB
    noise = NoiseBuffer(256 * MiB, seed=1)
    bufs = [aligned_buffer(chunk) for _ in range(a.jobs)]
    worst_w, worst_r = float("inf"), float("inf")
    try:
        for entry_mb in (int(x) for x in a.entry_mb.split(",")):
            entry = entry_mb * MiB
            total = max(a.total_mb * MiB, entry * a.jobs)
            wr, rr = [], []
            for rep in range(a.reps):
                fdir = base / f"fio-{entry_mb}-{rep}"
                fdir.mkdir()
                tier = FileTier(base, capacity_bytes=1 << 50, direct_io="on")
                order = ("fio", "kvtier") if rep % 2 == 0 else ("kvtier", "fio")
                bw: dict[tuple[str, str], float] = {}
                for op in ("write", "read"):
                    for who in order:
                        drop_page_cache()
                        if who == "fio":
                            bw[(who, op)] = fio_bandwidth(fio, fdir, op, entry, total, a.jobs, chunk)
                        else:
                            bw[(who, op)] = kvtier_bandwidth(tier, noise, op, entry, total, a.jobs, chunk, bufs)
                wr.append(bw[("kvtier", "write")] / bw[("fio", "write")])
                rr.append(bw[("kvtier", "read")] / bw[("fio", "read")])
                print(
                    f"entry {entry_mb} MiB rep {rep}: write fio {bw[('fio', 'write')] / 1e9:.2f} GB/s "
                    f"kvtier {bw[('kvtier', 'write')] / 1e9:.2f} GB/s | read fio {bw[('fio', 'read')] / 1e9:.2f} "
                    f"GB/s kvtier {bw[('kvtier', 'read')] / 1e9:.2f} GB/s",
                    flush=True,
                )
                tier.close()
                shutil.rmtree(fdir)
            mw, mr = median(wr), median(rr)
            print(
                f"entry {entry_mb} MiB: median kvtier/fio write={mw:.2f} read={mr:.2f} "
                f"(jobs={a.jobs}, bs={a.chunk_mb} MiB, {total // MiB} MiB per measurement)",
                flush=True,
            )
            worst_w, worst_r = min(worst_w, mw), min(worst_r, mr)
    finally:
        if thp_changed:
            set_thp(thp_before)
        if not a.dir:
            shutil.rmtree(base, ignore_errors=True)
    cw, cr = cpu_ratios(a.cpu_mb * MiB, max(a.reps, 5))
    one = CPU_ONE_THREAD[-1]
    print(f"cpu tier vs np.copyto ({a.cpu_mb} MiB): write={cw:.2f} (on one thread {one:.2f}) read={cr:.2f}")
    cpu = {op: median(v) * 1e3 for op, v in CPU_S_PER_GB.items()}
    print(f"kvtier host CPU per device GB: write {cpu.get('write', 0):.0f} ms, read {cpu.get('read', 0):.0f} ms")
    ip, st, pl = stamp_cost(max(a.reps, 5))
    print(
        f"unique data: stamped in place {ip * 1e3:.1f} ms of one core per GB; stamped copy {st * 1e3:.1f} ms/GB "
        f"({1 / st:.1f} GB/s) against a plain memcpy {pl * 1e3:.1f} ms/GB: the stamp costs {(st - pl) * 1e3:.1f} "
        "ms/GB on a copy"
    )
    print(f"io_vs_fio write={worst_w:.2f} read={worst_r:.2f} cpu={min(cw, cr):.2f} cpu_one_thread={min(one, cr):.2f}")


if __name__ == "__main__":
    main()
