"""#54 item 2: the CXL / DAX memory tier (engine/cxl.py) on a file in /dev/shm, its refusals, and its place in every
command that builds tiers: kvtier bench's waterfall, the sim's offload tier and kvtier's vLLM spec."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from kvtier.config.bench import BenchConfig
from kvtier.config.sim import OffloadTierConfig
from kvtier.engine import cxl
from kvtier.engine.cxl import CxlTier, backing, mount_of
from kvtier.errors import ConfigError, StorageError, UnusableDirectory
from kvtier.keys import KeyScope
from kvtier.sim.model import Offload, OffloadConfig
from kvtier.tiers import KINDS, OFFLOAD_KINDS, Ask, TierSpec, offload_plan, open_tier
from kvtier.vllm.settings import VllmOffloadSettings

SHM = "/dev/shm"
pytestmark = pytest.mark.skipif(
    not os.path.isdir(SHM) or backing(SHM) != "host", reason="no tmpfs at /dev/shm to stand in for CXL memory"
)
MiB = 2**20


def ours() -> list[str]:
    return [n for n in os.listdir(SHM) if n.startswith("kvtier-cxl-")]


def test_entries_round_trip_through_pages_of_a_mapped_file_that_no_one_else_can_see():
    before = ours()
    tier = CxlTier(64 * MiB, SHM, page_bytes=MiB)
    try:
        assert (tier.backing, tier.page_bytes, tier.capacity_bytes) == ("host", MiB, 64 * MiB)
        assert ours() == before  # created 0600 and unlinked at once: a killed run leaves nothing in the folder
        data = np.random.default_rng(1).integers(0, 256, 3 * MiB + 100, dtype=np.uint8)
        tier.write("k", [memoryview(data)], len(data))
        assert tier.stored_bytes() == 4 * MiB  # whole pages
        out = bytearray(4 * MiB)
        tier.read("k", memoryview(out))
        assert bytes(out[: len(data)]) == data.tobytes()
        # the arena is the file's: a second mapping of the same descriptor sees the bytes written through the tier
        assert os.pread(tier._fd, 100, 0) == data[:100].tobytes()
    finally:
        tier.close()
    assert tier._fd == -1


def test_the_arena_is_claimed_whole_at_start_so_the_tier_never_stops_growing():
    tier = CxlTier(32 * MiB, SHM, page_bytes=MiB)
    try:
        assert os.fstat(tier._fd).st_blocks * 512 >= 32 * MiB  # posix_fallocate: no SIGBUS on a full tmpfs later
        assert tier._host_short(32 * MiB) is None
    finally:
        tier.close()


def test_a_tier_on_host_ram_that_would_leave_the_host_short_is_refused_with_the_figures(monkeypatch):
    monkeypatch.setattr(cxl, "mem_available_bytes", lambda: 3 * 2**30)
    monkeypatch.setattr(cxl, "default_floor", lambda: 2 * 2**30)  # a 24 GiB host's
    with pytest.raises(StorageError, match=r"would leave 1\.00 GiB of the 3\.00 GiB available; the host keeps 2\.00"):
        CxlTier(2 * 2**30, SHM)
    with pytest.raises(ConfigError, match="^--cxl-path: /dev/shm: a 2.00 GiB tier on host RAM"):
        open_tier("cxl", TierSpec(2 * 2**30, directory=SHM))


def test_a_folder_on_a_disk_filesystem_a_plain_file_and_a_missing_path_are_refused_naming_what_to_give(tmp_path):
    if mount_of(str(tmp_path))[1] in cxl.MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is itself on memory here")
    with pytest.raises(UnusableDirectory, match="not memory: mapped there, the tier would be the page cache"):
        backing(str(tmp_path))
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(UnusableDirectory, match="give a DAX device"):
        backing(str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="--cxl-path: .*missing: No such file"):
        open_tier("cxl", TierSpec(MiB, directory=str(tmp_path / "missing")))


def test_a_character_device_that_is_not_dax_is_refused():
    """/dev/zero (or /dev/mem, /dev/tty) is no DAX device: refused by its sysfs subsystem, not mapped."""
    with pytest.raises(UnusableDirectory, match="/dev/zero: a character device that is not a DAX device .subsystem"):
        CxlTier(8 * MiB, "/dev/zero", page_bytes=MiB)


def test_a_dax_device_is_mapped_shared_and_locked_to_one_tier(monkeypatch):
    """No device-DAX node exists here: /dev/zero stands in, its sysfs subsystem read as dax (the one mock), to check
    the mapping is shared and held with an exclusive lock, so a second tier (another rank, another run) on the same
    device is refused, not interleaved."""
    monkeypatch.setattr(cxl, "_char_subsystem", lambda st: "dax")
    first = CxlTier(8 * MiB, "/dev/zero", page_bytes=MiB)
    try:
        assert first.backing == "devdax"
        with pytest.raises(UnusableDirectory, match="in use by another process"):
            CxlTier(8 * MiB, "/dev/zero", page_bytes=MiB)
        data = bytes(range(256)) * 4096
        first.write("k", [memoryview(data)], len(data))
        out = bytearray(MiB)
        first.read("k", memoryview(out))
        assert bytes(out) == data
    finally:
        first.close()
    CxlTier(8 * MiB, "/dev/zero", page_bytes=MiB).close()  # the lock went with the first tier


def test_a_folder_whose_name_hides_a_disk_mount_is_refused_by_the_files_own_filesystem(tmp_path, monkeypatch):
    """The folder's filesystem is checked again on the file the tier created (its st_dev against mountinfo), so a
    misread mount table (an escaped name) or a folder swapped after the check cannot put the tier on a disk."""
    if mount_of(str(tmp_path))[1] in cxl.MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is itself on memory here")
    monkeypatch.setattr(cxl, "backing", lambda path: "host")  # as if the path check had been fooled
    with pytest.raises(UnusableDirectory, match="its file landed on"):
        CxlTier(MiB * 16, str(tmp_path), page_bytes=MiB)
    assert not list(tmp_path.iterdir())


def test_kvtier_bench_puts_the_cxl_tier_behind_cpu_ram_and_counts_its_host_ram():
    cfg = BenchConfig(cxl_path=SHM, cxl_mem_gb=1, cpu_mem_gb=2, gpu_mem_gb=0)
    assert cfg.configured_tiers() == ["cpu", "cxl", "storage"]
    spec = KINDS["cxl"].spec(cfg, Ask(page_bytes=MiB))
    assert (spec.capacity_bytes, spec.directory, spec.page_bytes) == (2**30, SHM, MiB)
    assert KINDS["cxl"].host_bytes(spec) == 2**30  # on a tmpfs it is the host's RAM; on a DAX device it is not
    assert KINDS["cxl"].host_bytes(TierSpec(2**30, directory="/nonexistent")) == 0
    assert KINDS["cxl"].trace_label == "Tier-5"
    with pytest.raises(ValueError, match="--cxl-path and --cxl-mem-gb > 0 go together"):
        BenchConfig(cxl_path=SHM)


def test_the_sims_offload_tier_and_kvtiers_vllm_spec_take_it_alone():
    assert "cxl" in OFFLOAD_KINDS
    flags = OffloadTierConfig(cxl_path=SHM, cxl_mem_gb=0.0625)
    ((kind, spec, where),) = offload_plan("cxl", flags, Ask(page_bytes=MiB, share=2))
    assert (kind, spec.capacity_bytes, where) == ("cxl", 32 * MiB, "--offload cxl")
    with pytest.raises(ConfigError, match="--offload cxl: give --cxl-path and --cxl-mem-gb"):
        offload_plan("cxl", OffloadTierConfig(), Ask())
    o = Offload(OffloadConfig("cxl", tier=flags), KeyScope("tiny"), kv_bytes_per_token=1024, seed=1)
    try:
        keys = o.chunk_keys(list(range(256 * 2)))
        o.save(keys)
        assert o.lookup(keys) == 2 and o.load(keys)[2] == 2
        assert o.store.tier_names == ["cxl"] and o.usage()["cpu_used_bytes"] == 2 * 256 * 1024  # L1 is the CXL tier
    finally:
        o.close()
    settings = VllmOffloadSettings.from_extra({"offload": "cxl", "cxl_path": SHM, "cxl_mem_gb": 0.0625})
    assert settings.slots(block_bytes=MiB, world_size=2) == [("cxl", 32, "host")]  # vLLM counts its hits as host


def test_a_trace_of_a_run_with_a_cxl_tier_replays_its_rows_on_the_cpu_tier():
    from kvtier.iotrace.replay import TIER_OF

    assert TIER_OF[5] == "cpu" and TIER_OF[1] == "cpu" and TIER_OF[2] == "storage" and 3 not in TIER_OF


def test_the_cxl_kind_is_named_only_by_its_row_its_flags_and_its_engine():
    """The new kind took three source files: engine/cxl.py, its row in kvtier/tiers.py, its flags in
    config/tiers.py. Nothing else in src/ spells it."""
    src = Path(cxl.__file__).parents[1]
    found = [str(f.relative_to(src)) for f in src.rglob("*.py") if '"cxl"' in f.read_text() or "'cxl'" in f.read_text()]
    assert sorted(found) == ["engine/cxl.py", "tiers.py"]
    flags = [str(f.relative_to(src)) for f in src.rglob("*.py") if "cxl_path" in f.read_text()]
    assert sorted(flags) == ["config/tiers.py", "tiers.py"]
