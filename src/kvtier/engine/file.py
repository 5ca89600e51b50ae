"""File tier (NVMe or any filesystem): one raw file per entry, fsync on write, page cache bypassed.

File layout: one ALIGN-sized header block (magic, version, logical length, key digest), then
the payload padded to ALIGN. With O_DIRECT the header and the first payload chunk go out in one
``writev`` and are read back in one ``preadv`` straight into the caller's reused aligned buffer,
so the kernel DMA-s between the device and our buffers with no copy. Where the filesystem
refuses O_DIRECT (tmpfs, some overlays) the tier falls back to buffered write + fsync +
``posix_fadvise(DONTNEED)`` and buffered ``preadv`` + DONTNEED, so reads still reach the device.

Timing: device_ns covers the calls that move bytes (writev/write + fsync, preadv);
host_ns covers open/close, header packing and checks, and page-cache advice.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from kvtier.engine.backend import ALIGN, IOTiming, aligned_buffer, check_cancel, read_through_export, round_up
from kvtier.engine.runs import MARKER, RUN_DIR_PREFIX, create_marker
from kvtier.errors import EntryNotFound, StorageError, TierFullError, UnusableDirectory

MAGIC = b"KVTIER01"
FORMAT_VERSION = 2
_HEADER = struct.Struct("<8sIIQ16sI")  # magic, version, header length, payload bytes, key digest, sample crc32
SAMPLE_BYTES = ALIGN
"""The payload's first SAMPLE_BYTES are checksummed (zlib crc32, ~1.5 µs per entry, measured): a file whose start
was overwritten or zeroed is caught on read; truncation is caught by the size check."""


def sample_crc(first: memoryview | bytes | None, nbytes: int) -> int:
    if first is None:
        return 0
    return zlib.crc32(first[: min(SAMPLE_BYTES, nbytes, len(first))])


DirectIO = Literal["auto", "on", "off"]


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def probe_direct_io(directory: Path) -> bool:
    """True if O_DIRECT works for aligned I/O in ``directory`` (checked with a real write and read)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".kvtier-odirect-probe-{uuid.uuid4().hex}"
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.write(fd, buf)
        os.preadv(fd, [buf], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def free_bytes(directory: Path) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


class FileTier:
    """KV entries as files under a run directory that this tier creates and removes."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        capacity_bytes: int = 0,
        direct_io: DirectIO = "auto",
        name: str = "storage",
        keep_files: bool = False,
        preallocate: bool = False,
    ) -> None:
        self.name = name
        base = Path(cache_dir)
        if not base.exists():
            raise UnusableDirectory(f"{base} does not exist")
        if not base.is_dir():
            raise UnusableDirectory(f"{base} is not a directory")
        if not os.access(base, os.W_OK | os.X_OK):
            raise UnusableDirectory(f"{base} is not writable")
        try:
            self.directory = base / f"{RUN_DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.directory.mkdir()
            self._marker_fd = create_marker(self.directory)  # proves the folder ours; locked while we run
        except OSError as e:
            raise UnusableDirectory(f"cannot create a run directory in {base}: {e.strerror}") from e
        self.cleanup_problems: list[str] = []
        supported = probe_direct_io(self.directory)
        if direct_io == "on" and not supported:
            os.close(self._marker_fd)
            self._marker_fd = -1
            shutil.rmtree(self.directory, ignore_errors=True)
            raise UnusableDirectory(f"the filesystem of {base} does not support O_DIRECT", direct_io=True)
        self.direct = supported and direct_io != "off"
        self.direct_io_supported = supported
        detected = free_bytes(self.directory)
        self.detected_free_bytes = detected
        # Use 95% of the free space when no capacity is given (as the reference's auto-detection),
        # leaving room for the filesystem.
        self.capacity_bytes = capacity_bytes if capacity_bytes > 0 else int(detected * 0.95) // ALIGN * ALIGN
        self.keep_files = keep_files
        self.preallocate = preallocate
        self._flags_w = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0)
        self._flags_r = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        self._files: dict[str, int] = {}  # key -> file size
        self._lock = threading.Lock()
        self._local = threading.local()

    # -- helpers ---------------------------------------------------------------------------
    def _header_buf(self) -> memoryview:
        hb = getattr(self._local, "header", None)
        if hb is None:
            hb = self._local.header = aligned_buffer(ALIGN)
        return hb

    def path_for(self, key: str) -> Path:
        return self.directory / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"

    def stored_size(self, nbytes: int) -> int:
        return ALIGN + round_up(nbytes)

    # The two calls that move bytes (GdsFileTier moves the payload through cuFile instead).
    def _put(self, fd: int, path: Path, views: list[memoryview], offset: int) -> None:
        """Write ``views`` at ``offset`` (the file position is there: writes are sequential)."""
        _write_all(fd, views)

    def _get(self, fd: int, path: Path, views: list[memoryview], offset: int) -> int:
        return os.preadv(fd, views, offset)

    # -- Backend ---------------------------------------------------------------------------
    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        t0 = time.perf_counter_ns()
        hdr = self._header_buf()
        path = self.path_for(key)
        size = self.stored_size(nbytes)
        device = 0
        fd = -1
        try:
            fd = os.open(path, self._flags_w, 0o600)
            if self.preallocate:
                # Optional: one allocation up front. Off by default: under load fallocate waits on
                # the journal (seconds here) and the write then converts the extents again.
                os.posix_fallocate(fd, 0, size)
            it = iter(chunks)
            first = next(it, None)
            _HEADER.pack_into(hdr, 0, MAGIC, FORMAT_VERSION, ALIGN, nbytes, key_digest(key), sample_crc(first, nbytes))
            t = time.perf_counter_ns()
            self._put(fd, path, [hdr] if first is None else [hdr, first], 0)
            off = ALIGN + (len(first) if first is not None else 0)
            for c in it:
                self._put(fd, path, [c], off)
                off += len(c)
            os.fsync(fd)
            device = time.perf_counter_ns() - t
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
                fd = -1
            path.unlink(missing_ok=True)
            if not isinstance(e, OSError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"{self.name} tier: device full writing {path.name}") from e
            raise StorageError(f"{self.name} tier: write of {path.name} failed: {e.strerror}") from e
        finally:
            if fd >= 0:
                os.close(fd)
        with self._lock:
            self._files[key] = size
        return IOTiming(host_ns=time.perf_counter_ns() - t0 - device, device_ns=device)

    def _open_checked(self, key: str, timing: IOTiming, buf: memoryview) -> tuple[int, int, int]:
        """Open the entry, read header + first chunk in one preadv; return (fd, nbytes, bytes_read)."""
        with self._lock:
            if key not in self._files:
                raise EntryNotFound(f"{self.name} tier: {key!r} not stored")
        path = self.path_for(key)
        hdr = self._header_buf()
        fd = os.open(path, self._flags_r)
        try:
            size = os.fstat(fd).st_size
            first = min(len(buf) - len(buf) % ALIGN, size - ALIGN)
            t = time.perf_counter_ns()
            got = self._get(fd, path, [hdr, buf[:first]], 0)
            timing.device_ns += time.perf_counter_ns() - t
            magic, version, hlen, nbytes, digest, crc = _HEADER.unpack_from(hdr, 0)
            if magic != MAGIC or version != FORMAT_VERSION or hlen != ALIGN or digest != key_digest(key):
                raise StorageError(f"{self.name} tier: {path.name} has a bad header (not a kvtier entry?)")
            if size < ALIGN + nbytes or got < ALIGN:
                raise StorageError(f"{self.name} tier: {path.name} is truncated ({size} bytes)")
            if nbytes and sample_crc(buf[: got - ALIGN], nbytes) != crc:
                raise StorageError(f"{self.name} tier: {path.name} fails its checksum (the payload changed)")
            return fd, nbytes, got - ALIGN
        except BaseException:
            os.close(fd)
            raise

    def export(
        self, key: str, buf: memoryview, timing: IOTiming, cancel: threading.Event | None = None
    ) -> Iterator[memoryview]:
        t0 = time.perf_counter_ns()
        dev0 = timing.device_ns
        try:
            fd, nbytes, got = self._open_checked(key, timing, buf)
        except OSError as e:
            raise StorageError(f"{self.name} tier: read of {key!r} failed: {e.strerror}") from e
        try:
            padded = round_up(nbytes)
            step = len(buf) - len(buf) % ALIGN
            off = got
            path = self.path_for(key)
            yield buf[:got]
            while off < padded:
                check_cancel(cancel, f"{self.name} read", off)
                n = min(step, padded - off)
                t = time.perf_counter_ns()
                r = self._get(fd, path, [buf[:n]], ALIGN + off)
                timing.device_ns += time.perf_counter_ns() - t
                if r <= 0:
                    raise StorageError(f"{self.name} tier: short read of {key!r} at {off}")
                off += r
                yield buf[:r]
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise StorageError(f"{self.name} tier: read of {key!r} failed: {e.strerror}") from e
        finally:
            os.close(fd)
            timing.host_ns += time.perf_counter_ns() - t0 - (timing.device_ns - dev0)

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        return read_through_export(self.export, key, buf, cancel)

    def delete(self, key: str) -> None:
        with self._lock:
            self._files.pop(key, None)
        self.path_for(key).unlink(missing_ok=True)

    def __del__(self) -> None:
        if getattr(self, "_marker_fd", -1) >= 0:
            os.close(self._marker_fd)

    def stored_bytes(self) -> int:
        """Sum of the sizes of our files as the filesystem reports them."""
        total = 0
        with self._lock:
            keys = list(self._files)
        for k in keys:
            try:
                total += self.path_for(k).stat().st_size
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        """Remove the files this tier created and its run directory (only if then empty). A file that
        cannot be removed (a read-only or immutable folder) is noted in ``cleanup_problems`` and the
        rest are still removed; nothing raises."""
        if self._marker_fd < 0:
            return
        if self.keep_files:
            os.close(self._marker_fd)
            self._marker_fd = -1
            return
        with self._lock:
            keys = list(self._files)
            self._files.clear()
        for path in [*(self.path_for(k) for k in keys), self.directory / MARKER]:
            try:
                path.unlink(missing_ok=True)
            except OSError as e:
                self.cleanup_problems.append(f"{path}: {e.strerror}")
        os.close(self._marker_fd)  # releases the lock: a folder left behind is now stale, and removable
        self._marker_fd = -1
        try:
            self.directory.rmdir()
        except OSError as e:
            if self.cleanup_problems:  # the folder is only worth a word when we also left files in it
                self.cleanup_problems.append(f"{self.directory}: {e.strerror}")


def _write_all(fd: int, views: list[memoryview]) -> None:
    """writev until everything is written (short writes are rare but legal)."""
    total = sum(len(v) for v in views)
    done = os.writev(fd, views)
    while done < total:
        rest: list[memoryview] = []
        skip = done
        for v in views:
            if skip >= len(v):
                skip -= len(v)
                continue
            rest.append(v[skip:])
            skip = 0
        views, total = rest, total - done
        done = os.writev(fd, views)
