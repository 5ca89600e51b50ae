"""--gpu-native (#45 item 2) without a GPU: torch CPU tensors stand in for device memory (engine/device.py
``DeviceMemory("cpu")``: the same calls as on CUDA), the tiers are the real ones (the file tier on a real
folder, O_DIRECT where it allows). What is checked is the logic: entries made in device memory with only their
stamps rewritten, each byte's path between device memory and the tiers, every byte arriving as written, and
what a bench result says. cuFile's path is tested with the stand-in kvikio in test_gds_standin.py."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from kvtier.engine.backend import aligned_buffer, round_up
from kvtier.engine.file import FileTier
from kvtier.engine.gpu import GpuTier
from kvtier.engine.memory import MemoryTier
from kvtier.engine.noise import NoiseBuffer
from kvtier.engine.store_api import StoreConfig
from kvtier.engine.tiered import TieredStore
from kvtier.telemetry.clock import IOTiming
from tests.conftest import kvtier_cmd, tiny_bench_config

pytest.importorskip("torch", reason="torch is not installed (scripts/setup.sh test installs its CPU build)")

from kvtier.engine.device import DeviceMemory, DeviceNoise, DevicePaths, is_device

MiB = 1 << 20


@pytest.fixture
def dm() -> DeviceMemory:
    return DeviceMemory("cpu")


def host(chunk) -> bytes:  # type: ignore[no-untyped-def]
    return bytes(chunk.numpy()) if is_device(chunk) else bytes(chunk)


def test_entries_are_made_on_the_device_with_only_the_stamps_rewritten(dm):
    noise = NoiseBuffer(8 * MiB, seed=11)  # fresh: its first writer buffer starts where the device's does
    dn = DeviceNoise(noise, dm)
    n = 3 * MiB + 100
    chunks = []
    for c in dn.chunks("k", n, MiB):
        assert is_device(c)
        chunks.append(c.numpy().copy())
    data = b"".join(c.tobytes() for c in chunks)
    assert len(data) == round_up(n) and noise.verify("k", data) is None  # every block the key's, as written
    # one writer buffer: from one chunk to the next only each 4 KiB block's first 8 bytes change
    a, b = (np.frombuffer(x.tobytes(), np.uint64).reshape(-1, 512) for x in chunks[:2])
    assert (a[:, 1:] == b[:, 1:]).all() and (a[:, 0] != b[:, 0]).all()
    # byte for byte what the host path makes from the same base (a fresh noise's first writer buffer)
    assert data == b"".join(bytes(c) for c in noise.chunks("k", n, MiB))
    other = b"".join(host(c) for c in dn.chunks("k2", MiB, MiB))
    assert noise.verify("k2", other) is None and noise.verify("k", other) == 0  # another key's block is caught
    d = dn.describe()
    assert d["writer_buffers"] == 1 and d["bytes_stamped_on_device"] == len(data) + MiB
    for _ in dn.chunks("s", 16 * MiB, MiB):  # ~4 sampled blocks (one of about every 4 MiB written)
        pass
    s = noise.sample.section()  # the payload sample takes its blocks from device memory too
    assert s["blocks_sampled"] >= 1 and s["distinct_fraction"] == 1.0 and s["compress_sample_bytes"] > 0


def _fill(store: TieredStore, dn: DeviceNoise, keys: str, n: int, buf: memoryview) -> None:
    for k in keys:
        store.put(k, lambda k=k: dn.chunks(k, n, MiB), n, buf)


def test_gpu_to_file_goes_through_the_pinned_buffer_and_reads_land_in_device_memory(dm, noise, cache_dir):
    dn = DeviceNoise(noise, dm)
    gpu, ft = GpuTier(5 * MiB, memory=dm, native=True), FileTier(cache_dir, 64 * MiB)
    store = TieredStore([gpu, ft], StoreConfig(), device=dm)
    buf, n = aligned_buffer(MiB), 2 * MiB
    _fill(store, dn, "abcd", n, buf)
    where = {k: store.location(k) for k in "abcd"}
    on_file = [k for k in "abcd" if where[k] == "storage"]
    assert on_file and where["d"] == "gpu"
    p = dm.paths
    assert p.get("write", "gpu", DevicePaths.FROM_DEVICE) == 4 * n  # every entry made on the device went there
    assert p.get("write", "storage", DevicePaths.BOUNCED) == len(on_file) * n  # demoted through the pinned buffer
    assert p.get("write", "storage", DevicePaths.FROM_DEVICE) == 0
    for k in on_file:  # what reached the file is the entry as made on the device
        assert noise.verify(k, b"".join(host(c) for c in ft.export(k, buf, IOTiming()))) is None
    r = store.get(on_file[0], buf)
    assert r.hit and r.tier == "storage" and r.timing.device_ns > 0
    assert p.get("read", "storage", DevicePaths.HOST_TO_DEVICE) == n
    last = bytes(dm.landing(MiB)[:MiB].numpy())  # the landing buffer holds the entry's last MiB
    assert noise.verify(on_file[0], last, first_block=(n - MiB) // 4096) is None
    r = store.get("d", buf)
    assert r.hit and r.tier == "gpu" and r.timing.device_ns > 0  # the device-to-device copy is the GPU tier's read
    assert p.get("read", "gpu", DevicePaths.DEVICE_TO_DEVICE) == n
    assert noise.verify("d", bytes(dm.landing(MiB)[:MiB].numpy()), first_block=(n - MiB) // 4096) is None
    store.check_accounting()
    store.close()


def test_the_cpu_tier_takes_device_chunks_into_its_pages_and_promotion_lands_on_the_device(dm, noise, cache_dir):
    dn = DeviceNoise(noise, dm)
    cpu, ft = MemoryTier(5 * MiB, page_bytes=MiB), FileTier(cache_dir, 64 * MiB)
    gpu = GpuTier(5 * MiB, memory=dm, native=True)
    store = TieredStore([gpu, cpu, ft], StoreConfig(promotion="on-read"), device=dm)
    buf, n = aligned_buffer(MiB), 2 * MiB
    _fill(store, dn, "abcdef", n, buf)
    p = dm.paths
    in_cpu = [k for k in "abcdef" if store.location(k) == "cpu"]
    on_file = [k for k in "abcdef" if store.location(k) == "storage"]
    assert in_cpu and on_file
    # GPU -> CPU: device chunks straight into the pages; CPU -> file: host memory, nothing bounced
    assert p.get("write", "cpu", DevicePaths.FROM_DEVICE) >= len(in_cpu) * n
    assert p.get("write", "storage", DevicePaths.FROM_HOST) == len(on_file) * n
    assert p.get("write", "storage", DevicePaths.BOUNCED) == 0
    for k in in_cpu:
        assert noise.verify(k, b"".join(host(c) for c in cpu.export(k, buf, IOTiming()))) is None
    promoted = on_file[0]
    r = store.get(promoted, buf)
    assert r.hit and r.tier == "storage" and store.location(promoted) == "gpu"  # moved up with the read
    assert p.get("write", "gpu", DevicePaths.FROM_HOST) == n
    got = b"".join(host(c) for c in gpu.export(promoted, buf, IOTiming()))
    assert noise.verify(promoted, got) is None
    store.check_accounting()
    store.close()


def _result(tmp_path, monkeypatch, **overrides):  # type: ignore[no-untyped-def]
    from kvtier.bench import run, setup

    monkeypatch.setattr(setup, "native_memory", lambda: DeviceMemory("cpu"))  # the stand-in device, no CUDA here
    cfg = tiny_bench_config(tmp_path, gpu_native=True, gpu_mem_gb=0.01, storage_capacity_gb=0.05, **overrides)
    return run(cfg, handle_signals=False)


def _padded_bounds(op) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """The chunk bytes a tier's operations moved lie between their logical bytes and those padded to 4 KiB."""
    return op.bytes, op.bytes + 4095 * op.ops


def test_bench_gpu_native_says_where_every_byte_went(tmp_path, monkeypatch):
    from kvtier.results.envelope import Status

    result = _result(tmp_path, monkeypatch)
    assert result.status == Status.complete, result.stop_reason
    g = result.storage.gpu_native
    assert g is not None and g.stand_in and g.device.startswith("cpu")
    assert g.source.bytes_stamped_on_device > 0 and g.source.writer_buffers >= 1
    gpu_w, file_w = result.tiers["gpu"].write, result.tiers["storage"].write
    assert gpu_w.ops > 0 and file_w.ops > 0  # the GPU tier took the writes and demoted to the file tier
    lo, hi = _padded_bounds(gpu_w)
    assert lo <= g.paths["write"]["gpu"][DevicePaths.FROM_DEVICE] <= hi
    lo, hi = _padded_bounds(file_w)  # the O_DIRECT file tier cannot take device memory: the pinned buffer
    assert lo <= g.paths["write"]["storage"][DevicePaths.BOUNCED] <= hi
    for tier, path in (("gpu", DevicePaths.DEVICE_TO_DEVICE), ("storage", DevicePaths.HOST_TO_DEVICE)):
        req = result.tiers[tier].read.by_cause.get("request")
        landed = g.paths["read"].get(tier, {}).get(path, 0)
        assert (req.bytes if req else 0) <= landed <= (req.bytes + 4095 * req.ops if req else 0)
    assert g.paths["read"]  # the run read something back into device memory
    assert result.storage.payload is not None and result.storage.payload.sample.distinct_fraction == 1.0


def test_bench_gpu_native_refuses_without_a_cuda_device(tmp_path):
    p = subprocess.run(
        kvtier_cmd()
        + ["bench", "--gpu-native", "--duration", "1", "--cache-dir", str(tmp_path / "c"), "--gpu-mem-gb", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--gpu-native needs a CUDA device through torch" in p.stderr
    assert not (tmp_path / "c").exists()  # refused before anything was made


def test_gpu_native_refuses_trace_mode(tmp_path):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="--gpu-native with --io-trace-log"):
        tiny_bench_config(tmp_path, gpu_native=True, io_trace_log=str(tmp_path / "t.csv"))


def test_the_gpu_check_script_runs_its_gpu_native_part_on_the_stand_in(tmp_path):
    """benchmarks/gpu_check.py is for a GPU host's few minutes: its --gpu-native part is run here on the stand-in
    device so it cannot arrive there broken (its figures here are not a GPU's, and its last line says so)."""
    import sys

    from tests.conftest import REPO

    p = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--dry-run-on-cpu", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    last = p.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu_check native_stamp_gbps=") and "native_verified=yes" in last
    assert last.endswith("device=cpu-stand-in-not-a-gpu-figure")
    assert "through the pinned host buffer" in p.stdout and "host to device" in p.stdout
