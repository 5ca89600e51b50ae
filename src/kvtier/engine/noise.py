"""KV-entry data without per-request RNG cost, and which a storage array can neither deduplicate nor compress.

Generating random bytes costs ~0.1-1.7 GB/s here, far below the device, so one buffer (256 MiB by default)
is generated once from the seed and every entry is made from it. Sliced as they are, a run's files would hold
at most 256 MiB / 4 KiB distinct blocks (a 12 s run repeated 96 % of its blocks): an array that deduplicates
inline would turn the writes into metadata. So every 4 KiB block carries a stamp:

    the block's first 8 bytes = the noise's ^ key_hash(seed, key) ^ block_index

``block_index`` is the block's index within the entry, so every 4 KiB block of every entry of the run
differs from every other: two blocks can only be equal if they hold the same noise *and* the same stamp
(within an entry the index differs, across entries the 64-bit key hash). Another seed changes both the noise
and the key hash. The noise is random (``unique``: incompressible) or float16 values of a normal
distribution (``realistic``: they compress a little, as real KV does).

**Writes stamp in place** (``chunks`` without ``out``): a writer borrows a buffer from the noise's pool,
filled from the noise once (each new buffer at the next base along the noise, so the writers' buffers tile
it), and for every chunk only each block's first 8 bytes are rewritten (clean noise word ^ new stamp): 0.2 %
of the bytes, no copy. An entry's byte ``i`` is then the noise at ``base + i mod len(buffer)``, stamped.
**A tier that holds the bytes in its own memory** (the CPU tier) calls ``fill``: one copy from the noise at
the key's own offset, stamped on the way (that copy is the work a CPU tier does). ``out=`` keeps the older
copy-and-stamp into the caller's buffer (pipelined on two halves), for comparison (benchmarks/unique_payload.py).

**Reads are verified from the bytes alone** (``verify``): a block's words after its stamp locate it in the
noise (an index of every 4 KiB noise block by its second word), and its first word, unstamped, must give the
key's hash ^ its index. So an entry needs no record of which writer's buffer made it, in any tier, after any
demotion, and a block of another key, another index or another seed is caught. ``expected`` gives the bytes of
the key-offset layout (``fill``'s and ``out=``'s).

``PayloadSample`` checks the run's own writes: a sampled set of 4 KiB blocks (one of about every 4 MiB
written, picked by key and index so a rewrite of a key samples the same blocks) hashed to 8-byte digests,
distinct ones counted, and the zstd ratio of the first MiB written.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any, Generic, Literal, Protocol, TypeVar

import numpy as np

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up

DEFAULT_NOISE_BYTES = 256 * 1024 * 1024
BLOCK = 4096  # the dedup unit the stamp defeats (arrays deduplicate at 4-16 KiB)
PIECE = 1 << 19  # the unit the payload sample picks its blocks by (one block of about one piece in 8)
COPY_PIECE = 1 << 25  # the copy and stamp run in pieces of this (a page of kvtier bench's CPU tier, at most): above
# glibc's streaming threshold as kvtier bench sets it (engine/backend.py NT_COPY_BYTES), so the copy streams past the
# cache, and above 16 times it, where glibc streams four pages at a time; the stamp then reads back one cache line in
# 64 (each block's first). Of np.copyto's rate (benchmarks/cpu_tier_pages.py): 0.50-0.57 in 512 KiB pieces (the
# stamp finding its piece in cache, the copy not streaming), 0.83-0.86 in 8 or 16 MiB pieces, 0.91 in 32 MiB. The
# stamp's read-back of lines the copy just streamed to memory is the rest (~9 %): stamping on a helper thread while
# the next piece copies gained 0.01 in 32 MiB pages and lost 0.05 in 2 MiB ones
SPLIT_BYTES = 1 << 24  # a shared fill of twice this or more is copied by two threads, a half each (NoiseChunks.fill):
# numpy's copy releases the GIL, and one core's copy is bounded by its own outstanding misses, not by the memory
# (two threads: 1.43 x np.copyto's rate against 0.91 for one, 256 MiB in 32 MiB pieces, on the 2-core dev VM)
_BLOCKS_PER_PIECE = COPY_PIECE // BLOCK
_MIX = 0x9E3779B97F4A7C15  # the sample's mixing constant (PayloadSample.picks)
_IDX = np.arange(_BLOCKS_PER_PIECE, dtype=np.uint64)
Payload = Literal["unique", "realistic"]


P = TypeVar("P")


class WriterPool(Generic[P]):
    """Writer buffers not in use, by size, and where along the noise (``span`` bytes) the next new one starts, so
    the writers' buffers tile the noise; ``made`` counts those made (the most writes ever in flight at once)."""

    def __init__(self, span: int, make: Callable[[int, int], P]) -> None:
        self.span, self._make = span, make
        self._lock = threading.Lock()
        self._free: dict[int, list[P]] = {}
        self._next_base = 0
        self.made = 0

    def borrow(self, size: int) -> P:
        """A free buffer of ``size`` bytes, or a new one at the next base along the noise."""
        with self._lock:
            free = self._free.get(size)
            if free:
                return free.pop()
            base = self._next_base
            self._next_base = (base + size) % self.span
            self.made += 1
        return self._make(size, base)

    def give_back(self, size: int, p: P) -> None:
        with self._lock:
            self._free.setdefault(size, []).append(p)


class EntrySource(Protocol):
    """Where a write takes its entry's chunks from: the noise (host memory), or --gpu-native's DeviceNoise."""

    def chunks(self, key: str, nbytes: int, chunk_bytes: int | None = None) -> Iterable[Any]: ...


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

    def add(self, key: str, first_block: int, span: memoryview, key_hash: int) -> None:
        """``span`` written (whole blocks from entry block ``first_block``): its head (while the compression
        sample is short) and the blocks ``picks`` chooses."""
        if self.head_missing():
            self.add_head(span)
        for b in self.picks(first_block, len(span) // BLOCK, key_hash):
            self.record(key, first_block + b, span[b * BLOCK : (b + 1) * BLOCK])

    def head_missing(self) -> int:
        """Bytes the compression sample still wants (0 once it has COMPRESS_BYTES)."""
        with self._lock:
            return max(0, self.COMPRESS_BYTES - len(self._head))

    def add_head(self, data: memoryview | bytes) -> None:
        with self._lock:
            self._head += data[: self.COMPRESS_BYTES - len(self._head)]

    def picks(self, first_block: int, nblocks: int, key_hash: int) -> Iterator[int]:
        """Of ``nblocks`` written from entry block ``first_block``, taken as pieces of PIECE bytes, the blocks
        (relative to the span) sampled: about one piece in PIECES_PER_SAMPLE gives one, chosen by key and index
        (a rewrite of the key samples the same block); plain integer work per piece."""
        per = PIECE // BLOCK
        if nblocks <= 8 * per:  # a few pieces: plain integers are quicker than arrays
            for start in range(0, nblocks, per):
                x = (((key_hash ^ (first_block + start)) * _MIX) & 0xFFFFFFFFFFFFFFFF) >> 32  # mixed
                if x % self.PIECES_PER_SAMPLE == 0:
                    yield start + (x >> 8) % min(per, nblocks - start)
            return
        # a CPU-tier page (32 MiB: 64 pieces): the same integers as arrays (uint64 products wrap as the mask does)
        starts = np.arange(0, nblocks, per, dtype=np.uint64)
        xs = ((np.uint64(key_hash) ^ (np.uint64(first_block) + starts)) * np.uint64(_MIX)) >> np.uint64(32)
        for i in np.flatnonzero(xs % np.uint64(self.PIECES_PER_SAMPLE) == 0).tolist():
            start, x = int(starts[i]), int(xs[i])
            yield start + (x >> 8) % min(per, nblocks - start)

    def record(self, key: str, block: int, data: memoryview | bytes) -> None:
        """One sampled 4 KiB block (entry block ``block`` of ``key``): hashed, counted, a repeat caught."""
        d = hashlib.blake2b(data, digest_size=8).digest()
        with self._lock:
            if len(self._digests) >= self.MAX_DIGESTS:
                return
            seen = self._digests.get(d)
            if seen is None:
                self._digests[d] = (key, block)
                self.sampled += 1
            elif seen != (key, block):
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
        self._writers: WriterPool[_Primed] = WriterPool(self.nbytes, lambda size, base: _Primed(self, size, base))
        self.writer_buffer_bytes = 0  # of which filled with noise (each is filled as far as its largest chunk)
        self.bytes_in_place = 0  # entry bytes handed out from writer buffers, stamps rewritten in place
        self.bytes_copied = 0  # entry bytes copied from the noise (fill: the CPU tier; out=: the caller's buffer)
        self.bytes_copied_by_helper = 0  # of which a helper thread copied (a shared fill's second half)
        self._blocks: tuple[np.ndarray, np.ndarray] | None = None  # verify's index (built on first use)
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
        with self._pool_lock:
            counts = {
                "bytes_stamped_in_place": self.bytes_in_place,
                "bytes_copied": self.bytes_copied,
                "bytes_copied_by_helper": self.bytes_copied_by_helper,
                "writer_buffers": self._writers.made,
                "writer_buffer_bytes": self.writer_buffer_bytes,
            }
        return {
            "scheme": f"{self.payload}: each 4 KiB block stamped (key, seed, block index); writers' buffers filled "
            "from the noise once, only the stamps rewritten per chunk; a memory tier copies from the noise",
            "payload": self.payload,
            "noise_bytes": self.nbytes,
            "stamp_bytes_per_block": 8,
            "block_bytes": BLOCK,
            **counts,
            "sample": self.sample.section(),
        }

    def _count(self, in_place: int = 0, copied: int = 0, shared: int = 0) -> None:
        with self._pool_lock:
            self.bytes_in_place += in_place
            self.bytes_copied += copied
            self.bytes_copied_by_helper += shared

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
        """The entry's bytes, ``round_up(nbytes)`` of them, as aligned chunks of at most ``chunk_bytes`` (default
        PIECE): each a view of a writer buffer borrowed from the pool for the iteration, its stamps rewritten
        for the next chunk (consume each before pulling the next, as every tier does). With ``out`` (the
        caller's reusable aligned buffer; chunks of at most ``len(out)``) the noise is copied into it instead.
        A tier that holds the bytes in its own memory calls ``fill``: one copy, straight into it
        (engine/memory.py)."""
        return NoiseChunks(self, key, nbytes, chunk_bytes, out)

    def expected(self, key: str, nbytes: int) -> bytes:
        """The first ``nbytes`` of the entry under ``key`` as ``fill`` and ``out=`` lay it out (from the key's
        own noise offset). A write from a writer buffer has its buffer's layout: check it with ``verify``."""
        buf = aligned_buffer(round_up(max(nbytes, 1)))
        NoiseChunks(self, key, nbytes, PIECE, None).fill(buf, written=False)
        return bytes(buf[:nbytes])

    def head(self, key: str, n: int) -> bytes:
        """First ``n`` bytes of ``expected``."""
        return self.expected(key, n)

    def _block_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(noise block numbers, their second words), sorted by the word: where a block came from."""
        with self._pool_lock:
            if self._blocks is None:
                second = self._u64.reshape(-1, BLOCK // 8)[:, 1]
                order = np.argsort(second, kind="stable")
                self._blocks = (order, second[order])
            return self._blocks

    def verify(self, key: str, data: bytes | memoryview, first_block: int = 0) -> int | None:
        """Whether ``data`` (whole 4 KiB blocks of the entry under ``key``, from its block ``first_block``) is
        what this run's noise wrote for that key, whichever layout wrote it: None if every block is, else the
        entry index of the first block that is not. Each block's words after its stamp must be a noise block's
        and its first word, less that block's, the key's hash ^ the block's index."""
        n = len(data) // BLOCK
        arr = np.frombuffer(data, dtype=np.uint64, count=n * (BLOCK // 8)).reshape(n, BLOCK // 8)
        order, seconds = self._block_index()
        noise = self._u64.reshape(-1, BLOCK // 8)
        h = np.uint64(self.key_hash(key))
        step = 4096  # blocks per pass: the gathered noise blocks stay 16 MiB
        for lo in range(0, n, step):
            part = arr[lo : lo + step]
            pos = np.minimum(np.searchsorted(seconds, part[:, 1]), len(seconds) - 1)
            cand = noise[order[pos]]
            idx = np.arange(first_block + lo, first_block + lo + len(part), dtype=np.uint64)
            ok = (cand[:, 1:] == part[:, 1:]).all(axis=1) & ((cand[:, 0] ^ part[:, 0]) == (idx ^ h))
            for b in np.flatnonzero(~ok):  # rare: two noise blocks with the same second word, or a bad block
                word = part[b, 1]
                same = order[np.searchsorted(seconds, word, "left") : np.searchsorted(seconds, word, "right")]
                want = idx[b] ^ h
                if not any((noise[r, 1:] == part[b, 1:]).all() and noise[r, 0] ^ part[b, 0] == want for r in same):
                    return first_block + lo + int(b)
        return None


class NoiseChunks:
    """One entry's stamped bytes: iterate for chunks in the caller's buffer, or ``fill`` a tier's memory."""

    def __init__(
        self, noise: NoiseBuffer, key: str, nbytes: int, chunk_bytes: int | None, out: memoryview | None
    ) -> None:
        self.noise, self.key, self.padded = noise, key, round_up(nbytes)
        limit = min(chunk_bytes or len(out), len(out)) if out is not None else (chunk_bytes or PIECE)
        self.limit = max(BLOCK, limit // BLOCK * BLOCK)
        self.out = out

    def _pieces(self, dst: memoryview, off: int, block: int, h: int, sample: bool = True) -> tuple[int, int]:
        """Copy into ``dst`` (whole blocks) from noise offset ``off``, entry block ``block``, stamped; returns
        (off, block) after it."""
        noise = self.noise
        at = 0
        while at < len(dst):  # pieces of COPY_PIECE, each within the noise buffer (it wraps)
            m = min(len(dst) - at, COPY_PIECE, noise.nbytes - off)
            piece = dst[at : at + m]
            noise._fill(piece, off, block, h)
            if sample:  # one call: it picks one block of about one PIECE in PIECES_PER_SAMPLE, as a call per PIECE did
                noise.sample.add(self.key, block, piece, h)
            block += m // BLOCK
            at += m
            off = (off + m) % noise.nbytes
        return off, block

    def __iter__(self) -> Iterator[memoryview]:
        return self._copied() if self.out is not None else self._in_place()

    def _in_place(self) -> Iterator[memoryview]:
        """Chunks of ``limit`` bytes from a borrowed writer buffer: only the stamps change between chunks."""
        noise, h = self.noise, self.noise.key_hash(self.key)
        p = noise._writers.borrow(self.limit)
        try:
            block, remaining = 0, self.padded
            while remaining > 0:
                n = min(remaining, self.limit)
                view = p.stamp(n, block, h)
                noise.sample.add(self.key, block, view, h)
                noise._count(in_place=n)
                block += n // BLOCK
                remaining -= n
                yield view
        finally:
            noise._writers.give_back(self.limit, p)  # the consumer is done with every chunk (or dropped the iteration)

    def _copied(self) -> Iterator[memoryview]:
        """Chunks of ``limit`` bytes, each copied into the caller's buffer. With a buffer of at least two
        PIECEs the copy is pipelined: the buffer's two halves take turns, the next half filled by a helper
        thread (numpy's copy releases the GIL) while the caller writes the current one, so a writer keeps
        its device busy through the copy; the chunks are then half the buffer."""
        assert self.out is not None
        buf = self.out
        off, block, h = self.noise.offset_for(self.key), 0, self.noise.key_hash(self.key)
        remaining = self.padded
        half = self.limit // 2 // PIECE * PIECE
        if half == 0 or remaining <= half:  # a small entry or buffer: fill and hand over in turn
            while remaining > 0:
                n = min(remaining, self.limit)
                off, block = self._pieces(buf[:n], off, block, h)
                self.noise._count(copied=n)
                remaining -= n
                yield buf[:n]
            return
        halves = (buf[:half], buf[half : 2 * half])
        pool = self.noise.helpers()

        def fill(k: int, n: int, off: int, block: int) -> tuple[int, int]:
            self.noise._count(copied=n)
            return self._pieces(halves[k][:n], off, block, h)

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

    def fill(
        self,
        dst: memoryview | Sequence[memoryview],
        check: Callable[[int], None] | None = None,
        written: bool = True,
        share: bool = False,
    ) -> None:
        """Write the whole entry (``round_up(nbytes)`` bytes) into ``dst`` directly, from the key's own noise
        offset: one view, or the tier's pages in order (each a multiple of 4 KiB; the bytes are those of one view
        of them all); ``check(done)`` is called between pieces of ``limit`` bytes (a cancel check raises there).
        ``written=False``: a check's copy (``expected``), neither counted nor sampled.

        ``share``: the caller has the host's copying to itself (engine/memory.py: no other read or write of the
        tier in flight); an entry of 2 x SPLIT_BYTES or more is then copied by two threads, its second half (from
        a PIECE boundary) by a helper while this thread copies the first; both call ``check``."""
        noise = self.noise
        spans, done = [], 0  # (view, entry offset of its first byte)
        for v in [dst] if isinstance(dst, memoryview) else dst:
            if done >= self.padded:
                break
            n = min(len(v), self.padded - done)
            spans.append((v[:n], done))
            done += n
        cut = self.padded // 2 // PIECE * PIECE
        if not (share and written and cut >= SPLIT_BYTES):
            self._spans(spans, check, written)
            return
        first, second = [], []
        for v, at in spans:
            if at + len(v) <= cut:
                first.append((v, at))
            elif at >= cut:
                second.append((v, at))
            else:
                first.append((v[: cut - at], at))
                second.append((v[cut - at :], cut))
        rest = noise.helpers().submit(self._spans, second, check, written)  # a cancel stops both halves
        try:
            self._spans(first, check, written)
        finally:  # this thread's error, if any, goes on; the helper's only if this half went well
            _settle(rest)  # the helper never writes into the caller's memory after we return
        rest.result()
        noise._count(shared=self.padded - cut)

    def _spans(self, spans: list[tuple[memoryview, int]], check: Callable[[int], None] | None, written: bool) -> None:
        """Fill each (view, entry offset) in pieces of ``limit`` bytes."""
        noise, h, origin = self.noise, self.noise.key_hash(self.key), self.noise.offset_for(self.key)
        for v, start in spans:
            for at in range(0, len(v), self.limit):
                if check is not None:
                    check(start + at)
                n = min(self.limit, len(v) - at)
                pos = start + at
                self._pieces(v[at : at + n], (origin + pos) % noise.nbytes, pos // BLOCK, h, sample=written)
                if written:
                    noise._count(copied=n)


def _settle(job: Future[Any]) -> None:
    """Wait until ``job`` has finished, through interrupts (a second Ctrl+C while waiting is dropped): its caller
    is about to give back the memory the job writes into."""
    while True:
        try:
            futures_wait([job])
            return
        except BaseException:  # noqa: BLE001 (any interrupt: the wait itself must finish)
            continue


class _Primed:
    """A writer buffer: noise from ``base`` on (wrapping at the noise's end), filled once as far as the largest
    chunk asked of it; a chunk rewrites only each block's first word, from the clean noise word and the stamp."""

    def __init__(self, noise: NoiseBuffer, size: int, base: int) -> None:
        self.noise, self.base = noise, base
        self.view = aligned_buffer(size)
        d64 = np.frombuffer(self.view, dtype=np.uint64)
        self._d64 = d64
        self.words = d64[:: BLOCK // 8]  # each block's first 8 bytes, as they are now
        self.clean = np.empty(len(self.words), dtype=np.uint64)  # the same, unstamped (the noise's)
        self._stamps = np.empty(len(self.words), dtype=np.uint64)
        self._index = np.arange(len(self.words), dtype=np.uint64)
        self.filled = 0  # bytes of the buffer that hold their noise

    def _fill_to(self, n: int) -> None:
        """Copy the noise into the buffer's bytes [filled, n): once per buffer, as far as it is used."""
        noise, at = self.noise, self.filled
        off = (self.base + at) % noise.nbytes
        while at < n:
            m = min(n - at, noise.nbytes - off)
            np.copyto(self._d64[at // 8 : (at + m) // 8], noise._u64[off // 8 : (off + m) // 8])
            at += m
            off = (off + m) % noise.nbytes
        lo, hi = self.filled // BLOCK, n // BLOCK
        self.clean[lo:hi] = self.words[lo:hi]
        with noise._pool_lock:
            noise.writer_buffer_bytes += n - self.filled
        self.filled = n

    def stamp(self, n: int, block: int, h: int) -> memoryview:
        """The buffer's first ``n`` bytes as entry blocks ``block``.. of the key hashed ``h``."""
        if n > self.filled:
            self._fill_to(n)
        k = n // BLOCK
        s = self._stamps[:k]
        np.add(self._index[:k], np.uint64(block), out=s)
        np.bitwise_xor(s, np.uint64(h), out=s)
        np.bitwise_xor(self.clean[:k], s, out=self.words[:k])
        return self.view[:n]
