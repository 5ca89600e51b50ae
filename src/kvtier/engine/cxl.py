"""A memory tier on another mapping: CXL memory, persistent memory, any DAX mapping (``--cxl-path``).

The tier is the CPU tier's arena of fixed pages (engine/memory.py), mapped from somewhere else:

- a device-DAX character device (``/dev/daxN.M``: a CXL expander or a PMem region in devdax mode) — the device's
  memory itself, mapped shared, locked against a second process (``flock``);
- a folder on a memory-backed filesystem: a filesystem mounted with ``-o dax`` (fsdax on PMem or CXL), or a tmpfs
  (``/dev/shm``; or one bound to a CPU-less CXL memory node, ``mount -t tmpfs -o mpol=bind:N,size=… tmpfs DIR``).
  The tier creates its own file there (0600, never through a link), unlinks it at once (a killed run leaves
  nothing behind), allocates it whole up front (``posix_fallocate``: a later write can never meet a full
  filesystem as a SIGBUS) and maps it shared.

Unlike the CPU tier, the arena is claimed whole when the tier starts, so the tier never stops growing: on a tmpfs
the start checks that the host keeps its floor (engine/memory.py ``host_floor``) after the claim, and refuses with
the figures when it would not. A folder on a disk filesystem is refused: its mapping would be the page cache in
front of a disk, a different tier with a different cost.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import stat
import tempfile
from pathlib import Path

from kvtier.engine.backend import HUGE_PAGE, advise_huge_pages
from kvtier.engine.memory import DEFAULT_PAGE_BYTES, MemoryTier, default_floor
from kvtier.errors import StorageError, UnusableDirectory
from kvtier.telemetry.host import mem_available_bytes

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "hugetlbfs"})
"""Filesystems whose files are host RAM (a tmpfs may be bound to a CXL memory node: see the module's text)."""


def _mounts() -> list[tuple[str, str, frozenset[str], str]]:
    """/proc/self/mountinfo as (mount point, filesystem type, mount options, its device "major:minor")."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 6 or len(tail) < 3:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040, \011, \012, \134
        out.append((point, tail[0], frozenset(fields[5].split(",")) | frozenset(tail[2].split(",")), fields[2]))
    return out


def mount_of(path: str) -> tuple[str, str, frozenset[str]]:
    """The mount holding ``path``: (mount point, filesystem type, mount options), from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best = ("/", "", frozenset[str]())
    for point, fstype, options, _ in _mounts():
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, fstype, options)
    return best


def _memory_mount(fstype: str, options: frozenset[str]) -> str | None:
    """``fsdax`` or ``host`` for a mount that is memory, else None."""
    if "dax" in options or any(o.startswith("dax=") and o != "dax=never" for o in options):
        return "fsdax"
    return "host" if fstype in MEMORY_FILESYSTEMS else None


def _char_subsystem(st: os.stat_result) -> str:
    """The kernel subsystem of a character device (``dax`` for a device-DAX node), from sysfs."""
    try:
        return os.path.basename(
            os.path.realpath(f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/subsystem")
        )
    except OSError:
        return ""


def backing(path: str) -> str:
    """What ``path`` maps: ``devdax`` (a DAX device), ``fsdax`` (a folder on a DAX mount), ``host`` (a folder on
    host RAM: tmpfs, ramfs, hugetlbfs); raises UnusableDirectory for anything else, saying what to give."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise UnusableDirectory(f"{path}: {e.strerror}") from None
    if stat.S_ISCHR(st.st_mode):
        subsystem = _char_subsystem(st)
        if subsystem != "dax":
            raise UnusableDirectory(
                f"{path}: a character device that is not a DAX device (subsystem {subsystem or '?'})"
            )
        return "devdax"
    if not stat.S_ISDIR(st.st_mode):
        raise UnusableDirectory(f"{path}: give a DAX device (/dev/daxN.M) or a folder on a memory-backed filesystem")
    point, fstype, options = mount_of(path)
    kind = _memory_mount(fstype, options)
    if kind is not None:
        return kind
    raise UnusableDirectory(
        f"{path}: on {fstype or 'an unknown filesystem'} ({point}), which is not memory: mapped there, the tier "
        "would be the page cache in front of a disk. Give a DAX device (/dev/daxN.M), a folder on a DAX mount "
        "(-o dax), or a tmpfs (/dev/shm, or one bound to the CXL node: mount -t tmpfs -o mpol=bind:N)"
    )


def host_bytes(path: str | None, nbytes: int) -> int:
    """The host RAM a tier of ``nbytes`` at ``path`` takes: all of it on a tmpfs, none on DAX memory (0 when the path
    is not usable: the tier's own start says why)."""
    try:
        return nbytes if path and backing(path) == "host" else 0
    except UnusableDirectory:
        return 0


def _device_bytes(st: os.stat_result) -> int:
    """A character device's size from sysfs (a DAX device's region), or 0 when unknown."""
    try:
        return int(Path(f"/sys/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}/size").read_text())
    except (OSError, ValueError):
        return 0


class CxlTier(MemoryTier):
    """KV entries in fixed pages of a DAX device's or a memory-backed file's mapping."""

    def __init__(self, capacity_bytes: int, path: str, name: str = "cxl", page_bytes: int = DEFAULT_PAGE_BYTES):
        self.path = path
        self.backing = backing(path)
        self._fd = -1
        super().__init__(capacity_bytes, name, page_bytes, host_floor_bytes=0)

    def _map(self, nbytes: int) -> mmap.mmap:
        flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
        if self.backing == "devdax":
            checked = os.stat(self.path)
            try:
                self._fd = os.open(self.path, flags)
            except OSError as e:
                raise UnusableDirectory(f"{self.path}: {e.strerror}") from None
            opened = os.fstat(self._fd)
            if not stat.S_ISCHR(opened.st_mode) or opened.st_rdev != checked.st_rdev:
                self._close_fd()
                raise UnusableDirectory(f"{self.path}: changed between its check and its opening")
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._close_fd()
                raise UnusableDirectory(f"{self.path}: in use by another process (one tier per DAX device)") from None
            size = _device_bytes(os.fstat(self._fd))
            if size and nbytes > size:
                self._close_fd()
                raise StorageError(f"{self.path}: {nbytes / 2**30:.2f} GiB asked, the device has {size / 2**30:.2f}")
            return self._mapped(nbytes)
        if self.backing == "host":
            self._check_host(nbytes)
        fd, name = tempfile.mkstemp(prefix="kvtier-cxl-", dir=self.path)  # 0600, O_EXCL: never through a link
        os.unlink(name)
        self._fd = fd
        dev = os.fstat(fd).st_dev  # the file's own filesystem, not the path's as read before: it must be memory
        mount = next((m for m in _mounts() if m[3] == f"{os.major(dev)}:{os.minor(dev)}"), None)
        if mount is None or _memory_mount(mount[1], mount[2]) is None:
            self._close_fd()
            raise UnusableDirectory(f"{self.path}: its file landed on {mount[1] if mount else 'an unknown'} filesystem")
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            self._close_fd()
            raise StorageError(f"{self.path}: cannot claim {nbytes / 2**30:.2f} GiB: {e.strerror}") from None
        return self._mapped(nbytes)

    def _mapped(self, nbytes: int) -> mmap.mmap:
        try:
            arena = mmap.mmap(self._fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            self._close_fd()
            raise StorageError(f"{self.path}: cannot map {nbytes / 2**30:.2f} GiB: {e.strerror}") from None
        if nbytes >= HUGE_PAGE:
            advise_huge_pages(arena)
        return arena

    def _check_host(self, nbytes: int) -> None:
        avail, floor = mem_available_bytes(), default_floor()
        if avail and avail - nbytes < floor:
            raise StorageError(
                f"{self.path}: a {nbytes / 2**30:.2f} GiB tier on host RAM would leave {(avail - nbytes) / 2**30:.2f}"
                f" GiB of the {avail / 2**30:.2f} GiB available; the host keeps {floor / 2**30:.2f} GiB"
            )

    def _host_short(self, fresh_bytes: int) -> int | None:
        return None  # the arena was claimed whole at start: taking its pages takes nothing more from the host

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def close(self) -> None:
        super().close()
        self._close_fd()


__all__ = ["CxlTier", "backing", "host_bytes", "mount_of"]
