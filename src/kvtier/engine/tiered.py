"""Waterfall LRU across tiers, fastest first (MLPerf KV Cache spec, sections 3.4-3.5).

* A new entry goes to the fastest tier that may hold it (an entry larger than
  ``large_entry_limit_ratio`` x capacity skips the tier).
* Room is made by taking the tier's least-recently-used entries and demoting each to the next
  tier, recursively (a demotion may itself demote there), down to the bottom tier, which deletes.
  A tier is filled to ``target_usage_ratio`` x capacity; an entry larger than that target may use
  the whole capacity. Recursion is capped at ``max_recursion``; past it, victims are deleted.
* Space is *reserved* under the store lock before any byte is written, and only when it fits, so
  ``used <= capacity`` at every instant. A failed write or demotion releases its reservation, so
  ``used`` always equals the bytes the tiers really hold plus the reservations in flight.
* Every demotion is a real read from the upper tier and a real write to the lower one, timed and
  reported to the event sink with cause "demotion".
* Promotion (``promotion="on-read"``): a hit below the top tier is moved to the top tier with the
  read that serves the request, as production engines do.

Concurrency: one store lock guards metadata only (no I/O under it); each entry has its own lock
held during I/O on it. An entry being moved is marked ``moving`` so it is never chosen twice.
Locks are only nested downwards (an entry lock is held while entries of *lower* tiers are
evicted), and promotion pins its entry before reserving, so lock order is acyclic.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Literal, Protocol, Sequence

from kvtier.engine.backend import Backend, IOTiming, check_cancel
from kvtier.errors import Cancelled, ConfigError, EntryNotFound, StorageError, TierFragmented, TierFullError

Promotion = Literal["none", "on-read"]
ChunkSource = Callable[[], Iterable[memoryview]]


class EventSink(Protocol):
    """Receives every tier operation; the store itself keeps no statistics."""

    def tier_op(self, tier: str, op: str, cause: str, nbytes: int, timing: IOTiming) -> None: ...

    def tier_error(self, tier: str, op: str, cause: str, nbytes: int, error: BaseException) -> None: ...

    def tier_cancelled(self, tier: str, op: str, cause: str, bytes_done: int) -> None: ...

    def count(self, name: str, n: int = 1) -> None: ...


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
    target_usage_ratio: float = 0.8
    large_entry_limit_ratio: float = 0.95
    max_recursion: int = 10
    promotion: Promotion = "none"
    reserve_rounds: int = 16

    def __post_init__(self) -> None:
        if not 0 < self.target_usage_ratio <= 1:
            raise ConfigError(f"eviction.target_usage_ratio: must be in (0, 1], got {self.target_usage_ratio}")
        if not 0 < self.large_entry_limit_ratio <= 1:
            raise ConfigError(f"eviction.large_entry_limit_ratio: must be in (0, 1], got {self.large_entry_limit_ratio}")
        if self.max_recursion < 1:
            raise ConfigError(f"eviction.max_recursion_depth: must be >= 1, got {self.max_recursion}")
        if self.promotion not in ("none", "on-read"):
            raise ConfigError(f"--promotion: expected none or on-read, got {self.promotion!r}")


class _Entry:
    __slots__ = ("key", "nbytes", "tier", "size", "moving", "lock")

    def __init__(self, key: str, nbytes: int) -> None:
        self.key = key
        self.nbytes = nbytes
        self.tier = -1      # index into the store's tiers; -1 while not stored
        self.size = 0       # bytes it occupies in its tier
        self.moving = False  # chosen for demotion, promotion or deletion
        self.lock = threading.Lock()


class _Tier:
    __slots__ = ("backend", "capacity", "target", "max_entry", "used", "lru")

    def __init__(self, backend: Backend, cfg: StoreConfig) -> None:
        self.backend = backend
        self.capacity = backend.capacity_bytes
        self.target = int(self.capacity * cfg.target_usage_ratio)
        self.max_entry = int(self.capacity * cfg.large_entry_limit_ratio)
        self.used = 0
        self.lru: OrderedDict[str, None] = OrderedDict()  # oldest first


@dataclass
class PutResult:
    tier: str | None
    timing: IOTiming
    deduplicated: bool = False  # another thread was writing the same key; no bytes were written


@dataclass
class GetResult:
    hit: bool
    tier: str | None = None
    nbytes: int = 0
    timing: IOTiming = field(default_factory=IOTiming)


class TieredStore:
    """A KV store over an ordered list of tiers (index 0 = fastest)."""

    def __init__(self, backends: Sequence[Backend], config: StoreConfig | None = None,
                 sink: EventSink | None = None, cancel: threading.Event | None = None) -> None:
        self.config = config or StoreConfig()
        self.cancel = cancel
        self.sink: EventSink = sink or NullSink()
        self._tiers = [_Tier(b, self.config) for b in backends if b.capacity_bytes > 0]
        if not self._tiers:
            raise ConfigError("no tier has capacity > 0: give --cpu-mem-gb, --gpu-mem-gb or a cache dir")
        self._entries: dict[str, _Entry] = {}
        self._writing: dict[str, threading.Event] = {}  # keys whose put is in flight
        self._lock = threading.Lock()

    # -- introspection -----------------------------------------------------------------------
    @property
    def tier_names(self) -> list[str]:
        return [t.backend.name for t in self._tiers]

    def usage(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {t.backend.name: {"used_bytes": t.used, "capacity_bytes": t.capacity,
                                     "entries": len(t.lru)} for t in self._tiers}

    def location(self, key: str) -> str | None:
        with self._lock:
            e = self._entries.get(key)
            return self._tiers[e.tier].backend.name if e is not None and e.tier >= 0 else None

    def lru_keys(self, tier: str) -> list[str]:
        with self._lock:
            for t in self._tiers:
                if t.backend.name == tier:
                    return list(t.lru)
        raise KeyError(tier)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def check_accounting(self) -> None:
        """Raise AssertionError-like StorageError if accounting differs from what tiers hold (quiescent only)."""
        with self._lock:
            for i, t in enumerate(self._tiers):
                expect = sum(e.size for e in self._entries.values() if e.tier == i)
                real = t.backend.stored_bytes()
                if not (t.used == expect == real) or t.used > t.capacity:
                    raise StorageError(f"{t.backend.name}: used={t.used} entries={expect} medium={real} "
                                       f"capacity={t.capacity}")

    # -- space -------------------------------------------------------------------------------
    def _threshold(self, t: _Tier, size: int) -> int:
        return t.target if size <= t.target else t.capacity

    def _reserve(self, i: int, size: int, depth: int, buf: memoryview) -> bool:
        """Reserve ``size`` bytes in tier ``i``, demoting LRU victims as needed. No lock held on entry."""
        t = self._tiers[i]
        if size > t.max_entry:
            return False
        thr = self._threshold(t, size)
        for _ in range(self.config.reserve_rounds):
            with self._lock:
                if t.used + size <= thr:
                    t.used += size
                    return True
                victims: list[_Entry] = []
                freed = 0
                for k in t.lru:
                    e = self._entries[k]
                    if e.moving:
                        continue
                    victims.append(e)
                    freed += e.size
                    if t.used - freed + size <= thr:
                        break
                for e in victims:
                    e.moving = True
                    del t.lru[e.key]
            if not victims:
                time.sleep(0.001)  # space is held by writes in flight; let them land
                continue
            for e in victims:
                self._evict(e, i, depth, buf)
        return False

    def _cancellable(self, chunks: Iterable[memoryview], what: str) -> Iterator[memoryview]:
        """Pass chunks through, raising Cancelled between chunks once the cancel event is set."""
        done = 0
        for c in chunks:
            check_cancel(self.cancel, what, done)
            yield c
            done += len(c)

    def _write_making_room(self, i: int, key: str, chunks: Callable[[], Iterable[memoryview]], nbytes: int,
                           buf: memoryview) -> IOTiming:
        """Write into tier i (space reserved); on fragmentation evict more LRU entries and retry."""
        backend = self._tiers[i].backend
        for attempt in range(4):
            try:
                return backend.write(key, chunks(), nbytes)
            except TierFragmented:
                if attempt == 3 or not self._evict_lru_bytes(i, backend.stored_size(nbytes), buf):
                    raise
        raise AssertionError("unreachable")

    def _evict_lru_bytes(self, i: int, nbytes: int, buf: memoryview) -> bool:
        """Evict at least ``nbytes`` of tier i's LRU entries (beyond what accounting asks)."""
        t = self._tiers[i]
        with self._lock:
            victims, freed = [], 0
            for k in t.lru:
                e = self._entries[k]
                if not e.moving:
                    victims.append(e)
                    freed += e.size
                    if freed >= nbytes:
                        break
            for e in victims:
                e.moving = True
                del t.lru[e.key]
        for e in victims:
            self._evict(e, i, 0, buf)
        return bool(victims)

    def _release(self, i: int, size: int) -> None:
        with self._lock:
            self._tiers[i].used -= size

    def _drop(self, e: _Entry, i: int, cause: str) -> None:
        """Delete ``e`` from tier ``i`` for good (caller holds e.lock)."""
        t = self._tiers[i]
        try:
            t.backend.delete(e.key)
        finally:
            with self._lock:
                t.used -= e.size
                if self._entries.get(e.key) is e:
                    del self._entries[e.key]
                t.lru.pop(e.key, None)
                e.tier, e.size, e.moving = -1, 0, False
        self.sink.count(f"evictions_{cause}")

    def _evict(self, e: _Entry, i: int, depth: int, buf: memoryview) -> None:
        """Demote ``e`` out of tier ``i`` (marked moving by the caller) or delete it at the bottom."""
        with e.lock:
            if e.tier != i:  # deleted meanwhile
                return
            if depth < self.config.max_recursion:
                for j in range(i + 1, len(self._tiers)):
                    dst = self._tiers[j]
                    size = dst.backend.stored_size(e.nbytes)
                    if self._reserve(j, size, depth + 1, buf):
                        if self._move(e, i, j, size, buf, cause="demotion"):
                            self.sink.count("demotions")
                            return
                        break  # the move failed and released its reservation: the entry is dropped
            self._drop(e, i, "bottom" if i == len(self._tiers) - 1 else "dropped")

    def _move(self, e: _Entry, i: int, j: int, size: int, buf: memoryview, cause: str) -> bool:
        """Copy ``e`` from tier i to tier j (reservation of ``size`` held in j; caller holds e.lock)."""
        src, dst = self._tiers[i], self._tiers[j]
        read_t = IOTiming()
        try:
            def chunks() -> Iterator[memoryview]:
                return self._cancellable(src.backend.export(e.key, buf, read_t), cause)

            write_t = self._write_making_room(j, e.key, chunks, e.nbytes, buf)
        except StorageError as exc:
            self._release(j, size)
            if isinstance(exc, Cancelled):
                self.sink.tier_cancelled(src.backend.name, "read", cause, exc.bytes_done)
                self.sink.tier_cancelled(dst.backend.name, "write", cause, exc.bytes_done)
            else:
                self.sink.tier_error(dst.backend.name, "write", cause, e.nbytes, exc)
            return False
        self.sink.tier_op(src.backend.name, "read", cause, e.nbytes, read_t)
        self.sink.tier_op(dst.backend.name, "write", cause, e.nbytes, write_t)
        src.backend.delete(e.key)
        with self._lock:
            src.used -= e.size
            e.tier, e.size, e.moving = j, size, False
            dst.lru[e.key] = None
        return True

    # -- public operations -------------------------------------------------------------------
    def put(self, key: str, source: ChunkSource, nbytes: int, buf: memoryview) -> PutResult:
        """Store an entry (replacing any entry under the same key) in the fastest tier with room.

        ``source()`` returns the entry's aligned chunks; it may be called once per tier tried.
        ``buf`` is the caller's reusable aligned buffer, used by demotions this write causes.
        Raises TierFullError when no tier can hold it, StorageError when the write fails.
        Concurrent puts of one key are deduplicated: the later caller waits for the first write
        and returns ``deduplicated=True`` (keys name content, so the bytes would be the same).
        """
        with self._lock:
            busy = self._writing.get(key)
            if busy is None:
                self._writing[key] = threading.Event()
        if busy is not None:
            busy.wait()
            self.sink.count("deduplicated_writes")
            return PutResult(self.location(key), IOTiming(), deduplicated=True)
        try:
            return self._put(key, source, nbytes, buf)
        finally:
            with self._lock:
                self._writing.pop(key).set()

    def _put(self, key: str, source: ChunkSource, nbytes: int, buf: memoryview) -> PutResult:
        self.delete(key)
        e = _Entry(key, nbytes)
        last_error: StorageError | None = None
        for i, t in enumerate(self._tiers):
            size = t.backend.stored_size(nbytes)
            if not self._reserve(i, size, 0, buf):
                continue
            try:
                timing = self._write_making_room(i, key, lambda: self._cancellable(source(), "write"),
                                                 nbytes, buf)
            except StorageError as exc:
                self._release(i, size)
                if isinstance(exc, Cancelled):
                    self.sink.tier_cancelled(t.backend.name, "write", "request", exc.bytes_done)
                    raise
                self.sink.tier_error(t.backend.name, "write", "request", nbytes, exc)
                last_error = exc
                if isinstance(exc, TierFullError):
                    continue  # the medium is full (ENOSPC): try the next tier
                raise
            with self._lock:
                previous = self._entries.get(key)
                if previous is None:
                    e.tier, e.size = i, size
                    self._entries[key] = e
                    t.lru[key] = None
            if previous is not None:  # a concurrent put of the same key won; keep theirs
                t.backend.delete(key)
                self._release(i, size)
            self.sink.tier_op(t.backend.name, "write", "request", nbytes, timing)
            return PutResult(t.backend.name, timing)
        if last_error is not None:
            raise last_error
        raise TierFullError(f"no tier can hold {key!r} ({nbytes} bytes)")

    def get(self, key: str, buf: memoryview) -> GetResult:
        """Read an entry through ``buf``. A miss is a result, not an error."""
        with self._lock:
            e = self._entries.get(key)
        if e is None:
            return GetResult(hit=False)
        if self.config.promotion == "on-read":
            promoted = self._try_promote(e, buf)
            if promoted is not None:
                return promoted
        with e.lock:
            with self._lock:
                if self._entries.get(key) is not e or e.tier < 0:
                    return GetResult(hit=False)
                t = self._tiers[e.tier]
                if key in t.lru:
                    t.lru.move_to_end(key)
            try:
                timing = t.backend.read(key, buf, self.cancel)
            except StorageError as exc:
                if isinstance(exc, Cancelled):
                    self.sink.tier_cancelled(t.backend.name, "read", "request", exc.bytes_done)
                else:
                    self.sink.tier_error(t.backend.name, "read", "request", e.nbytes, exc)
                raise
        self.sink.tier_op(t.backend.name, "read", "request", e.nbytes, timing)
        return GetResult(True, t.backend.name, e.nbytes, timing)

    def _try_promote(self, e: _Entry, buf: memoryview) -> GetResult | None:
        with self._lock:
            i = e.tier
            if i <= 0 or e.moving or self._entries.get(e.key) is not e:
                return None
            e.moving = True
            self._tiers[i].lru.pop(e.key, None)
        top = self._tiers[0]
        size = top.backend.stored_size(e.nbytes)
        if not self._reserve(0, size, 0, buf):
            with self._lock:
                e.moving = False
                if e.tier == i:
                    self._tiers[i].lru[e.key] = None
            return None
        with e.lock:
            src = self._tiers[i]
            read_t = IOTiming()
            try:
                chunks = self._cancellable(src.backend.export(e.key, buf, read_t), "promotion")
                write_t = top.backend.write(e.key, chunks, e.nbytes)
            except StorageError as exc:
                self._release(0, size)
                if isinstance(exc, Cancelled):
                    self.sink.tier_cancelled(src.backend.name, "read", "request", exc.bytes_done)
                    self.sink.tier_cancelled(top.backend.name, "write", "promotion", exc.bytes_done)
                else:
                    self.sink.tier_error(top.backend.name, "write", "promotion", e.nbytes, exc)
                with self._lock:
                    e.moving = False
                    src.lru[e.key] = None
                return None
            src.backend.delete(e.key)
            with self._lock:
                src.used -= e.size
                e.tier, e.size, e.moving = 0, size, False
                top.lru[e.key] = None
        self.sink.tier_op(src.backend.name, "read", "request", e.nbytes, read_t)
        self.sink.tier_op(top.backend.name, "write", "promotion", e.nbytes, write_t)
        self.sink.count("promotions")
        return GetResult(True, src.backend.name, e.nbytes, read_t)

    def delete(self, key: str) -> bool:
        """Remove ``key`` from whichever tier holds it; False if absent."""
        while True:
            with self._lock:
                e = self._entries.get(key)
                if e is None:
                    return False
                if not e.moving:
                    e.moving = True
                    if e.tier >= 0:
                        self._tiers[e.tier].lru.pop(key, None)
                    break
            with e.lock:  # someone is moving it: wait for them, then look again
                pass
        with e.lock:
            if e.tier < 0:
                return False
            t = self._tiers[e.tier]
            try:
                t.backend.delete(key)
            finally:
                with self._lock:
                    t.used -= e.size
                    if self._entries.get(key) is e:
                        del self._entries[key]
                    e.tier, e.size, e.moving = -1, 0, False
        return True

    def close(self) -> None:
        for t in self._tiers:
            t.backend.close()


__all__ = ["TieredStore", "StoreConfig", "PutResult", "GetResult", "EventSink", "NullSink", "EntryNotFound"]
