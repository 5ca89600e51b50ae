"""The GPU tier and GPUDirect Storage on a GPU host (#31 item 4), in one prepared run of under 5 minutes.

1. The GPU tier (engine/gpu.py, through torch) writing and reading entries of 64 MiB and 1 GiB from and into
   the caller's host buffer (kvtier's aligned, pageable buffers), against torch's own copy of the same bytes
   between pinned host memory and the device (the fastest host<->device path), each synchronized: ratio =
   reference seconds / ours, the median of 5 repetitions (aim >= 0.9).
2. GPUDirect Storage: with kvikio, a 256 MiB device buffer written to and read from a file in --dir through
   ``kvikio.CuFile``, and what kvikio says of its path (cuFile, or compatibility mode: POSIX through a host
   bounce buffer), beside kvtier's own probe (engine/gds.py ``probe_gds``); then kvtier's GDS file tier
   (``GdsFileTier``: the payload through a per-thread device buffer) writing and reading a 256 MiB entry,
   checked against the noise, with its verdict from kvikio's own account (``outcome()``: used, evidence,
   bytes per backend).

Without torch, a CUDA device or kvikio, each part says why it was skipped; nothing here needs a GPU to run.
Last line: ``gpu_check gpu_write_ratio=… gpu_read_ratio=… gds=… gds_tier=…`` (``skipped`` where its part was).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

sys.path.insert(0, str(REPO / "src"))
from kvtier.engine.backend import aligned_buffer
from kvtier.engine.gds import probe_gds
from kvtier.engine.gpu import gpu_available
from kvtier.telemetry.clock import IOTiming

MiB = 1 << 20


def tier_ratios(sizes: list[int], reps: int) -> tuple[float, float]:
    """(write, read) ratios of the GPU tier against torch's pinned copies, the lower over ``sizes``."""
    import torch

    from kvtier.engine.gpu import GpuTier

    tier = GpuTier(2 * max(sizes))
    worst_w = worst_r = float("inf")
    for size in sizes:
        buf = aligned_buffer(min(size, 64 * MiB))  # kvtier's per-worker buffer: entries move through it
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        w, r = [], []
        for i in range(reps + 1):
            t = time.perf_counter()
            dev.copy_(pinned)
            torch.cuda.synchronize()
            ref_h2d = time.perf_counter() - t
            t = time.perf_counter()
            pinned.copy_(dev)
            torch.cuda.synchronize()
            ref_d2h = time.perf_counter() - t
            chunks = [buf[: min(len(buf), size - off)] for off in range(0, size, len(buf))]
            t = time.perf_counter()
            tier.write("x", chunks, size)
            ours_w = time.perf_counter() - t
            t = time.perf_counter()
            tier.read("x", buf)
            ours_r = time.perf_counter() - t
            tier.delete("x")
            if i:  # the first round warms the allocator and the copy engines
                w.append(ref_h2d / ours_w)
                r.append(ref_d2h / ours_r)
        mw, mr = statistics.median(w), statistics.median(r)
        print(f"GPU tier, {size // MiB} MiB entries: write {mw:.2f}, read {mr:.2f} of torch's pinned copies "
              f"({size / ref_h2d / 1e9:.1f} / {size / ref_d2h / 1e9:.1f} GB/s)", flush=True)  # fmt: skip
        worst_w, worst_r = min(worst_w, mw), min(worst_r, mr)
        del pinned, dev
    tier.close()
    return worst_w, worst_r


def gds_check(directory: str, size: int) -> str:
    """Write and read ``size`` bytes of device memory through kvikio.CuFile; what path kvikio took."""
    import cupy
    import kvikio

    dev = cupy.arange(size, dtype=cupy.uint8)
    back = cupy.empty_like(dev)
    path = Path(directory) / "kvtier-gds-check.bin"
    try:
        t = time.perf_counter()
        with kvikio.CuFile(path, "w") as f:
            f.write(dev)
        tw = time.perf_counter() - t
        t = time.perf_counter()
        with kvikio.CuFile(path, "r") as f:
            f.read(back)
        tr = time.perf_counter() - t
        same = bool((dev == back).all())
    finally:
        path.unlink(missing_ok=True)
    defaults = kvikio.defaults
    compat = (defaults.is_compat_mode_preferred() if hasattr(defaults, "is_compat_mode_preferred")
              else defaults.compat_mode())  # fmt: skip
    mode = "compat (POSIX through a bounce buffer)" if compat else "cuFile"
    print(f"GDS: {size // MiB} MiB device buffer via kvikio.CuFile: write {size / tw / 1e9:.2f} GB/s, read "
          f"{size / tr / 1e9:.2f} GB/s, {mode}, data {'intact' if same else 'DIFFERS'}", flush=True)  # fmt: skip
    return "cufile" if not compat and same else ("compat" if same else "corrupt")


def gds_tier_check(directory: str, size: int) -> str:
    """kvtier's GDS file tier: one entry written and read back through its device buffers; kvikio's verdict."""
    from kvtier.engine.gds import GdsFileTier
    from kvtier.engine.noise import NoiseBuffer

    noise = NoiseBuffer(64 * MiB, seed=1)
    tier = GdsFileTier(directory, 4 * size)
    buf = aligned_buffer(64 * MiB)
    try:
        t = time.perf_counter()
        tier.write("g", noise.chunks("g", size, 64 * MiB), size)
        tw = time.perf_counter() - t
        t = time.perf_counter()
        got = b"".join(bytes(c) for c in tier.export("g", buf, IOTiming()))
        same = len(got) >= size and noise.verify("g", got[: size // 4096 * 4096]) is None
        tr = time.perf_counter() - t
        out = tier.outcome()
    finally:
        tier.close()
    print(f"GDS tier: {size // MiB} MiB entry: write {size / tw / 1e9:.2f} GB/s, read {size / tr / 1e9:.2f} GB/s "
          f"(with the staging copies), data {'intact' if same else 'DIFFERS'}; used={out['used']} "
          f"({out['reason']}; evidence: {out['evidence']})", flush=True)  # fmt: skip
    return ("used" if out["used"] else "not-used") if same else "corrupt"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on the NVMe under test (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    ok, why = gpu_available()
    w = r = "skipped"
    if ok:
        print(f"device: {why}", flush=True)
        cw, cr = tier_ratios([64 * MiB, 1024 * MiB], a.reps)
        w, r = f"{cw:.2f}", f"{cr:.2f}"
    else:
        print(f"GPU tier: skipped ({why})", flush=True)
    gds_ok, gds_why = probe_gds()
    print(f"kvtier's GDS probe: {'usable' if gds_ok else 'not usable'} ({gds_why})", flush=True)
    gds = tier = "skipped"
    try:
        import cupy  # noqa: F401
        import kvikio  # noqa: F401
    except ImportError as e:
        print(f"GDS check: skipped ({e.name} is not installed: pip install 'kvtier[gds]' cupy)", flush=True)
    else:
        if ok:
            with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvtier-gpu-check-") as d:
                gds = gds_check(d, 256 * MiB)
                tier = gds_tier_check(d, 256 * MiB)
        else:
            print("GDS check: skipped (no CUDA device)", flush=True)
    print(f"gpu_check gpu_write_ratio={w} gpu_read_ratio={r} gds={gds} gds_tier={tier}")


if __name__ == "__main__":
    main()
