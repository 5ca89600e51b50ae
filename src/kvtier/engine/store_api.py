"""The store's contract with its callers: the rules it is given (``StoreConfig``), the sinks it reports
to (``EventSink`` for every operation, error and cancellation; ``IOLog`` for the I/O trace), what a put or
get returns, and the chunk iterator that checks the cancel event between chunks."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvtier.engine.backend import check_cancel
from kvtier.engine.policy import EvictionPolicy, LRUPolicy
from kvtier.telemetry.clock import IOTiming

Promotion = Literal["none", "on-read"]
ChunkSource = Callable[[], Iterable[memoryview]]


class CancellableChunks:
    """Chunks checked against the cancel event between chunks (and between ``fill``'s pieces)."""

    def __init__(self, chunks: Iterable[memoryview], cancel: threading.Event | None, what: str) -> None:
        self.chunks, self.cancel, self.what = chunks, cancel, what
        inner = getattr(chunks, "fill", None)
        if inner is not None:
            self.fill = lambda dst, share=False: inner(
                dst, lambda done: check_cancel(self.cancel, self.what, done), share=share
            )

    def __iter__(self) -> Iterator[memoryview]:
        done = 0
        for c in self.chunks:
            check_cancel(self.cancel, self.what, done)
            yield c
            done += len(c)


class EventSink(Protocol):
    """Receives every tier operation; the store itself keeps no statistics."""

    def tier_op(self, tier: str, op: str, cause: str, nbytes: int, timing: IOTiming) -> None: ...

    def tier_error(self, tier: str, op: str, cause: str, nbytes: int, error: BaseException) -> None: ...

    def tier_cancelled(self, tier: str, op: str, cause: str, bytes_done: int) -> None: ...

    def count(self, name: str, n: int = 1) -> None: ...


class IOLog(Protocol):
    """Receives every completed tier operation with its key (the I/O trace, tracefile.py)."""

    def io(self, op: str, tier: str, key: str, cause: str, nbytes: int) -> None: ...


class NullSink:
    def tier_op(self, tier: str, op: str, cause: str, nbytes: int, timing: IOTiming) -> None:
        pass

    def tier_error(self, tier: str, op: str, cause: str, nbytes: int, error: BaseException) -> None:
        pass

    def tier_cancelled(self, tier: str, op: str, cause: str, bytes_done: int) -> None:
        pass

    def count(self, name: str, n: int = 1) -> None:
        pass


@dataclass(frozen=True)
class StoreConfig:
    """The waterfall's rules. Bad values raise ValueError (the caller names its own setting)."""

    target_usage_ratio: float = 0.8
    large_entry_limit_ratio: float = 0.95
    max_recursion: int = 10
    promotion: Promotion = "none"
    reserve_rounds: int = 16
    max_evictions_hard_cap: int = 5000
    max_evictions_min: int = 1000
    reserve_wait_s: float = 1.0
    policy: Callable[[], EvictionPolicy] = field(default=LRUPolicy)
    tier_eviction_caps: Mapping[str, int] = field(default_factory=dict)
    """Further caps on the victims one reservation may evict, by tier name (the GPU tier's
    ``gpu_backend.max_eviction_attempts``)."""
    tier_target_ratios: Mapping[str, float] = field(default_factory=dict)
    """A tier's own fill target, by tier name, instead of target_usage_ratio (the file tier's
    ``--s3-cold-threshold``: past it, its LRU entries go down to S3)."""

    def __post_init__(self) -> None:
        if not 0 < self.target_usage_ratio <= 1:
            raise ValueError(f"target_usage_ratio must be in (0, 1], got {self.target_usage_ratio}")
        if not 0 < self.large_entry_limit_ratio <= 1:
            raise ValueError(f"large_entry_limit_ratio must be in (0, 1], got {self.large_entry_limit_ratio}")
        if self.max_recursion < 1:
            raise ValueError(f"max_recursion must be >= 1, got {self.max_recursion}")
        if self.promotion not in ("none", "on-read"):
            raise ValueError(f"promotion must be none or on-read, got {self.promotion!r}")
        if self.reserve_rounds < 1 or self.max_evictions_hard_cap < 1 or self.max_evictions_min < 1:
            raise ValueError("reserve_rounds, max_evictions_hard_cap and max_evictions_min must be >= 1")
        if self.reserve_wait_s < 0:
            raise ValueError(f"reserve_wait_s must be >= 0, got {self.reserve_wait_s}")
        for name, ratio in self.tier_target_ratios.items():
            if not 0 < ratio <= 1:
                raise ValueError(f"the {name} tier's target ratio must be in (0, 1], got {ratio}")

    def eviction_limit(self, entries: int, tier: str = "") -> int:
        """Victims one reservation may evict in a tier holding ``entries`` (the reference's bound)."""
        limit = min(self.max_evictions_hard_cap, max(self.max_evictions_min, entries + 100))
        return min(limit, self.tier_eviction_caps.get(tier, limit))


@dataclass
class PutResult:
    tier: str | None
    timing: IOTiming
    deduplicated: bool = False  # another thread was writing the same key; no bytes were written
    held: bool = False  # put with hold=True and committed: not evictable until release(key)


@dataclass
class GetResult:
    hit: bool
    tier: str | None = None
    nbytes: int = 0
    timing: IOTiming = field(default_factory=IOTiming)
