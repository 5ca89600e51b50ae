"""/proc/diskstats parsing and device resolution on fixtures: real line layouts (14, 18 and 20 fields;
sd, nvme, dm, md names) and a sysfs tree with a partition, an LVM volume over two partitions and an md
RAID over two disks; and one real run on this machine's disk."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.telemetry.diskstats import Counters, cpu_times, delta, devices_under, parse_diskstats, whole_devices

# the layouts of kernels < 4.18 (14 fields), 4.18+ (18: discards) and 5.5+ (20: flushes)
DISKSTATS = """\
   8       0 sda 1000 10 80000 500 2000 20 160000 900 0 1200 1400
   8       1 sda1 900 10 70000 450 1900 20 150000 850 0 1100 1300 0 0 0 0
 259       0 nvme0n1 5000 0 4000000 2500 6000 3 8000000 4000 2 3000 6600 10 0 80 1 7 9
 259       1 nvme0n1p1 10 0 80 1 0 0 0 0 0 1 1 0 0 0 0 0 0
 253       0 dm-0 800 0 64000 400 1800 0 144000 800 0 1000 1200 0 0 0 0
   9       0 md0 3000 0 2400000 0 4000 0 5600000 0 0 0 0 0 0 0 0
   7       0 loop0 1 0 2 0 0 0 0 0 0 0 0 0 0 0 0 0 0
bad line
"""


def test_parse_every_kernel_layout():
    s = parse_diskstats(DISKSTATS)
    assert set(s) == {"sda", "sda1", "nvme0n1", "nvme0n1p1", "dm-0", "md0", "loop0"}
    assert s["sda"] == Counters(1000, 10, 80000, 500, 2000, 20, 160000, 900, 0, 1200, 1400)
    assert s["nvme0n1"].in_flight == 2 and s["nvme0n1"].time_in_queue == 6600


def test_delta_gives_bytes_await_utilization_and_queue_depth():
    a = Counters(100, 0, 1000, 50, 200, 2, 4000, 300, 0, 100, 1000)
    b = Counters(300, 5, 9000, 250, 300, 6, 12000, 600, 3, 900, 5000)
    d = delta(a, b, 1.0)
    assert d["read_bytes"] == 8000 * 512 and d["write_bytes"] == 8000 * 512
    assert (d["read_ios"], d["write_ios"], d["read_merged"], d["write_merged"]) == (200, 100, 5, 4)
    assert d["read_await_ms"] == 1.0 and d["write_await_ms"] == 3.0
    assert d["utilization"] == 0.8 and d["avg_queue_depth"] == 4.0
    idle = delta(a, a, 1.0)
    assert idle["read_await_ms"] is None and idle["utilization"] == 0.0


def test_cpu_times_counts_idle_and_iowait_as_not_busy():
    busy, total = cpu_times("cpu  100 0 50 800 50 0 0 0 0 0\ncpu0 1 2 3 4\n")
    assert (busy, total) == (150, 1000)


def sysfs_tree(root: Path) -> Path:
    """/sys/class/block and /sys/dev/block as the kernel lays them out (links into /sys/devices)."""
    dev = root / "devices"
    disks = {
        "sda": dev / "pci0" / "ata1" / "block" / "sda",
        "nvme0n1": dev / "pci1" / "nvme" / "nvme0" / "nvme0n1",
        "nvme1n1": dev / "pci2" / "nvme" / "nvme1" / "nvme1n1",
        "dm-0": dev / "virtual" / "block" / "dm-0",
        "md0": dev / "virtual" / "block" / "md0",
    }
    parts = {"sda1": disks["sda"] / "sda1", "sda2": disks["sda"] / "sda2", "nvme0n1p1": disks["nvme0n1"] / "nvme0n1p1"}
    for p in [*disks.values(), *parts.values()]:
        p.mkdir(parents=True)
    for p in parts.values():
        (p / "partition").write_text("1\n")
    (disks["dm-0"] / "slaves").mkdir()
    for s in ("sda2", "nvme0n1p1"):  # an LVM volume over two partitions of two disks
        (disks["dm-0"] / "slaves" / s).symlink_to(parts[s])
    (disks["md0"] / "slaves").mkdir()
    for s in ("nvme0n1", "nvme1n1"):  # RAID over two whole disks
        (disks["md0"] / "slaves" / s).symlink_to(disks[s])
    (root / "class" / "block").mkdir(parents=True)
    for name, p in {**disks, **parts}.items():
        (root / "class" / "block" / name).symlink_to(p)
    (root / "dev" / "block").mkdir(parents=True)
    for num, name in (("8:1", "sda1"), ("253:0", "dm-0"), ("9:0", "md0"), ("259:0", "nvme0n1")):
        (root / "dev" / "block" / num).symlink_to({**disks, **parts}[name])
    return root


def test_partitions_lvm_and_md_resolve_to_their_disks(tmp_path: Path):
    sysfs = sysfs_tree(tmp_path / "sys")
    assert whole_devices("sda1", sysfs) == ["sda"]
    assert whole_devices("nvme0n1", sysfs) == ["nvme0n1"]
    assert whole_devices("dm-0", sysfs) == ["nvme0n1", "sda"]
    assert whole_devices("md0", sysfs) == ["nvme0n1", "nvme1n1"]


def test_a_path_on_a_filesystem_without_a_block_device_resolves_to_none(tmp_path: Path):
    found, how = devices_under("/proc", tmp_path)
    assert found == [] and "without a block device" in how
    assert devices_under(tmp_path / "missing")[0] == [] and "cannot stat" in devices_under(tmp_path / "missing")[1]


def test_a_real_run_sees_at_least_its_own_bytes_on_the_device(tmp_path: Path):
    """The device under the cache dir wrote at least the bytes our O_DIRECT writes put there."""
    devices, how = devices_under(tmp_path)
    if not devices:
        pytest.skip(f"no block device under {tmp_path}: {how}")
    from kvtier.bench import run
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning
    from tests.conftest import TINY_TEMPLATES

    cache = tmp_path / "cache"
    cache.mkdir()
    r = run(
        BenchConfig(
            model="tiny-1b",
            num_users=2,
            duration=2,
            gpu_mem_gb=0,
            cpu_mem_gb=0,
            max_concurrent_allocs=2,
            generation_mode="none",
            cache_dir=str(cache),
            progress="none",
            noise_mb=64,
            io_chunk_mb=8,
            device_interval=0.5,
            # small entries (<= 12 MB): many writes complete in 2 s even on a loaded disk (the default
            # templates' 600 MB entries could all still be in flight at the end, and be cancelled)
            tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
        )
    )
    assert r.tiers["storage"].write.ops > 0, "no storage write completed: nothing to see on the device"
    d = r.device
    assert d is not None and d.devices == devices and d.totals is not None and d.ours is not None
    if r.storage.direct_io:
        assert d.totals["write_bytes"] >= d.ours["storage_write_bytes_on_disk"] > 0
    assert len(d.timeline) >= 2 and all(set(row["devices"]) == set(devices) for row in d.timeline)
    assert sum(row["kvtier_storage_write_bytes"] for row in d.timeline) > 0
    assert d.sampler_cpu_fraction is not None and d.sampler_cpu_fraction < 0.01
    assert os.listdir(cache) == []


def test_drive_facts_from_a_sysfs_tree(tmp_path):
    """An NVMe namespace's model, firmware, transport and PCIe link (from its controller), and the link's
    theoretical bandwidth; a field sysfs lacks is null."""
    from kvtier.telemetry.drives import drive_facts, link_bandwidth_bytes_per_s

    blk = tmp_path / "block" / "nvme0n1"
    (blk / "queue").mkdir(parents=True)
    (blk / "queue" / "rotational").write_text("0\n")
    (blk / "size").write_text("7814037168\n")
    ctrl = tmp_path / "class" / "nvme" / "nvme0"
    (ctrl / "device").mkdir(parents=True)
    (ctrl / "model").write_text("Samsung SSD 990 PRO 4TB\n")
    (ctrl / "firmware_rev").write_text("4B2QJXD7\n")
    (ctrl / "transport").write_text("pcie\n")
    (ctrl / "device" / "current_link_speed").write_text("16.0 GT/s PCIe\n")
    (ctrl / "device" / "current_link_width").write_text("4\n")
    d = drive_facts("nvme0n1", tmp_path)
    assert (d["model"], d["firmware"], d["transport"], d["rotational"]) == ("Samsung SSD 990 PRO 4TB", "4B2QJXD7",
                                                                             "pcie", False)  # fmt: skip
    assert d["size_bytes"] == 7814037168 * 512 and d["link_width"] == "4"
    assert d["link_bandwidth_bytes_per_s"] == pytest.approx(16e9 * 128 / 130 / 8 * 4)
    assert link_bandwidth_bytes_per_s("8.0 GT/s PCIe", "x4") is None and link_bandwidth_bytes_per_s(None, "4") is None
    assert drive_facts("sdz", tmp_path)["model"] is None
