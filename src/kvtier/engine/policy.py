"""Eviction policies: the order in which a tier gives up its entries when room is needed.

The store owns placement, reservations and the moves; a policy only keeps the order of the keys
a tier holds. It is told when a key arrives (``insert``), is used (``touch``) or leaves
(``remove``), and yields candidate victims, best first (``victims``). The store calls it under
its own lock, so implementations need no locking of their own.

LRU is what the MLPerf reference and vLLM's prefix cache use. The interface is there because the
choice matters for offload tiers (LMCache offers others): a new policy is one class here and one
entry in ``POLICIES``; ``StoreConfig.policy`` also takes any factory.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Literal, Protocol

PolicyName = Literal["lru"]


class EvictionPolicy(Protocol):
    def insert(self, key: str) -> None:
        """A key now lives in the tier (most recently used)."""
        ...

    def touch(self, key: str) -> None:
        """The key was read (no-op for a key the policy does not hold)."""
        ...

    def remove(self, key: str) -> bool:
        """The key left the tier or was picked as a victim; False if it was not held."""
        ...

    def victims(self) -> Iterator[str]:
        """Held keys in eviction order, best victim first. Do not mutate while iterating."""
        ...

    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool: ...


class LRUPolicy:
    """Least recently used first: insertion and each read move a key to the back."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: str) -> bool:
        return self._order.pop(key, 0) is None

    def victims(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {"lru": LRUPolicy}
"""Policies by the name configs use."""


__all__ = ["EvictionPolicy", "LRUPolicy", "POLICIES", "PolicyName"]
