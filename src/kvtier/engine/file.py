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
import logging
import os
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

from kvtier.engine.backend import ALIGN, aligned_buffer, check_cancel, read_through_export, round_up
from kvtier.engine.runs import (
    BACKGROUND_REMOVAL_BYTES,
    MARKER,
    PROBE_PREFIX,
    RUN_DIR_PREFIX,
    create_marker,
    exposed_cache_dir,
    hand_off_removal,
    make_run_dir,
    remove_if_same,
    system_directory,
)
from kvtier.errors import EntryNotFound, StorageError, TierFullError, UnusableDirectory
from kvtier.telemetry.clock import IOTiming

log = logging.getLogger("kvtier.engine")

MAGIC = b"KVTIER01"
FORMAT_VERSION = 2
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_ENTRY = os.O_NOFOLLOW | _CLOEXEC  # every entry is opened through the run folder's descriptor, never via a link
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


def probe_direct_io(directory: Path | int) -> bool:
    """True if O_DIRECT works for aligned I/O in ``directory`` (a path, or a folder's descriptor), checked with a
    real write and read of a probe file made there (and removed)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    if not isinstance(directory, int):
        try:
            dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError:
            return False
        try:
            return probe_direct_io(dir_fd)
        finally:
            os.close(dir_fd)
    probe = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    buf = aligned_buffer(ALIGN)
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_DIRECT | _ENTRY, 0o600, dir_fd=directory)
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
        _unlink(probe, directory)


def free_bytes(directory: Path | int) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def _unlink(name: str, dir_fd: int) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass


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
        system = system_directory(base)
        if system is not None:
            raise UnusableDirectory(f"{base} is a system directory ({system}): no cache goes there")
        if not base.exists():
            raise UnusableDirectory(f"{base} does not exist")
        if not base.is_dir():
            raise UnusableDirectory(f"{base} is not a directory")
        if not os.access(base, os.W_OK | os.X_OK):
            raise UnusableDirectory(f"{base} is not writable")
        self.exposure = exposed_cache_dir(base)  # others may rename in it: reported by the callers
        folder = f"{RUN_DIR_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.directory = base / folder  # for messages and telemetry; I/O goes through _dir_fd
        self.keep_files = keep_files
        self._files: dict[str, int] = {}  # key -> file size
        self._lock = threading.Lock()
        self._local = threading.local()
        self._base_fd = self._dir_fd = self._marker_fd = -1
        self.cleanup_problems: list[str] = []
        self.remove_in_background = False  # kvtier bench sets it once its result is written
        self.removal_pid: int | None = None  # the background remover of this run's files
        self.removal_bytes = 0
        try:
            self._base_fd, self._dir_fd = make_run_dir(base, folder)
            self._marker_fd = create_marker(self._dir_fd)  # proves the folder ours; locked while we run
        except OSError as e:
            self._close_fds()
            raise UnusableDirectory(f"cannot create a run directory in {base}: {e.strerror}") from e
        supported = probe_direct_io(self._dir_fd)
        if direct_io == "on" and not supported:
            self.keep_files = False
            self.close()
            raise UnusableDirectory(f"the filesystem of {base} does not support O_DIRECT", direct_io=True)
        self.direct = supported and direct_io != "off"
        self.direct_io_supported = supported
        detected = free_bytes(self._dir_fd)
        self.detected_free_bytes = detected
        # Use 95% of the free space when no capacity is given (as the reference's auto-detection),
        # leaving room for the filesystem.
        self.capacity_bytes = capacity_bytes if capacity_bytes > 0 else int(detected * 0.95) // ALIGN * ALIGN
        self.preallocate = preallocate
        self._flags_w = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _ENTRY | (os.O_DIRECT if self.direct else 0)
        self._flags_r = os.O_RDONLY | _ENTRY | (os.O_DIRECT if self.direct else 0)

    # -- helpers ---------------------------------------------------------------------------
    def _header_buf(self) -> memoryview:
        hb = getattr(self._local, "header", None)
        if hb is None:
            hb = self._local.header = aligned_buffer(ALIGN)
        return hb

    @staticmethod
    def name_for(key: str) -> str:
        """The entry's file name in the run folder (a digest: any key is a safe name)."""
        return f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"

    def path_for(self, key: str) -> Path:
        """The entry's path, for messages and inspection; the tier itself never opens by path."""
        return self.directory / self.name_for(key)

    def pinned_path(self, name: str) -> str:
        """A path to ``name`` that resolves through the run folder's open descriptor (for a library that takes
        only paths, cuFile): renaming or replacing the folder cannot redirect it."""
        return f"/proc/self/fd/{self._dir_fd}/{name}"

    def stored_size(self, nbytes: int) -> int:
        return ALIGN + round_up(nbytes)

    # The two calls that move bytes (GdsFileTier moves the payload through cuFile instead).
    def _put(self, fd: int, name: str, views: list[memoryview], offset: int) -> None:
        """Write ``views`` at ``offset`` (the file position is there: writes are sequential)."""
        _write_all(fd, views)

    def _get(self, fd: int, name: str, views: list[memoryview], offset: int) -> int:
        return os.preadv(fd, views, offset)

    def _crc(self, first: memoryview | None, nbytes: int) -> int:
        """The header's checksum of the payload's first bytes (GdsFileTier: of a device chunk too)."""
        return sample_crc(first, nbytes)

    # -- Backend ---------------------------------------------------------------------------
    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        t0 = time.perf_counter_ns()
        hdr = self._header_buf()
        name = self.name_for(key)
        size = self.stored_size(nbytes)
        device = 0
        fd = -1
        try:
            fd = os.open(name, self._flags_w, 0o600, dir_fd=self._dir_fd)
            if self.preallocate:
                # Optional: one allocation up front. Off by default: under load fallocate waits on
                # the journal (seconds here) and the write then converts the extents again.
                os.posix_fallocate(fd, 0, size)
            it = iter(chunks)
            first = next(it, None)
            _HEADER.pack_into(hdr, 0, MAGIC, FORMAT_VERSION, ALIGN, nbytes, key_digest(key), self._crc(first, nbytes))
            t = time.perf_counter_ns()
            self._put(fd, name, [hdr] if first is None else [hdr, first], 0)
            off = ALIGN + (len(first) if first is not None else 0)
            for c in it:
                self._put(fd, name, [c], off)
                off += len(c)
            os.fsync(fd)
            device = time.perf_counter_ns() - t
            if not self.direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except BaseException as e:
            if fd >= 0:
                os.close(fd)
                fd = -1
            _unlink(name, self._dir_fd)
            if not isinstance(e, OSError):
                raise
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"{self.name} tier: device full writing {name}") from e
            raise StorageError(f"{self.name} tier: write of {name} failed: {e.strerror}") from e
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
        name = self.name_for(key)
        hdr = self._header_buf()
        fd = os.open(name, self._flags_r, dir_fd=self._dir_fd)
        try:
            size = os.fstat(fd).st_size
            first = min(len(buf) - len(buf) % ALIGN, size - ALIGN)
            t = time.perf_counter_ns()
            got = self._get(fd, name, [hdr, buf[:first]], 0)
            timing.device_ns += time.perf_counter_ns() - t
            magic, version, hlen, nbytes, digest, crc = _HEADER.unpack_from(hdr, 0)
            if magic != MAGIC or version != FORMAT_VERSION or hlen != ALIGN or digest != key_digest(key):
                raise StorageError(f"{self.name} tier: {name} has a bad header (not a kvtier entry?)")
            if size < ALIGN + nbytes or got < ALIGN:
                raise StorageError(f"{self.name} tier: {name} is truncated ({size} bytes)")
            if nbytes and sample_crc(buf[: got - ALIGN], nbytes) != crc:
                raise StorageError(f"{self.name} tier: {name} fails its checksum (the payload changed)")
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
            name = self.name_for(key)
            yield buf[:got]
            while off < padded:
                check_cancel(cancel, f"{self.name} read", off)
                n = min(step, padded - off)
                t = time.perf_counter_ns()
                r = self._get(fd, name, [buf[:n]], ALIGN + off)
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
        _unlink(self.name_for(key), self._dir_fd)

    def _close_fds(self) -> None:
        for attr in ("_marker_fd", "_dir_fd", "_base_fd"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, attr, -1)

    def __del__(self) -> None:
        self._close_fds()

    def stored_bytes(self) -> int:
        """Sum of the sizes of our files as the filesystem reports them."""
        total = 0
        with self._lock:
            keys = list(self._files)
        for k in keys:
            try:
                total += os.stat(self.name_for(k), dir_fd=self._dir_fd, follow_symlinks=False).st_size
            except FileNotFoundError:
                pass
        return total

    def close(self) -> None:
        """Remove the files this tier created and its run directory (only if then empty, and only if its name
        still names the folder this tier made). Every unlink goes through the folder's descriptor. A file that
        cannot be removed (a read-only or immutable folder) is noted in ``cleanup_problems`` and the rest are
        still removed; nothing raises. With ``remove_in_background`` set, files of more than BACKGROUND_REMOVAL_BYTES
        are handed to a remover of their own (engine/runs.py ``hand_off_removal``; ``removal_pid`` names it)."""
        if self._marker_fd < 0:
            self._close_fds()
            return
        if self.keep_files:
            self._close_fds()
            return
        with self._lock:
            keys = list(self._files)
            held = sum(self._files.values())
            self._files.clear()
        if self.remove_in_background and held > BACKGROUND_REMOVAL_BYTES and self._hand_off(held):
            return
        for name in [*(self.name_for(k) for k in keys), MARKER]:
            try:
                _unlink(name, self._dir_fd)
            except OSError as e:
                self.cleanup_problems.append(f"{self.directory / name}: {e.strerror}")
        os.close(self._marker_fd)  # releases the lock: a folder left behind is now stale, and removable
        self._marker_fd = -1
        try:
            if not remove_if_same(self._base_fd, self.directory.name, self._dir_fd):
                self.cleanup_problems.append(
                    f"{self.directory}: the name no longer names this run's folder (renamed or replaced while the "
                    "run used it): left alone; its entries were removed through the folder's descriptor"
                )
        except OSError as e:
            if self.cleanup_problems:  # the folder is only worth a word when we also left files in it
                self.cleanup_problems.append(f"{self.directory}: {e.strerror}")
        finally:
            self._close_fds()

    def _hand_off(self, held: int) -> bool:
        """Hand the run folder to a background remover; False (nothing changed) when one cannot be started."""
        try:
            self.removal_pid = hand_off_removal(self._base_fd, self._dir_fd, self._marker_fd, self.directory.name)
        except Exception as e:  # noqa: BLE001 - whatever kept the remover from starting, the files go here
            log.warning("%s: no background remover (%s); removing the run's files before exiting", self.directory, e)
            return False
        self.removal_bytes = held
        self._close_fds()  # the remover holds the lock through its own copy of the marker's descriptor
        return True


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
