"""Data a storage array cannot deduplicate or compress (engine/noise.py): every 4 KiB block a run writes is
unique — across entries, within an entry far larger than the noise buffer, across writers' buffers, and against
another seed's run — whether stamped in place in a writer's buffer or copied; every block read back is verified
from its bytes alone; and the result says so from its own sample."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import numpy as np
import pytest

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.file import FileTier
from kvtier.engine.noise import BLOCK, NoiseBuffer

MiB = 1 << 20


def blocks_of(folder: Path) -> list[bytes]:
    """Every 4 KiB block of every file under ``folder`` (the entry files as written: header and payload)."""
    out = []
    for f in sorted(folder.rglob("*")):
        if f.is_file() and f.suffix != ".lock":
            data = f.read_bytes()
            out += [hashlib.blake2b(data[i : i + BLOCK], digest_size=16).digest() for i in range(0, len(data), BLOCK)]
    return out


def write_entries(
    tmp: Path, seed: int, entries: dict[str, int], how: str = "in place", writers: int = 1
) -> tuple[FileTier, NoiseBuffer]:
    """Write ``entries`` with ``writers`` threads (each takes every writers-th key), stamped in place in the
    writers' buffers or copied into each thread's own buffer (``out=``)."""
    noise = NoiseBuffer(2 * MiB, seed=seed)  # small on purpose: the 24 MiB entry wraps it 12 times
    tmp.mkdir()
    tier = FileTier(tmp, 1 << 30, direct_io="auto", keep_files=True)
    keys = list(entries)
    start = threading.Barrier(writers)

    def work(w: int) -> None:
        buf = aligned_buffer(4 * MiB)
        start.wait()
        for key in keys[w::writers]:
            n = entries[key]
            src = noise.chunks(key, n, 4 * MiB) if how == "in place" else noise.chunks(key, n, out=buf)
            tier.write(key, src, n)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tier, noise


ENTRIES = {"user-1/turn-1": 24 * MiB, "user-1/turn-2": 3 * MiB + 100, "user-2/turn-1": 5 * MiB, "system": 1 * MiB}
MANY = {f"u{i}/t{j}": (i + 1) * 3 * MiB + j * 4096 for i in range(4) for j in range(3)}


@pytest.mark.parametrize("how", ["in place", "copied"])
def test_every_block_of_a_runs_files_is_unique_even_past_the_noise_buffer(tmp_path: Path, how: str):
    tier, noise = write_entries(tmp_path / "a", 7, ENTRIES, how)
    blocks = blocks_of(tmp_path / "a")
    assert len(blocks) >= sum(ENTRIES.values()) // BLOCK  # payload (and headers) of every entry
    assert len(set(blocks)) == len(blocks)  # not one repeated 4 KiB block, though the noise is 2 MiB
    d = noise.describe()
    written = sum(-(-n // BLOCK) * BLOCK for n in ENTRIES.values())
    if how == "in place":  # no entry byte was copied: one writer buffer, filled once, its stamps rewritten
        assert (d["bytes_stamped_in_place"], d["bytes_copied"], d["writer_buffers"]) == (written, 0, 1)
        assert d["writer_buffer_bytes"] == 4 * MiB
    else:
        assert (d["bytes_stamped_in_place"], d["bytes_copied"], d["writer_buffers"]) == (0, written, 0)
    tier.close()


def test_concurrent_writers_buffers_tile_the_noise_and_their_blocks_stay_unique(tmp_path: Path):
    tier, noise = write_entries(tmp_path / "a", 7, MANY, writers=4)
    blocks = blocks_of(tmp_path / "a")
    assert len(set(blocks)) == len(blocks) >= sum(MANY.values()) // BLOCK
    d = noise.describe()
    assert 1 <= d["writer_buffers"] <= 4 and d["bytes_copied"] == 0  # at most one buffer per write in flight
    buf = aligned_buffer(16 * MiB)
    for key, n in MANY.items():  # whichever writer's buffer (base) made the entry, its bytes verify
        tier.read(key, buf)
        assert noise.verify(key, buf[: n // BLOCK * BLOCK]) is None, key
    tier.close()


@pytest.mark.parametrize("how", ["in place", "copied"])
def test_every_block_read_back_is_verified_and_a_wrong_one_is_named(tmp_path: Path, how: str):
    tier, noise = write_entries(tmp_path / "a", 7, ENTRIES, how)
    buf = aligned_buffer(32 * MiB)
    fresh = NoiseBuffer(2 * MiB, seed=7)  # the same seed in another process: the same verdicts
    for key, n in ENTRIES.items():
        tier.read(key, buf)
        whole = n // BLOCK * BLOCK
        assert noise.verify(key, buf[:whole]) is None and fresh.verify(key, buf[:whole]) is None, key
    tier.read("user-1/turn-1", buf)
    data = bytearray(buf[: 24 * MiB])
    assert noise.verify("user-2/turn-1", data) == 0  # another key's bytes: its first block is named
    assert NoiseBuffer(2 * MiB, seed=8).verify("user-1/turn-1", data) == 0  # another seed's noise
    assert noise.verify("user-1/turn-1", data[BLOCK:], first_block=2) == 2  # a block at the wrong index
    data[777 * BLOCK + 9] ^= 0x10  # one bit of one block, past its stamp
    assert noise.verify("user-1/turn-1", data) == 777
    data[777 * BLOCK + 9] ^= 0x10
    data[900 * BLOCK] ^= 0x01  # one bit of a stamp
    assert noise.verify("user-1/turn-1", data) == 900
    if how == "copied":  # the key-offset layout is also what expected() gives
        assert bytes(buf[:MiB]) == fresh.expected("user-1/turn-1", MiB)
    tier.close()


def test_another_seeds_run_shares_no_block(tmp_path: Path):
    tier, _ = write_entries(tmp_path / "a", 7, ENTRIES)
    other, _ = write_entries(tmp_path / "b", 8, ENTRIES)
    assert not set(blocks_of(tmp_path / "a")) & set(blocks_of(tmp_path / "b"))
    tier.close()
    other.close()


def test_a_writer_buffer_changes_only_its_stamps_between_chunks_and_goes_back_when_dropped():
    noise = NoiseBuffer(2 * MiB, seed=1)
    it = iter(noise.chunks("k", 8 * MiB, MiB))
    first = np.frombuffer(bytes(next(it)), dtype=np.uint64).reshape(-1, BLOCK // 8)
    second = np.frombuffer(bytes(next(it)), dtype=np.uint64).reshape(-1, BLOCK // 8)
    assert (first[:, 1:] == second[:, 1:]).all()  # the same buffer, the same noise past each stamp
    assert (first[:, 0] != second[:, 0]).all()  # every stamp rewritten (the block index moved on)
    assert noise.verify("k", second.tobytes(), first_block=MiB // BLOCK) is None
    del it  # a writer that stops early (a failed write) hands the buffer back
    for _ in noise.chunks("j", 3 * MiB, MiB):
        pass
    assert noise.describe()["writer_buffers"] == 1


def test_blocks_of_one_entry_copied_past_the_noise_buffer_are_unique():
    noise = NoiseBuffer(1 * MiB, seed=1)
    data = noise.expected("k", 8 * MiB)  # wraps the 1 MiB buffer 8 times
    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    assert len(set(blocks)) == len(blocks)


@pytest.mark.parametrize("payload,bound", [("unique", 1.01), ("realistic", 2.0)])
def test_the_payload_does_not_compress_and_the_sample_says_so(payload: str, bound: float):
    noise = NoiseBuffer(4 * MiB, seed=3, payload=payload)  # type: ignore[arg-type]
    for k in range(6):
        for _ in noise.chunks(f"e{k}", 16 * MiB, 2 * MiB):
            pass
    s = noise.describe()["sample"]
    assert s["compress_sample_bytes"] == MiB and s["compress_ratio"] is not None
    assert s["compress_ratio"] <= bound and (payload == "unique") == (s["compress_ratio"] <= 1.01)
    assert s["blocks_sampled"] >= 10 and s["distinct_fraction"] == 1.0
    # a rewrite of the same key samples the same blocks: equal bytes of one entry are not counted as repeats
    for _ in noise.chunks("e0", 16 * MiB, 2 * MiB):
        pass
    assert noise.describe()["sample"]["distinct_fraction"] == 1.0


@pytest.mark.parametrize("how", ["in place", "copied"])
def test_a_repeated_block_is_seen_by_the_sample(how: str):
    """The sample's check can fail: two keys made to write the same bytes are counted as repeats."""
    noise = NoiseBuffer(1 * MiB, seed=0)
    buf = aligned_buffer(MiB)
    noise.key_hash = lambda key: 42  # type: ignore[method-assign]  # every key stamped alike
    noise.offset_for = lambda key: 0  # type: ignore[method-assign]  # and (copied) read from the same offset
    for k in range(40):
        chunks = noise.chunks(f"k{k}", 32 * MiB, MiB) if how == "in place" else noise.chunks(f"k{k}", 32 * MiB, out=buf)
        for _ in chunks:
            pass
    s = noise.describe()["sample"]
    assert s["blocks_sampled"] > 0 and s["distinct_fraction"] is not None and s["distinct_fraction"] < 0.2


def test_realistic_payload_is_float16_kv_like():
    noise = NoiseBuffer(1 * MiB, seed=2, payload="realistic")
    v = np.frombuffer(noise.expected("k", 64 * 1024), dtype=np.float16).astype(np.float32)
    plain = v[np.abs(v) < 6]  # the stamped 8 bytes of each 4 KiB block (4 of 2048 values) are not N(0, 1)
    assert plain.size >= 0.99 * v.size and abs(float(plain.mean())) < 0.05 and 0.9 < float(plain.std()) < 1.1
