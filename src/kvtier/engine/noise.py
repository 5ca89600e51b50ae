"""KV-entry data without per-request RNG cost, and which a storage array can neither deduplicate nor compress.

Generating random bytes costs ~0.1-1.7 GB/s here, far below the device, so one buffer (256 MiB by default)
is generated once from the seed and every entry is read from it, starting at a page-aligned offset derived
from the key. Sliced as they are, a run's files would hold at most 256 MiB / 4 KiB distinct blocks (a 12 s
run repeated 96 % of its blocks): an array that deduplicates inline would turn the writes into metadata.
So each chunk is *copied* into the caller's own aligned buffer with a stamp folded in:

    every 4 KiB block's first 8 bytes ^= key_hash(seed, key) ^ block_index

``block_index`` is the block's index within the entry, so every 4 KiB block of every entry of the run
differs from every other (two blocks could only be equal if they came from the same noise offset *and* had
the same stamp: within an entry the index differs, across entries the 64-bit key hash), while the same key
and seed give the same bytes
(reads can be verified, ``expected``). Another seed changes both the noise and the key hash. The noise is
random (``unique``: incompressible) or float16 values of a normal distribution (``realistic``: they
compress a little, as real KV does). The copy runs in 512 KiB pieces, each stamped while it is in a core's L2
cache (2 MiB pieces, which spill out of it, cost the CPU tier's write 3 % against ``np.copyto``, measured);
nothing is allocated per request (a few KiB of stamp scratch per thread, once).

``PayloadSample`` checks the run's own writes: a sampled set of 4 KiB blocks (one of about every 4 MiB
written, picked by key and index so a rewrite of a key samples the same blocks) hashed to 8-byte digests,
distinct ones counted, and the zstd ratio of the first MiB written.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import numpy as np

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up

DEFAULT_NOISE_BYTES = 256 * 1024 * 1024
BLOCK = 4096  # the dedup unit the stamp defeats (arrays deduplicate at 4-16 KiB)
PIECE = 1 << 19  # the copy and stamp run in pieces of this, so the stamp finds each piece in cache
_BLOCKS_PER_PIECE = PIECE // BLOCK
_IDX = np.arange(_BLOCKS_PER_PIECE, dtype=np.uint64)
Payload = Literal["unique", "realistic"]


class PayloadSample:
    """Digests of a sample of the 4 KiB blocks written, and a sample of bytes for the compression ratio."""

    PIECES_PER_SAMPLE = 8  # one 4 KiB block of about one piece (512 KiB) in this many is sampled: one per 4 MiB
    MAX_DIGESTS = 200_000
    COMPRESS_BYTES = 1 << 20

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._digests: dict[bytes, tuple[str, int]] = {}
        self.sampled = 0
        self.repeats = 0  # a sampled block equal to another (key, block) sampled before
        self._head = bytearray()

    def add(self, key: str, first_block: int, piece: memoryview, key_hash: int) -> None:
        """One piece written: about one in PIECES_PER_SAMPLE pieces gives one block (chosen by key and index,
        so a rewrite of the key samples the same block); plain integer work, no array, on the hot path."""
        x = (((key_hash ^ first_block) * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> 32  # high bits: well mixed
        head_wanted = len(self._head) < self.COMPRESS_BYTES
        if x % self.PIECES_PER_SAMPLE and not head_wanted:
            return
        nblocks = len(piece) // BLOCK
        b = (x >> 8) % nblocks
        d = hashlib.blake2b(piece[b * BLOCK : (b + 1) * BLOCK], digest_size=8).digest()
        with self._lock:
            if len(self._head) < self.COMPRESS_BYTES:
                self._head += piece[: self.COMPRESS_BYTES - len(self._head)]
            if x % self.PIECES_PER_SAMPLE or len(self._digests) >= self.MAX_DIGESTS:
                return
            seen = self._digests.get(d)
            if seen is None:
                self._digests[d] = (key, first_block + b)
                self.sampled += 1
            elif seen != (key, first_block + b):
                self.sampled += 1
                self.repeats += 1

    def section(self) -> dict[str, Any]:
        """``{blocks_sampled, distinct_blocks, distinct_fraction, compress_codec, compress_sample_bytes,
        compress_ratio}`` (ratio = sample bytes / compressed bytes; zstd level 1 when installed, else zlib 1)."""
        with self._lock:
            head = bytes(self._head)
            sampled, repeats = self.sampled, self.repeats
        ratio, codec = None, None
        if head:
            try:
                import zstandard

                codec, packed = "zstd-1", zstandard.ZstdCompressor(level=1).compress(head)
            except ImportError:
                import zlib

                codec, packed = "zlib-1", zlib.compress(head, 1)
            ratio = round(len(head) / len(packed), 4)
        return {
            "blocks_sampled": sampled,
            "distinct_blocks": sampled - repeats,
            "distinct_fraction": round((sampled - repeats) / sampled, 6) if sampled else None,
            "compress_codec": codec,
            "compress_sample_bytes": len(head),
            "compress_ratio": ratio,
        }


class NoiseBuffer:
    """Seeded, page-aligned bytes that entries are copied from, stamped (module docstring)."""

    def __init__(self, nbytes: int = DEFAULT_NOISE_BYTES, seed: int = 0, payload: Payload = "unique") -> None:
        self.nbytes = round_up(max(nbytes, PIECE))
        self.seed = seed
        self.payload = payload
        self._view = aligned_buffer(self.nbytes)
        self._u64 = np.frombuffer(self._view, dtype=np.uint64)
        self._salt = seed.to_bytes(16, "little", signed=True)
        self._tls = threading.local()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.sample = PayloadSample()
        rng = np.random.default_rng(seed)
        step = 16 * 1024 * 1024 // 2
        if payload == "unique":
            arr = np.frombuffer(self._view, dtype=np.uint16)
            for start in range(0, arr.size, step):  # fill in slices to keep the temporary small
                stop = min(arr.size, start + step)
                arr[start:stop] = rng.integers(0, 1 << 16, size=stop - start, dtype=np.uint16)
        elif payload == "realistic":  # KV-like activations: float16 of N(0, 1)
            half = np.frombuffer(self._view, dtype=np.float16)
            for start in range(0, half.size, step):
                stop = min(half.size, start + step)
                half[start:stop] = rng.standard_normal(stop - start, dtype=np.float32).astype(np.float16)
        else:
            raise ValueError(f"payload must be unique or realistic, got {payload!r}")

    def helpers(self) -> ThreadPoolExecutor:
        """The threads that fill the next half of a writer's buffer (one per core: the work is a copy)."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max(2, os.cpu_count() or 2), thread_name_prefix="kvtier-fill")
            return self._pool

    def describe(self) -> dict[str, Any]:
        """The scheme as a result records it (``storage.payload``), with the sample of this run's writes."""
        return {
            "scheme": f"{self.payload}: noise copied per chunk, each 4 KiB block stamped (key, seed, block index)",
            "payload": self.payload,
            "noise_bytes": self.nbytes,
            "stamp_bytes_per_block": 8,
            "block_bytes": BLOCK,
            "sample": self.sample.section(),
        }

    def key_hash(self, key: str) -> int:
        """The key's stamp, salted by the seed: 64 bits."""
        h = hashlib.blake2b(key.encode(), digest_size=8, salt=self._salt).digest()
        return int.from_bytes(h, "little")

    def offset_for(self, key: str) -> int:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return (h % (self.nbytes // ALIGN)) * ALIGN

    def _scratch(self) -> np.ndarray:
        s: np.ndarray | None = getattr(self._tls, "stamps", None)
        if s is None:
            s = self._tls.stamps = np.empty(_BLOCKS_PER_PIECE, dtype=np.uint64)
        return s

    def _fill(self, dst: memoryview, off: int, block: int, h: int) -> None:
        """Copy ``len(dst)`` noise bytes from ``off`` into ``dst`` (whole 4 KiB blocks) and stamp them."""
        nblocks = len(dst) // BLOCK
        d64 = np.frombuffer(dst, dtype=np.uint64)
        np.copyto(d64, self._u64[off // 8 : (off + len(dst)) // 8])
        b = self._scratch()[:nblocks]
        np.add(_IDX[:nblocks], np.uint64(block), out=b)  # the block's index in the entry
        np.bitwise_xor(b, np.uint64(h), out=b)
        words = d64[:: BLOCK // 8]  # each block's first 8 bytes
        np.bitwise_xor(words, b, out=words)

    def chunks(
        self, key: str, nbytes: int, chunk_bytes: int | None = None, *, out: memoryview | None = None
    ) -> NoiseChunks:
        """The entry's bytes, ``round_up(nbytes)`` of them, as aligned chunks of at most ``chunk_bytes`` (or
        ``len(out)``): each is a view of ``out``, the caller's reusable aligned buffer, refilled for the
        next chunk (consume each before pulling the next, as every tier does). Without ``out`` one buffer is
        allocated for the whole iteration (tests, one-off writes). A tier that holds the bytes in its own
        memory calls ``fill`` instead: one copy, straight into it (engine/memory.py)."""
        return NoiseChunks(self, key, nbytes, chunk_bytes, out)

    def expected(self, key: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of the entry under ``key`` (for verifying reads)."""
        out = bytearray()
        for c in self.chunks(key, nbytes, PIECE):
            out += c
            if len(out) >= nbytes:
                break
        return bytes(out[:nbytes])

    def head(self, key: str, n: int) -> bytes:
        """First ``n`` bytes of what ``chunks`` yields for ``key``."""
        return self.expected(key, n)


class NoiseChunks:
    """One entry's stamped bytes: iterate for chunks in the caller's buffer, or ``fill`` a tier's memory."""

    def __init__(
        self, noise: NoiseBuffer, key: str, nbytes: int, chunk_bytes: int | None, out: memoryview | None
    ) -> None:
        self.noise, self.key, self.padded = noise, key, round_up(nbytes)
        limit = min(chunk_bytes or len(out), len(out)) if out is not None else (chunk_bytes or PIECE)
        self.limit = max(BLOCK, limit // BLOCK * BLOCK)
        self.out = out

    def _pieces(self, dst: memoryview, done: int, off: int, block: int, h: int) -> tuple[int, int]:
        """Fill ``dst`` (whole blocks) from noise offset ``off``, entry block ``block``; returns (off, block)."""
        noise = self.noise
        at = 0
        while at < len(dst):  # pieces of PIECE, each within the noise buffer (it wraps)
            m = min(len(dst) - at, PIECE, noise.nbytes - off)
            piece = dst[at : at + m]
            noise._fill(piece, off, block, h)
            noise.sample.add(self.key, block, piece, h)
            block += m // BLOCK
            at += m
            off = (off + m) % noise.nbytes
        return off, block

    def __iter__(self) -> Iterator[memoryview]:
        """Chunks of ``limit`` bytes, each filled in the caller's buffer. With a buffer of at least two
        PIECEs the copy is pipelined: the buffer's two halves take turns, the next half filled by a helper
        thread (numpy's copy releases the GIL) while the caller writes the current one, so a writer keeps
        its device busy through the copy; the chunks are then half the buffer."""
        buf = self.out if self.out is not None else aligned_buffer(self.limit)
        off, block, h = self.noise.offset_for(self.key), 0, self.noise.key_hash(self.key)
        remaining = self.padded
        half = self.limit // 2 // PIECE * PIECE
        if half == 0 or remaining <= half:  # a small entry or buffer: fill and hand over in turn
            while remaining > 0:
                n = min(remaining, self.limit)
                off, block = self._pieces(buf[:n], 0, off, block, h)
                remaining -= n
                yield buf[:n]
            return
        halves = (buf[:half], buf[half : 2 * half])
        pool = self.noise.helpers()

        def fill(k: int, n: int, off: int, block: int) -> tuple[int, int]:
            return self._pieces(halves[k][:n], 0, off, block, h)

        n = min(remaining, half)
        pending = pool.submit(fill, 0, n, off, block)
        k = 0
        try:
            while remaining > 0:
                off, block = pending.result()
                cur = halves[k][:n]
                remaining -= n
                if remaining > 0:
                    nxt = min(remaining, half)
                    pending = pool.submit(fill, 1 - k, nxt, off, block)
                yield cur
                if remaining > 0:
                    k, n = 1 - k, nxt
        finally:
            pending.result()  # never leave a helper writing into the caller's buffer after we return

    def fill(self, dst: memoryview | Sequence[memoryview], check: Callable[[int], None] | None = None) -> None:
        """Write the whole entry (``round_up(nbytes)`` bytes) into ``dst`` directly: one view, or the tier's
        pages in order (each a multiple of 4 KiB; the bytes are those of one view of them all); ``check(done)``
        is called between pieces of ``limit`` bytes (a cancel check raises there)."""
        off, block, h = self.noise.offset_for(self.key), 0, self.noise.key_hash(self.key)
        views = [dst] if isinstance(dst, memoryview) else list(dst)
        done = 0
        for v in views:
            for at in range(0, min(len(v), self.padded - done), self.limit):
                if check is not None:
                    check(done)
                n = min(self.limit, len(v) - at, self.padded - done)
                off, block = self._pieces(v[at : at + n], done, off, block, h)
                done += n
