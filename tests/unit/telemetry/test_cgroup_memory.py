"""#58 item 6: the memory a run may take is the smaller of the host's MemAvailable and what its memory cgroup (a
container's limit) leaves it (kvtier/telemetry/host.py). Before, a bench with a 4 GB CPU tier in a 1.5 GiB cgroup saw
the host's 20+ GiB, grew its tier and was OOM-killed with no result."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.telemetry.host import _cgroup_dirs, cgroup_room_bytes

GiB = 1 << 30


def _v2_tree(tmp_path: Path) -> Path:
    """A process in cgroup2 /a/b, the hierarchy mounted at tmp_path/sys: b limited to 3 GiB, a (above) to 2 GiB."""
    proc, sys_ = tmp_path / "proc", tmp_path / "sys"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/a/b\n")
    (proc / "mountinfo").write_text(f"30 25 0:26 / {sys_} rw,nosuid - cgroup2 cgroup2 rw\n")
    for d, limit, used, inactive in ((sys_ / "a", 2 * GiB, GiB, GiB // 4), (sys_ / "a" / "b", 3 * GiB, GiB, 0)):
        d.mkdir(parents=True)
        (d / "memory.max").write_text(f"{limit}\n")
        (d / "memory.current").write_text(f"{used}\n")
        (d / "memory.stat").write_text(f"anon 1\ninactive_file {inactive}\nactive_file 2\n")
    (sys_ / "memory.max").write_text("max\n")  # the root: no limit
    (sys_ / "memory.current").write_text("1\n")
    return proc


def test_the_tightest_cgroup_on_the_path_sets_the_room_and_reclaimable_cache_counts_as_room(tmp_path: Path):
    proc = _v2_tree(tmp_path)
    assert cgroup_room_bytes(str(proc)) == 2 * GiB - (GiB - GiB // 4)  # a's: 1.25 GiB, not b's 2 GiB
    (tmp_path / "sys" / "a" / "memory.max").write_text("max\n")
    assert cgroup_room_bytes(str(proc)) == 2 * GiB  # b's, once a is unlimited


def test_no_limit_and_no_cgroup_mean_none(tmp_path: Path):
    proc = _v2_tree(tmp_path)
    for d in (tmp_path / "sys" / "a", tmp_path / "sys" / "a" / "b"):
        (d / "memory.max").write_text("max\n")
    assert cgroup_room_bytes(str(proc)) is None
    assert cgroup_room_bytes(str(tmp_path / "nowhere")) is None


def _memory_cgroup_dir() -> tuple[Path, bool] | None:
    """This process's own memory cgroup folder (the first that host.py finds) and whether it is cgroup2, where it
    can be written (root)."""
    dirs = _cgroup_dirs("/proc/self")
    if not dirs or not os.access(dirs[0][0], os.W_OK):
        return None
    return dirs[0]


def test_a_process_in_a_real_child_cgroup_sees_its_limit_not_the_hosts(tmp_path: Path):
    where = _memory_cgroup_dir() if os.geteuid() == 0 else None
    if where is None:
        pytest.skip("needs root and a writable memory cgroup (v1 or v2) to make a child one")
    parent, v2 = where
    child = parent / f"kvtier-test-{os.getpid()}"
    try:
        child.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a child memory cgroup here: {e}")
    try:
        (child / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(3 * GiB // 2))
        code = (
            "from kvtier.telemetry.host import mem_available_bytes; from kvtier.engine.memory import MemoryTier\n"
            "print(mem_available_bytes())\n"
            "t = MemoryTier(1 << 30, page_bytes=32 << 20)  # a CPU tier grows in the container (the host's 2 GiB "
            "floor left it none)\n"
            "t.write('k', [memoryview(bytearray(256 << 20))], 256 << 20); print(t.stored_bytes()); t.close()\n"
        )

        def join() -> None:
            (child / "cgroup.procs").write_text(str(os.getpid()))

        out = subprocess.run([sys.executable, "-c", code], preexec_fn=join, capture_output=True, text=True, check=True)
        avail, stored = (int(x) for x in out.stdout.split())
        assert 0 < avail <= 3 * GiB // 2, avail  # the cgroup's room, not the host's MemAvailable
        assert stored == 256 << 20
    finally:
        child.rmdir()


def test_the_tightest_limit_is_the_containers_memory_and_its_floor_is_of_it(tmp_path: Path, monkeypatch):
    """#58 item 6, the floor: the host's 2 GiB (or 5 % of its RAM) kept in a 1.5 GiB container left a CPU tier no room
    at all; inside a limit the floor is 5 % of it, at least 256 MiB."""
    from kvtier.engine import memory
    from kvtier.telemetry import host
    from kvtier.telemetry.host import cgroup_limit_bytes

    proc = _v2_tree(tmp_path)
    assert cgroup_limit_bytes(str(proc)) == 2 * GiB  # a's, above b's 3 GiB
    for d in (tmp_path / "sys" / "a", tmp_path / "sys" / "a" / "b"):
        (d / "memory.max").write_text("max\n")
    assert cgroup_limit_bytes(str(proc)) is None
    monkeypatch.setattr(host, "mem_total_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(host, "_meminfo_bytes", lambda key: 20 * GiB)  # the host's MemAvailable
    monkeypatch.setattr(host, "cgroup_limit_bytes", lambda: 3 * GiB // 2)
    monkeypatch.setattr(host, "cgroup_room_bytes", lambda: GiB)
    assert host.mem_limit_bytes() == (3 * GiB // 2, True)
    monkeypatch.setattr(memory, "mem_limit_bytes", host.mem_limit_bytes)
    assert memory.default_floor() == 256 << 20
    monkeypatch.setattr(host, "cgroup_limit_bytes", lambda: 64 * GiB)  # a limit above the host's RAM: the host's
    assert host.mem_limit_bytes() == (24 * GiB, False) and memory.default_floor() == 2 * GiB
    # a limit just under the host's RAM, its room more than the host has available: the host's memory binds, and
    # its floor is kept (5 % of 23 GiB would keep 1.15 GiB of a 24 GiB host)
    monkeypatch.setattr(host, "cgroup_limit_bytes", lambda: 23 * GiB)
    monkeypatch.setattr(host, "cgroup_room_bytes", lambda: 22 * GiB)
    assert host.mem_limit_bytes() == (24 * GiB, False) and memory.default_floor() == 2 * GiB
