"""Facts about the host and the storage under the cache directory, for the result file."""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path
from typing import Any


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field in bytes (0 if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def mem_total_bytes() -> int:
    return _meminfo_bytes("MemTotal")


def mem_available_bytes() -> int:
    """What this process may still take: the host's MemAvailable, or less where a memory cgroup (a container's
    limit) leaves less (``cgroup_room_bytes``)."""
    host = _meminfo_bytes("MemAvailable")
    room = cgroup_room_bytes()
    return host if room is None else min(host, room) if host else room


UNLIMITED = 1 << 60
"""A cgroup v1 limit at or above this is "no limit" (the kernel writes 2^63 rounded down to a page)."""


def cgroup_room_bytes(proc: str = "/proc/self") -> int | None:
    """Bytes this process's memory cgroups leave it (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``, less what is
    used and not reclaimable: usage minus inactive file pages), the tightest over the cgroup and every one above it
    that the mount shows; None where none limits memory (or cgroups cannot be read). ``proc`` is for tests. The
    folders are found once; their figures are read on every call (a CPU tier asks at most 20 times a second)."""
    rooms = [r for d, v2 in _cgroup_dirs(proc) if (r := _room(d, v2)) is not None]
    return max(0, min(rooms)) if rooms else None


def cgroup_limit_bytes(proc: str = "/proc/self") -> int | None:
    """The tightest memory limit of this process's cgroups (v2 ``memory.max``, v1 ``memory.limit_in_bytes``): the
    memory a container has in all, where the host's MemTotal is not; None where none limits it."""
    limits = [v for d, v2 in _cgroup_dirs(proc) if (v := _limit(d, v2)) is not None]
    return min(limits) if limits else None


def mem_limit_bytes() -> tuple[int, bool]:
    """(the memory this process's world has in all, whether a cgroup binds it now): the tightest cgroup limit where
    the room it leaves is less than the host's MemAvailable (a container's memory), else MemTotal (a limit just under
    the host's RAM leaves the host's memory the one that runs out, and the host's floor the one to keep)."""
    total, limit = mem_total_bytes(), cgroup_limit_bytes()
    if limit is not None and (not total or limit < total):
        room, host = cgroup_room_bytes(), _meminfo_bytes("MemAvailable")
        if room is not None and (not host or room < host):
            return limit, True
    return total, False


@functools.lru_cache(maxsize=8)
def _cgroup_dirs(proc: str) -> tuple[tuple[Path, bool], ...]:
    """(folder, cgroup2) of this process's memory cgroup and of every one above it that a mount shows."""
    try:
        lines = Path(proc, "cgroup").read_text().splitlines()
        mounts = Path(proc, "mountinfo").read_text().splitlines()
    except OSError:
        return ()
    out: list[tuple[Path, bool]] = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for mount, root in _cgroup_mounts(mounts, v2):
            rel = path[len(root) :] if path.startswith(root) else path
            d = Path(mount, rel.lstrip("/"))
            while True:
                out.append((d, v2))
                if d == Path(mount) or Path(mount) not in d.parents:
                    break
                d = d.parent
    return tuple(out)


def _cgroup_mounts(mountinfo: list[str], v2: bool) -> list[tuple[str, str]]:
    """(mount point, the cgroup root it shows) of the cgroup2 mounts, or of the v1 mounts with the memory
    controller."""
    out = []
    for line in mountinfo:
        head, sep, tail = line.partition(" - ")
        f, t = head.split(), tail.split()
        if not sep or len(f) < 5 or len(t) < 3:
            continue
        if (v2 and t[0] == "cgroup2") or (not v2 and t[0] == "cgroup" and "memory" in t[2].split(",")):
            out.append((f[4], f[3]))
    return out


def _read_int(p: Path) -> int | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(d: Path, key: str) -> int:
    try:
        for line in (d / "memory.stat").read_text().splitlines():
            name, _, v = line.partition(" ")
            if name == key and v.strip().isdigit():
                return int(v)
    except OSError:
        pass
    return 0


def _limit(d: Path, v2: bool) -> int | None:
    """A cgroup's memory limit (v2 ``memory.max``, v1 ``memory.limit_in_bytes``); None for no limit."""
    limit = _read_int(d / ("memory.max" if v2 else "memory.limit_in_bytes"))  # v2 "max": None
    return None if limit is None or limit >= UNLIMITED else limit


def _room(d: Path, v2: bool) -> int | None:
    """The limit less what is used and not reclaimable (usage minus inactive file pages); None without a limit."""
    limit = _limit(d, v2)
    used = _read_int(d / ("memory.current" if v2 else "memory.usage_in_bytes"))
    if limit is None or used is None:
        return None
    return limit - (used - _inactive_file(d, "inactive_file" if v2 else "total_inactive_file"))


def filesystem_of(path: str | os.PathLike[str]) -> dict[str, str]:
    """Mount point, device and type of the filesystem holding ``path`` (longest mount prefix)."""
    real = os.path.realpath(path)
    best = {"mount_point": "/", "device": "unknown", "fs_type": "unknown"}
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best["mount_point"]):
                best = {"mount_point": mnt, "device": dev, "fs_type": fstype}
    except OSError:
        pass
    return best


def mount_options(path: str | os.PathLike[str], mounts: str | None = None) -> list[str]:
    """The mount options of the filesystem holding ``path`` (longest mount prefix; [] if unknown)."""
    real = os.path.realpath(path)
    best, opts = "", []
    try:
        text = mounts if mounts is not None else Path("/proc/mounts").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, opts = mnt, parts[3].split(",")
    return opts


LIBRARIES = (
    "numpy",
    "pydantic",
    "aiohttp",
    "uvloop",
    "prometheus-client",
    "PyYAML",
    "rich",
    "xlsxwriter",
    "tiktoken",
    "torch",
    "matplotlib",
)
"""Distributions whose versions a result records (None: not installed)."""


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def host_basics() -> dict[str, Any]:
    """CPU, memory, kernel, Python and library versions of this host."""
    return {
        "hostname": platform.node(),
        "os": platform.platform(terse=True),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem_total_bytes(),
        "libraries": {d: _version(d) for d in LIBRARIES},
    }


def block_device_of(path: str | os.PathLike[str]) -> str | None:
    """Kernel name of the block device holding ``path`` (e.g. ``nvme0n1p2``, ``dm-0``), from its st_dev
    through /sys/dev/block; None for filesystems without one (tmpfs, overlay, network)."""
    try:
        st = os.stat(path)
        link = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
        return link.resolve(strict=True).name
    except OSError:
        return None


def describe_directory(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The directory's real path, its filesystem (mount point, type, source device) and block device."""
    fs = filesystem_of(path)
    return {
        "path": os.path.realpath(path),
        "mount_point": fs["mount_point"],
        "fs_type": fs["fs_type"],
        "device": fs["device"],
        "block_device": block_device_of(path),
    }


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """A process's I/O counters (/proc/<pid>/io; this one's by default): read_bytes/write_bytes reached
    the block layer. Empty when the process is gone or its counters are not ours to read."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            k, v = line.split(":")
            out[k.strip()] = int(v)
    except OSError:
        pass
    return out


def peak_rss_bytes() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
