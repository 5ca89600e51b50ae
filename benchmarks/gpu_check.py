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

3. ``--gpu-native`` (engine/device.py, #45): entries stamped in device memory (only each 4 KiB block's 8-byte
   stamp rewritten per chunk) at what rate, and checked against the noise; then a GPU tier entry of 256 MiB
   demoted to the file tier and read back into device memory, once through the O_DIRECT tier (the pinned host
   buffer) and once, with kvikio, through the GDS tier (cuFile from the device buffer), each checked byte for
   byte, with the bytes per path the store counted and kvikio's verdict.

Without torch, a CUDA device or kvikio, each part says why it was skipped; nothing here needs a GPU to run.
``--dry-run-on-cpu`` runs part 3 on torch CPU tensors standing in for device memory, to check the script
before a GPU host's minutes are spent (its figures are not a GPU's, and the last line says so).
Last line: ``gpu_check gpu_write_ratio=… gpu_read_ratio=… gds=… gds_tier=… native_stamp_gbps=…
native_demote_gbps=… native_demote_gds_gbps=… native_verified=… device=…`` (``skipped`` where its part was).
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
from kvtier.engine.device import gpu_available
from kvtier.engine.gds import probe_gds
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


def native_check(directory: str, size: int, device: str, with_gds: bool) -> dict[str, str]:
    """--gpu-native: the stamp rate on the device, then GPU tier -> file -> device through the O_DIRECT tier
    and (``with_gds``) the GDS tier, each verified; the figures for the last line."""
    from kvtier.engine.device import DeviceMemory, DeviceNoise
    from kvtier.engine.file import FileTier
    from kvtier.engine.gpu import GpuTier
    from kvtier.engine.noise import NoiseBuffer
    from kvtier.engine.store_api import StoreConfig
    from kvtier.engine.tiered import TieredStore

    dm = DeviceMemory(device)
    noise = NoiseBuffer(256 * MiB, seed=1)
    dn = DeviceNoise(noise, dm)
    chunk = 64 * MiB
    rates = []
    for _ in range(3):
        t = time.perf_counter()
        for _c in dn.chunks("stamp", size, chunk):
            pass
        rates.append(size / (time.perf_counter() - t) / 1e9)
    host = aligned_buffer(chunk)
    made = []
    for c in dn.chunks("check", chunk, chunk):
        dm.to_host(host[: len(c)], c)
        made.append(bytes(host[: len(c)]))
    stamped_ok = noise.verify("check", b"".join(made)) is None
    print(f"gpu-native: entries stamped in device memory at {statistics.median(rates):.1f} GB/s (8 bytes of each "
          f"4 KiB block rewritten per chunk), data {'intact' if stamped_ok else 'DIFFERS'}", flush=True)  # fmt: skip
    out = {"native_stamp_gbps": f"{statistics.median(rates):.1f}", "native_demote_gbps": "skipped",
           "native_demote_gds_gbps": "skipped"}  # fmt: skip
    verified = stamped_ok
    kinds = [("O_DIRECT file tier (pinned host buffer)", "native_demote_gbps", False)]
    if with_gds:
        kinds.append(("GDS file tier (cuFile from the device buffer)", "native_demote_gds_gbps", True))
    for label, field, gds in kinds:
        sub = Path(directory) / ("gds" if gds else "posix")
        sub.mkdir()
        if gds:
            from kvtier.engine.gds import GdsFileTier

            ft: FileTier = GdsFileTier(str(sub), 4 * size, memory=dm, native=True)
        else:
            ft = FileTier(str(sub), 4 * size)
        dm.paths.reset()
        store = TieredStore([GpuTier(2 * size, memory=dm, native=True), ft], StoreConfig(), device=dm)
        buf = aligned_buffer(chunk)
        try:
            store.put("e", lambda: dn.chunks("e", size, chunk), size, buf)
            t = time.perf_counter()
            moved = store.move("e", "storage", buf)
            demote = time.perf_counter() - t
            t = time.perf_counter()
            r = store.get("e", buf)
            read = time.perf_counter() - t
            got = []
            for c in ft.export("e", buf, IOTiming()):
                if isinstance(c, memoryview):
                    got.append(bytes(c))
                else:
                    dm.to_host(host[: len(c)], c)
                    got.append(bytes(host[: len(c)]))
            ok = moved and r.hit and noise.verify("e", b"".join(got)) is None
            verified = verified and ok
            paths = dm.paths.section()
            verdict, prefix = "", ""
            if gds:
                o = ft.outcome()  # type: ignore[attr-defined]
                verdict = f"; kvikio: used={o['used']} ({o['reason']})"
                prefix = "" if o["used"] else "compat:"  # kvikio moved the bytes by POSIX: not a GDS figure
            out[field] = f"{prefix}{size / demote / 1e9:.2f}" if ok else "corrupt"
            print(f"gpu-native: {size // MiB} MiB GPU tier -> {label}: {size / demote / 1e9:.2f} GB/s, read back "
                  f"into device memory {size / read / 1e9:.2f} GB/s, data {'intact' if ok else 'DIFFERS'}; "
                  f"paths {paths['write'].get('storage')} / {paths['read'].get('storage')}{verdict}",
                  flush=True)  # fmt: skip
        finally:
            store.close()
    out["native_verified"] = "yes" if verified else "NO"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="a directory on the NVMe under test (default: a temporary one)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dry-run-on-cpu", action="store_true", help="part 3 on torch CPU tensors (checks the script)")
    a = ap.parse_args()
    if a.dry_run_on_cpu:
        with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvtier-gpu-check-") as d:
            n = native_check(d, 64 * MiB, "cpu", with_gds=False)
        print("gpu_check " + " ".join(f"{k}={v}" for k, v in n.items()) + " device=cpu-stand-in-not-a-gpu-figure")
        return
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
    have_kvikio = False
    try:
        import cupy  # noqa: F401
        import kvikio  # noqa: F401
    except ImportError as e:
        print(f"GDS check: skipped ({e.name} is not installed: pip install 'kvtier[gds]' cupy)", flush=True)
    else:
        have_kvikio = True
        if ok:
            with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvtier-gpu-check-") as d:
                gds = gds_check(d, 256 * MiB)
                tier = gds_tier_check(d, 256 * MiB)
        else:
            print("GDS check: skipped (no CUDA device)", flush=True)
    native = {"native_stamp_gbps": "skipped", "native_demote_gbps": "skipped", "native_demote_gds_gbps": "skipped",
              "native_verified": "skipped"}  # fmt: skip
    if ok:
        with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvtier-gpu-check-") as d:
            native = native_check(d, 256 * MiB, "cuda:0", with_gds=have_kvikio)
    else:
        print(f"gpu-native: skipped ({why})", flush=True)
    rest = " ".join(f"{k}={v}" for k, v in native.items())
    dev = why.replace(" ", "_") if ok else "none"
    print(f"gpu_check gpu_write_ratio={w} gpu_read_ratio={r} gds={gds} gds_tier={tier} {rest} device={dev}")


if __name__ == "__main__":
    main()
