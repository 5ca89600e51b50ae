"""Waterfall LRU across tiers, fastest first (MLPerf KV Cache spec, sections 3.4-3.5).

* A new entry goes to the fastest tier that may hold it (an entry larger than
  ``large_entry_limit_ratio`` x capacity skips the tier).
* Room is made by taking the tier's victims — in the order its eviction policy gives (LRU,
  engine/policy.py) — and demoting each to the next tier, recursively (a demotion may itself
  demote there), down to the bottom tier, which deletes. One reservation evicts at most
  min(max_evictions_hard_cap, max(max_evictions_min, entries + 100)) victims, as the reference
  bounds one ensure-space call; then the entry tries the next tier.
  A tier is filled to ``target_usage_ratio`` x capacity; an entry larger than that target may use
  the whole capacity. Recursion is capped at ``max_recursion``; past it, victims are deleted.
* Space is *reserved* under the store lock before any byte is written, and only when it fits, so
  ``used <= capacity`` at every instant. A failed write or demotion releases its reservation, so
  ``used`` always equals the bytes the tiers really hold plus the reservations in flight.
* Every demotion is a real read from the upper tier and a real write to the lower one, timed and
  reported to the event sink with cause "demotion".
* Promotion (``promotion="on-read"``): a hit below the top tier is moved to the top tier with the
  read that serves the request, as production engines do. Demotion and promotion are one copy
  routine (``_copy``), so both make room the same way and book their I/O the same way.
* An entry written with ``put(..., hold=True)`` is *in use* until ``release(key)``: it stays out of its
  tier's eviction order (as an engine never evicts the blocks of a sequence it is running), so the
  request that wrote it reads it back where it was written. Released, it is the most recently used.
* Room held only by writes in flight or entries in use (nothing evictable) is waited for on a condition
  variable that every release of space, of a victim or of an entry in use notifies, up to
  ``reserve_wait_s``; then the entry tries the next tier (counted as ``reserve_waits_expired``).
* An entry whose read fails (deleted, truncated or corrupt on the medium) is dropped: the read
  raises, and later lookups miss instead of failing again.

Concurrency: one store lock guards metadata only (no I/O under it); each entry has its own lock
held during I/O on it. An entry being moved is marked ``moving`` so it is never chosen twice.
Locks are only nested downwards (an entry lock is held while entries of *lower* tiers are
evicted), and promotion pins its entry before reserving, so lock order is acyclic.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from kvtier.engine.backend import Backend
from kvtier.engine.device import Chunk, DeviceMemory, DevicePaths, Feed
from kvtier.engine.store_api import (
    CancellableChunks,
    ChunkSource,
    EventSink,
    GetResult,
    IOLog,
    NullSink,
    PutResult,
    StoreConfig,
)
from kvtier.engine.tiered_state import StoreViews, _Entry, _Tier
from kvtier.errors import Cancelled, EntryNotFound, ForeignEntry, HostMemoryShort, StorageError, TierFullError
from kvtier.telemetry.clock import IOTiming


class TieredStore(StoreViews):
    """A KV store over an ordered list of tiers (index 0 = fastest)."""

    def __init__(
        self,
        backends: Sequence[Backend],
        config: StoreConfig | None = None,
        sink: EventSink | None = None,
        cancel: threading.Event | None = None,
        device: DeviceMemory | None = None,
    ) -> None:
        self.config = config or StoreConfig()
        self.cancel = cancel
        self.device = device  # --gpu-native: chunks may be device memory, and reads land there (engine/device.py)
        self.sink: EventSink = sink or NullSink()
        self.io_log: IOLog | None = None  # set by the I/O trace mode; None costs one test per operation
        self._tiers = [_Tier(b, self.config) for b in backends if b.capacity_bytes > 0]
        # the tiers whose key space others write too (--remote-namespace shared:NAME): a miss is looked up there
        self._shared = [
            t for t in self._tiers if getattr(t.backend, "namespace", None) and hasattr(t.backend, "read_shared")
        ]
        if not self._tiers:
            raise ValueError("no tier has a capacity > 0")
        self._entries: dict[str, _Entry] = {}
        self._writing: dict[str, threading.Event] = {}  # keys whose put is in flight
        self._in_use: set[_Entry] = set()  # put with hold and not yet released: in no tier's policy
        self._lock = threading.Lock()
        self._space = threading.Condition(self._lock)  # notified when room or a victim may have appeared

    # -- victims and removal (each in one place) ---------------------------------------------
    def _pick_victims(self, t: _Tier, enough: Callable[[int], bool], most: int) -> list[_Entry]:
        """Under the store lock: the tier's next victims (not already moving), in policy order, until
        ``enough(bytes freed)`` or ``most`` of them. They are marked moving and leave the policy."""
        victims: list[_Entry] = []
        freed = 0
        for k in t.policy.victims():
            if len(victims) >= most:
                break
            e = self._entries[k]
            if e.moving:
                continue
            victims.append(e)
            freed += e.size
            if enough(freed):
                break
        for e in victims:
            e.moving = True
            t.policy.remove(e.key)
        return victims

    def _remove(self, e: _Entry) -> None:
        """Delete ``e`` from its tier and forget it (caller holds e.lock; e.tier >= 0)."""
        t = self._tiers[e.tier]
        try:
            t.backend.delete(e.key)
        finally:
            with self._lock:
                t.used -= e.size
                if self._entries.get(e.key) is e:
                    del self._entries[e.key]
                t.policy.remove(e.key)
                self._in_use.discard(e)
                e.tier, e.size, e.moving = -1, 0, False
                self._space.notify_all()

    def _done(self, tier: str, op: str, cause: str, key: str, nbytes: int, timing: IOTiming) -> None:
        """A completed operation, told to the sink and (trace mode) the I/O log: the one place both learn of it."""
        self.sink.tier_op(tier, op, cause, nbytes, timing)
        if self.io_log is not None:
            self.io_log.io(op, tier, key, cause, nbytes)

    def _release(self, i: int, size: int) -> None:
        with self._lock:
            self._tiers[i].used -= size
            self._space.notify_all()

    def _unpin(self, e: _Entry, i: int) -> None:
        """A move of ``e`` did not happen: it stays in tier i, evictable again (unless in use)."""
        with self._lock:
            e.moving = False
            if e.tier == i and self._entries.get(e.key) is e and e not in self._in_use:
                self._tiers[i].policy.insert(e.key)
            self._space.notify_all()

    # -- space -------------------------------------------------------------------------------
    def _reserve(self, i: int, size: int, depth: int, buf: memoryview) -> bool:
        """Reserve ``size`` bytes in tier ``i``, demoting victims as needed. No lock held on entry.

        False when the entry may not use the tier, when the eviction limit is reached, when room
        held by writes in flight does not come free within ``reserve_wait_s``, or on cancel."""
        t = self._tiers[i]
        if size > t.max_entry:
            return False
        thr = t.threshold(size)
        limit: int | None = None
        evicted = 0
        deadline: float | None = None
        waited, expired = 0.0, False  # told to the sink after the store lock is let go
        try:
            for _ in range(self.config.reserve_rounds):
                with self._lock:
                    while True:
                        if t.used + size <= thr:
                            t.used += size
                            return True
                        if limit is None:
                            limit = self.config.eviction_limit(len(t.policy), t.backend.name)
                        if evicted >= limit:
                            return False
                        victims = self._pick_victims(t, lambda freed: t.used - freed + size <= thr, limit - evicted)
                        if victims:
                            break
                        # Nothing evictable: the room is held by writes in flight, entries being moved or in use.
                        now = time.monotonic()
                        deadline = deadline if deadline is not None else now + self.config.reserve_wait_s
                        if self.cancel is not None and self.cancel.is_set():
                            return False
                        if now >= deadline:
                            expired = True
                            return False
                        self._space.wait(min(0.1, deadline - now))  # short bound: the cancel event is polled
                        waited += time.monotonic() - now
                for e in victims:
                    self._evict(e, i, depth, buf)
                evicted += len(victims)
            return False
        finally:
            if waited:
                self.sink.count("reserve_wait_ns", int(waited * 1e9))
            if expired:
                self.sink.count("reserve_waits_expired")

    def _cancellable(self, chunks: Iterable[memoryview], what: str) -> Iterable[memoryview]:
        """Pass chunks through, raising Cancelled between chunks once the cancel event is set; a source
        that can ``fill`` a tier's memory directly keeps that ability (with the same check between pieces)."""
        return CancellableChunks(chunks, self.cancel, what)

    def _feed(self, backend: Backend, chunks: Iterable[Chunk]) -> Iterable[Chunk]:
        """``chunks`` on their way into ``backend``: as they are, or (--gpu-native) counted by path, and copied
        through a pinned host buffer where the tier cannot take device memory (engine/device.py ``Feed``; its
        counts are committed by ``_fed`` once the write succeeded)."""
        if self.device is None:
            return chunks
        return self.device.feed(chunks, backend.name, getattr(backend, "takes_device", False))

    @staticmethod
    def _fed(chunks: Iterable[Chunk]) -> None:
        if isinstance(chunks, Feed):
            chunks.commit()

    def _read(self, backend: Backend, key: str, buf: memoryview) -> IOTiming:
        """A request's read. --gpu-native: the tier's export lands, chunk by chunk, in this thread's device
        buffer; the landing copy is the read's device time from a memory tier (it is that tier's read), host
        time after a storage tier's own I/O."""
        dm = self.device
        if dm is None:
            return backend.read(key, buf, self.cancel)
        timing = IOTiming()
        own = getattr(backend, "in_memory", False)
        landed = {DevicePaths.DEVICE_TO_DEVICE: 0, DevicePaths.HOST_TO_DEVICE: 0}
        for c in self._cancellable(backend.export(key, buf, timing), "read"):
            t = time.perf_counter_ns()
            from_device = dm.land(c)
            dt = time.perf_counter_ns() - t
            if own:
                timing.device_ns += dt
            else:
                timing.host_ns += dt
            landed[DevicePaths.DEVICE_TO_DEVICE if from_device else DevicePaths.HOST_TO_DEVICE] += len(c)
        for path, n in landed.items():  # a completed read only, as the statistics count it
            if n:
                dm.paths.add("read", backend.name, path, n)
        return timing

    def _evict(self, e: _Entry, i: int, depth: int, buf: memoryview) -> None:
        """Demote ``e`` out of tier ``i`` (picked as a victim by the caller) or delete it at the bottom."""
        with e.lock:
            if e.tier != i:  # deleted meanwhile
                return
            if e.filler:  # preconditioning data makes room by going away, counted apart from evictions
                self._remove(e)
                self.sink.count("filler_removed")
                self.sink.count("filler_removed_bytes", e.nbytes)
                return
            if depth < self.config.max_recursion:
                for j in range(i + 1, len(self._tiers)):
                    size = self._tiers[j].backend.stored_size(e.nbytes)
                    if self._reserve(j, size, depth + 1, buf):
                        if self._copy(e, i, j, size, buf, "demotion", "demotion") is not None:
                            self.sink.count("demotions")
                            return
                        break  # the copy failed and released its reservation: the entry is dropped
            self._remove(e)
            self.sink.count("evictions_bottom" if i == len(self._tiers) - 1 else "evictions_dropped")

    def _copy(
        self, e: _Entry, i: int, j: int, size: int, buf: memoryview, read_cause: str, write_cause: str
    ) -> IOTiming | None:
        """Move ``e`` from tier i to tier j: the one copy routine of demotion and promotion.

        The caller holds e.lock, e is picked (moving), and ``size`` bytes are reserved in j. On
        success the entry lives in j and the read's timing is returned; on failure the
        reservation is released, the entry stays in i (still picked) and None is returned. A
        failed or cancelled move books its read under ``write_cause`` — it served no request."""
        src, dst = self._tiers[i], self._tiers[j]
        read_t = IOTiming()
        read_error: list[StorageError] = []

        def chunks() -> Iterator[memoryview]:
            try:
                yield from self._cancellable(src.backend.export(e.key, buf, read_t), write_cause)
            except Cancelled:
                raise
            except StorageError as exc:
                read_error.append(exc)
                raise

        try:
            fed = self._feed(dst.backend, chunks())
            write_t = dst.backend.write(e.key, fed, e.nbytes)
            self._fed(fed)
        except StorageError as exc:
            self._release(j, size)
            if isinstance(exc, HostMemoryShort):
                self._host_short(dst)
            elif isinstance(exc, Cancelled):
                self.sink.tier_cancelled(src.backend.name, "read", write_cause, exc.bytes_done)
                self.sink.tier_cancelled(dst.backend.name, "write", write_cause, exc.bytes_done)
            elif read_error:
                self.sink.tier_error(src.backend.name, "read", write_cause, e.nbytes, exc)
            else:
                self.sink.tier_error(dst.backend.name, "write", write_cause, e.nbytes, exc)
            return None
        src.backend.delete(e.key)
        with self._lock:
            src.used -= e.size
            e.tier, e.size, e.moving = j, size, False
            if e not in self._in_use:
                dst.policy.insert(e.key)
            self._space.notify_all()
        self._done(src.backend.name, "read", read_cause, e.key, e.nbytes, read_t)
        self._done(dst.backend.name, "write", write_cause, e.key, e.nbytes, write_t)
        return read_t

    def _commit(self, e: _Entry, i: int, size: int, hold: bool = False) -> bool:
        """A written entry joins tier i (its ``size`` bytes already reserved and written), in use when
        ``hold`` — unless a concurrent put of the same key committed first: then theirs is kept, ours
        given back, and False returned."""
        t = self._tiers[i]
        with self._lock:
            previous = self._entries.get(e.key)
            if previous is None:
                e.tier, e.size = i, size
                self._entries[e.key] = e
                if hold:
                    self._in_use.add(e)
                else:
                    t.policy.insert(e.key)
                self._space.notify_all()
        if previous is not None:
            t.backend.delete(e.key)
            self._release(i, size)
        return previous is None

    def _host_short(self, t: _Tier) -> bool:
        """A RAM tier stopped growing (the host ran short of memory): the store takes its new size; entries over
        it make room as any full tier does. Counted, not a tier error; the tier says when and at what size.
        False when the tier is no smaller than the store knew (nothing to retry)."""
        with self._lock:
            if t.backend.capacity_bytes >= t.capacity:
                return False
            t.resize(t.backend.capacity_bytes)
            self._space.notify_all()
        self.sink.count("host_memory_short")
        return True

    # -- public operations -------------------------------------------------------------------
    def put(self, key: str, source: ChunkSource, nbytes: int, buf: memoryview, hold: bool = False) -> PutResult:
        """Store an entry (replacing any entry under the same key) in the fastest tier with room; with
        ``hold`` it is in use (never a victim) until ``release(key)`` (``PutResult.held`` says it is).

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
            return self._put(key, source, nbytes, buf, hold)
        finally:
            with self._lock:
                self._writing.pop(key).set()

    def _put(self, key: str, source: ChunkSource, nbytes: int, buf: memoryview, hold: bool) -> PutResult:
        self.delete(key)
        e = _Entry(key, nbytes)
        last_error: StorageError | None = None
        tries = list(enumerate(self._tiers))
        retried: set[int] = set()
        while tries:
            i, t = tries.pop(0)
            size = t.backend.stored_size(nbytes)
            if not self._reserve(i, size, 0, buf):
                continue
            try:
                fed = self._feed(t.backend, source())
                timing = t.backend.write(key, self._cancellable(fed, "write"), nbytes)
                self._fed(fed)
            except StorageError as exc:
                self._release(i, size)
                if isinstance(exc, HostMemoryShort):
                    # the tier is smaller now (the host ran short): make room within it once, else the next tier;
                    # no room, not a failed operation
                    self._host_short(t)
                    if i not in retried:
                        retried.add(i)
                        tries.insert(0, (i, t))
                    continue
                if isinstance(exc, Cancelled):
                    self.sink.tier_cancelled(t.backend.name, "write", "request", exc.bytes_done)
                    raise
                last_error = exc
                self.sink.tier_error(t.backend.name, "write", "request", nbytes, exc)
                if isinstance(exc, TierFullError):
                    continue  # the medium is full (ENOSPC): try the next tier
                raise
            held = self._commit(e, i, size, hold) and hold
            self._done(t.backend.name, "write", "request", key, nbytes, timing)
            return PutResult(t.backend.name, timing, held=held)
        if last_error is not None:
            raise last_error
        raise TierFullError(f"no tier can hold {key!r} ({nbytes} bytes)")

    def get(self, key: str, buf: memoryview, expect: int | None = None) -> GetResult:
        """Read an entry through ``buf``. A miss is a result, not an error. ``expect``: the entry's logical bytes
        as the key names them; a key this store does not hold is looked up in its shared tiers only when given
        (what another writer put there is checked against it)."""
        with self._lock:
            e = self._entries.get(key)
        if e is None:
            return self._get_shared(key, buf, expect) if expect is not None else GetResult(hit=False)
        if self.config.promotion == "on-read":
            promoted = self._try_promote(e, buf)
            if promoted is not None:
                return promoted
        with e.lock:
            with self._lock:
                if self._entries.get(key) is not e or e.tier < 0:
                    return GetResult(hit=False)
                t = self._tiers[e.tier]
                t.policy.touch(key)
            try:
                timing = self._read(t.backend, key, buf)
            except StorageError as exc:
                if isinstance(exc, Cancelled):
                    self.sink.tier_cancelled(t.backend.name, "read", "request", exc.bytes_done)
                else:  # unreadable (deleted, truncated, corrupt): forget it, or every later read fails too
                    self.sink.tier_error(t.backend.name, "read", "request", e.nbytes, exc)
                    self._remove(e)
                    self.sink.count("entries_dropped_unreadable")
                raise
        self._done(t.backend.name, "read", "request", key, e.nbytes, timing)
        if t in self._shared:
            self.sink.count("remote_own_hits")
        return GetResult(True, t.backend.name, e.nbytes, timing)

    def _get_shared(self, key: str, buf: memoryview, expect: int) -> GetResult:
        """A key this store does not hold, looked up in the tiers whose key space is shared (``read_shared``:
        Redis or S3 with --remote-namespace shared:NAME): an entry another rank or an earlier run wrote there
        serves the read from that tier (counted as a cross-writer hit; it stays theirs, this store does not
        take it into its accounting). Something there that is not the ``expect``-byte entry the key names is
        a miss counted as ``remote_foreign_entries`` (never a hit); a failed lookup is a tier error and a miss."""
        for t in self._shared:
            try:
                got = t.backend.read_shared(key, buf, expect, self.cancel)  # type: ignore[attr-defined]  # Redis/S3
            except ForeignEntry:
                self.sink.count("remote_foreign_entries")
                continue
            except StorageError as exc:
                if isinstance(exc, Cancelled):
                    self.sink.tier_cancelled(t.backend.name, "read", "request", exc.bytes_done)
                    raise
                self.sink.tier_error(t.backend.name, "read", "request", 0, exc)
                continue
            if got is None:
                continue
            nbytes, timing, cross = got
            self._done(t.backend.name, "read", "request", key, nbytes, timing)
            self.sink.count("remote_cross_writer_hits" if cross else "remote_own_hits")
            return GetResult(True, t.backend.name, nbytes, timing)
        return GetResult(hit=False)

    def _try_promote(self, e: _Entry, buf: memoryview) -> GetResult | None:
        """Move a hit below the top tier to the top with the read that serves the request; None
        (the caller reads it where it is) when there is no room or the copy fails."""
        with self._lock:
            i = e.tier
            if i <= 0 or e.moving or self._entries.get(e.key) is not e:
                return None
            e.moving = True  # pinned before reserving: keeps the entry-lock order acyclic
            self._tiers[i].policy.remove(e.key)
        size = self._tiers[0].backend.stored_size(e.nbytes)
        if not self._reserve(0, size, 0, buf):
            self._unpin(e, i)
            return None
        with e.lock:
            read_t = self._copy(e, i, 0, size, buf, "request", "promotion")
        if read_t is None:
            self._unpin(e, i)
            return None
        self.sink.count("promotions")
        return GetResult(True, self._tiers[i].backend.name, e.nbytes, read_t)

    def release(self, key: str) -> None:
        """The request that put ``key`` with ``hold`` is done with it: it becomes evictable, the most
        recently used of its tier. A key no longer held (deleted, replaced) is ignored."""
        with self._lock:
            e = self._entries.get(key)
            if e is None or e not in self._in_use:
                return
            self._in_use.discard(e)
            if not e.moving:
                self._tiers[e.tier].policy.insert(key)
            self._space.notify_all()

    # -- explicit placement (kvtier trace replay: the recorded trace decides, not the waterfall) ----
    def _index(self, tier: str) -> int:
        for i, t in enumerate(self._tiers):
            if t.backend.name == tier:
                return i
        raise KeyError(f"no tier {tier!r} (tiers: {', '.join(self.tier_names)})")

    def place(
        self, key: str, tier: str, source: ChunkSource, nbytes: int, buf: memoryview, filler: bool = False
    ) -> PutResult:
        """Store an entry in the named tier (replacing any entry under the key). Room is made by
        *deleting* that tier's victims: a replayed trace carries its own demotions as rows. ``filler``
        marks preconditioning data: it stays on the device, oldest in the LRU, until the tier needs its
        room, then it is removed (never demoted), counted as ``filler_removed``. Raises TierFullError when
        the tier cannot make room, StorageError when the write fails."""
        i = self._index(tier)
        self.delete(key)
        t = self._tiers[i]
        size = t.backend.stored_size(nbytes)
        if not self._reserve(i, size, self.config.max_recursion, buf):
            raise TierFullError(f"{tier}: no room for {key!r} ({nbytes} bytes)")
        try:
            fed = source() if filler else self._feed(t.backend, source())  # preconditioning: host bytes, uncounted
            timing = t.backend.write(key, self._cancellable(fed, "write"), nbytes)
            self._fed(fed)
        except StorageError as exc:
            self._release(i, size)
            if isinstance(exc, Cancelled):
                self.sink.tier_cancelled(tier, "write", "request", exc.bytes_done)
            else:
                self.sink.tier_error(tier, "write", "request", nbytes, exc)
            raise
        self._commit(_Entry(key, nbytes, filler), i, size)
        self._done(tier, "write", "request", key, nbytes, timing)
        return PutResult(tier, timing)

    def move(self, key: str, tier: str, buf: memoryview) -> bool:
        """Move an entry to the named tier, as a recorded demotion: a real read from its tier and a real
        write to ``tier`` (cause "demotion"), room made by deleting victims there. False when the key is
        absent, already there or being moved, or when the move could not be made (nothing lost: the
        entry stays where it was)."""
        j = self._index(tier)
        with self._lock:
            e = self._entries.get(key)
            if e is None or e.moving or e.tier < 0 or e.tier == j:
                return False
            i = e.tier
            e.moving = True
            self._tiers[i].policy.remove(key)
        size = self._tiers[j].backend.stored_size(e.nbytes)
        if not self._reserve(j, size, self.config.max_recursion, buf):
            self._unpin(e, i)
            return False
        with e.lock:
            if e.tier != i:  # deleted meanwhile
                self._release(j, size)
                return False
            moved = self._copy(e, i, j, size, buf, "demotion", "demotion") is not None
        if not moved:
            self._unpin(e, i)
            return False
        self.sink.count("demotions")
        return True

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
                        self._tiers[e.tier].policy.remove(key)
                    break
            with e.lock:  # someone is moving it: wait for them, then look again
                pass
        with e.lock:
            if e.tier < 0:
                return False
            self._remove(e)
        return True

    def close(self) -> None:
        for t in self._tiers:
            t.backend.close()


__all__ = ["TieredStore", "StoreConfig", "PutResult", "GetResult", "EventSink", "IOLog", "NullSink", "EntryNotFound"]
