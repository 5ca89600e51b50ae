"""Facts about the host and the storage under the cache directory, for the result file."""

from __future__ import annotations

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
    return _meminfo_bytes("MemAvailable")


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


def host_facts(cache_dir: str | None) -> dict[str, Any]:
    import numpy  # noqa: PLC0415

    facts: dict[str, Any] = {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "mem_total_bytes": mem_total_bytes(),
    }
    if cache_dir:
        facts["cache_filesystem"] = filesystem_of(cache_dir)
    return facts


def proc_io() -> dict[str, int]:
    """This process's I/O counters (/proc/self/io): read_bytes/write_bytes reached the block layer."""
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
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
