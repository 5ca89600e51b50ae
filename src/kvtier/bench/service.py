"""Serving one benchmark request against the tiered store, and the record of what it did.

A request (workload/users.py ``Request``) is served in this order:
1. the RAG burst: each retrieved chunk is read; a miss is re-ingested (written);
2. its reads before the first token (system prompt, history, cached prefix chunks): hits are
   read; with ``prefix_reads`` the prefix ends at the first miss and that chunk and all after it
   are recomputed (written); an evicted system prompt is stored again;
3. its writes (the KV its prefill produced);
4. decode (prefill+decode requests, unless ``--prefill-only``): the decode entry is read once and
   once per decode batch of generated tokens; a miss of the first read re-writes it (unless
   ``--decode-only``) and ends the decode, as the reference's does (a batch read that misses is counted);
5. simulated generation: generate_tokens x the per-token time, slept (cut short by a hard stop).

Only completed operations count: a failed one ends the request with an error; the run's stop
between two operations cuts the request (``CUT``), counted apart from failures. A store that no tier can
take is *dropped*, not failed (a serving system does not cache what it has no room for): counted by cause,
the request completes, and a later read of that key misses. A request fails only when its reads fail or
the device errors.
"""

from __future__ import annotations

import errno
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.engine.noise import EntrySource
from kvtier.engine.tiered import GetResult, TieredStore
from kvtier.errors import Cancelled, StorageError, TierFullError
from kvtier.telemetry.clock import Clock
from kvtier.telemetry.recorder import BenchRequest
from kvtier.workload.layout import KVRef
from kvtier.workload.users import Request

CUT = "cut: the run stopped while this request was in flight"
"""Error text of requests cut short by the end of the run; counted apart from failures."""


def drop_cause(e: TierFullError, nbytes: int, store: TieredStore) -> str:
    """Why no tier took a store: ``entry-too-large`` (larger than any tier may hold) or ``no-room`` (the tiers
    were full of entries that could not be evicted in time: in flight, or past the eviction limit)."""
    return "entry-too-large" if nbytes > store.largest_entry_bytes() else "no-room"


class _Cut(Exception):
    """The run stopped between two operations of a request."""


@dataclass
class _Tally:
    """What one request did so far (bytes and tokens it moved itself, hits, misses, times)."""

    storage_ns: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    decode_bytes_read: int = 0
    tokens_read: int = 0
    tokens_written: int = 0
    hits: int = 0
    misses: int = 0
    rag_ns: int = 0
    rag_bytes: int = 0
    prefill_ns: int = 0  # the request's own KV writes before its first token
    decode_ns: int | None = None  # the decode phase's reads (None: the request had no decode phase)
    dropped: int = 0  # stores no tier could take (the request went on without caching them)
    alloc_wait_ns: int = 0  # time waiting for an allocation slot (--max-concurrent-allocs), outside storage time
    held: list[str] = field(default_factory=list)  # entries this request holds in use until its reads are done
    counts: dict[str, int] = field(default_factory=dict)
    tier_ns: dict[str, int] = field(default_factory=dict)  # the request's own operations' time, by tier

    def on_tier(self, tier: str | None, ns: int) -> None:
        if tier is not None:
            self.tier_ns[tier] = self.tier_ns.get(tier, 0) + ns

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n


class Served(NamedTuple):
    record: BenchRequest
    device_full: bool  # the storage device ran out of space (ENOSPC/EDQUOT): the run should stop


@dataclass(frozen=True)
class ServiceSettings:
    decode_batch: int  # generated tokens per decode read (decode.batch_size)
    per_token_s: float  # simulated GPU time per generated token
    prefill_only: bool = False
    decode_only: bool = False


class RequestService:
    """Serves requests through a TieredStore; thread safe (each caller passes its own buffer)."""

    def __init__(
        self,
        store: TieredStore,
        noise: EntrySource,
        io_chunk_bytes: int,
        entry_bytes: Callable[[int], int],
        settings: ServiceSettings,
        count: Callable[[str, int], None],
        clock: Clock,
        stop: threading.Event,
        hard_stop: threading.Event,
        alloc_slots: threading.Semaphore | None = None,
    ) -> None:
        self.alloc_slots = alloc_slots  # --max-concurrent-allocs: writes in flight at most (reads are not bound)
        self.store = store
        self.noise = noise
        self.io_chunk_bytes = io_chunk_bytes
        self.entry_bytes = entry_bytes
        self.settings = settings
        self._count = count
        self.clock = clock
        self.stop = stop  # no new operation starts once set
        self.hard_stop = hard_stop  # also cuts simulated generation short
        # --duration's end on the run's clock: a request a worker takes past it does no I/O, whether or not the
        # runner's loop has noticed the deadline yet (on a loaded host it wakes late)
        self.deadline_ns: int | None = None

    # -- one operation each ------------------------------------------------------------------
    def _put(self, t: _Tally, key: str, tokens: int, buf: memoryview, hold: bool = False) -> int:
        """Write one KV object for this request; returns its storage time, counts its bytes. With ``hold``
        the entry is in use (not evicted) until the request ends: its decode reads find it where it went."""
        if self.stop.is_set():
            raise _Cut
        nbytes = self.entry_bytes(tokens)
        noise, chunk = self.noise, self.io_chunk_bytes
        t0 = self.clock.now_ns()
        slots = self.alloc_slots
        if slots is not None:
            while not slots.acquire(timeout=0.1):  # the allocation bound; the run's stop is polled
                if self.stop.is_set():
                    raise _Cut
            waited = self.clock.now_ns() - t0
            t.count("alloc_wait_ns", waited)
            t.alloc_wait_ns += waited
            t0 += waited
        try:
            # the entry's bytes come from a writer buffer of the noise's, only its stamps rewritten per chunk
            # (engine/noise.py): each write is unique on disk; buf serves the demotions this write causes
            res = self.store.put(key, lambda: noise.chunks(key, nbytes, chunk), nbytes, buf, hold=hold)
        except TierFullError as e:
            cause = e.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # the device itself is full: the run stops (device-full)
            # no tier could take it: a serving system would not cache it. The KV was computed, so the request
            # goes on; a later read of the key misses. The time spent trying is its storage time.
            spent = self.clock.now_ns() - t0
            t.count(f"stores_dropped_{drop_cause(e, nbytes, self.store)}")
            t.count("stores_dropped_bytes", nbytes)
            t.dropped += 1
            return spent
        finally:
            if slots is not None:
                slots.release()
        if res.held:
            t.held.append(key)
        if not res.deduplicated:  # a concurrent writer of the same key wrote it, not us
            t.bytes_written += nbytes
            t.tokens_written += tokens
        t.on_tier(res.tier, res.timing.total_ns)
        return res.timing.total_ns

    def _lookup(self, t: _Tally, ref: KVRef, buf: memoryview) -> GetResult:
        """Read one KV object; a hit is counted (tokens, bytes, per-kind counters) here."""
        if self.stop.is_set():
            raise _Cut
        r = self.store.get(ref.key, buf, self.entry_bytes(ref.tokens))
        if r.hit:
            t.hits += 1
            t.bytes_read += r.nbytes
            t.tokens_read += ref.tokens
            t.storage_ns += r.timing.total_ns
            t.on_tier(r.tier, r.timing.total_ns)
            t.count(f"lookup_{ref.kind}_hits")
            t.count(f"read_{ref.kind}_bytes", r.nbytes)
        return r

    # -- the phases --------------------------------------------------------------------------
    def _rag_burst(self, t: _Tally, req: Request, buf: memoryview) -> None:
        for ref in req.rag_reads:  # independent lookups, misses re-ingested
            r = self._lookup(t, ref, buf)
            if r.hit:
                t.rag_ns += r.timing.total_ns
                t.rag_bytes += r.nbytes
                continue
            t.misses += 1
            t.count("lookup_rag_misses")
            t.count("restores_rag")
            ns = self._put(t, ref.key, ref.tokens, buf)
            t.rag_ns += ns
            t.storage_ns += ns

    def _prefill(self, t: _Tally, req: Request, buf: memoryview) -> None:
        recompute: list[KVRef] = []
        for i, ref in enumerate(req.reads):
            if self._lookup(t, ref, buf).hit:
                continue
            if req.prefix_reads:  # chunked: the prefix ends at the first miss; the rest is recomputed
                recompute = list(req.reads[i:])
                for x in recompute:
                    t.count(f"lookup_{x.kind}_misses")
                t.misses += len(recompute)
                break
            t.misses += 1
            t.count(f"lookup_{ref.kind}_misses")
            if ref.kind == "prefix":  # a shared system prompt evicted from the cache: store it again
                recompute.append(ref)
        for ref in recompute:
            t.count(f"restores_{ref.kind}")
        decode_key = self._decode_key(req)
        for ref in (*recompute, *req.writes):
            ns = self._put(t, ref.key, ref.tokens, buf, hold=ref.key == decode_key)
            t.storage_ns += ns
            t.prefill_ns += ns

    def _decode_key(self, req: Request) -> str | None:
        """The entry the request re-reads after its prefill (None: it has no decode phase)."""
        return req.decode_key if req.phase == "prefill_decode" and not self.settings.prefill_only else None

    def _decode(self, t: _Tally, req: Request, buf: memoryview) -> None:
        s = self.settings
        key = self._decode_key(req)
        if key is None:
            return
        decode = KVRef(key, req.decode_tokens, "decode")
        t.decode_ns = 0
        for i in range(1 + math.ceil(req.generate_tokens / s.decode_batch)):
            r = self._lookup(t, decode, buf)
            if r.hit:
                t.decode_ns = (t.decode_ns or 0) + r.timing.total_ns
                if i > 0:
                    t.decode_bytes_read += r.nbytes
                continue
            t.misses += 1
            t.count("lookup_decode_misses")
            if i > 0:  # a batch read that missed: counted, the decode goes on (the reference's rule)
                continue
            if not s.decode_only:
                t.storage_ns += self._put(t, key, req.decode_tokens, buf, hold=True)
            return  # as the reference: a miss of the first read re-writes the entry and reads no batches

    # -- a whole request ---------------------------------------------------------------------
    def serve(self, req: Request, submit_ns: int, buf: memoryview) -> Served:
        """Serve ``req`` (submitted at ``submit_ns``) with ``buf`` as its I/O buffer."""
        clock = self.clock
        start = clock.now_ns()
        t = _Tally()
        ok, err, device_full = True, "", False
        try:
            if self.deadline_ns is not None and start >= self.deadline_ns:
                raise _Cut
            self._rag_burst(t, req, buf)
            self._prefill(t, req, buf)
            self._decode(t, req, buf)
        except (_Cut, Cancelled):
            ok, err = False, CUT
        except TierFullError as e:
            ok, err = False, f"tier_full: {e}"
            cause = e.__cause__
            device_full = isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT)
        except StorageError as e:
            ok, err = False, f"storage_error: {e}"
        finally:
            for key in t.held:  # its reads are done (or cut): the entries may be evicted again
                self.store.release(key)
            for name, n in t.counts.items():
                self._count(name, n)
        storage_done = clock.now_ns()
        gen_ns = 0
        if ok and self.settings.per_token_s > 0:
            if self.hard_stop.wait(req.generate_tokens * self.settings.per_token_s):
                ok, err = False, CUT
            gen_ns = clock.now_ns() - storage_done
        end = clock.now_ns()
        record = BenchRequest(
            user=req.user_id,
            qos=req.qos,
            phase=req.phase,
            context_tokens=req.context_tokens,
            generate_tokens=req.generate_tokens,
            submit_ns=submit_ns,
            start_ns=start,
            storage_done_ns=storage_done,
            end_ns=end,
            storage_ns=t.storage_ns,
            generation_ns=gen_ns,
            bytes_read=t.bytes_read,
            bytes_written=t.bytes_written,
            decode_bytes_read=t.decode_bytes_read,
            tokens_read=t.tokens_read,
            tokens_written=t.tokens_written,
            hits=t.hits,
            misses=t.misses,
            ok=ok,
            error=err,
            new_tokens=req.new_tokens,
            turn=req.turn,
            rag_ns=t.rag_ns,
            rag_bytes=t.rag_bytes,
            prefill_ns=t.prefill_ns,
            decode_ns=t.decode_ns,
            key=req.key,
            seq=req.seq,
            tier_ns=tuple(sorted(t.tier_ns.items())),
            stores_dropped=t.dropped,
            alloc_wait_ns=t.alloc_wait_ns,
            lookups=tuple(sorted((k, n) for k, n in t.counts.items() if k.startswith("lookup_"))),
        )
        return Served(record, device_full)


__all__ = ["RequestService", "ServiceSettings", "Served", "CUT"]
