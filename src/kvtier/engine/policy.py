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
from collections.abc import Callable, Hashable, Iterator, Sequence
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

FANOUT_PROTECT_SHARE = 0.9
"""Of a tier's evictable blocks, the share shared (fanout) blocks may keep before the oldest of them is a victim
again: measured on the τ²-bench traces against 0.5-1.0 (docs/plan.md, "Protecting shared prefixes")."""


class FanoutMarks:
    """Which prefix blocks more than one continuation used: a block's *fanout* in the prefix tree of the requests
    seen, from each request's chain of block keys in prompt order (no session identity needed: a system prompt's
    blocks are followed by every conversation's own). A block followed by two different blocks is shared, and so is
    every block before it in a chain (its prefix is used by both continuations). At most ``memory`` blocks'
    continuations are remembered, the least recently noted forgotten first."""

    def __init__(self, memory: int = 1 << 20) -> None:
        self.memory = memory
        self._next: OrderedDict[Hashable, Hashable] = OrderedDict()  # block -> its one continuation seen so far
        self.shared: set[Hashable] = set()
        self.on_shared: Callable[[Hashable], None] = lambda key: None  # told when a block becomes shared

    def note(self, chain: Sequence[Hashable]) -> None:
        """One request's block keys, in prompt order."""
        for i in range(len(chain) - 1):
            a, b = chain[i], chain[i + 1]
            if a in self.shared:
                continue
            seen = self._next.get(a)
            if seen is None:
                self._next[a] = b
                self._next.move_to_end(a)
                if len(self._next) > self.memory:
                    self._next.popitem(last=False)
            elif seen != b:
                for k in chain[: i + 1]:  # a branches: it and its prefix are used by both continuations
                    if k not in self.shared:
                        self.shared.add(k)
                        self._next.pop(k, None)
                        self.on_shared(k)

    def forget(self, key: Hashable) -> None:
        """A block no tier holds any more: its mark goes (a later store of it starts unshared)."""
        self.shared.discard(key)


__all__ = ["EvictionPolicy", "FanoutMarks", "FANOUT_PROTECT_SHARE", "LRUPolicy", "POLICIES", "PolicyName"]
