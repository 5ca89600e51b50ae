"""The waterfall's bookkeeping (engine/tiered.py): an entry's place (its tier, its size there, whether it is
being moved, its lock) and a tier's accounting (capacity, fill target, largest entry, bytes used, its policy)."""

from __future__ import annotations

import threading

from kvtier.engine.backend import Backend
from kvtier.engine.store_api import (
    StoreConfig,
)


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


__all__ = ["_Entry", "_Tier"]
