"""Serving one request (bench/service.py) on a real in-memory store with a hand-driven clock: what a
request reads, writes and counts, without threads, subprocesses or sleeps."""

from __future__ import annotations

import errno
import threading

import pytest

from kvtier.bench.service import CUT, RequestService, ServiceSettings
from kvtier.engine.backend import ALIGN, aligned_buffer
from kvtier.engine.memory import MemoryTier
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import TierFullError
from kvtier.telemetry.clock import ManualClock
from kvtier.telemetry.recorder import Recorder
from kvtier.workload.layout import KVRef
from kvtier.workload.users import Request

BPT = 100  # bytes per token in these tests


def entry_bytes(tokens: int) -> int:
    return tokens * BPT


def make(noise, *, tiers=None, per_token_s=0.0, prefill_only=False, decode_only=False, decode_batch=32):
    rec = Recorder()
    store = TieredStore(tiers or [MemoryTier(64 * 1024 * ALIGN, "cpu")], StoreConfig(1.0, 1.0), rec)
    clock = ManualClock(1_000)
    stop, hard = threading.Event(), threading.Event()
    svc = RequestService(
        store,
        noise,
        1 << 20,
        entry_bytes,
        ServiceSettings(decode_batch, per_token_s, prefill_only, decode_only),
        rec.count,
        clock,
        stop,
        hard,
    )
    return svc, store, rec, clock, stop


def req(**kw) -> Request:
    base = dict(
        user_id=1,
        seq=0,
        key="k",
        qos="batch",
        priority=1,
        phase="prefill_decode",
        context_tokens=300,
        generate_tokens=64,
        think_before_s=0.0,
        new_tokens=100,
        turn=2,
    )
    return Request(**{**base, **kw})


def test_entry_layout_turn_reads_history_writes_context_and_decodes(noise):
    svc, store, rec, clock, _ = make(noise)
    buf = aligned_buffer(1 << 20)
    store.put("h1", lambda: noise.chunks("h1", 200 * BPT, 1 << 20), 200 * BPT, buf)
    r = req(
        reads=(KVRef("sys", 50, "prefix"), KVRef("h1", 200, "history")),
        writes=(KVRef("t2", 100, "context"),),
        decode_key="t2",
        decode_tokens=100,
    )
    served = svc.serve(r, submit_ns=900, buf=buf)
    x = served.record
    assert x.ok and x.error == "" and not served.device_full
    # the prefix missed (and was restored), the history hit; decode: 1 + ceil(64 / 32) reads of the new entry
    assert (x.hits, x.misses) == (1 + 3, 1)
    assert x.bytes_read == 200 * BPT + 3 * 100 * BPT and x.tokens_read == 200 + 3 * 100
    assert x.decode_bytes_read == 2 * 100 * BPT  # the first decode read is the prefill's own read-back
    assert x.bytes_written == (50 + 100) * BPT and x.tokens_written == 150
    assert (x.submit_ns, x.start_ns, x.storage_done_ns, x.end_ns) == (900, 1_000, 1_000, 1_000)  # the clock's word
    assert x.generation_ns == 0
    c = rec.counters
    assert (c["lookup_prefix_misses"], c["restores_prefix"], c["lookup_history_hits"]) == (1, 1, 1)
    assert c["read_history_bytes"] == 200 * BPT and c["lookup_decode_hits"] == 3
    assert store.location("sys") == "cpu" and store.location("t2") == "cpu"


def test_chunked_prefix_ends_at_the_first_miss(noise):
    svc, store, rec, *_ = make(noise)
    buf = aligned_buffer(1 << 20)
    for k in ("c0", "c2"):  # c1 missing: c2 cannot be used (a prefix), so it is recomputed too
        store.put(k, lambda k=k: noise.chunks(k, 256 * BPT, 1 << 20), 256 * BPT, buf)
    r = req(
        reads=tuple(KVRef(f"c{i}", 256, "history") for i in range(3)),
        prefix_reads=True,
        writes=(KVRef("c3", 256, "context"),),
    )
    x = svc.serve(r, 0, buf).record
    assert (x.hits, x.misses) == (1, 2)
    assert x.bytes_written == 3 * 256 * BPT  # c1, c2 recomputed, c3 new
    assert rec.counters["restores_history"] == 2 and rec.counters["lookup_history_misses"] == 2


def test_prefill_only_never_decodes_and_decode_only_never_writes(noise):
    buf = aligned_buffer(1 << 20)
    svc, store, *_ = make(noise, prefill_only=True)
    x = svc.serve(req(writes=(KVRef("e", 100, "context"),), decode_key="e", decode_tokens=100), 0, buf).record
    assert x.hits == 0 and x.bytes_read == 0 and x.bytes_written == 100 * BPT
    svc, store, *_ = make(noise, decode_only=True)
    x = svc.serve(req(decode_key="gone", decode_tokens=100), 0, buf).record
    # the reference's rule: a decode miss ends the decode (no batch reads of an entry that is not there)
    assert x.misses == 1 and x.hits == 0 and x.bytes_written == 0 and store.location("gone") is None


def test_a_decode_miss_rewrites_the_entry_and_reads_no_batches(noise):
    svc, store, *_ = make(noise)
    x = svc.serve(req(decode_key="lost", decode_tokens=100), 0, aligned_buffer(1 << 20)).record
    # the reference (benchmark.py process_requests, step 5): on a miss, allocate and skip the batched reads;
    # before, kvtier went on reading the rewritten entry 1 + ceil(64 / 32) - 1 more times
    assert (x.hits, x.misses) == (0, 1) and x.bytes_read == 0 and x.bytes_written == 100 * BPT
    assert store.location("lost") is not None


def test_generation_time_is_slept_and_cut_by_a_hard_stop(noise):
    svc, *_ = make(noise, per_token_s=0.001)
    svc.hard_stop.set()  # the run is ending: generation stops at once
    x = svc.serve(req(generate_tokens=10_000), 0, aligned_buffer(1 << 20)).record
    assert not x.ok and x.error == CUT


def test_a_stopped_run_cuts_before_the_next_operation(noise):
    svc, store, rec, _, stop = make(noise)
    stop.set()
    x = svc.serve(req(writes=(KVRef("w", 10, "context"),)), 0, aligned_buffer(1 << 20)).record
    assert not x.ok and x.error == CUT and x.bytes_written == 0 and store.location("w") is None


class FullDevice(MemoryTier):
    """A real tier that reports the device full (ENOSPC) on writes, as a filesystem would."""

    def write(self, key, chunks, nbytes):
        raise TierFullError("device full") from OSError(errno.ENOSPC, "No space left on device")


def test_enospc_fails_the_request_and_asks_the_run_to_stop(noise):
    svc, *_ = make(noise, tiers=[FullDevice(64 * ALIGN, "storage")])
    served = svc.serve(req(writes=(KVRef("w", 10, "context"),)), 0, aligned_buffer(1 << 20))
    assert served.device_full and not served.record.ok and served.record.error.startswith("tier_full")


@pytest.mark.parametrize("cause", [OSError(errno.EIO, "I/O error"), None])
def test_other_full_tiers_do_not_stop_the_run(noise, cause):
    class Full(MemoryTier):
        def write(self, key, chunks, nbytes):
            raise TierFullError("no room") from cause

    svc, *_ = make(noise, tiers=[Full(64 * ALIGN, "storage")])
    served = svc.serve(req(writes=(KVRef("w", 10, "context"),)), 0, aligned_buffer(1 << 20))
    # no tier took the store: dropped, not failed (the request completes; a later read misses)
    assert not served.device_full and served.record.ok and served.record.stores_dropped == 1


class WatchedReads(MemoryTier):
    """A real tier that notes, at each read, which keys its store may evict (set ``store`` after making it)."""

    store: TieredStore | None = None

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[str, list[str]]] = []

    def read(self, key, buf, cancel=None):
        assert self.store is not None
        self.seen.append((key, self.store.eviction_order(self.name)))
        return super().read(key, buf, cancel)


@pytest.mark.parametrize("cut_after", [None, 2])
def test_a_requests_own_entry_is_in_use_until_its_decode_reads_end(noise, cut_after):
    """From its write to the end of its decode reads (or the cut that ends them) the request's entry is out of
    the eviction order, so writes beside it cannot demote it under its reads; then it is the most recent."""
    tier = WatchedReads(64 * 1024 * ALIGN, "cpu")
    svc, store, *_ = make(noise, tiers=[tier])
    tier.store = store
    buf = aligned_buffer(1 << 20)
    store.put("older", lambda: noise.chunks("older", 10 * BPT, 1 << 20), 10 * BPT, buf)
    if cut_after is not None:  # the run ends during the decode reads

        class Stopping(list):
            def append(self, x):
                super().append(x)
                if len(self) == cut_after:
                    svc.stop.set()

        tier.seen = Stopping()
    r = req(writes=(KVRef("t2", 100, "context"),), decode_key="t2", decode_tokens=100)
    x = svc.serve(r, 0, buf).record
    decode_reads = [order for key, order in tier.seen if key == "t2"]
    assert len(decode_reads) == (3 if cut_after is None else cut_after)
    assert all("t2" not in order and "older" in order for order in decode_reads)
    assert x.ok == (cut_after is None)
    assert store.eviction_order("cpu") == ["older", "t2"]  # released, cut or not
