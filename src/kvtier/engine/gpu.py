"""GPU tier: entries in device memory, only when torch (or cupy) *and* a CUDA device exist.

Without a device the tier is not offered: ``gpu_available()`` says why, and the benchmark turns
``--gpu-mem-gb > 0`` into a warning that the tier is off (the reference's default is 16 GB, so an
MLPerf command line must still run on a host without a GPU). Data is copied host->device from the
caller's aligned chunks; reads copy device->host into the caller's reused buffer; timings wrap the
copies with a device synchronize so they measure the transfer, not its launch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

from kvtier.engine.backend import check_cancel, round_up
from kvtier.errors import EntryNotFound, TierFullError, UnsupportedError
from kvtier.telemetry.clock import IOTiming


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when a CUDA device is usable through torch, else (False, reason)."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed (pip install 'kvtier[gpu]')"
    try:
        if not torch.cuda.is_available():
            return False, "torch found no CUDA device"
        return True, torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001 - CUDA driver errors surface as assorted exception types
        return False, f"CUDA is not usable: {e}"


def gpu_memory_bytes(device: int = 0) -> int:
    """Total memory of CUDA device ``device`` (call only when gpu_available())."""
    import torch

    return int(torch.cuda.get_device_properties(device).total_memory)


class GpuTier:
    """KV entries in CUDA device memory, through torch. ``memory_fraction`` caps what torch's
    allocator may take of the device for this process (``gpu_backend.memory_fraction``)."""

    def __init__(self, capacity_bytes: int, name: str = "gpu", device: int = 0, memory_fraction: float = 1.0) -> None:
        ok, why = gpu_available()
        if not ok:
            raise UnsupportedError(f"GPU tier: {why}")
        import torch

        self._torch = torch
        self._device = torch.device("cuda", device)
        if memory_fraction < 1.0:
            torch.cuda.set_per_process_memory_fraction(memory_fraction, device)
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._entries: dict[str, Any] = {}
        self._lock = threading.Lock()

    def stored_size(self, nbytes: int) -> int:
        return round_up(nbytes)

    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        torch = self._torch
        t0 = time.perf_counter_ns()
        try:
            dev = torch.empty(round_up(nbytes), dtype=torch.uint8, device=self._device)
        except RuntimeError as e:  # CUDA out of memory
            raise TierFullError(f"gpu tier: cannot allocate {nbytes} bytes: {e}") from e
        t1 = time.perf_counter_ns()
        off = 0
        for c in chunks:
            src = torch.frombuffer(c, dtype=torch.uint8)
            dev[off : off + src.numel()].copy_(src, non_blocking=False)
            off += src.numel()
        torch.cuda.synchronize(self._device)
        t2 = time.perf_counter_ns()
        with self._lock:
            self._entries[key] = dev
        return IOTiming(host_ns=t1 - t0, device_ns=t2 - t1)

    def export(self, key: str, buf: memoryview, timing: IOTiming) -> Iterator[memoryview]:
        torch = self._torch
        with self._lock:
            dev = self._entries.get(key)
        if dev is None:
            raise EntryNotFound(f"gpu tier: {key!r} not stored")
        host = torch.frombuffer(buf, dtype=torch.uint8)
        step = host.numel()
        for off in range(0, dev.numel(), step):
            n = min(step, dev.numel() - off)
            t = time.perf_counter_ns()
            host[:n].copy_(dev[off : off + n])
            torch.cuda.synchronize(self._device)
            timing.device_ns += time.perf_counter_ns() - t
            yield buf[:n]

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        timing = IOTiming()
        for _ in self.export(key, buf, timing):
            check_cancel(cancel, "gpu read")
        return timing

    def delete(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def stored_bytes(self) -> int:
        with self._lock:
            return sum(int(t.numel()) for t in self._entries.values())

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
        self._torch.cuda.empty_cache()
