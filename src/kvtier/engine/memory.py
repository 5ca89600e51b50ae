"""CPU RAM tier: one arena reserved up front, cut into fixed-size pages; an entry is a list of pages.

The arena is an anonymous mapping of the tier's capacity made with MAP_NORESERVE (and advised for huge
pages): address space is reserved at start, physical pages appear as entries are first written and are
then reused. Pages come from a free list, so the tier never fragments: a write fails for space only when
the free pages cannot hold it (the store evicts first), never because free bytes lie in holes. That is
how LMCache's CPU backend and vLLM's block pool allocate. Writes and reads are ``np.copyto`` between
aligned views, page by page (scatter on write, gather on read), so the tier runs at memory-copy speed
and allocates nothing per request. The cost of pages is internal waste: an entry's last page is partly
empty; ``waste_bytes`` says how much.

The tier's size is a bound, not a claim: a tier larger than the host's free memory starts (the spec's 32 GB CPU
tier on the spec's 32 GB host), and its pages are taken as entries first need them. Before a write takes pages
never used before, the tier checks that the host keeps ``host_floor_bytes`` available (2 GiB or 5 % of RAM,
the larger, plus the process's own buffers the caller names, which may be touched later) after them; when it
would not, the tier stops growing: it keeps the pages it has used, its ``capacity_bytes`` drops to them,
``host_short`` records when and at what size, and the write raises ``HostMemoryShort`` (the store then makes
room within the smaller tier). So a run on a host that runs short is counted and warned about, never killed for
memory.
"""

from __future__ import annotations

import mmap
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.engine.backend import ALIGN, HUGE_PAGE, advise_huge_pages, check_cancel, round_up
from kvtier.errors import EntryNotFound, HostMemoryShort, TierFullError
from kvtier.telemetry.clock import IOTiming
from kvtier.telemetry.host import mem_available_bytes, mem_limit_bytes

if TYPE_CHECKING:
    from kvtier.engine.device import Chunk

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux value; Python <3.13 lacks the name
DEFAULT_PAGE_BYTES = ALIGN
"""The page of a tier built without one: 4 KiB, byte-exact like the entries' own padding (kvtier bench and
the sim give the model's chunk instead, so an entry is a few pages)."""
MIN_PAGES = 16
"""A tier holds at least this many pages: a page its capacity cannot hold 16 times is cut down."""
FLOOR_MIN_BYTES = 2 * 2**30
FLOOR_FRACTION = 0.05
CGROUP_FLOOR_MIN_BYTES = 256 * 2**20
"""Inside a memory cgroup (a container) the floor is of its limit, at least this: the kernel's own needs are the
host's, and 2 GiB kept in a 1.5 GiB container left a CPU tier no room at all."""
RECHECK_S = 0.05  # /proc/meminfo is read again after this long; in between, what the tier took is subtracted


def host_floor(total_bytes: int, in_cgroup: bool = False) -> int:
    """Memory a RAM tier leaves the host: 2 GiB or 5 % of RAM, the larger (a run that kept 1.2 GiB on a 24 GiB
    host was killed for memory: buffers touched later, the kernel's own needs); in a memory cgroup of
    ``total_bytes``, 256 MiB or 5 % of it."""
    return max(CGROUP_FLOOR_MIN_BYTES if in_cgroup else FLOOR_MIN_BYTES, int(total_bytes * FLOOR_FRACTION))


def default_floor() -> int:
    """``host_floor`` of the memory this process's world has: the host's, or its container's limit."""
    return host_floor(*mem_limit_bytes())


def page_size(capacity_bytes: int, wanted: int) -> int:
    """The page a tier of ``capacity_bytes`` uses when ``wanted`` is asked for: a multiple of 4 KiB (of 2 MiB,
    a huge page, when at least that), at most 1/MIN_PAGES of the capacity, at least 4 KiB."""
    page = round_up(max(wanted, ALIGN))
    cap = capacity_bytes // MIN_PAGES // ALIGN * ALIGN
    if page > cap:
        page = max(cap, ALIGN)
    if page >= HUGE_PAGE:
        page = page // HUGE_PAGE * HUGE_PAGE
    return page


class MemoryTier:
    """KV entries in host RAM, in fixed-size pages."""

    takes_device = True  # TieredStore: a --gpu-native device chunk is copied straight into the pages
    in_memory = True  # a read landing in device memory from here is this tier's own read (device time)

    def __init__(
        self,
        capacity_bytes: int,
        name: str = "cpu",
        page_bytes: int = DEFAULT_PAGE_BYTES,
        host_available: Callable[[], int] | None = None,
        host_floor_bytes: int | None = None,
        host_reserved_bytes: int = 0,
    ) -> None:
        self.name = name
        self._available = host_available or mem_available_bytes
        floor = default_floor() if host_floor_bytes is None else host_floor_bytes
        self.host_floor_bytes = floor + max(host_reserved_bytes, 0)  # buffers touched later count against the host
        self.configured_bytes = 0  # the size asked for; capacity_bytes drops below it when the host runs short
        self.host_short: dict[str, Any] | None = None
        self._high_water = 0  # pages below this index have been used (are the host's memory already)
        self._checked_at = -1.0e9
        self._avail_est = 0
        self._pending = 0  # fresh bytes handed to writes that have not filled them yet
        self.page_bytes = page_size(max(capacity_bytes, 0), page_bytes)
        pages = max(capacity_bytes, 0) // self.page_bytes
        self.capacity_bytes = pages * self.page_bytes
        self.configured_bytes = self.capacity_bytes
        self._arena = self._map(self.capacity_bytes) if self.capacity_bytes else None
        self._np = np.frombuffer(self._arena, dtype=np.uint8) if self._arena is not None else np.empty(0, np.uint8)
        self._free: list[int] = list(range(pages - 1, -1, -1))  # a stack: pop() gives the lowest page first
        self._index: dict[str, tuple[list[int], int]] = {}  # key -> (its pages, in order; its bytes)
        self._used_pages = 0
        self._payload = 0  # bytes of the entries themselves (padded to 4 KiB): used pages minus this is waste
        self._lock = threading.Lock()
        self._copying = 0  # reads and writes in flight: a write alone shares a large copy (NoiseChunks.fill)

    def _map(self, nbytes: int) -> mmap.mmap:
        """The arena: anonymous host memory, reserved as address space only (a paged tier on another mapping,
        engine/cxl.py, maps its device or file here instead)."""
        arena = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        advise_huge_pages(arena)
        return arena

    def stored_size(self, nbytes: int) -> int:
        """What an entry of ``nbytes`` takes: whole pages (the capacity the store accounts in)."""
        p = self.page_bytes
        return -(-round_up(nbytes) // p) * p

    def _views(self, pages: list[int], padded: int) -> list[np.ndarray]:
        """The entry's bytes as one view per page, the last cut to what the entry uses."""
        p, out, left = self.page_bytes, [], padded
        for i in pages:
            n = min(p, left)
            out.append(self._np[i * p : i * p + n])
            left -= n
        return out

    def write(self, key: str, chunks: Iterable[Chunk], nbytes: int) -> IOTiming:
        t0 = time.perf_counter_ns()
        padded = round_up(nbytes)
        need = self.stored_size(nbytes) // self.page_bytes
        with self._lock:
            if key in self._index:
                raise ValueError(f"{self.name} tier: {key!r} already stored")
            if need > len(self._free):
                if self.host_short is not None:  # a store that reserved under the old size meets the new one
                    raise HostMemoryShort(
                        f"{self.name} tier: stopped growing at {self.capacity_bytes / 2**30:.2f} GiB (the host ran "
                        f"short): {need} pages needed, {len(self._free)} free"
                    )
                raise TierFullError(f"{self.name} tier: {need} pages needed, {len(self._free)} free")
            pages = [self._free.pop() for _ in range(need)]
            fresh = sum(1 for i in pages if i >= self._high_water)
            if fresh:
                short = self._host_short(fresh * self.page_bytes)
                if short is not None:
                    self._free.extend(reversed(pages))
                    self._stop_growing(short)
                    raise HostMemoryShort(
                        f"{self.name} tier: the host has {short / 2**30:.2f} GiB available and keeps "
                        f"{self.host_floor_bytes / 2**30:.2f} GiB; the tier stops growing at "
                        f"{self.capacity_bytes / 2**30:.2f} GiB of {self.configured_bytes / 2**30:.2f} GiB"
                    )
                self._high_water = max(self._high_water, max(pages) + 1)
                self._pending += fresh * self.page_bytes
            self._index[key] = (pages, nbytes)
            self._used_pages += need
            self._payload += padded
            self._copying += 1
            alone = self._copying == 1
        views = self._views(pages, padded)
        t1 = time.perf_counter_ns()
        fill = getattr(chunks, "fill", None)  # a source that writes straight into our memory: one copy, not two
        try:
            if fill is not None:  # the tier to itself: a large entry's copy is shared with a helper thread
                fill([memoryview(v.data) for v in views], share=alone)
            else:
                self._scatter(chunks, views)
        except BaseException:
            self.delete(key)
            raise
        finally:
            with self._lock:  # written (or given back): the host's figure has the fresh pages now
                self._pending -= fresh * self.page_bytes
                self._copying -= 1
        t2 = time.perf_counter_ns()
        return IOTiming(host_ns=t1 - t0, device_ns=t2 - t1)

    @staticmethod
    def _scatter(chunks: Iterable[Chunk], views: list[np.ndarray]) -> None:
        """Copy the chunks, in order, across the page views (a device chunk of ``--gpu-native`` device to host,
        straight into the pages: engine/device.py)."""
        from kvtier.engine.device import is_device, to_host

        k, at = 0, 0
        for c in chunks:
            device = is_device(c)
            src = c if device else np.frombuffer(c, dtype=np.uint8)
            pos = 0
            while pos < len(src) and k < len(views):
                n = min(len(src) - pos, len(views[k]) - at)
                if device:
                    to_host(views[k][at : at + n].data, src[pos : pos + n])
                else:
                    np.copyto(views[k][at : at + n], src[pos : pos + n])
                pos += n
                at += n
                if at == len(views[k]):
                    k, at = k + 1, 0

    def _lookup(self, key: str) -> tuple[list[int], int]:
        with self._lock:
            try:
                return self._index[key]
            except KeyError:
                raise EntryNotFound(f"{self.name} tier: {key!r} not stored") from None

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        """Gather the entry's pages through ``buf`` (its bytes pass through in ``len(buf)`` pieces)."""
        t0 = time.perf_counter_ns()
        pages, nbytes = self._lookup(key)
        views = self._views(pages, round_up(nbytes))
        dst = np.frombuffer(buf, dtype=np.uint8)
        step = len(buf) - len(buf) % ALIGN
        t1 = time.perf_counter_ns()
        at = done = 0
        with self._lock:
            self._copying += 1
        try:
            for v in views:
                pos = 0
                while pos < len(v):
                    if at == 0:
                        check_cancel(cancel, f"{self.name} read", done)
                    n = min(len(v) - pos, step - at)
                    np.copyto(dst[at : at + n], v[pos : pos + n])
                    pos += n
                    at += n
                    done += n
                    if at == step:
                        at = 0
        finally:
            with self._lock:
                self._copying -= 1
        t2 = time.perf_counter_ns()
        return IOTiming(host_ns=t1 - t0, device_ns=t2 - t1)

    def export(self, key: str, buf: memoryview, timing: IOTiming) -> Iterator[memoryview]:
        # Zero copy: the consumer (the next tier's write) reads RAM directly, page by page, so the cost of
        # this read is inside the consumer's timed write. The store holds the entry lock meanwhile.
        pages, nbytes = self._lookup(key)
        if self._arena is None:  # a zero-capacity tier stores nothing, so _lookup already raised
            raise EntryNotFound(f"{self.name} tier: {key!r} not stored")
        step = max(ALIGN, len(buf) - len(buf) % ALIGN)  # the caller's I/O size: cancellation granularity
        for v in self._views(pages, round_up(nbytes)):
            view = memoryview(v.data)
            for off in range(0, len(view), step):
                yield view[off : off + step]

    def _host_short(self, fresh_bytes: int) -> int | None:
        """The host's available memory when taking ``fresh_bytes`` more would leave less than the floor, else
        None. Called under the lock; reads /proc/meminfo at most every RECHECK_S (between reads, the bytes this
        tier took since are subtracted from the last figure), less the fresh pages of writes still filling them
        (32 writers of 3 GiB entries had 20 GiB of pages out that the host's figure did not show yet)."""
        now = time.monotonic()
        if now - self._checked_at >= RECHECK_S or self._avail_est - fresh_bytes < self.host_floor_bytes:
            avail = self._available()
            if avail <= 0:  # unknown (no /proc/meminfo): nothing to guard against
                return None
            # pages handed to writes still filling them are not in the host's figure yet
            self._avail_est, self._checked_at = avail - self._pending, now
        if self._avail_est - fresh_bytes < self.host_floor_bytes:
            return max(self._avail_est, 0)
        self._avail_est -= fresh_bytes
        return None

    def _stop_growing(self, available: int) -> None:
        """Keep the pages already used; the ones never used leave the free list. Called under the lock."""
        hw = self._high_water
        self._free = [i for i in self._free if i < hw]
        self.capacity_bytes = hw * self.page_bytes
        self.host_short = {
            "at_unix_s": time.time(),
            "capacity_bytes": self.capacity_bytes,
            "configured_bytes": self.configured_bytes,
            "host_available_bytes": available,
            "host_floor_bytes": self.host_floor_bytes,
        }

    def delete(self, key: str) -> None:
        with self._lock:
            pages, nbytes = self._index.pop(key)
            self._free.extend(reversed(pages))
            self._used_pages -= len(pages)
            self._payload -= round_up(nbytes)

    def stored_bytes(self) -> int:
        """Bytes of the pages entries hold (whole pages: what the capacity is spent on)."""
        with self._lock:
            return self._used_pages * self.page_bytes

    def waste_bytes(self) -> int:
        """The part of the held pages no entry uses (each entry's last page is partly empty)."""
        with self._lock:
            return self._used_pages * self.page_bytes - self._payload

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._free.clear()
            self._np = np.empty(0, np.uint8)
            if self._arena is not None:
                try:
                    self._arena.close()
                except BufferError:  # a view still exists somewhere; the GC will unmap it
                    pass
                self._arena = None
