"""Data a storage array cannot deduplicate or compress (engine/noise.py): every 4 KiB block a run writes is
unique — across entries, within an entry far larger than the noise buffer, and against another seed's run —
while the same key and seed give the same bytes, verified on read; and the result says so from its own sample."""

from __future__ import annotations

import hashlib
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


def write_entries(tmp: Path, seed: int, entries: dict[str, int]) -> tuple[FileTier, NoiseBuffer]:
    noise = NoiseBuffer(2 * MiB, seed=seed)  # small on purpose: the 24 MiB entry wraps it 12 times
    tmp.mkdir()
    tier = FileTier(tmp, 1 << 30, direct_io="auto", keep_files=True)
    buf = aligned_buffer(4 * MiB)
    for key, n in entries.items():
        tier.write(key, noise.chunks(key, n, out=buf), n)
    return tier, noise


ENTRIES = {"user-1/turn-1": 24 * MiB, "user-1/turn-2": 3 * MiB + 100, "user-2/turn-1": 5 * MiB, "system": 1 * MiB}


def test_every_block_of_a_runs_files_is_unique_even_past_the_noise_buffer(tmp_path: Path):
    tier, _ = write_entries(tmp_path / "a", 7, ENTRIES)
    blocks = blocks_of(tmp_path / "a")
    assert len(blocks) >= sum(ENTRIES.values()) // BLOCK  # payload (and headers) of every entry
    assert len(set(blocks)) == len(blocks)  # not one repeated 4 KiB block, though the noise is 2 MiB
    tier.close()


def test_same_key_and_seed_same_bytes_verified_on_read_another_seed_shares_nothing(tmp_path: Path):
    tier, noise = write_entries(tmp_path / "a", 7, ENTRIES)
    buf = aligned_buffer(32 * MiB)
    for key, n in ENTRIES.items():
        tier.read(key, buf)
        assert bytes(buf[:n]) == NoiseBuffer(2 * MiB, seed=7).expected(key, n), key  # a fresh buffer, same bytes
    other, _ = write_entries(tmp_path / "b", 8, ENTRIES)
    assert not set(blocks_of(tmp_path / "a")) & set(blocks_of(tmp_path / "b"))
    tier.close()
    other.close()


def test_blocks_of_one_entry_wrapping_the_noise_buffer_are_unique():
    noise = NoiseBuffer(1 * MiB, seed=1)
    data = noise.expected("k", 8 * MiB)  # wraps the 1 MiB buffer 8 times
    blocks = [data[i : i + BLOCK] for i in range(0, len(data), BLOCK)]
    assert len(set(blocks)) == len(blocks)


@pytest.mark.parametrize("payload,bound", [("unique", 1.01), ("realistic", 2.0)])
def test_the_payload_does_not_compress_and_the_sample_says_so(payload: str, bound: float):
    noise = NoiseBuffer(4 * MiB, seed=3, payload=payload)  # type: ignore[arg-type]
    buf = aligned_buffer(2 * MiB)
    for k in range(6):
        for _ in noise.chunks(f"e{k}", 16 * MiB, out=buf):
            pass
    s = noise.describe()["sample"]
    assert s["compress_sample_bytes"] == MiB and s["compress_ratio"] is not None
    assert s["compress_ratio"] <= bound and (payload == "unique") == (s["compress_ratio"] <= 1.01)
    assert s["blocks_sampled"] >= 10 and s["distinct_fraction"] == 1.0
    # a rewrite of the same key samples the same blocks: equal bytes of one entry are not counted as repeats
    for _ in noise.chunks("e0", 16 * MiB, out=buf):
        pass
    assert noise.describe()["sample"]["distinct_fraction"] == 1.0


def test_a_repeated_block_is_seen_by_the_sample():
    """The sample's check can fail: two keys made to write the same bytes are counted as repeats."""
    noise = NoiseBuffer(1 * MiB, seed=0)
    buf = aligned_buffer(MiB)
    noise.key_hash = lambda key: 42  # type: ignore[method-assign]  # every key stamped alike
    noise.offset_for = lambda key: 0  # type: ignore[method-assign]  # and read from the same offset
    for k in range(40):
        for _ in noise.chunks(f"k{k}", 32 * MiB, out=buf):
            pass
    s = noise.describe()["sample"]
    assert s["blocks_sampled"] > 0 and s["distinct_fraction"] is not None and s["distinct_fraction"] < 0.2


def test_realistic_payload_is_float16_kv_like():
    noise = NoiseBuffer(1 * MiB, seed=2, payload="realistic")
    v = np.frombuffer(noise.expected("k", 64 * 1024), dtype=np.float16).astype(np.float32)
    plain = v[np.abs(v) < 6]  # the stamped 8 bytes of each 4 KiB block (4 of 2048 values) are not N(0, 1)
    assert plain.size >= 0.99 * v.size and abs(float(plain.mean())) < 0.05 and 0.9 < float(plain.std()) < 1.1
