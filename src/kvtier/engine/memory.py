"""CPU RAM tier: one arena reserved up front, entries copied into reused extents.

The arena is an anonymous mapping of the tier's capacity made with MAP_NORESERVE: address space
is reserved at start, physical pages appear as entries are first written and are then reused
(freed extents go back to a first-fit free list and are coalesced). Writes and reads are
``np.copyto`` between aligned views, so the tier runs at memory-copy speed and allocates nothing
per request.
"""

from __future__ import annotations

import bisect
import mmap
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np

from kvtier.engine.backend import ALIGN, IOTiming, advise_huge_pages, check_cancel, round_up
from kvtier.errors import EntryNotFound, TierFragmented

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; Python <3.13 lacks the name


class ExtentAllocator:
    """First-fit allocator over [0, size) in ALIGN units, with coalescing on free. Not thread safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0] if size else []
        self._lens: list[int] = [size] if size else []
        self.allocated = 0

    def alloc(self, n: int) -> int | None:
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i]
                    del self._lens[i]
                else:
                    self._starts[i] = start + n
                    self._lens[i] = length - n
                self.allocated += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self._starts, start)
        # merge with the following extent
        if i < len(self._starts) and start + n == self._starts[i]:
            self._starts[i] = start
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)
        # merge with the preceding extent
        if i > 0 and self._starts[i - 1] + self._lens[i - 1] == self._starts[i]:
            self._lens[i - 1] += self._lens[i]
            del self._starts[i]
            del self._lens[i]
        self.allocated -= n

    def largest_free(self) -> int:
        return max(self._lens, default=0)


class MemoryTier:
    """KV entries in host RAM."""

    def __init__(self, capacity_bytes: int, name: str = "cpu") -> None:
        self.name = name
        self.capacity_bytes = round_up(capacity_bytes) if capacity_bytes > 0 else 0
        self._arena = (
            mmap.mmap(-1, self.capacity_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
            if self.capacity_bytes
            else None
        )
        if self._arena is not None:
            advise_huge_pages(self._arena)
        self._np = np.frombuffer(self._arena, dtype=np.uint8) if self._arena is not None else np.empty(0, np.uint8)
        self._alloc = ExtentAllocator(self.capacity_bytes)
        self._index: dict[str, tuple[int, int, int]] = {}  # key -> (start, padded, nbytes)
        self._lock = threading.Lock()

    def stored_size(self, nbytes: int) -> int:
        return round_up(nbytes)

    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        t0 = time.perf_counter_ns()
        padded = round_up(nbytes)
        with self._lock:
            if key in self._index:
                raise ValueError(f"cpu tier: {key!r} already stored")
            start = self._alloc.alloc(padded)
            if start is None:
                raise TierFragmented(f"cpu tier: no contiguous {padded} bytes free (fragmentation)")
            self._index[key] = (start, padded, nbytes)
        t1 = time.perf_counter_ns()
        off = start
        fill = getattr(chunks, "fill", None)  # a source that writes straight into our memory: one copy, not two
        try:
            if fill is not None:
                fill(memoryview(self._np[start : start + padded].data))
            else:
                for c in chunks:
                    n = min(len(c), start + padded - off)
                    np.copyto(self._np[off : off + n], np.frombuffer(c, dtype=np.uint8, count=n))
                    off += n
        except BaseException:
            self.delete(key)
            raise
        t2 = time.perf_counter_ns()
        return IOTiming(host_ns=t1 - t0, device_ns=t2 - t1)

    def _lookup(self, key: str) -> tuple[int, int, int]:
        with self._lock:
            try:
                return self._index[key]
            except KeyError:
                raise EntryNotFound(f"cpu tier: {key!r} not stored") from None

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        t0 = time.perf_counter_ns()
        start, padded, _ = self._lookup(key)
        dst = np.frombuffer(buf, dtype=np.uint8)
        step = len(buf) - len(buf) % ALIGN
        t1 = time.perf_counter_ns()
        for off in range(start, start + padded, step):
            check_cancel(cancel, "cpu read", off - start)
            n = min(step, start + padded - off)
            np.copyto(dst[:n], self._np[off : off + n])
        t2 = time.perf_counter_ns()
        return IOTiming(host_ns=t1 - t0, device_ns=t2 - t1)

    def export(self, key: str, buf: memoryview, timing: IOTiming) -> Iterator[memoryview]:
        # Zero copy: the consumer (the next tier's write) reads RAM directly, so the cost of this
        # read is inside the consumer's timed write. The store holds the entry lock meanwhile.
        start, padded, _ = self._lookup(key)
        if self._arena is None:  # a zero-capacity tier stores nothing, so _lookup already raised
            raise EntryNotFound(f"cpu tier: {key!r} not stored")
        view = memoryview(self._arena)[start : start + padded]
        step = max(ALIGN, len(buf) - len(buf) % ALIGN)  # the caller's I/O size: cancellation granularity
        for off in range(0, padded, step):
            yield view[off : off + step]

    def delete(self, key: str) -> None:
        with self._lock:
            start, padded, _ = self._index.pop(key)
            self._alloc.free(start, padded)

    def stored_bytes(self) -> int:
        with self._lock:
            return self._alloc.allocated

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._np = np.empty(0, np.uint8)
            if self._arena is not None:
                try:
                    self._arena.close()
                except BufferError:  # a view still exists somewhere; the GC will unmap it
                    pass
                self._arena = None
