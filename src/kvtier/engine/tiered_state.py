"""The waterfall's bookkeeping (engine/tiered.py): an entry's place (its tier, its size there, whether it is
being moved, its lock), a tier's accounting (capacity, fill target, largest entry, bytes used, its policy), and
what the store shows of them (``StoreViews``: usage, locations, eviction order, the accounting check)."""

from __future__ import annotations

import threading
from typing import Any

from kvtier.engine.backend import Backend
from kvtier.engine.store_api import (
    StoreConfig,
)
from kvtier.errors import StorageError


class _Entry:
    __slots__ = ("key", "nbytes", "tier", "size", "moving", "lock", "filler")

    def __init__(self, key: str, nbytes: int, filler: bool = False) -> None:
        self.key = key
        self.nbytes = nbytes
        self.filler = filler  # preconditioning data: never read, never demoted, removed when room is needed
        self.tier = -1  # index into the store's tiers; -1 while not stored
        self.size = 0  # bytes it occupies in its tier
        self.moving = False  # chosen for demotion, promotion or deletion (then not in its tier's policy)
        self.lock = threading.Lock()


class _Tier:
    __slots__ = ("backend", "capacity", "target", "max_entry", "used", "policy", "cfg")

    def __init__(self, backend: Backend, cfg: StoreConfig) -> None:
        self.backend = backend
        self.cfg = cfg
        self.used = 0
        self.policy = cfg.policy()  # the entries that may be chosen as victims, in eviction order
        self.resize(backend.capacity_bytes)

    def resize(self, capacity: int) -> None:
        """The tier's size, and the fill target and largest entry that follow from it."""
        self.capacity = capacity
        self.target = int(capacity * self.cfg.tier_target_ratios.get(self.backend.name, self.cfg.target_usage_ratio))
        self.max_entry = int(capacity * self.cfg.large_entry_limit_ratio)

    def threshold(self, size: int) -> int:
        """Fill limit for an entry of ``size``: the target, or the whole capacity for an entry larger
        than the target (which may still use the tier, up to large_entry_limit_ratio)."""
        return self.target if size <= self.target else self.capacity


class StoreViews:
    """The read-only side of engine/tiered.py's ``TieredStore``: what it holds, where, and whether its accounting
    matches the tiers' media. Each view takes the store lock for its own read."""

    _tiers: list[_Tier]
    _entries: dict[str, _Entry]
    _in_use: set[_Entry]
    _lock: threading.Lock

    def filler_bytes(self) -> int:
        """Logical bytes of the filler entries (preconditioning data) still stored."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values() if e.filler and e.tier >= 0)

    def filler_entries(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.filler and e.tier >= 0)

    def largest_entry_bytes(self) -> int:
        """The largest entry (logical bytes) some tier may hold: its stored size within that tier's limit."""
        best = 0
        for t in self._tiers:
            if t.max_entry >= t.backend.stored_size(0):
                # stored_size is padding + header: the payload that fits is the limit less the overhead
                best = max(best, t.max_entry - t.backend.stored_size(0))
        return best

    def host_short(self) -> dict[str, dict[str, Any]]:
        """Per RAM tier that stopped growing because the host ran short of memory: when, and at what size."""
        out = {}
        for t in self._tiers:
            record = getattr(t.backend, "host_short", None)
            if record:
                out[t.backend.name] = dict(record)
        return out

    @property
    def tier_names(self) -> list[str]:
        return [t.backend.name for t in self._tiers]

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: bytes used (the tier's stored sizes), capacity, entries; a paged tier adds its page and
        the part of the used pages no entry fills."""
        with self._lock:
            held = [len(t.policy) for t in self._tiers]  # the evictable entries, and those in use (few)
            for e in self._in_use:
                held[e.tier] += 1
            out = {
                t.backend.name: {"used_bytes": t.used, "capacity_bytes": t.capacity, "entries": held[i]}
                for i, t in enumerate(self._tiers)
            }
        for t in self._tiers:
            waste = getattr(t.backend, "waste_bytes", None)
            if waste is not None:
                out[t.backend.name].update(page_bytes=getattr(t.backend, "page_bytes", 0), waste_bytes=waste())
        return out

    def location(self, key: str) -> str | None:
        with self._lock:
            e = self._entries.get(key)
            return self._tiers[e.tier].backend.name if e is not None and e.tier >= 0 else None

    def eviction_order(self, tier: str) -> list[str]:
        """The tier's evictable keys, next victim first."""
        with self._lock:
            for t in self._tiers:
                if t.backend.name == tier:
                    return list(t.policy.victims())
        raise KeyError(tier)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def check_accounting(self) -> None:
        """Raise StorageError if accounting differs from what the tiers hold (call when quiescent)."""
        with self._lock:
            for i, t in enumerate(self._tiers):
                expect = sum(e.size for e in self._entries.values() if e.tier == i)
                real = t.backend.stored_bytes()
                if not (t.used == expect == real) or t.used > t.capacity:
                    raise StorageError(
                        f"{t.backend.name}: used={t.used} entries={expect} medium={real} capacity={t.capacity}"
                    )


__all__ = ["StoreViews", "_Entry", "_Tier"]
