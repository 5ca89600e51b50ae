"""What the drives under a folder are, from sysfs (no root, no nvme-cli needed): model, vendor, firmware,
rotational, size, the NVMe transport and the PCIe link (speed x width) where readable, and the link's
theoretical bandwidth. A field sysfs does not have is null. An MLPerf submission records these beside its
figures (kvtier mlperf run's ``system``)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from kvtier.telemetry.diskstats import devices_under

PCIE_GT_PER_S_ENCODING = {2.5: 0.8, 5.0: 0.8, 8.0: 128 / 130, 16.0: 128 / 130, 32.0: 128 / 130, 64.0: 242 / 256}
"""Raw GT/s per lane -> payload share after line encoding (8b/10b up to Gen 2, 128b/130b Gen 3-5, FLIT Gen 6)."""


def _read(p: Path) -> str | None:
    try:
        text = p.read_text().strip()
    except OSError:
        return None
    return text or None


def link_bandwidth_bytes_per_s(speed: str | None, width: str | None) -> float | None:
    """A PCIe link's theoretical payload bandwidth, one direction: ``"16.0 GT/s PCIe"`` x ``"4"`` -> 7.88e9."""
    if not speed or not width:
        return None
    m = re.match(r"\s*([0-9.]+)\s*GT/s", speed)
    if m is None or not width.strip().isdigit():
        return None
    gt = float(m.group(1))
    share = PCIE_GT_PER_S_ENCODING.get(gt)
    return None if share is None else gt * 1e9 * share / 8 * int(width)


def drive_facts(name: str, sysfs: Path = Path("/sys")) -> dict[str, Any]:
    """One whole-disk device's facts (``name`` as in /sys/block)."""
    block = sysfs / "block" / name
    dev = block / "device"
    out: dict[str, Any] = {
        "device": name,
        "model": _read(dev / "model"),
        "vendor": _read(dev / "vendor"),
        "firmware": _read(dev / "firmware_rev") or _read(dev / "rev"),
        "rotational": _read(block / "queue" / "rotational") == "1" if _read(block / "queue" / "rotational") else None,
        "size_bytes": int(s) * 512 if (s := _read(block / "size")) and s.isdigit() else None,
        "transport": None,
        "link_speed": None,
        "link_width": None,
        "link_bandwidth_bytes_per_s": None,
    }
    m = re.match(r"(nvme\d+)", name)
    if m is not None:  # an NVMe namespace: the controller holds model, firmware, transport and the PCIe link
        ctrl = sysfs / "class" / "nvme" / m.group(1)
        out["model"] = out["model"] or _read(ctrl / "model")
        out["firmware"] = out["firmware"] or _read(ctrl / "firmware_rev")
        out["transport"] = _read(ctrl / "transport")
        pci = ctrl / "device"
        out["link_speed"] = _read(pci / "current_link_speed")
        out["link_width"] = _read(pci / "current_link_width")
        out["link_bandwidth_bytes_per_s"] = link_bandwidth_bytes_per_s(out["link_speed"], out["link_width"])
    return out


def drives_under(path: str | os.PathLike[str], sysfs: Path = Path("/sys")) -> dict[str, Any]:
    """``{resolution, drives[]}`` for the folder ``path`` (partitions, LVM and md resolved to their disks)."""
    names, how = devices_under(path, sysfs)
    return {"resolution": how, "drives": [drive_facts(n, sysfs) for n in names]}


__all__ = ["drive_facts", "drives_under", "link_bandwidth_bytes_per_s"]
