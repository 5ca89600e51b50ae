"""--gds without a device: a stand-in kvikio and a stand-in device memory check what the GDS tier hands
kvikio, and that the result says ``used: true`` only when kvikio's account says cuFile moved the payload.

The stand-in kvikio behaves as the real one routes buffers: a device buffer (the stand-in DeviceArray, or a torch
tensor of --gpu-native's stand-in device) goes to its Gds backend, host memory (a memoryview, bytes, a numpy
array) to POSIX, and in compatibility mode everything goes to POSIX.
It moves real bytes to and from the real file, so the round trip is checked against the noise."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import numpy as np
import pytest

from kvtier.engine import gds
from kvtier.engine.backend import aligned_buffer, round_up
from kvtier.telemetry.clock import IOTiming
from tests.conftest import tiny_bench_config


class DeviceArray:
    """Stand-in device memory: bytes a host view cannot be mistaken for."""

    def __init__(self, nbytes: int) -> None:
        self.mem = np.frombuffer(aligned_buffer(nbytes), dtype=np.uint8)

    def view(self, n: int) -> DeviceArray:
        out = DeviceArray.__new__(DeviceArray)
        out.mem = self.mem[:n]
        return out


class StandInStaging:
    def __init__(self) -> None:
        self.to_device_bytes = self.to_host_bytes = 0

    def buffer(self, nbytes: int) -> DeviceArray:
        return DeviceArray(nbytes)

    def slice(self, buf: DeviceArray, nbytes: int) -> DeviceArray:
        return buf.view(nbytes)

    def to_device(self, dst: DeviceArray, src: memoryview) -> None:
        np.copyto(dst.mem, np.frombuffer(src, dtype=np.uint8))
        self.to_device_bytes += len(src)

    def to_host(self, dst: memoryview, src: DeviceArray) -> None:
        np.copyto(np.frombuffer(dst, dtype=np.uint8), src.mem)
        self.to_host_bytes += len(dst)


def device_memory(buf: Any) -> bool:
    """What kvikio treats as device memory (``__cuda_array_interface__``): the stand-in DeviceArray, and the torch
    tensors --gpu-native's stand-in device (engine/device.py on the CPU) hands out."""
    return isinstance(buf, DeviceArray) or type(buf).__module__.startswith("torch")


def host_array(buf: Any) -> np.ndarray:
    """The bytes behind a buffer of either kind, to move to and from the real file."""
    if isinstance(buf, DeviceArray):
        return buf.mem
    if type(buf).__module__.startswith("torch"):
        return buf.numpy()  # a CPU tensor shares its memory
    return np.frombuffer(buf, dtype=np.uint8)


def fake_kvikio(compat: bool, statistics: bool = True) -> types.ModuleType:
    moved: dict[str, int] = {"Gds": 0, "Posix": 0}

    class Done:
        def __init__(self, n: int) -> None:
            self.n = n

        def get(self) -> int:
            return self.n

    class CuFile:
        def __init__(self, path: Any, flags: str = "r") -> None:
            self.fd = os.open(path, os.O_RDWR if "+" in flags or "w" in flags else os.O_RDONLY)

        def _backend(self, buf: Any) -> str:
            return "Posix" if compat or not device_memory(buf) else "Gds"

        def pwrite(self, buf: Any, size: int | None = None, file_offset: int = 0) -> Done:
            mem = host_array(buf)
            n = os.pwrite(self.fd, memoryview(mem)[: size or len(mem)], file_offset)
            moved[self._backend(buf)] += n
            return Done(n)

        def pread(self, buf: Any, size: int | None = None, file_offset: int = 0) -> Done:
            mem = host_array(buf)
            n = os.preadv(self.fd, [memoryview(mem)[: size or len(mem)]], file_offset)
            moved[self._backend(buf)] += n
            return Done(n)

        def close(self) -> None:
            os.close(self.fd)

    class Summary:
        @property
        def by_backend(self) -> dict[str, dict[str, int]]:
            return {k: {"bytes_transferred": v, "num_ops": 1} for k, v in moved.items() if v}

    class SummaryMonitor:
        def get(self) -> Summary:
            return Summary()

    mod = types.ModuleType("kvikio")
    mod.__version__ = "stand-in"  # type: ignore[attr-defined]
    mod.CuFile = CuFile  # type: ignore[attr-defined]
    mod.defaults = types.SimpleNamespace(is_compat_mode_preferred=lambda: compat)  # type: ignore[attr-defined]
    if statistics:
        mod.SummaryMonitor = SummaryMonitor  # type: ignore[attr-defined]
    mod.moved = moved  # type: ignore[attr-defined]
    return mod


@pytest.fixture
def stand_in(monkeypatch):
    """Install a stand-in kvikio (``stand_in(compat=..., statistics=...)``) and device memory."""
    staging = StandInStaging()

    def install(compat: bool = False, statistics: bool = True) -> types.ModuleType:
        mod = fake_kvikio(compat, statistics)
        monkeypatch.setitem(sys.modules, "kvikio", mod)
        monkeypatch.setattr(gds, "new_staging", lambda: staging)
        monkeypatch.setattr(gds, "gpu_available", lambda: (True, "a stand-in device"))
        return mod

    install.staging = staging  # type: ignore[attr-defined]
    return install


def _roundtrip(tier: gds.GdsFileTier, noise, key: str, n: int) -> None:
    tier.write(key, noise.chunks(key, n, 256 * 1024), n)
    timing = IOTiming()
    data = b"".join(bytes(c) for c in tier.export(key, aligned_buffer(128 * 1024), timing))
    assert len(data) == round_up(n) and noise.verify(key, data) is None  # every block as written
    assert timing.device_ns >= 0 and timing.host_ns > 0


def test_the_payload_goes_to_kvikio_in_device_memory_and_the_result_says_so(stand_in, cache_dir, noise):
    kv = stand_in()
    assert gds.probe_gds()[0]
    tier = gds.GdsFileTier(cache_dir, 1 << 30, direct_io="auto")
    _roundtrip(tier, noise, "a", 3_000_001)
    _roundtrip(tier, noise, "b", 700_000)
    out = tier.outcome()
    tier.close()
    # everything kvikio moved came from or went to device memory: no host buffer reached it
    assert kv.moved["Posix"] == 0 and kv.moved["Gds"] == out["gds_bytes"] == out["staged_bytes"] > 6_000_000
    assert stand_in.staging.to_device_bytes + stand_in.staging.to_host_bytes == out["staged_bytes"]
    assert out["used"] is True and out["evidence"] == "kvikio statistics"


def test_compatibility_mode_is_reported_as_not_used(stand_in, cache_dir, noise):
    """kvikio took POSIX for every byte (its compatibility mode): the result says used: false, and why."""
    kv = stand_in(compat=True)
    tier = gds.GdsFileTier(cache_dir, 1 << 30)
    _roundtrip(tier, noise, "a", 1_000_000)
    out = tier.outcome()
    tier.close()
    assert kv.moved["Gds"] == 0 and out["posix_bytes"] > 0
    assert out["used"] is False and "POSIX" in out["reason"]


def test_without_kvikio_statistics_the_evidence_is_its_compatibility_mode(stand_in, cache_dir, noise):
    stand_in(statistics=False)
    tier = gds.GdsFileTier(cache_dir, 1 << 30)
    assert tier.outcome()["used"] is False  # nothing moved yet: nothing to claim
    _roundtrip(tier, noise, "a", 500_000)
    out = tier.outcome()
    tier.close()
    assert out["used"] is True and out["gds_bytes"] is None and "compatibility mode" in out["evidence"]


def _bench(tmp_path, gds_mode: str):
    from kvtier.bench import run

    return run(tiny_bench_config(tmp_path, storage_capacity_gb=0.05, gds=gds_mode), handle_signals=False)


def test_bench_with_gds_records_kvikio_s_account(stand_in, tmp_path):
    """kvtier bench --gds on through the stand-in: storage.gds carries the evidence and the bytes per path."""
    from kvtier.results.envelope import Status

    kv = stand_in()
    result = _bench(tmp_path, "on")
    assert result.status == Status.complete, result.stop_reason
    g = result.storage.gds
    assert g is not None and g.used is True and g.evidence == "kvikio statistics"
    assert g.gds_bytes == kv.moved["Gds"] > 0 and g.posix_bytes == 0
    assert not any(w.code == "gds-off" for w in result.warnings)


def test_bench_says_when_kvikio_fell_back_to_posix(stand_in, tmp_path, monkeypatch):
    """The probe said cuFile, kvikio then moved the bytes by POSIX: used false and a gds-off warning."""
    stand_in(compat=True)
    monkeypatch.setattr(gds, "probe_gds", lambda: (True, "the probe believed cuFile"))
    result = _bench(tmp_path, "auto")
    g = result.storage.gds
    assert g is not None and g.used is False and g.posix_bytes and not g.gds_bytes
    assert any(w.code == "gds-off" and "POSIX" in w.message for w in result.warnings)


def test_gpu_native_hands_cufile_the_device_memory_both_ways(stand_in, cache_dir, noise):
    """--gpu-native with GDS (#45 item 2): a GPU tier's entry demoted to the file goes to kvikio as the device
    buffer it is (no staging copy, nothing bounced through the host), and a read has cuFile fill a device buffer
    that lands device to device; kvikio's account says Gds for all of it. torch CPU tensors are the device."""
    pytest.importorskip("torch", reason="torch is not installed (scripts/setup.sh test installs its CPU build)")
    from kvtier.engine.device import DeviceMemory, DeviceNoise, DevicePaths
    from kvtier.engine.gpu import GpuTier
    from kvtier.engine.store_api import StoreConfig
    from kvtier.engine.tiered import TieredStore

    kv = stand_in()
    mib = 1 << 20
    dm = DeviceMemory("cpu")
    dn = DeviceNoise(noise, dm)
    ft = gds.GdsFileTier(cache_dir, 1 << 30, memory=dm, native=True)
    store = TieredStore([GpuTier(5 * mib, memory=dm, native=True), ft], StoreConfig(), device=dm)
    buf, n = aligned_buffer(mib), 2 * mib
    for k in "abcd":
        store.put(k, lambda k=k: dn.chunks(k, n, mib), n, buf)
    on_file = [k for k in "abcd" if store.location(k) == "storage"]
    assert on_file
    p, out = dm.paths, ft.outcome()
    assert p.get("write", "storage", DevicePaths.FROM_DEVICE) == len(on_file) * n
    assert p.get("write", "storage", DevicePaths.BOUNCED) == 0
    assert out["device_bytes"] == len(on_file) * n and out["staged_bytes"] == 0  # no copy through staging
    assert kv.moved["Gds"] == len(on_file) * n and kv.moved["Posix"] == 0
    r = store.get(on_file[0], buf)
    assert r.hit and r.tier == "storage" and r.timing.device_ns > 0
    # the payload's first block comes with the header (its checksum is checked on the host); the rest is the
    # device buffer cuFile filled, landing device to device
    assert p.get("read", "storage", DevicePaths.HOST_TO_DEVICE) == 4096
    assert p.get("read", "storage", DevicePaths.DEVICE_TO_DEVICE) == n - 4096
    last = n - 4096 - mib  # the chunks: the first block, then 1 MiB, then the rest (the last to land)
    assert noise.verify(on_file[0], bytes(dm.landing(mib)[:last].numpy()), first_block=(n - last) // 4096) is None
    got = b"".join(
        bytes(c.numpy()) if hasattr(c, "numpy") else bytes(c) for c in ft.export(on_file[0], buf, IOTiming())
    )
    assert noise.verify(on_file[0], got) is None  # every block on the file as made on the device
    out = ft.outcome()
    assert out["used"] is True and kv.moved["Posix"] == 0 and out["gds_bytes"] == kv.moved["Gds"]
    store.close()


def test_bench_gpu_native_with_gds_moves_the_payload_by_cufile_from_device_memory(stand_in, tmp_path, monkeypatch):
    """kvtier bench --gpu-native --gds on, the stand-in device and kvikio: the GPU tier demotes to the GDS file
    tier with nothing bounced through the host, and storage.gds and storage.gpu_native agree on the bytes."""
    pytest.importorskip("torch", reason="torch is not installed (scripts/setup.sh test installs its CPU build)")
    from kvtier.bench import run, setup
    from kvtier.engine.device import DeviceMemory, DevicePaths
    from kvtier.results.envelope import Status

    kv = stand_in()
    monkeypatch.setattr(setup, "native_memory", lambda: DeviceMemory("cpu"))
    cfg = tiny_bench_config(tmp_path, storage_capacity_gb=0.05, gds="on", gpu_native=True, gpu_mem_gb=0.01)
    result = run(cfg, handle_signals=False)
    assert result.status == Status.complete, result.stop_reason
    g, native = result.storage.gds, result.storage.gpu_native
    assert g is not None and native is not None and g.used is True and kv.moved["Posix"] == 0
    to_file = native.paths["write"]["storage"]
    assert to_file.get(DevicePaths.FROM_DEVICE, 0) > 0 and DevicePaths.BOUNCED not in to_file
    landed = native.paths["read"].get("storage", {})
    # cuFile moved what went to the file from device memory and what it read into device memory (the paths count
    # the load's completed operations; the tier also counts set-up and those cut at the end), and the first block
    # of each read (staged: its checksum is checked on the host)
    assert g.device_bytes >= to_file[DevicePaths.FROM_DEVICE] + landed.get(DevicePaths.DEVICE_TO_DEVICE, 0) > 0
    assert g.gds_bytes == g.device_bytes + g.staged_bytes
