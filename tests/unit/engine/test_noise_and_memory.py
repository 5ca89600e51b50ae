import numpy as np
import pytest

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up
from kvtier.engine.memory import ExtentAllocator, MemoryTier
from kvtier.engine.noise import NoiseBuffer
from kvtier.errors import EntryNotFound, TierFullError


def test_noise_is_seeded_aligned_and_wraps():
    a, b, c = NoiseBuffer(1 << 20, seed=1), NoiseBuffer(1 << 20, seed=1), NoiseBuffer(1 << 20, seed=2)
    assert bytes(a._view[:4096]) == bytes(b._view[:4096])
    assert bytes(a._view[:4096]) != bytes(c._view[:4096])
    chunks = [bytes(c) for c in a.chunks("k", 3 * (1 << 20) + 5, chunk_bytes=256 * 1024)]  # each consumed at once
    assert sum(len(x) for x in chunks) == round_up(3 * (1 << 20) + 5)
    assert all(len(x) % ALIGN == 0 for x in chunks)
    assert chunks[0][:64] == a.head("k", 64) and b"".join(chunks) == a.expected("k", round_up(3 * (1 << 20) + 5))


def test_extent_allocator_coalesces_and_reuses():
    al = ExtentAllocator(10 * ALIGN)
    x = al.alloc(3 * ALIGN)
    y = al.alloc(3 * ALIGN)
    z = al.alloc(4 * ALIGN)
    assert (x, y, z) == (0, 3 * ALIGN, 6 * ALIGN)
    assert al.alloc(ALIGN) is None
    al.free(x, 3 * ALIGN)
    al.free(z, 4 * ALIGN)
    assert al.largest_free() == 4 * ALIGN  # not adjacent yet
    al.free(y, 3 * ALIGN)
    assert al.largest_free() == 10 * ALIGN and al.allocated == 0


def test_memory_tier_roundtrip_and_accounting(noise):
    t = MemoryTier(4 << 20)
    n = 1_000_001
    t.write("a", noise.chunks("a", n, 1 << 20), n)
    assert t.stored_bytes() == round_up(n)
    buf = aligned_buffer(round_up(n))
    timing = t.read("a", buf)
    assert timing.device_ns > 0
    assert bytes(buf[:64]) == noise.head("a", 64)
    exported = b"".join(bytes(c) for c in t.export("a", buf, timing))
    assert exported[:4096] == noise.expected("a", 4096)
    t.delete("a")
    assert t.stored_bytes() == 0
    with pytest.raises(EntryNotFound):
        t.read("a", buf)
    t.close()


def test_memory_tier_fragmentation_is_a_tier_full_error(noise):
    t = MemoryTier(3 * ALIGN)
    for k in "abc":
        t.write(k, noise.chunks(k, ALIGN, ALIGN), ALIGN)
    t.delete("a")
    t.delete("c")
    with pytest.raises(TierFullError, match="fragmentation"):
        t.write("d", noise.chunks("d", 2 * ALIGN, ALIGN), 2 * ALIGN)
    assert t.stored_bytes() == ALIGN


def test_memory_tier_failed_write_leaves_nothing(noise):
    t = MemoryTier(1 << 20)

    def broken():
        yield from noise.chunks("x", 8192, 4096)
        raise RuntimeError("source died")

    with pytest.raises(RuntimeError):
        t.write("x", broken(), 3 * 4096)
    assert t.stored_bytes() == 0
    t.write("x", noise.chunks("x", 4096, 4096), 4096)  # key is free again


def test_aligned_buffer_is_page_aligned():
    b = aligned_buffer(10)
    addr = np.frombuffer(b, dtype=np.uint8).ctypes.data
    assert addr % ALIGN == 0 and len(b) == ALIGN
