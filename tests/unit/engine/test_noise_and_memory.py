import numpy as np
import pytest

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up
from kvtier.engine.memory import MemoryTier, page_size
from kvtier.engine.noise import NoiseBuffer
from kvtier.errors import EntryNotFound, TierFullError


def test_noise_is_seeded_aligned_and_wraps():
    a, b, c = NoiseBuffer(1 << 20, seed=1), NoiseBuffer(1 << 20, seed=1), NoiseBuffer(1 << 20, seed=2)
    assert bytes(a._view[:4096]) == bytes(b._view[:4096])
    assert bytes(a._view[:4096]) != bytes(c._view[:4096])
    chunks = [bytes(c) for c in a.chunks("k", 3 * (1 << 20) + 5, chunk_bytes=256 * 1024)]  # each consumed at once
    assert sum(len(x) for x in chunks) == round_up(3 * (1 << 20) + 5)
    assert all(len(x) % ALIGN == 0 for x in chunks)
    assert a.verify("k", b"".join(chunks)) is None and b.verify("k", b"".join(chunks)) is None
    assert c.verify("k", b"".join(chunks)) == 0  # another seed's
    copied = b"".join(bytes(x) for x in a.chunks("k", 3 * (1 << 20) + 5, out=aligned_buffer(256 * 1024)))
    assert copied[:64] == a.head("k", 64) and copied == a.expected("k", round_up(3 * (1 << 20) + 5))


def test_page_size_is_whole_4k_huge_pages_when_large_and_a_sixteenth_of_the_tier_at_most():
    assert page_size(64 << 30, 32 << 20) == 32 << 20
    assert page_size(64 << 30, (3 << 20) + 5) == 2 << 20  # rounded to 4 KiB, then down to a huge page
    assert page_size(4 << 20, 32 << 20) == 256 << 10  # a small tier still holds 16 pages
    assert page_size(3 * ALIGN, 32 << 20) == ALIGN and page_size(0, 1) == ALIGN


def test_memory_tier_roundtrip_and_accounting(noise):
    t = MemoryTier(4 << 20)
    n = 1_000_001
    copied = noise.describe()["bytes_copied"]  # the fixture is shared
    t.write("a", noise.chunks("a", n, 1 << 20), n)
    assert t.stored_bytes() == round_up(n)
    buf = aligned_buffer(round_up(n))
    timing = t.read("a", buf)
    assert timing.device_ns > 0
    assert bytes(buf[:64]) == noise.head("a", 64)  # the CPU tier copies from the key's own offset (fill)
    exported = b"".join(bytes(c) for c in t.export("a", buf, timing))
    assert exported[:4096] == noise.expected("a", 4096) and noise.verify("a", exported[: n // 4096 * 4096]) is None
    assert noise.describe()["bytes_copied"] - copied == round_up(n)
    t.delete("a")
    assert t.stored_bytes() == 0
    with pytest.raises(EntryNotFound):
        t.read("a", buf)
    t.close()


def test_memory_tier_never_fragments_and_pages_hold_the_same_bytes(noise):
    """#31: the CPU tier was a first-fit extent arena, so a write could fail with free bytes in holes. With pages a
    write fits whenever enough pages are free, wherever they lie, and reads back the bytes a contiguous copy
    holds; it fails only when the free pages cannot hold it."""
    t = MemoryTier(6 * ALIGN, page_bytes=ALIGN)
    for k in "abcdef":
        t.write(k, noise.chunks(k, ALIGN, ALIGN), ALIGN)
    for k in "ace":
        t.delete(k)  # three free pages, none adjacent
    n = 3 * ALIGN - 100
    t.write("x", noise.chunks("x", n, ALIGN), n)  # through fill(): the noise source writes into the pages
    buf = aligned_buffer(ALIGN)
    got = b"".join(bytes(c) for c in t.export("x", buf, None))  # type: ignore[arg-type]
    assert got == noise.expected("x", round_up(n))
    t.delete("x")
    plain = [memoryview(bytes(c)) for c in noise.chunks("y", n, ALIGN)]  # a plain chunk list: scattered
    t.write("y", plain, n)
    assert b"".join(bytes(c) for c in t.export("y", buf, None)) == b"".join(plain)  # type: ignore[arg-type]
    t.read("y", aligned_buffer(2 * ALIGN))  # gathered through a buffer of two pages
    with pytest.raises(TierFullError, match="pages needed"):
        t.write("z", noise.chunks("z", ALIGN, ALIGN), ALIGN)  # all six pages held
    assert t.stored_bytes() == 6 * ALIGN and t.waste_bytes() == 0
    t.close()


def test_internal_waste_is_the_unused_part_of_last_pages(noise):
    t = MemoryTier(64 * ALIGN, page_bytes=4 * ALIGN)
    t.write("a", noise.chunks("a", 5 * ALIGN, ALIGN), 5 * ALIGN)  # two pages, 3 KiB-pages of the second unused
    assert t.stored_size(5 * ALIGN) == 8 * ALIGN and t.stored_bytes() == 8 * ALIGN
    assert t.waste_bytes() == 3 * ALIGN
    t.delete("a")
    assert t.stored_bytes() == 0 and t.waste_bytes() == 0
    t.close()


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


def test_a_fragmenting_pattern_never_refuses_a_write_the_free_pages_hold():
    """#31's test: sizes 1-250 MB, random frees. Every write that the free pages can hold lands, the others
    are refused only for pages, and the tier's accounting is its entries' pages throughout."""
    import random

    MB = 1_000_000
    rng = random.Random(5)
    t = MemoryTier(512 * MB, page_bytes=2 << 20)
    zeros = memoryview(bytearray(4 << 20))
    held: dict[str, int] = {}
    refused_with_room = refused = 0
    for i in range(60):
        n = rng.randint(1, 250) * MB
        key = f"e{i}"
        fits = t.stored_size(n) <= t.capacity_bytes - t.stored_bytes()
        try:
            t.write(key, [zeros] * -(-n // len(zeros)), n)
            held[key] = n
        except TierFullError:
            refused += 1
            refused_with_room += fits
        for k in rng.sample(sorted(held), k=min(len(held), rng.randint(0, 2))):  # random frees
            t.delete(k)
            del held[k]
        assert t.stored_bytes() == sum(t.stored_size(v) for v in held.values())
        assert t.waste_bytes() == sum(t.stored_size(v) - round_up(v) for v in held.values())
    assert refused_with_room == 0 and refused > 0  # the pattern did fill the tier
    t.close()


def test_a_large_write_alone_shares_its_copy_with_a_helper_and_writes_the_same_bytes(monkeypatch):
    """#59 item 1: an entry of 2 x SPLIT_BYTES or more, written while the CPU tier has no other read or write in
    flight, is copied by two threads (its second half by a helper); the bytes, stamps, counts and cancel checks
    are as one thread's. With a read in flight, the write copies alone."""
    import threading
    import time

    from kvtier.engine import noise as noise_mod

    monkeypatch.setattr(noise_mod, "SPLIT_BYTES", 1 << 20)  # small, so the test stays small
    noise = NoiseBuffer(3 << 20, seed=4)  # entries wrap the noise: the halves start at the right offsets
    n = (5 << 20) + 4096 * 3 + 7
    threads: set[str] = set()
    fill = noise._fill

    def tracked(dst, off, block, h):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        fill(dst, off, block, h)

    monkeypatch.setattr(noise, "_fill", tracked)
    pages = [aligned_buffer(1 << 20) for _ in range(6)]  # the cut falls inside a page
    checked: list[int] = []
    noise.chunks("big", n, 1 << 19).fill(pages, check=checked.append, share=True)
    assert len(threads) == 2 and any(t.startswith("kvtier-fill") for t in threads)
    got = b"".join(bytes(p) for p in pages)[: round_up(n)]
    assert got[:n] == noise.expected("big", n) and noise.verify("big", got) is None
    d, cut = noise.describe(), round_up(n) // 2 // noise_mod.PIECE * noise_mod.PIECE
    assert d["bytes_copied"] == round_up(n) and d["bytes_copied_by_helper"] == round_up(n) - cut
    assert min(checked) == 0 and max(checked) >= cut  # both halves check (a cancel stops both)

    def cancel_in_second_half(done: int) -> None:
        if done >= cut:
            raise InterruptedError("cancelled")

    with pytest.raises(InterruptedError):  # the helper's half is cancelled: the write fails whole
        noise.chunks("c", n, 1 << 19).fill(pages, check=cancel_in_second_half, share=True)

    main, helper_done = threading.current_thread(), threading.Event()

    def slow(dst, off, block, h):  # type: ignore[no-untyped-def]
        if threading.current_thread() is not main:
            time.sleep(0.05)
            fill(dst, off, block, h)
            helper_done.set()

    def interrupted(done: int) -> None:
        if threading.current_thread() is main:
            raise KeyboardInterrupt  # Ctrl+C in the caller: fill waits for the helper before it lets the pages go

    monkeypatch.setattr(noise, "_fill", slow)
    with pytest.raises(KeyboardInterrupt):
        noise.chunks("d", n, 1 << 19).fill(pages, check=interrupted, share=True)
    assert helper_done.is_set()
    monkeypatch.setattr(noise, "_fill", tracked)

    tier = MemoryTier(16 << 20, page_bytes=1 << 20)
    threads.clear()
    tier.write("a", noise.chunks("a", n, n), n)  # the tier to itself: shared
    assert len(threads) == 2
    buf = aligned_buffer(round_up(n))
    assert tier.read("a", buf).device_ns > 0 and bytes(buf[:n]) == noise.expected("a", n)
    threads.clear()
    tier._copying += 1  # as a read in flight: this write copies alone
    try:
        tier.write("b", noise.chunks("b", n, n), n)
    finally:
        tier._copying -= 1
    assert threads == {threading.current_thread().name} and tier._copying == 0
    tier.read("b", buf)
    assert bytes(buf[:n]) == noise.expected("b", n)
