"""Static noise buffer: KV-entry data without per-request RNG cost.

Generating random float16 costs ~0.1-1.7 GB/s here, far below the device; so one buffer
(256 MiB by default) is generated once from the seed and every entry is a sequence of
zero-copy slices of it, starting at a page-aligned offset derived from the key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import numpy as np

from kvtier.engine.backend import ALIGN, aligned_buffer, round_up

DEFAULT_NOISE_BYTES = 256 * 1024 * 1024


class NoiseBuffer:
    """Seeded, page-aligned random bytes that entries are sliced from."""

    def __init__(self, nbytes: int = DEFAULT_NOISE_BYTES, seed: int = 0) -> None:
        self.nbytes = round_up(max(nbytes, ALIGN))
        self._view = aligned_buffer(self.nbytes)
        arr = np.frombuffer(self._view, dtype=np.uint16)
        rng = np.random.default_rng(seed)
        step = 16 * 1024 * 1024 // 2
        for start in range(0, arr.size, step):  # fill in slices to keep the temporary small
            stop = min(arr.size, start + step)
            arr[start:stop] = rng.integers(0, 1 << 16, size=stop - start, dtype=np.uint16)

    def offset_for(self, key: str) -> int:
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
        return (h % (self.nbytes // ALIGN)) * ALIGN

    def chunks(self, key: str, nbytes: int, chunk_bytes: int) -> Iterator[memoryview]:
        """Aligned slices covering ``round_up(nbytes)`` bytes, wrapping around the buffer."""
        remaining = round_up(nbytes)
        off = self.offset_for(key)
        while remaining > 0:
            n = min(remaining, chunk_bytes, self.nbytes - off)
            yield self._view[off : off + n]
            remaining -= n
            off = (off + n) % self.nbytes

    def head(self, key: str, n: int) -> bytes:
        """First ``n`` bytes of what ``chunks`` yields for ``key`` (for verifying reads)."""
        off = self.offset_for(key)
        return bytes(self._view[off : off + min(n, self.nbytes - off)])
