"""A tier that moves no bytes: the I/O trace mode's stand-in for every real tier.

It keeps what the store needs to make the same decisions as a real run — which keys it holds and
their sizes, and the medium's ``stored_size`` (padding and headers), so capacity and eviction
behave as they would on the real tier — but ``write`` never reads its chunks and ``read`` copies
nothing. Timings are zero: a trace records *what* would be moved, never how long it took.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

from kvtier.engine.backend import round_up
from kvtier.errors import EntryNotFound
from kvtier.telemetry.clock import IOTiming


class NullTier:
    def __init__(self, name: str, capacity_bytes: int, stored_size: Callable[[int], int] = round_up) -> None:
        self.name = name
        self.capacity_bytes = capacity_bytes
        self._stored_size = stored_size
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def stored_size(self, nbytes: int) -> int:
        return self._stored_size(nbytes)

    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        with self._lock:
            self._held[key] = self._stored_size(nbytes)
        return IOTiming()

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        if key not in self._held:
            raise EntryNotFound(f"{self.name} tier: {key!r} not stored")
        return IOTiming()

    def export(self, key: str, buf: memoryview, timing: IOTiming) -> Iterator[memoryview]:
        if key not in self._held:
            raise EntryNotFound(f"{self.name} tier: {key!r} not stored")
        return iter(())

    def delete(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def stored_bytes(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def close(self) -> None:
        with self._lock:
            self._held.clear()


__all__ = ["NullTier"]
