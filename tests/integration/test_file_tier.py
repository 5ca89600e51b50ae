"""The file tier against real filesystems: O_DIRECT on ext4, buffered on tmpfs, ENOSPC on a tiny fs."""

import os

import pytest

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up
from kvtier.engine.file import FileTier, probe_direct_io
from kvtier.engine.runs import RUN_DIR_PREFIX
from kvtier.errors import EntryNotFound, StorageError, TierFullError, UnusableDirectory
from kvtier.telemetry.clock import IOTiming


def _roundtrip(tier: FileTier, noise, n: int) -> None:
    tier.write("key/../odd:name", noise.chunks("key/../odd:name", n, 256 * 1024), n)
    path = tier.path_for("key/../odd:name")
    assert path.parent == tier.directory
    assert path.stat().st_size == ALIGN + round_up(n) == tier.stored_size(n)
    buf = aligned_buffer(128 * 1024)
    timing = IOTiming()
    data = b"".join(bytes(c) for c in tier.export("key/../odd:name", buf, timing))
    assert len(data) == round_up(n) and noise.verify("key/../odd:name", data) is None  # every block as written
    assert timing.device_ns > 0 and timing.host_ns > 0


def test_direct_io_roundtrip(cache_dir, noise):
    if not probe_direct_io(cache_dir):
        pytest.skip("this filesystem refuses O_DIRECT")
    tier = FileTier(cache_dir, 1 << 30, direct_io="on")
    assert tier.direct
    _roundtrip(tier, noise, 1_234_567)


def test_buffered_roundtrip_when_direct_off(cache_dir, noise):
    tier = FileTier(cache_dir, 1 << 30, direct_io="off")
    assert not tier.direct
    _roundtrip(tier, noise, 300_001)


def test_auto_follows_the_probe_on_tmpfs(tmpfs_dir, noise):
    # tmpfs accepts O_DIRECT since Linux 6.6 and refuses it before: either way auto must agree
    # with a real probe, and the round trip must work.
    tier = FileTier(tmpfs_dir, 1 << 20, direct_io="auto")
    assert tier.direct == tier.direct_io_supported == probe_direct_io(tmpfs_dir)
    _roundtrip(tier, noise, 5000)
    tier.close()
    assert not [p for p in os.listdir(tmpfs_dir) if p.startswith(RUN_DIR_PREFIX)]


def test_direct_on_where_unsupported_is_an_error(cache_dir, monkeypatch):
    # No filesystem here refuses O_DIRECT, so the probe's answer is the one stand-in.
    monkeypatch.setattr("kvtier.engine.file.probe_direct_io", lambda d: False)
    auto = FileTier(cache_dir, 1 << 20, direct_io="auto")
    assert not auto.direct
    auto.close()
    with pytest.raises(UnusableDirectory, match="does not support O_DIRECT"):
        FileTier(cache_dir, 1 << 20, direct_io="on")
    assert not [p for p in os.listdir(cache_dir) if p.startswith(RUN_DIR_PREFIX)]


def test_bad_header_is_detected(cache_dir, noise):
    tier = FileTier(cache_dir, 1 << 30)
    tier.write("a", noise.chunks("a", 8192, 8192), 8192)
    with open(tier.path_for("a"), "r+b") as f:
        f.write(b"NOTKVTIE")
    with pytest.raises(StorageError, match="bad header"):
        tier.read("a", aligned_buffer(8192))


def test_missing_entry_and_dirs(cache_dir, tmp_path):
    tier = FileTier(cache_dir, 1 << 20)
    with pytest.raises(EntryNotFound):
        tier.read("nope", aligned_buffer(4096))
    with pytest.raises(UnusableDirectory, match="does not exist"):
        FileTier(tmp_path / "missing")
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UnusableDirectory, match="not a directory"):
        FileTier(f)


def test_close_removes_only_our_files(cache_dir, noise):
    foreign = cache_dir / "precious.npy"
    foreign.write_bytes(b"not ours")
    tier = FileTier(cache_dir, 1 << 30)
    tier.write("a", noise.chunks("a", 4096, 4096), 4096)
    (tier.directory / "someone-elses.txt").write_text("left here by a user")
    tier.close()
    assert foreign.exists()
    assert not tier.path_for("a").exists()
    assert (tier.directory / "someone-elses.txt").exists()  # run dir kept because it is not empty


def test_enospc_is_tier_full_and_leaves_no_partial_file(small_fs, noise):
    tier = FileTier(small_fs, 1 << 30)  # capacity larger than the filesystem: the medium must say no
    written = 0
    with pytest.raises(TierFullError, match="device full"):
        for i in range(100):
            tier.write(f"k{i}", noise.chunks(f"k{i}", 4 << 20, 1 << 20), 4 << 20)
            written += 1
    assert written > 0
    assert len(list(tier.directory.glob("*.kv"))) == written  # the failed entry left nothing behind
    assert tier.stored_bytes() == written * tier.stored_size(4 << 20)
    tier.close()


def test_capacity_zero_is_95_percent_of_the_free_space(small_fs):
    """--storage-capacity-gb 0 auto-detects, as the reference: 95 % of the free space (a quiet 48 MiB fs)."""
    tier = FileTier(small_fs, 0)
    try:
        assert tier.capacity_bytes == int(tier.detected_free_bytes * 0.95) // ALIGN * ALIGN
        assert tier.capacity_bytes > 0.9 * tier.detected_free_bytes
    finally:
        tier.close()


@pytest.mark.parametrize("damage", ["truncate", "delete", "corrupt"])
def test_an_unreadable_entry_is_dropped_not_found_forever(cache_dir, noise, damage):
    from kvtier.engine.tiered import StoreConfig, TieredStore
    from kvtier.telemetry.recorder import Recorder

    rec = Recorder()
    tier = FileTier(cache_dir, 64 << 20)
    store = TieredStore([tier], StoreConfig(1.0, 1.0), rec)
    buf = aligned_buffer(1 << 20)
    store.put("k", lambda: noise.chunks("k", 3 << 20, 1 << 20), 3 << 20, buf)
    path = tier.path_for("k")
    if damage == "truncate":
        os.truncate(path, 8192)
    elif damage == "delete":
        path.unlink()
    else:  # a flipped byte in the checksummed first 4 KiB of the payload
        with open(path, "r+b") as f:
            f.seek(4096 + 100)
            b = f.read(1)
            f.seek(4096 + 100)
            f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(StorageError):
        store.get("k", buf)
    assert store.location("k") is None and not store.get("k", buf).hit  # forgotten: a miss, not a failure
    assert rec.counters["entries_dropped_unreadable"] == 1 and rec.errors[("storage", "read", "request")] == 1
    store.check_accounting()
    store.close()


@pytest.mark.gpu
def test_gds_roundtrip_keeps_the_file_layout(cache_dir, noise):
    """--gds: the payload through cuFile, the header and checks as the O_DIRECT tier's (needs a CUDA
    device, kvikio and the cuFile driver; skipped elsewhere)."""
    from kvtier.engine.gds import GdsFileTier, probe_gds

    ok, why = probe_gds()
    if not ok:
        pytest.skip(f"GPUDirect Storage is not usable here: {why}")
    _roundtrip(GdsFileTier(cache_dir, 1 << 30, direct_io="on"), noise, 3_000_001)
