"""The waterfall LRU: placement, demotion, deletion at the bottom, accounting, concurrency."""

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.engine.backend import ALIGN, aligned_buffer
from kvtier.engine.memory import MemoryTier
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import StorageError, TierFullError
from kvtier.telemetry.recorder import Recorder

KB4 = ALIGN


def put(store, noise, key, n, buf):
    return store.put(key, lambda: noise.chunks(key, n, 1 << 20), n, buf)


class FlakyTier(MemoryTier):
    """A real memory tier whose writes fail on demand (to test reservation release)."""

    fail = False

    def write(self, key, chunks, nbytes):
        if self.fail:
            raise StorageError("injected write failure")
        return super().write(key, chunks, nbytes)


def two_tier(cfg=None, top=10, bottom=20):
    rec = Recorder()
    s = TieredStore(
        [MemoryTier(top * KB4, "cpu"), MemoryTier(bottom * KB4, "storage")],
        cfg or StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0),
        rec,
    )
    return s, rec


def test_new_entries_go_to_fastest_tier_then_lru_demotes(noise, buf):
    s, rec = two_tier()
    for k in "abcde":
        put(s, noise, k, 2 * KB4, buf)
    assert s.eviction_order("cpu") == list("abcde")
    assert s.get("a", buf).tier == "cpu"  # touch a: b becomes the LRU
    put(s, noise, "f", 2 * KB4, buf)
    assert s.location("b") == "storage"
    assert s.eviction_order("cpu") == list("cdeaf")
    assert rec.counters["demotions"] == 1
    causes = {(t, o): [x.cause for x in v] for (t, o), v in rec.ops.items()}
    assert causes[("cpu", "read")].count("demotion") == 1
    assert causes[("storage", "write")] == ["demotion"]
    s.check_accounting()


def test_bottom_tier_deletes(noise, buf):
    s, rec = two_tier(top=2, bottom=2)
    for k in "abc":
        put(s, noise, k, 2 * KB4, buf)
    assert s.location("c") == "cpu" and s.location("b") == "storage"
    assert s.location("a") is None
    assert not s.get("a", buf).hit
    assert rec.counters["evictions_bottom"] == 1
    s.check_accounting()


def test_target_ratio_leaves_headroom(noise, buf):
    s, _ = two_tier(StoreConfig(target_usage_ratio=0.5, large_entry_limit_ratio=1.0), top=10, bottom=100)
    for i in range(6):
        put(s, noise, f"k{i}", KB4, buf)
    assert s.usage()["cpu"]["used_bytes"] == 5 * KB4


def test_large_entry_skips_a_tier(noise, buf):
    s, _ = two_tier(StoreConfig(target_usage_ratio=0.8, large_entry_limit_ratio=0.95), top=10, bottom=100)
    assert put(s, noise, "big", 10 * KB4, buf).tier == "storage"  # > 0.95 x 10 pages
    assert put(s, noise, "mid", 9 * KB4, buf).tier == "cpu"  # > target but <= limit: may use the capacity
    with pytest.raises(TierFullError):
        put(s, noise, "huge", 200 * KB4, buf)
    s.check_accounting()


def test_overwrite_replaces_entry(noise, buf):
    s, _ = two_tier()
    put(s, noise, "a", 2 * KB4, buf)
    put(s, noise, "a", 3 * KB4, buf)
    assert len(s) == 1 and s.get("a", buf).nbytes == 3 * KB4
    s.check_accounting()


def test_failed_write_releases_reservation(noise, buf):
    flaky = FlakyTier(10 * KB4, "cpu")
    rec = Recorder()
    s = TieredStore([flaky], StoreConfig(1.0, 1.0), rec)
    put(s, noise, "a", 2 * KB4, buf)
    flaky.fail = True
    with pytest.raises(StorageError):
        put(s, noise, "b", 2 * KB4, buf)
    assert s.usage()["cpu"]["used_bytes"] == 2 * KB4
    assert rec.errors[("cpu", "write", "request")] == 1
    s.check_accounting()


def test_failed_demotion_drops_entry_and_keeps_accounting(noise, buf):
    bottom = FlakyTier(20 * KB4, "storage")
    rec = Recorder()
    s = TieredStore([MemoryTier(4 * KB4, "cpu"), bottom], StoreConfig(1.0, 1.0), rec)
    put(s, noise, "a", 2 * KB4, buf)
    put(s, noise, "b", 2 * KB4, buf)
    bottom.fail = True
    put(s, noise, "c", 2 * KB4, buf)
    assert s.location("a") is None and s.location("c") == "cpu"
    assert rec.errors[("storage", "write", "demotion")] == 1
    assert rec.counters["evictions_dropped"] == 1
    s.check_accounting()


def test_promotion_on_read_moves_hit_to_top(noise, buf):
    s, rec = two_tier(StoreConfig(1.0, 1.0, promotion="on-read"), top=4, bottom=20)
    for k in "abc":
        put(s, noise, k, 2 * KB4, buf)
    assert s.location("a") == "storage"
    r = s.get("a", buf)
    assert r.hit and r.tier == "storage"  # served from where it was
    assert s.location("a") == "cpu" and s.location("b") == "storage"
    assert rec.counters["promotions"] == 1
    s.check_accounting()


def test_zero_capacity_tier_is_skipped_and_empty_store_is_an_error():
    s = TieredStore([MemoryTier(0, "cpu"), MemoryTier(8 * KB4, "storage")])
    assert s.tier_names == ["storage"]
    with pytest.raises(ValueError, match="no tier"):
        TieredStore([MemoryTier(0, "cpu")])


def test_bad_store_config():
    with pytest.raises(ValueError, match="target_usage_ratio"):
        StoreConfig(target_usage_ratio=1.5)
    with pytest.raises(ValueError, match="promotion"):
        StoreConfig(promotion="sometimes")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ops=st.lists(st.tuples(st.sampled_from(["put", "get", "del"]), st.integers(0, 12), st.integers(1, 6)), max_size=80),
    caps=st.tuples(st.integers(0, 12), st.integers(1, 16), st.integers(1, 24)),
    ratio=st.sampled_from([0.5, 0.8, 1.0]),
)
def test_waterfall_properties(noise, ops, caps, ratio):
    """Usage <= capacity, accounting == stored bytes, LRU order, nothing lost but at the bottom."""
    buf = aligned_buffer(1 << 16)
    rec = Recorder()
    tiers = [MemoryTier(c * KB4, n) for c, n in zip(caps, ("gpu", "cpu", "storage"))]
    s = TieredStore(tiers, StoreConfig(target_usage_ratio=ratio, large_entry_limit_ratio=1.0), rec)
    present: set[str] = set()
    for op, k, pages in ops:
        key = f"k{k}"
        if op == "put":
            try:
                put(s, noise, key, pages * KB4 - 7, buf)
                present.add(key)
            except TierFullError:
                present.discard(key)
        elif op == "get":
            r = s.get(key, buf)
            assert r.hit == (key in present and s.location(key) is not None)
            if r.hit:
                assert s.location(key) == r.tier, "without promotion a hit stays where it was"
                assert s.eviction_order(r.tier)[-1] == key, "a hit becomes most recent in its tier"
        else:
            s.delete(key)
            present.discard(key)
        for t, u in s.usage().items():
            assert u["used_bytes"] <= u["capacity_bytes"], t
        s.check_accounting()
        stored = {k for k in present if s.location(k) is not None}
        lost = present - stored
        present = stored
        # anything that vanished left through bottom deletion (or an entry dropped en route)
        assert len(lost) <= rec.counters["evictions_bottom"] + rec.counters["evictions_dropped"]


def test_concurrent_threads_keep_accounting(noise):
    s, rec = two_tier(StoreConfig(target_usage_ratio=0.8), top=16, bottom=48)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        b = aligned_buffer(1 << 16)
        try:
            for i in range(150):
                key = f"w{w}-{i % 20}"
                if i % 3 == 2:
                    s.get(f"w{(w + 1) % 4}-{i % 20}", b)
                else:
                    put(s, noise, key, (1 + (i * 7 + w) % 5) * KB4, b)
                for u in s.usage().values():
                    assert u["used_bytes"] <= u["capacity_bytes"]
        except BaseException as e:  # noqa: BLE001 - surfaces in the main thread (assertions included)
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a worker hung (deadlock?)"
    assert not errors, errors
    assert rec.counters["demotions"] > 0 and rec.counters["evictions_bottom"] > 0
    s.check_accounting()


def test_concurrent_puts_of_one_key_are_deduplicated(noise):
    """Two requests recomputing the same shared prefix chunk: one write, both succeed."""
    s, rec = two_tier(top=64, bottom=64)
    gate, writing = threading.Event(), threading.Event()

    def slow_source():
        writing.set()
        assert gate.wait(10)
        return noise.chunks("shared", 4 * KB4, KB4)

    class Arrival:
        """Wraps the store's in-flight-write event to see the second writer start waiting on it."""

        def __init__(self, ev):
            self.ev, self.arrived = ev, threading.Event()

        def wait(self, timeout=None):
            self.arrived.set()
            return self.ev.wait(timeout)

        def set(self):
            self.ev.set()

    results = []
    t1 = threading.Thread(target=lambda: results.append(s.put("shared", slow_source, 4 * KB4, aligned_buffer(KB4))))
    t1.start()
    assert writing.wait(10), "the first writer never started"
    spy = Arrival(s._writing["shared"])
    s._writing["shared"] = spy
    t2 = threading.Thread(target=lambda: results.append(put(s, noise, "shared", 4 * KB4, aligned_buffer(KB4))))
    t2.start()
    assert spy.arrived.wait(10), "the second writer never waited for the first"
    gate.set()  # only now: the second put is certainly waiting, so it must be deduplicated
    for t in (t1, t2):
        t.join(10)
        assert not t.is_alive()
    assert sorted(r.deduplicated for r in results) == [False, True]
    assert all(r.tier == "cpu" for r in results)
    assert rec.counters["deduplicated_writes"] == 1 and len(rec.ops[("cpu", "write")]) == 1
    s.check_accounting()


def test_filler_stays_until_its_room_is_needed_and_is_never_demoted(noise, buf):
    """Preconditioning data (place(..., filler=True)) occupies a tier until the waterfall needs the room; then
    it is removed, counted as filler_removed, never demoted and never an eviction of the run's entries."""
    s, rec = two_tier(top=4, bottom=4)
    for k in ("p0", "p1"):
        s.place(k, "cpu", lambda k=k: noise.chunks(k, 2 * KB4, 1 << 20), 2 * KB4, buf, filler=True)
    assert s.filler_bytes() == 4 * KB4 and s.filler_entries() == 2  # the tier is full of filler
    put(s, noise, "a", 2 * KB4, buf)  # the run's first entry takes the oldest filler's room
    assert s.location("a") == "cpu" and s.location("p0") is None and s.location("p1") == "cpu"
    assert rec.counters["filler_removed"] == 1 and rec.counters["filler_removed_bytes"] == 2 * KB4
    assert rec.counters.get("demotions", 0) == 0 and rec.counters.get("evictions_bottom", 0) == 0
    assert s.filler_entries() == 1
    s.check_accounting()


def held_put(store, noise, key, n, buf):
    return store.put(key, lambda: noise.chunks(key, n, 1 << 20), n, buf, hold=True)


def test_an_entry_in_use_is_never_a_victim_and_released_it_is_the_most_recent(noise, buf):
    """A request's entry held in use (its decode reads to come) stays where it was written while later writes
    demote the other entries; released, it is evictable again, the most recently used of its tier."""
    s, rec = two_tier(StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0, reserve_wait_s=0))
    for k in "ab":
        put(s, noise, k, 2 * KB4, buf)
    assert held_put(s, noise, "mine", 2 * KB4, buf).held
    assert s.eviction_order("cpu") == ["a", "b"]  # in use: not in the eviction order
    assert s.usage()["cpu"]["entries"] == 3  # but counted in its tier
    for k in "cdefgh":  # four times the room that is left: everything else goes down, "mine" stays
        put(s, noise, k, 2 * KB4, buf)
    assert s.location("mine") == "cpu" and s.location("a") == "storage"
    assert s.get("mine", buf).tier == "cpu"
    s.release("mine")
    assert s.eviction_order("cpu")[-1] == "mine"
    s.release("mine")  # a second release, or one of a key no longer held, changes nothing
    s.release("absent")
    assert s.eviction_order("cpu").count("mine") == 1
    s.check_accounting()


def test_a_writer_that_finds_the_room_in_use_waits_then_takes_the_next_tier(noise, buf):
    """All of the top tier in use: a write waits up to reserve_wait_s for a release, then goes one tier down
    (counted as reserve_waits_expired); a release within the wait lets it in."""
    s, rec = two_tier(StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0, reserve_wait_s=0.2), top=4)
    for k in ("u1", "u2"):
        assert held_put(s, noise, k, 2 * KB4, buf).held
    assert put(s, noise, "late", 2 * KB4, buf).tier == "storage"
    assert rec.counters["reserve_waits_expired"] == 1 and 0.15e9 < rec.counters["reserve_wait_ns"] < 5e9
    s = TieredStore(
        [MemoryTier(4 * KB4, "cpu"), MemoryTier(20 * KB4, "storage")],
        StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0, reserve_wait_s=30),
        rec := Recorder(),
    )
    for k in ("u1", "u2"):
        held_put(s, noise, k, 2 * KB4, buf)
    got: list = []
    t = threading.Thread(target=lambda: got.append(put(s, noise, "late", 2 * KB4, aligned_buffer(KB4))))
    t.start()
    t.join(0.3)
    assert t.is_alive() and not got  # waiting: nothing in the tier may be evicted
    s.release("u1")
    t.join(10)
    assert not t.is_alive() and got[0].tier == "cpu"
    assert s.location("u1") == "storage" and s.location("u2") == "cpu"  # the released one made the room
    assert "reserve_waits_expired" not in rec.counters
    s.check_accounting()


def test_a_promoted_entry_in_use_stays_out_of_the_eviction_order(noise, buf):
    s, _ = two_tier(StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0, promotion="on-read"), top=4)
    for k in ("a", "b"):
        put(s, noise, k, 2 * KB4, buf)
    held_put(s, noise, "mine", 2 * KB4, buf)  # demotes "a"
    s.move("mine", "storage", buf)  # not a victim, but a recorded move may still take it down
    assert s.location("mine") == "storage" and "mine" not in s.eviction_order("storage")
    assert s.get("mine", buf).hit  # promoted back on read
    assert s.location("mine") == "cpu" and "mine" not in s.eviction_order("cpu")
    s.release("mine")
    assert s.eviction_order("cpu")[-1] == "mine"
    s.check_accounting()
