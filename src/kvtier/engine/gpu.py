"""GPU tier: entries in device memory, only when torch (or cupy) *and* a CUDA device exist.

Without a device the tier is not offered: ``gpu_available()`` says why, and the benchmark turns
``--gpu-mem-gb > 0`` into a warning that the tier is off (the reference's default is 16 GB, so an
MLPerf command line must still run on a host without a GPU). Data is copied host->device from the
caller's aligned chunks (device->device from the device chunks of ``--gpu-native``, engine/device.py);
reads copy device->host into the caller's reused buffer (with ``--gpu-native`` they hand out views of the
tier's memory and the read lands in device memory); timings wrap the copies with a device synchronize so
they measure the transfer, not its launch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from kvtier.engine.backend import ALIGN, check_cancel, round_up
from kvtier.engine.device import gpu_available
from kvtier.errors import EntryNotFound, TierFullError, UnsupportedError
from kvtier.telemetry.clock import IOTiming

if TYPE_CHECKING:
    from kvtier.engine.device import Chunk, DeviceMemory


class GpuTier:
    """KV entries in device memory, through torch (``engine/device.py`` ``DeviceMemory``: a CUDA device, or the
    CPU as a stand-in in tests). ``memory_fraction`` caps what torch's allocator may take of the device for this
    process (``gpu_backend.memory_fraction``).

    It takes chunks of either kind: host memory is copied host to device, device memory (``--gpu-native``)
    device to device. ``native``: its export yields views of its own memory (the consumer, the next tier or a
    read landing in device memory, does the copy) instead of copying device to host through the caller's buffer."""

    takes_device = True  # TieredStore: device chunks come as they are
    in_memory = True  # a read landing in device memory from here is this tier's own read (device time)

    def __init__(
        self,
        capacity_bytes: int,
        name: str = "gpu",
        device: int = 0,
        memory_fraction: float = 1.0,
        memory: DeviceMemory | None = None,
        native: bool = False,
    ) -> None:
        if memory is None:
            ok, why = gpu_available()
            if not ok:
                raise UnsupportedError(f"GPU tier: {why}")
            from kvtier.engine.device import DeviceMemory

            memory = DeviceMemory(f"cuda:{device}")
        if memory.cuda and memory_fraction < 1.0:
            memory._torch.cuda.set_per_process_memory_fraction(memory_fraction, memory.device)
        self.memory = memory
        self.native = native
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._entries: dict[str, Any] = {}
        self._lock = threading.Lock()

    def stored_size(self, nbytes: int) -> int:
        return round_up(nbytes)

    def write(self, key: str, chunks: Iterable[Chunk], nbytes: int) -> IOTiming:
        from kvtier.engine.device import copy_chunk

        t0 = time.perf_counter_ns()
        try:
            dev = self.memory.buffer(round_up(nbytes))
        except RuntimeError as e:  # CUDA out of memory
            raise TierFullError(f"gpu tier: cannot allocate {nbytes} bytes: {e}") from e
        t1 = time.perf_counter_ns()
        off = 0
        for c in chunks:
            n = len(c)
            copy_chunk(dev[off : off + n], c)
            off += n
        self.memory.sync()
        t2 = time.perf_counter_ns()
        with self._lock:
            self._entries[key] = dev
        return IOTiming(host_ns=t1 - t0, device_ns=t2 - t1)

    def export(self, key: str, buf: memoryview, timing: IOTiming) -> Iterator[Chunk]:
        from kvtier.engine.device import to_host

        with self._lock:
            dev = self._entries.get(key)
        if dev is None:
            raise EntryNotFound(f"gpu tier: {key!r} not stored")
        step = len(buf) - len(buf) % ALIGN
        for off in range(0, dev.numel(), step):
            n = min(step, dev.numel() - off)
            if self.native:  # a view of our memory: whoever takes it copies it
                yield dev[off : off + n]
                continue
            t = time.perf_counter_ns()
            to_host(buf[:n], dev[off : off + n])
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
        if self.memory.cuda:
            self.memory._torch.cuda.empty_cache()
