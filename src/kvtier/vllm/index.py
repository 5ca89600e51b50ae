"""The scheduler-side index of kvtier's vLLM offloading backend: which blocks are offloaded, in which tier.

Every entry is one vLLM block of the same size, so a tier is a number of *slots* (its capacity over the
block's stored size there, from the tier table). The index runs kvtier's waterfall on those slots:

* a new block goes to the fastest tier with room; room is made by taking the tier's least recently used
  block and demoting it one tier down (which may demote there in turn); the bottom tier drops its victim;
  a tier with nothing evictable is skipped, as the engine's waterfall skips a tier it cannot reserve in;
* a block being stored (until vLLM says the store completed) or being loaded (until the load completed) is
  pinned: never a victim, never moved;
* ``touch`` (vLLM marks blocks as used, even ones served by its own prefix cache) renews a block's place.

The index decides; the workers carry out. ``plan_store`` returns the actions in the order they must happen
on every worker's real tiers — evictions and demotions that make room before the placements that need it
— and the workers execute each store's actions in submission order, so their tiers hold what the index
says (kvtier/vllm/worker.py). A load reads a block wherever the worker's tiers hold it, so a demotion still
queued when a load runs costs nothing but order.

``SharedIndex`` is the same index in front of a shared Redis/S3 namespace (``remote_namespace: shared:NAME``):
a block this engine did not store may still be there, put by another replica, so a lookup that misses here
asks the store (``present``: one round trip for the request's run of keys) and plans the load from the store.

Pure Python, no vLLM import: tested on its own (tests/unit/vllm/test_index.py).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar, cast

from kvtier.engine.policy import FANOUT_PROTECT_SHARE, FanoutMarks
from kvtier.errors import StorageError

K = TypeVar("K", bound=Hashable)


@dataclass
class TierSlots:
    name: str
    slots: int
    source: str  # where vLLM's by-source counters put a hit from this tier: host, disk, external_unspecified
    lru: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)  # evictable blocks, next victim first
    held: int = 0  # blocks in the tier, pinned ones included
    unshared: OrderedDict[Hashable, None] = field(default_factory=OrderedDict)  # eviction fanout: lru's unshared


@dataclass
class StorePlan(Generic[K]):
    keys_to_store: list[K]  # in the order they were offered (the order of vLLM's source blocks)
    placed: dict[K, int]  # key -> tier index the new block goes to
    actions: list[tuple[str, K, int]]  # (place | move | evict, key, tier index), in the order they must run
    evicted: list[K]  # blocks that left the index (dropped at the bottom)


@dataclass
class IndexCounters:
    """What the index did since it was made (the spec's own Prometheus counters, by tier)."""

    placed: dict[str, int] = field(default_factory=dict)
    demoted: dict[str, int] = field(default_factory=dict)  # by the tier the block left
    evicted: dict[str, int] = field(default_factory=dict)
    rejected: int = 0  # blocks offered that no tier had room for
    failed_stores: int = 0  # blocks whose store vLLM reported failed
    lost: int = 0  # blocks a worker could not load, forgotten


class BlockIndex(Generic[K]):
    """Waterfall LRU over equal-size slots; not thread-safe (vLLM's scheduler calls it from one thread)."""

    def __init__(self, tiers: Iterable[tuple[str, int, str]], eviction: Literal["lru", "fanout"] = "lru") -> None:
        """``eviction`` fanout: a tier's victim is its least recent block that no two continuations followed
        (``note_chain``), a shared one only while shared blocks are more than FANOUT_PROTECT_SHARE of its slots or
        nothing else is evictable (plan/retention.py measures it against LRU on a trace)."""
        self.tiers = [TierSlots(name, slots, source) for name, slots, source in tiers if slots > 0]
        if not self.tiers:
            raise ValueError("no offload tier has room for one block")
        self._where: dict[K, int] = {}
        self._pending: set[K] = set()  # stored by a plan, not yet completed
        self._pins: dict[K, int] = {}  # load pins
        self.counters = IndexCounters()
        self.marks = FanoutMarks(4 * sum(t.slots for t in self.tiers)) if eviction == "fanout" else None
        if self.marks is not None:
            self.marks.on_shared = self._now_shared

    def note_chain(self, keys: Sequence[K]) -> None:
        """A request's block keys in prompt order (eviction fanout learns which blocks are shared from them)."""
        if self.marks is not None:
            self.marks.note(keys)

    def _now_shared(self, key: Hashable) -> None:
        i = self._where.get(cast(K, key))
        if i is not None:
            self.tiers[i].unshared.pop(key, None)

    # -- what vLLM asks -------------------------------------------------------------------
    def lookup(self, key: K) -> Literal["hit", "pending", "miss"]:
        if key not in self._where:
            return "miss"
        return "pending" if key in self._pending else "hit"

    def tier_of(self, key: K) -> TierSlots | None:
        i = self._where.get(key)
        return None if i is None else self.tiers[i]

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def keys(self) -> list[K]:
        """Every block in the index (pinned and pending ones too)."""
        return list(self._where)

    def usage(self) -> dict[str, tuple[int, int]]:
        """tier -> (blocks held, slots)."""
        return {t.name: (t.held, t.slots) for t in self.tiers}

    @property
    def pending(self) -> int:
        """Blocks a plan placed whose store has not completed (a lookup of one answers ``pending``)."""
        return len(self._pending)

    def touch(self, keys: Iterable[K]) -> None:
        for k in keys:
            i = self._where.get(k)
            if i is not None and k in self.tiers[i].lru:
                self.tiers[i].lru.move_to_end(k)
                if k in self.tiers[i].unshared:
                    self.tiers[i].unshared.move_to_end(k)

    def pin(self, keys: Iterable[K]) -> None:
        """Protect blocks being loaded from eviction and moves (until ``unpin``)."""
        for k in keys:
            i = self._where.get(k)
            if i is None:
                continue
            self._pins[k] = self._pins.get(k, 0) + 1
            self.tiers[i].lru.pop(k, None)
            self.tiers[i].unshared.pop(k, None)

    def unpin(self, keys: Iterable[K]) -> None:
        for k in keys:
            n = self._pins.get(k, 0)
            if n <= 1:
                self._pins.pop(k, None)
                self._evictable(k)
            else:
                self._pins[k] = n - 1

    def plan_store(self, keys: Iterable[K]) -> StorePlan[K] | None:
        """Place the blocks not yet in the index; None when some were offered and none found room."""
        plan: StorePlan[K] = StorePlan([], {}, [], [])
        offered = 0
        for k in keys:
            if k in self._where or k in plan.placed:
                continue
            offered += 1
            for i, t in enumerate(self.tiers):
                if self._make_room(i, plan):
                    self._where[k] = i
                    t.held += 1
                    self._pending.add(k)
                    plan.placed[k] = i
                    plan.keys_to_store.append(k)
                    plan.actions.append(("place", k, i))
                    self.counters.placed[t.name] = self.counters.placed.get(t.name, 0) + 1
                    break
            else:
                self.counters.rejected += 1
        if offered and not plan.keys_to_store:
            return None
        return plan

    def complete_store(self, keys: Iterable[K], success: bool = True) -> list[K]:
        """The stores of ``keys`` finished: they become loadable, or (failed) leave the index. Returns the
        keys removed."""
        removed = []
        for k in keys:
            if k not in self._pending:
                continue
            self._pending.discard(k)
            if success:
                self._evictable(k)
            else:
                self.counters.failed_stores += 1
                self._drop(k)
                removed.append(k)
        return removed

    def forget(self, keys: Iterable[K], lost: bool = True) -> int:
        """Blocks a worker could not load (lost or unreadable): out of the index, so the next lookup misses
        instead of failing again (``lost`` False: dropped on purpose, not counted as lost). Returns how many were
        still held."""
        n = 0
        for k in keys:
            if k in self._where:
                self._pending.discard(k)
                self._drop(k)
                n += 1
        if lost:
            self.counters.lost += n
        return n

    def clear(self) -> list[K]:
        """Forget every block (vLLM's reset_cache); returns them."""
        keys = list(self._where)
        for t in self.tiers:
            t.lru.clear()
            t.unshared.clear()
            t.held = 0
        self._where.clear()
        self._pending.clear()
        self._pins.clear()
        return keys

    # -- the waterfall ----------------------------------------------------------------------
    def _evictable(self, k: K, i: int | None = None) -> None:
        i = self._where.get(k) if i is None else i
        if i is not None and k not in self._pending and k not in self._pins:
            self.tiers[i].lru[k] = None
            self.tiers[i].lru.move_to_end(k)
            if self.marks is not None and k not in self.marks.shared:
                self.tiers[i].unshared[k] = None
                self.tiers[i].unshared.move_to_end(k)

    def _drop(self, k: K) -> None:
        i = self._where.pop(k)
        t = self.tiers[i]
        t.held -= 1
        t.lru.pop(k, None)
        t.unshared.pop(k, None)
        self._pins.pop(k, None)
        if self.marks is not None:
            self.marks.forget(k)

    def _victim(self, t: TierSlots) -> K:
        """The tier's next victim: its least recent block, or under eviction fanout its least recent unshared one
        while the shared ones are at most FANOUT_PROTECT_SHARE of its slots."""
        if t.unshared and len(t.lru) - len(t.unshared) <= FANOUT_PROTECT_SHARE * t.slots:
            return cast(K, next(iter(t.unshared)))
        return cast(K, next(iter(t.lru)))

    def _make_room(self, i: int, plan: StorePlan[K]) -> bool:
        """One free slot in tier i, by demoting its LRU block to tier i+1 (or dropping it at the bottom or
        when the tier below has no room either). False when every block there is pinned or pending."""
        t = self.tiers[i]
        if t.held < t.slots:
            return True
        if not t.lru:
            return False
        victim = self._victim(t)
        del t.lru[victim]
        t.unshared.pop(victim, None)
        t.held -= 1
        below = i + 1
        if below < len(self.tiers) and self._make_room(below, plan):
            self._where[victim] = below
            self.tiers[below].held += 1
            self._evictable(victim, below)  # the newest there: it was just written
            plan.actions.append(("move", victim, below))
            self.counters.demoted[t.name] = self.counters.demoted.get(t.name, 0) + 1
        else:
            del self._where[victim]
            if self.marks is not None:
                self.marks.forget(victim)
            plan.actions.append(("evict", victim, i))
            plan.evicted.append(victim)
            self.counters.evicted[t.name] = self.counters.evicted.get(t.name, 0) + 1
        return True


class SharedIndex(BlockIndex[K]):
    """The index of an engine whose one offload tier is a shared namespace other replicas write too. What this
    engine stored it answers itself; a miss asks ``present`` about the block and the request's following ones
    at once (the answers serve the lookups that follow, until a key outside them is asked), and a block found
    there is a hit served from the shared tier. A store that does not answer is a miss, counted
    (``server_errors``), and is not asked again for ``BACKOFF_S``: a dead store must not stall every lookup. A
    part of it that does not answer (``None`` for its keys: a cluster's lost master) is a miss for those keys,
    counted, while the rest is used."""

    BACKOFF_S = 5.0

    def __init__(
        self,
        tiers: Iterable[tuple[str, int, str]],
        present: Callable[[Sequence[K]], list[bool | None]],
        eviction: Literal["lru", "fanout"] = "lru",
    ) -> None:
        super().__init__(tiers, eviction)
        self._present = present
        self._found: dict[K, bool | None] = {}
        self._down_until = 0.0
        self.server_errors = 0
        self.shared_found = 0  # blocks found in the namespace that this engine had not stored

    def lookup(self, key: K, following: Callable[[], Sequence[K]] | None = None) -> Literal["hit", "pending", "miss"]:
        r = super().lookup(key)
        if r != "miss":
            return r
        if key not in self._found:
            self._found = {}
            if time.monotonic() < self._down_until:
                return "miss"
            batch = [key, *(k for k in (following() if following else ()) if k != key and k not in self)]
            try:
                answers = self._present(batch)
            except (StorageError, OSError):
                self.server_errors += 1
                self._down_until = time.monotonic() + self.BACKOFF_S
                return "miss"
            self._found = dict(zip(batch, answers, strict=False))
            if any(a is None for a in answers):
                self.server_errors += 1
        if self._found.get(key):
            self.shared_found += 1
            return "hit"
        return "miss"

    def tier_of(self, key: K) -> TierSlots | None:
        t = super().tier_of(key)
        return self.tiers[-1] if t is None and self._found.get(key) else t

    def plan_store(self, keys: Iterable[K]) -> StorePlan[K] | None:
        """As BlockIndex's, less the blocks just found in the namespace (another replica's, already there)."""
        return super().plan_store(k for k in keys if not self._found.get(k))


__all__ = ["BlockIndex", "SharedIndex", "StorePlan", "TierSlots", "IndexCounters"]
