"""KV that starts and ends in device memory (``kvtier bench --gpu-native``, the spec's §11.2).

In an inference server the KV cache is made by the GPU and read back into it; a benchmark that makes its
entries in host memory measures an offload path no server takes. With ``--gpu-native``:

* **Entries are made on the device.** ``DeviceNoise`` copies the run's noise into device memory once; each
  writer borrows a device buffer filled from it (at the next base along the noise) and, per chunk, rewrites
  only the first 8 bytes of each 4 KiB block (the stamp of engine/noise.py: key hash ^ block index) with one
  elementwise XOR over a strided view. The bytes are those the host path would make from the same base, so
  ``NoiseBuffer.verify`` checks them and the payload sample samples them (the sampled blocks are copied to
  the host, 4 KiB each).
* **Tiers take device chunks.** The GPU tier copies them device to device; the CPU tier copies them straight
  into its own pages (device to host, one copy: the work a CPU offload does); the GDS file tier hands them to
  kvikio's ``CuFile`` as they are (no staging copy). A tier that needs host memory for its I/O (the O_DIRECT
  file tier, Redis, S3) gets them through one pinned host buffer per thread (``Feed``, ``DeviceMemory.bounce``).
* **Reads land in device memory.** A request's read drains the tier's export into a per-thread device buffer
  (``DeviceMemory.land``): device to device from the GPU tier (which exports views of its own memory) and from
  the GDS file tier (cuFile fills a device buffer), host to device from the others. Promotion into the GPU
  tier takes the same chunks.
* **Every byte's path is counted** (``DevicePaths``): per direction, tier and path, so a result says how much
  went device to device, through cuFile, through the pinned bounce buffer, or host to device.

``DeviceMemory`` is torch on one device. On a CUDA device it is the real thing; on the CPU (``stand_in``) the
same calls move host tensors, which is how the logic is tested where no GPU exists (the tests route those
tensors through a stand-in kvikio the way kvikio routes device memory). ``native_memory()`` is what the bench
asks for: CUDA, or a ConfigError saying why not.
"""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up
from kvtier.engine.noise import BLOCK, PIECE, NoiseBuffer, WriterPool
from kvtier.errors import ConfigError

Chunk = Any
"""What moves through the store: a host ``memoryview``, or (``--gpu-native``) a device buffer, a 1-D uint8 tensor."""


def is_device(chunk: Chunk) -> bool:
    """A device buffer rather than host memory (the store's chunks are memoryviews otherwise)."""
    return not isinstance(chunk, (memoryview, bytes, bytearray, np.ndarray))


def to_host(dst: memoryview, src: Any) -> None:
    """Copy the device buffer ``src`` into host memory ``dst`` (of its length), synchronized."""
    import torch

    torch.frombuffer(dst, dtype=torch.uint8).copy_(src)
    if src.is_cuda:
        torch.cuda.synchronize(src.device)


def to_device(dst: Any, src: memoryview) -> None:
    """Copy host memory ``src`` into the device buffer ``dst`` (of its length), synchronized."""
    import torch

    dst.copy_(torch.frombuffer(src, dtype=torch.uint8))
    if dst.is_cuda:
        torch.cuda.synchronize(dst.device)


def copy_chunk(dst: Any, src: Chunk) -> None:
    """Copy a chunk of either kind into the device buffer ``dst``, synchronized."""
    if is_device(src):
        dst.copy_(src)
        if dst.is_cuda:
            import torch

            torch.cuda.synchronize(dst.device)
    else:
        to_device(dst, src)


class DevicePaths:
    """Bytes by the path they took between device memory and the tiers: ``write`` (into a tier) and ``read``
    (landing in device memory), per tier, per path. Thread-safe."""

    # how a write reached its tier
    FROM_DEVICE = "from device memory"  # the tier took the device buffer (GPU: device to device; CPU: into its
    # pages; GDS file tier: handed to cuFile)
    BOUNCED = "through the pinned host buffer"  # device -> pinned host -> the tier's host I/O
    FROM_HOST = "from host memory"  # a host chunk into a device tier (a promotion from a host tier)
    # how a read landed in device memory
    DEVICE_TO_DEVICE = "device to device"
    HOST_TO_DEVICE = "host to device"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes: dict[tuple[str, str, str], int] = {}

    def add(self, op: str, tier: str, path: str, nbytes: int) -> None:
        with self._lock:
            k = (op, tier, path)
            self._bytes[k] = self._bytes.get(k, 0) + nbytes

    def reset(self) -> None:
        with self._lock:
            self._bytes.clear()

    def get(self, op: str, tier: str, path: str) -> int:
        with self._lock:
            return self._bytes.get((op, tier, path), 0)

    def section(self) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {"write": {}, "read": {}}
        with self._lock:
            for (op, tier, path), n in sorted(self._bytes.items()):
                out.setdefault(op, {}).setdefault(tier, {})[path] = n
        return out


class _Local(threading.local):
    def __init__(self) -> None:
        self.landing: Any = None  # this thread's device buffer that reads land in
        self.bounce: tuple[Any, memoryview] | None = None  # (tensor, host view) of its pinned host buffer


class DeviceMemory:
    """Device buffers as 1-D uint8 torch tensors on one device (``cuda:N``, or ``cpu`` as a stand-in). It
    is also the GDS file tier's staging (engine/gds.py ``Staging``)."""

    def __init__(self, device: str = "cuda:0") -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stand_in = not self.cuda
        self.paths = DevicePaths()
        self._tls = _Local()
        self.pinned = True  # whether the bounce buffers are page-locked (False where registering them failed)
        self.bounce_bytes = 0  # host memory of the bounce buffers made (the bench's memory bound counts it)
        self._count_lock = threading.Lock()

    @property
    def name(self) -> str:
        if self.cuda:
            return str(self._torch.cuda.get_device_name(self.device))
        return "cpu (stand-in: torch CPU tensors, no GPU)"

    def total_bytes(self) -> int:
        """The device's memory (the stand-in: the host's)."""
        if self.cuda:
            return int(self._torch.cuda.get_device_properties(self.device).total_memory)
        from kvtier.telemetry.host import mem_total_bytes

        return mem_total_bytes()

    def sync(self) -> None:
        if self.cuda:
            self._torch.cuda.synchronize(self.device)

    # -- the Staging protocol of engine/gds.py ---------------------------------------------------
    def buffer(self, nbytes: int) -> Any:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def slice(self, buf: Any, nbytes: int) -> Any:
        return buf[:nbytes]

    def to_device(self, dst: Any, src: memoryview) -> None:
        to_device(dst, src)

    def to_host(self, dst: memoryview, src: Any) -> None:
        to_host(dst, src)

    # -- per-thread buffers ----------------------------------------------------------------------
    def landing(self, nbytes: int) -> Any:
        """This thread's device buffer that reads land in, at least ``nbytes`` (kept and reused)."""
        st = self._tls
        if st.landing is None or st.landing.numel() < nbytes:
            st.landing = self.buffer(round_up(nbytes))
        return st.landing

    def land(self, chunk: Chunk) -> bool:
        """Copy a chunk of a read into this thread's landing buffer; True when it came from device memory."""
        n = len(chunk)
        copy_chunk(self.landing(n)[:n], chunk)
        return is_device(chunk)

    def bounce(self, nbytes: int) -> tuple[Any, memoryview]:
        """This thread's pinned host buffer (tensor, aligned view), at least ``nbytes``: a device chunk for a
        tier whose I/O needs host memory is copied through it."""
        st = self._tls
        if st.bounce is None or len(st.bounce[1]) < nbytes:
            view = aligned_buffer(round_up(nbytes))  # page aligned: O_DIRECT writes it as it is
            tensor = self._torch.frombuffer(view, dtype=self._torch.uint8)
            if self.cuda:
                cudart = getattr(self._torch.cuda, "cudart")()  # noqa: B009 - untyped in torch
                rc = cudart.cudaHostRegister(tensor.data_ptr(), len(view), 0)
                self.pinned = self.pinned and int(rc) == 0
            st.bounce = (tensor, view)
            with self._count_lock:
                self.bounce_bytes += len(view)
        return st.bounce

    def feed(self, chunks: Iterable[Chunk], tier: str, takes_device: bool) -> Feed:
        """``chunks`` on their way into ``tier`` (``Feed``)."""
        return Feed(self, chunks, tier, takes_device)


class Feed:
    """Chunks on their way into a tier, each counted by its path. A tier that ``takes_device`` gets device chunks
    as they are; any other gets each copied into this thread's pinned host buffer (consume each before pulling
    the next, as every tier does). Host chunks pass through. The counts reach ``DevicePaths`` at ``commit()``,
    once the write has succeeded, so the paths add up to the bytes of completed operations."""

    def __init__(self, memory: DeviceMemory, chunks: Iterable[Chunk], tier: str, takes_device: bool) -> None:
        self.memory, self.chunks, self.tier, self.takes_device = memory, chunks, tier, takes_device
        self.counts = {DevicePaths.FROM_HOST: 0, DevicePaths.FROM_DEVICE: 0, DevicePaths.BOUNCED: 0}

    def __iter__(self) -> Iterator[Chunk]:
        for c in self.chunks:
            n = len(c)
            if not is_device(c):
                self.counts[DevicePaths.FROM_HOST] += n
                yield c
            elif self.takes_device:
                self.counts[DevicePaths.FROM_DEVICE] += n
                yield c
            else:
                _, view = self.memory.bounce(n)
                to_host(view[:n], c)
                self.counts[DevicePaths.BOUNCED] += n
                yield view[:n]

    def commit(self) -> None:
        for path, n in self.counts.items():
            if n:
                self.memory.paths.add("write", self.tier, path, n)


GPU_DEVICE_NODES = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
"""Where a GPU driver shows itself (NVIDIA, ROCm, WSL): with none of them torch cannot find a device, and
importing torch only to hear so costs 1.6 s (measured here) in every command that asks."""


def gpu_available() -> tuple[bool, str]:
    """(True, device name) when a CUDA device is usable through torch, else (False, reason)."""
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not installed (pip install 'kvtier[gpu]')"
    if not any(os.path.exists(p) for p in GPU_DEVICE_NODES):
        return False, f"torch found no CUDA device (no GPU driver: none of {', '.join(GPU_DEVICE_NODES)})"
    import torch

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


def native_memory() -> DeviceMemory:
    """The device ``--gpu-native`` makes and reads entries in: CUDA through torch, or a ConfigError naming why."""
    ok, why = gpu_available()
    if not ok:
        raise ConfigError(f"--gpu-native needs a CUDA device through torch: {why}")
    return DeviceMemory("cuda:0")


def _signed(h: int) -> int:
    """A 64-bit stamp as torch's int64 holds the same bits."""
    return h - (1 << 64) if h >= 1 << 63 else h


class _DevicePrimed:
    """A writer's device buffer: the noise from ``base`` on, filled once as far as used; a chunk rewrites only
    each block's first word (clean word ^ stamp) with one elementwise op over a strided view."""

    def __init__(self, dn: DeviceNoise, size: int, base: int) -> None:
        torch = dn.memory._torch
        self.dn, self.base = dn, base
        self.buf = dn.memory.buffer(size)
        self.words = self.buf.view(torch.int64)[:: BLOCK // 8]  # each block's first 8 bytes (a strided view)
        self.clean = torch.empty_like(self.words)
        self.index = torch.arange(len(self.words), dtype=torch.int64, device=dn.memory.device)
        self.stamps = torch.empty_like(self.words)
        self.filled = 0

    def _fill_to(self, n: int) -> None:
        dn, at = self.dn, self.filled
        off = (self.base + at) % dn.nbytes
        while at < n:
            m = min(n - at, dn.nbytes - off)
            self.buf[at : at + m].copy_(dn.tile[off : off + m])
            at += m
            off = (off + m) % dn.nbytes
        lo, hi = self.filled // BLOCK, n // BLOCK
        self.clean[lo:hi].copy_(self.words[lo:hi])
        with dn.lock:
            dn.writer_buffer_bytes += n - self.filled
        self.filled = n

    def stamp(self, n: int, block: int, h: int) -> Any:
        if n > self.filled:
            self._fill_to(n)
        k = n // BLOCK
        s = self.stamps[:k]
        self.dn.memory._torch.add(self.index[:k], block, out=s)
        s.bitwise_xor_(_signed(h))
        self.words[:k].copy_(self.clean[:k]).bitwise_xor_(s)
        self.dn.memory.sync()
        return self.buf[:n]


class DeviceNoise:
    """The run's entries made in device memory (module docstring): ``chunks`` as NoiseBuffer's, device buffers."""

    def __init__(self, noise: NoiseBuffer, memory: DeviceMemory) -> None:
        self.noise, self.memory = noise, memory
        self.nbytes = noise.nbytes
        self.tile = memory.buffer(noise.nbytes)
        to_device(self.tile, noise._view)
        self.lock = threading.Lock()
        self._writers: WriterPool[_DevicePrimed] = WriterPool(self.nbytes, lambda n, base: _DevicePrimed(self, n, base))
        self.writer_buffer_bytes = 0  # device memory, filled from the tile
        self.bytes_stamped = 0

    def chunks(self, key: str, nbytes: int, chunk_bytes: int | None = None) -> Iterator[Any]:
        """The entry's ``round_up(nbytes)`` bytes as device chunks of at most ``chunk_bytes`` (default PIECE),
        each a view of one borrowed device buffer, its stamps rewritten for the next (consume each first)."""
        limit = max(BLOCK, (chunk_bytes or PIECE) // BLOCK * BLOCK)
        h = self.noise.key_hash(key)
        p = self._writers.borrow(limit)
        try:
            block, remaining = 0, round_up(nbytes)
            while remaining > 0:
                n = min(remaining, limit)
                chunk = p.stamp(n, block, h)
                self._sample(key, block, chunk, h)
                with self.lock:
                    self.bytes_stamped += n
                block += n // BLOCK
                remaining -= n
                yield chunk
        finally:
            self._writers.give_back(limit, p)

    def _sample(self, key: str, block: int, chunk: Any, h: int) -> None:
        """The payload sample of the run's writes, from the few blocks it picks (copied to the host)."""
        sample = self.noise.sample
        need = sample.head_missing()
        if need:
            head = aligned_buffer(round_up(min(need, len(chunk)), ALIGN))
            n = min(need, len(chunk))
            to_host(head[:n], chunk[:n])
            sample.add_head(head[:n])
        blk = None
        for b in sample.picks(block, len(chunk) // BLOCK, h):
            blk = blk if blk is not None else aligned_buffer(BLOCK)
            to_host(blk, chunk[b * BLOCK : (b + 1) * BLOCK])
            sample.record(key, block + b, blk)

    def describe(self) -> dict[str, Any]:
        """``storage.gpu_native.source``: how the entries were made in device memory."""
        with self.lock:
            return {
                "scheme": "the noise copied into device memory once; writers' device buffers filled from it, only "
                "each 4 KiB block's 8-byte stamp rewritten per chunk (one XOR over a strided view)",
                "device_noise_bytes": self.nbytes,
                "writer_buffers": self._writers.made,
                "writer_buffer_bytes": self.writer_buffer_bytes,
                "bytes_stamped_on_device": self.bytes_stamped,
            }


__all__ = [
    "GPU_DEVICE_NODES",
    "gpu_available",
    "gpu_memory_bytes",
    "Chunk",
    "DeviceMemory",
    "DeviceNoise",
    "DevicePaths",
    "Feed",
    "copy_chunk",
    "is_device",
    "native_memory",
    "to_device",
    "to_host",
]
