"""The store's shared rules: promotion makes room like demotion, failed moves book their I/O under the
move's cause, a reservation evicts at most the configured number of victims, room held by a write in
flight is waited for (not spun on), and the eviction policy decides the victims."""

from __future__ import annotations

import threading
from collections import OrderedDict

import pytest

from kvtier.engine.backend import ALIGN, aligned_buffer
from kvtier.engine.memory import MemoryTier
from kvtier.engine.tiered import NullSink, StoreConfig, TieredStore
from kvtier.errors import Cancelled, TierFullError
from kvtier.telemetry.recorder import Recorder

P = ALIGN  # one page


def put(store, noise, key, pages, buf):
    return store.put(key, lambda: noise.chunks(key, pages * P, 1 << 20), pages * P, buf)


def test_a_promotion_evicts_only_the_pages_it_needs(noise):
    """A promotion needing 4 pages where 2 are free evicts one 2-page victim, wherever the free pages lie (an
    extent arena had to evict a second victim to get them contiguous)."""
    rec = Recorder()
    s = TieredStore(
        [MemoryTier(8 * P, "cpu"), MemoryTier(32 * P, "storage")], StoreConfig(1.0, 1.0, promotion="on-read"), rec
    )
    buf = aligned_buffer(P)
    put(s, noise, "x", 4, buf)
    put(s, noise, "a", 2, buf)
    put(s, noise, "c", 2, buf)
    put(s, noise, "b", 2, buf)  # x demoted; 2 pages free
    assert s.location("x") == "storage"
    s.get("a", buf)  # victims now in order c, b, a
    r = s.get("x", buf)  # needs 4 pages: evicting c frees 2, with the 2 free that is enough
    assert r.hit and r.tier == "storage" and s.location("x") == "cpu"
    assert rec.counters["promotions"] == 1 and not rec.errors
    assert s.location("c") == "storage" and s.location("b") == "cpu"
    s.check_accounting()


class CancellingTier(MemoryTier):
    """A real tier whose export sets the store's cancel event after the first chunk (the run ends mid-move)."""

    cancel: threading.Event

    def export(self, key, buf, timing):
        for i, chunk in enumerate(super().export(key, buf, timing)):
            if i == 1:
                self.cancel.set()
            yield chunk


class Calls(NullSink):
    def __init__(self):
        self.cancelled = []

    def tier_cancelled(self, tier, op, cause, bytes_done):
        self.cancelled.append((tier, op, cause))


def test_a_cancelled_promotion_books_its_read_as_promotion(noise):
    cancel = threading.Event()
    bottom = CancellingTier(32 * P, "storage")
    bottom.cancel = cancel
    sink = Calls()
    s = TieredStore([MemoryTier(8 * P, "cpu"), bottom], StoreConfig(1.0, 1.0, promotion="on-read"), sink, cancel)
    buf = aligned_buffer(P)  # one page per chunk: a 4-page entry moves in 4 chunks
    put(s, noise, "x", 4, buf)
    put(s, noise, "y", 4, buf)
    put(s, noise, "z", 4, buf)  # x demoted
    assert s.location("x") == "storage"
    with pytest.raises(Cancelled):  # the request's own read after the failed promotion is cancelled too
        s.get("x", buf)
    assert ("storage", "read", "promotion") in sink.cancelled and ("cpu", "write", "promotion") in sink.cancelled
    assert s.location("x") == "storage"  # the entry stayed where it was, evictable again
    assert "x" in s.eviction_order("storage")


def test_one_reservation_evicts_at_most_the_limit(noise):
    rec = Recorder()
    cfg = StoreConfig(1.0, 1.0, max_evictions_hard_cap=2, max_evictions_min=1)
    s = TieredStore([MemoryTier(6 * P, "cpu"), MemoryTier(64 * P, "storage")], cfg, rec)
    buf = aligned_buffer(P)
    for k in "abcdef":
        put(s, noise, k, 1, buf)
    assert cfg.eviction_limit(6) == 2
    assert put(s, noise, "big", 3, buf).tier == "storage"  # room for it needs 3 victims: over the limit
    assert rec.counters["demotions"] == 2  # the two it was allowed, then it went down a tier
    s.check_accounting()


def test_room_held_by_a_write_in_flight_is_waited_for(noise):
    rec = Recorder()
    s = TieredStore([MemoryTier(4 * P, "cpu")], StoreConfig(1.0, 1.0, reserve_wait_s=10), rec)
    inside, gate = threading.Event(), threading.Event()

    def slow_source():
        inside.set()
        assert gate.wait(10)
        return noise.chunks("a", 4 * P, 1 << 20)

    results: dict[str, object] = {}

    def writer(name, fn):
        try:
            results[name] = fn()
        except Exception as e:  # noqa: BLE001 - reported through results
            results[name] = e

    a = threading.Thread(target=writer, args=("a", lambda: s.put("a", slow_source, 4 * P, aligned_buffer(P))))
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=writer, args=("b", lambda: put(s, noise, "b", 2, aligned_buffer(P))))
    b.start()
    b.join(0.3)
    assert b.is_alive(), "b should be waiting for the room a's write holds, not failing"
    gate.set()
    for t in (a, b):
        t.join(10)
        assert not t.is_alive()
    assert results["a"].tier == "cpu" and results["b"].tier == "cpu"  # b evicted a once a landed
    assert s.location("b") == "cpu" and s.location("a") is None and rec.counters["evictions_bottom"] == 1
    s.check_accounting()


def test_the_wait_for_room_is_bounded(noise):
    s = TieredStore([MemoryTier(4 * P, "cpu")], StoreConfig(1.0, 1.0, reserve_wait_s=0.2))
    inside, gate = threading.Event(), threading.Event()

    def slow_source():
        inside.set()
        gate.wait(10)
        return noise.chunks("a", 4 * P, 1 << 20)

    a = threading.Thread(target=lambda: s.put("a", slow_source, 4 * P, aligned_buffer(P)))
    a.start()
    try:
        assert inside.wait(10)
        with pytest.raises(TierFullError):
            put(s, noise, "b", 2, aligned_buffer(P))
    finally:
        gate.set()
        a.join(10)


class MostRecentFirst:
    """A test policy: the newest entry is the first victim."""

    def __init__(self):
        self._order: OrderedDict[str, None] = OrderedDict()

    def insert(self, key):
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key):
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key):
        return self._order.pop(key, 0) is None

    def victims(self):
        return iter(reversed(self._order))

    def __len__(self):
        return len(self._order)

    def __contains__(self, key):
        return key in self._order


def test_the_policy_chooses_the_victims(noise):
    s = TieredStore(
        [MemoryTier(3 * P, "cpu"), MemoryTier(16 * P, "storage")], StoreConfig(1.0, 1.0, policy=MostRecentFirst)
    )
    buf = aligned_buffer(P)
    for k in "abc":
        put(s, noise, k, 1, buf)
    put(s, noise, "d", 1, buf)
    assert s.location("c") == "storage" and s.location("a") == "cpu"  # LRU would have moved a
    assert s.eviction_order("cpu") == ["d", "b", "a"]


def test_scattered_free_pages_take_a_write_without_a_fallthrough(noise):
    """Free pages scattered in one-page holes: an extent arena sent this 8-page write to the next tier
    (a fragmented fallthrough); pages take it in place, with no victim moved."""
    rec = Recorder()
    s = TieredStore(
        [MemoryTier(16 * P, "cpu"), MemoryTier(64 * P, "storage")],
        StoreConfig(1.0, 1.0, tier_eviction_caps={"cpu": 1}),
        rec,
    )
    buf = aligned_buffer(P)
    for i in range(16):
        put(s, noise, f"e{i:02d}", 1, buf)
    for i in range(1, 16, 2):
        s.delete(f"e{i:02d}")  # eight free pages, none adjacent
    put(s, noise, "x", 8, buf)
    assert s.location("x") == "cpu"
    assert rec.counters["fragmented_fallthroughs"] == 0 and rec.counters["demotions"] == 0 and not rec.errors
    s.check_accounting()


def test_failed_requests_do_not_count_toward_max_requests():
    """#29's trap: completed_requests() counted failed requests, so --max-requests ended a run early when
    requests failed. It counts the requests that did their work; the failed ones stay recorded."""
    from kvtier.telemetry.recorder import BenchRequest

    rec = Recorder()
    base = dict(user=0, qos="interactive", phase="prefill", context_tokens=1, generate_tokens=0, submit_ns=0,
                start_ns=0, storage_done_ns=0, end_ns=1, storage_ns=0, generation_ns=0, bytes_read=0,
                bytes_written=0, decode_bytes_read=0, tokens_read=0, tokens_written=0, hits=0, misses=0)  # fmt: skip
    for ok in (False, True, False, False, True):
        rec.request(BenchRequest(**base, ok=ok, error="" if ok else "EIO"))  # type: ignore[arg-type]
    assert rec.completed_requests() == 2 and len(rec.requests) == 5
