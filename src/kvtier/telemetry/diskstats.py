"""What the block device did: the physical devices under a directory and their ``/proc/diskstats``
counters over a run, per interval and in total, beside the host CPU's busy share from ``/proc/stat``.

Resolution: the directory's ``st_dev`` (major:minor) names a block device in ``/sys/dev/block``; a
partition is replaced by its whole disk; a device-mapper (LVM, dm-crypt) or md (RAID) device by the
devices under it (``slaves/``), recursively. A directory on a filesystem without a block device (tmpfs,
overlay on no disk) resolves to none, and the result says so.

Counters (kernel Documentation/admin-guide/iostats.rst), per device: reads and writes completed, merged,
sectors (512 bytes each, whatever the device's sector size), milliseconds spent reading / writing,
milliseconds the device was busy (``io_ticks``) and the weighted milliseconds of all I/O in flight
(``time_in_queue``). From two samples: bytes, I/Os and merges per direction; average await per
direction (ms per completed I/O); utilisation (busy ms / elapsed ms); average queue depth (weighted ms /
elapsed ms). Every function takes the file texts or a sysfs root, so tests feed it fixtures.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SECTOR = 512
FIELDS = (
    "reads",
    "reads_merged",
    "sectors_read",
    "ms_reading",
    "writes",
    "writes_merged",
    "sectors_written",
    "ms_writing",
    "in_flight",
    "io_ticks",
    "time_in_queue",
)


@dataclass(frozen=True)
class Counters:
    reads: int
    reads_merged: int
    sectors_read: int
    ms_reading: int
    writes: int
    writes_merged: int
    sectors_written: int
    ms_writing: int
    in_flight: int
    io_ticks: int
    time_in_queue: int


def parse_diskstats(text: str) -> dict[str, Counters]:
    """``/proc/diskstats`` by device name (lines of 14, 18 or 20 fields; discard and flush fields ignored)."""
    out: dict[str, Counters] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 14:
            continue
        try:
            values = [int(x) for x in parts[3:14]]
        except ValueError:
            continue
        out[parts[2]] = Counters(*values)
    return out


def _name_of(sysfs: Path, major: int, minor: int) -> str | None:
    link = sysfs / "dev" / "block" / f"{major}:{minor}"
    try:
        return Path(os.path.realpath(link)).name if link.exists() else None
    except OSError:
        return None


def whole_devices(name: str, sysfs: Path = Path("/sys"), depth: int = 0) -> list[str]:
    """The physical (whole-disk) devices under block device ``name``."""
    base = sysfs / "class" / "block" / name
    if depth > 8 or not base.exists():
        return [name] if depth == 0 and not base.exists() else []
    slaves = sorted(p.name for p in (base / "slaves").iterdir()) if (base / "slaves").is_dir() else []
    if slaves:  # dm / md: what it is built on
        return sorted({d for s in slaves for d in whole_devices(s, sysfs, depth + 1)})
    if (base / "partition").exists():  # a partition: its disk is the parent folder in sysfs
        parent = Path(os.path.realpath(base)).parent.name
        return whole_devices(parent, sysfs, depth + 1)
    return [name]


def devices_under(path: str | os.PathLike[str], sysfs: Path = Path("/sys")) -> tuple[list[str], str]:
    """(physical devices holding ``path``, how they were found)."""
    try:
        st = os.stat(path)
    except OSError as e:
        return [], f"cannot stat {path}: {e.strerror}"
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    if major == 0:
        return [], f"{path} is on a filesystem without a block device ({major}:{minor})"
    name = _name_of(sysfs, major, minor)
    if name is None:
        return [], f"no block device {major}:{minor} in {sysfs}/dev/block"
    found = whole_devices(name, sysfs)
    return found, f"{path} -> {name} ({major}:{minor})" + (f" -> {', '.join(found)}" if found != [name] else "")


def cpu_times(text: str) -> tuple[int, int]:
    """(busy, total) jiffies from the ``cpu`` line of ``/proc/stat`` (idle + iowait are not busy)."""
    for line in text.splitlines():
        if line.startswith("cpu "):
            v = [int(x) for x in line.split()[1:]]
            idle = v[3] + (v[4] if len(v) > 4 else 0)
            total = sum(v[:8]) if len(v) >= 8 else sum(v)
            return total - idle, total
    return 0, 0


def delta(a: Counters, b: Counters, elapsed_s: float) -> dict[str, float | int | None]:
    """One device's activity between two samples."""
    d = {f: getattr(b, f) - getattr(a, f) for f in FIELDS if f != "in_flight"}
    ms = max(elapsed_s * 1000.0, 1e-9)
    return {
        "read_bytes": d["sectors_read"] * SECTOR,
        "write_bytes": d["sectors_written"] * SECTOR,
        "read_ios": d["reads"],
        "write_ios": d["writes"],
        "read_merged": d["reads_merged"],
        "write_merged": d["writes_merged"],
        "read_await_ms": round(d["ms_reading"] / d["reads"], 4) if d["reads"] else None,
        "write_await_ms": round(d["ms_writing"] / d["writes"], 4) if d["writes"] else None,
        "utilization": round(min(1.0, d["io_ticks"] / ms), 4),
        "avg_queue_depth": round(d["time_in_queue"] / ms, 4),
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


class DeviceSampler:
    """Samples the devices' counters (and the CPU) every ``interval_s`` on a thread while a run loads.

    ``extra()`` is called at each sample for kvtier's own per-interval figures (requests, bytes, tier
    fill), so the timeline puts the device and kvtier side by side."""

    def __init__(
        self,
        devices: list[str],
        interval_s: float = 1.0,
        extra: Callable[[], dict[str, Any]] | None = None,
        read: Callable[[str], str] = _read,
    ) -> None:
        self.devices = devices
        self.interval_s = interval_s
        self.extra = extra
        self._read = read
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples: list[tuple[float, dict[str, Counters], tuple[int, int], dict[str, Any]]] = []
        self.cpu_seconds = 0.0  # the sampler's own CPU time, to show it costs nothing

    def sample(self) -> None:
        t0 = time.thread_time()
        stats = parse_diskstats(self._read("/proc/diskstats"))
        mine = {d: stats[d] for d in self.devices if d in stats}
        cpu = cpu_times(self._read("/proc/stat"))
        extra = self.extra() if self.extra is not None else {}
        self.samples.append((time.monotonic(), mine, cpu, extra))
        self.cpu_seconds += time.thread_time() - t0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="kvtier-diskstats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.sample()

    def timeline(self) -> list[dict[str, Any]]:
        out = []
        for (t0, a, c0, _), (t1, b, c1, x1) in zip(self.samples, self.samples[1:], strict=False):
            el = t1 - t0
            row: dict[str, Any] = {"t_s": round(t1 - self.samples[0][0], 3), "interval_s": round(el, 3)}
            row["devices"] = {d: delta(a[d], b[d], el) for d in self.devices if d in a and d in b}
            busy, total = c1[0] - c0[0], c1[1] - c0[1]
            row["cpu_utilization"] = round(busy / total, 4) if total > 0 else None
            row.update(x1)
            out.append(row)
        return out

    def totals(self) -> dict[str, Any]:
        if len(self.samples) < 2:
            return {}
        (t0, a, c0, _), (t1, b, c1, _) = self.samples[0], self.samples[-1]
        per = {d: delta(a[d], b[d], t1 - t0) for d in self.devices if d in a and d in b}
        busy, total = c1[0] - c0[0], c1[1] - c0[1]
        return {
            "seconds": round(t1 - t0, 3),
            "devices": per,
            "read_bytes": sum(int(v["read_bytes"] or 0) for v in per.values()),
            "write_bytes": sum(int(v["write_bytes"] or 0) for v in per.values()),
            "cpu_utilization": round(busy / total, 4) if total > 0 else None,
        }


__all__ = [
    "Counters",
    "DeviceSampler",
    "parse_diskstats",
    "devices_under",
    "whole_devices",
    "cpu_times",
    "delta",
]
