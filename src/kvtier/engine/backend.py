"""What a tier is: the Backend protocol, the timing it returns, and the aligned buffers it uses.

Data moves as *chunks*: memoryviews whose addresses are page aligned and whose lengths are
multiples of ``ALIGN`` (the logical entry size is passed separately). That lets every tier use
O_DIRECT or plain copies without re-packing, and lets the benchmark pass slices of one static
noise buffer without copying them.
"""

from __future__ import annotations

import hashlib
import mmap
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from kvtier.telemetry.clock import IOTiming  # defined with the clock (telemetry sits below the engine)

ALIGN = 4096
"""Alignment of every buffer address, chunk length and file offset (the usual O_DIRECT block)."""


MAX_TTL_S = 10 * 365.25 * 86400.0
"""The longest a shared-namespace entry may live (--remote-ttl's limit, and the latest expiry a reader believes
from another writer): ten years."""


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def check_cancel(cancel: threading.Event | None, what: str, bytes_done: int = 0) -> None:
    if cancel is not None and cancel.is_set():
        from kvtier.errors import Cancelled

        raise Cancelled(f"{what}: cancelled", bytes_done)


def read_through_export(
    export: Callable[[str, memoryview, IOTiming, threading.Event | None], Iterator[memoryview]],
    key: str,
    buf: memoryview,
    cancel: threading.Event | None,
) -> IOTiming:
    """A tier's ``read`` as its ``export`` drained: every chunk lands in ``buf``, the time is summed."""
    timing = IOTiming()
    for _ in export(key, buf, timing, cancel):
        pass
    return timing


HUGE_PAGE = 2 * 1024 * 1024


def advise_huge_pages(m: mmap.mmap) -> None:
    """Ask for transparent huge pages (THP is often in 'madvise' mode).

    Measured here: O_DIRECT reads into 4 KiB-page buffers ran at ~1.0 GB/s, into huge-page
    buffers at ~2.5-2.9 GB/s on the same files (pinning 512x fewer pages per call). Harmless
    where THP is off or unsupported.
    """
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice)
        except OSError:
            pass


NT_COPY_TUNABLE = "glibc.cpu.x86_non_temporal_threshold"
NT_COPY_BYTES = 1 << 20
"""glibc's memcpy streams a copy past the cache (non-temporal stores) only above a threshold it sets from the cache
size: 114 MiB on this VM's reported 300 MiB L3. Every copy kvtier's CPU tier makes is a page (2-32 MiB) or a piece of
one, so each ran with ordinary stores, at 0.52-0.59 of one ``np.copyto`` of a whole 256 MiB entry (which streams);
with copies of 1 MiB and more streaming, 0.77-1.01 of it (benchmarks/cpu_tier_pages.py, both in one run). glibc reads
the tunable once, at a process's start: ``kvtier bench`` re-executes itself under it (cli/main.py)."""


def nt_copy_environ(environ: Mapping[str, str]) -> dict[str, str] | None:
    """``environ`` with glibc told to stream copies of NT_COPY_BYTES and more; None where that is already so (or
    the user set the tunable) or cannot matter (not Linux on x86-64)."""
    import platform

    tunables = environ.get("GLIBC_TUNABLES", "")
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or NT_COPY_TUNABLE in tunables:
        return None
    ours = f"{NT_COPY_TUNABLE}={NT_COPY_BYTES:#x}"
    return {**environ, "GLIBC_TUNABLES": f"{tunables}:{ours}" if tunables else ours}


def aligned_buffer(nbytes: int) -> memoryview:
    """A zero-filled, writable buffer, page aligned, and 2 MiB aligned and huge-page backed when large.

    Anonymous mmap: pages materialise on first touch.
    """
    size = max(ALIGN, round_up(nbytes))
    if size < HUGE_PAGE:
        return memoryview(mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS))
    m = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(m)
    view = memoryview(m)
    import ctypes

    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    skip = (-addr) % HUGE_PAGE
    return view[skip : skip + size]


@runtime_checkable
class Backend(Protocol):
    """One storage tier. Implementations: MemoryTier, FileTier, GpuTier.

    A tier stores opaque entries by key; it does no eviction (the TieredStore decides that)
    and never refuses for capacity reasons except when the medium itself is out of space.
    """

    name: str
    capacity_bytes: int

    def stored_size(self, nbytes: int) -> int:
        """Bytes an entry of ``nbytes`` logical bytes occupies in this tier (padding, header)."""
        ...

    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        """Store an entry. On failure nothing of it remains and a StorageError is raised."""
        ...

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        """Read the whole entry through ``buf`` (reused; holds the last chunk afterwards).

        Checks ``cancel`` between chunks and raises Cancelled when it is set."""
        ...

    def export(self, key: str, buf: memoryview, timing: IOTiming) -> Iterator[memoryview]:
        """Yield the entry's data as aligned chunks (for demotion/promotion); adds read time to ``timing``."""
        ...

    def delete(self, key: str) -> None: ...

    def stored_bytes(self) -> int:
        """What the medium really holds now, measured independently of the store's accounting."""
        ...

    def close(self) -> None:
        """Release memory and remove every file this tier created."""
        ...


def shared_digest(scope: str, key: str) -> str:
    """The name of ``key`` in a remote tier: in a shared namespace it is hashed with the writer's scope (model,
    dtype, layout; the bench passes ``KeyScope.tag()`` and its layout), so two runs of different models never meet
    under one key whatever their own keys look like; outside one the scope is empty and the digest is the key's."""
    data = f"{len(scope)}:{scope}{key}" if scope else key
    return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()


def expected_size_problem(total: int, parts: int, expect: int) -> str | None:
    """Why a shared entry of ``total`` bytes in ``parts`` parts is not the entry of ``expect`` logical bytes the
    key names, or None. A writer stores the payload (``expect``) or its aligned image (up to round_up), cut at
    aligned chunks, so an honest entry has at most one part per 4 KiB block (two for chunks cut mid-block)."""
    if not expect <= total <= round_up(expect):
        return f"{total} bytes where the key names an entry of {expect}"
    if not 1 <= parts <= max_parts(expect):
        return f"{parts} parts where an entry of {expect} bytes has at most {max_parts(expect)}"
    return None


def max_parts(expect: int) -> int:
    return 2 * (round_up(expect) // ALIGN) + 1


WRITER_MAX = 256
"""The longest writer name a shared entry's description may start with (host-pid-id is well under it)."""


def description_limit(expect: int) -> int:
    """The longest description a shared entry of ``expect`` bytes has: its writer and one length per part."""
    return WRITER_MAX + max_parts(expect) * (len(str(round_up(expect))) + 1)


@dataclass
class OwnKeys:
    """What a remote tier may delete is decided here, not by the server's listing: of the keys a server lists
    for the run's ``prefix``, only those really under it are kept (a server that ignores MATCH or Prefix would
    otherwise have kvtier delete another team's data); the others are counted, a few named, and said once."""

    prefix: str
    foreign: int = 0
    examples: list[str] = field(default_factory=list)

    def keep(self, keys: Iterable[str]) -> list[str]:
        ours = []
        for k in keys:
            if k.startswith(self.prefix) and len(k) > len(self.prefix):
                ours.append(k)
            else:
                self.foreign += 1
                if len(self.examples) < 3:
                    self.examples.append(k)
        return ours

    def problem(self, where: str, listing: str, honoured: str) -> str | None:
        """The sentence for the run's cleanup problems, or None when the server listed only ours."""
        if not self.foreign:
            return None
        return (
            f"{where}: {listing} {self.prefix}* listed {self.foreign} keys outside this run's prefix (e.g. "
            f"{', '.join(self.examples)}): left alone — the server does not honour {honoured}"
        )
