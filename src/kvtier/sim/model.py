"""The simulated engine: a modelled GPU prefix cache in front of a real kvtier offload tier.

GPU (modelled, like vLLM's prefix cache): capacity in blocks (--block-tokens, default 16, vLLM's GPU
default; its CPU build uses 128) from --gpu-kv-gb and the model's KV bytes per token, or --gpu-kv-tokens;
prefix blocks are chained hashes of token ids (kvtier.keys); a request hits the longest run of leading
blocks present among those that end before its last token (vLLM always computes the last token);
blocks of running requests are pinned; a finished request's blocks are freed tail first, and unpinned
blocks are evicted LRU when new blocks are needed — so under pressure a history loses its end before
its start, as in vLLM's free-block queue.

Offload (real, like LMCache): 256-token chunks keyed by prefix-chained hashes in a kvtier
TieredStore (CPU RAM, or a small CPU staging tier in front of the file tier for NVMe). After a
request's prefill its full chunks are stored (write after prefill, off the request's path). A new
request first takes its GPU hit, then the contiguous continuation found in the offload tier, loaded
with real reads whose measured time is added to its TTFT — unless the fetch gate (kvtier plan)
says recomputing would be faster, judged on the load bandwidth measured so far.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.costs import should_fetch
from kvtier.engine.backend import Backend, aligned_buffer
from kvtier.engine.noise import NoiseBuffer
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import ConfigError, StorageError, TierFullError
from kvtier.keys import KeyScope, prefix_chunk_hashes
from kvtier.telemetry.recorder import Recorder
from kvtier.tiers import Ask, is_remote, offload_plan, open_tiers

if TYPE_CHECKING:
    from kvtier.config.sim import OffloadTierConfig

BLOCK_TOKENS = 16


def block_hashes(token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    return prefix_chunk_hashes(token_ids, block_tokens)


class GpuPrefixCache:
    """vLLM's block pool, block-granular: a request holds a list of blocks, each keyed by its prefix hash once
    full (cached: another request's prompt can hit it) or anonymous while partial; blocks no request holds stay
    cached in LRU order until a new block needs their room. Thread safe.

    The rules that decide hit rates are vLLM 0.32's (v1/core): blocks are allocated chunk by chunk as a request
    is scheduled (``grow``), and registered as cached then, before they are computed; a block a request fills
    while decoding is cached too (``seal``; nothing later matches it, but it takes room); a request's blocks are
    freed in reverse order (``free``: its tail is evicted before its head); and the admission gate counts the
    whole prompt's blocks against the free ones (``admissible``, vLLM's ``full_sequence_must_fit``)."""

    def __init__(self, capacity_blocks: int, block_tokens: int = BLOCK_TOKENS) -> None:
        if capacity_blocks < 1:
            raise ConfigError(f"--gpu-kv-gb: too small to hold one {block_tokens}-token block of this model")
        self.capacity = capacity_blocks
        self.block_tokens = block_tokens
        self._ref: dict[bytes, int] = {}  # cached blocks -> requests holding them
        self._free: OrderedDict[bytes, None] = OrderedDict()  # cached, held by none (LRU first)
        self._anon = 0  # held blocks without a key (a partial block, being filled)
        self._lock = threading.Lock()

    @property
    def used_blocks(self) -> int:
        """Blocks held by requests. Cached blocks no request holds count as free, as in vLLM's
        kv_cache_usage_perc: they are reused (evicted) as soon as room is needed."""
        with self._lock:
            return len(self._ref) - len(self._free) + self._anon

    def _available(self) -> int:
        """Blocks a request could take now: never used, or cached and held by none (evictable)."""
        return self.capacity - (len(self._ref) - len(self._free)) - self._anon

    def match(self, hashes: Sequence[bytes], limit: int | None = None) -> int:
        """Leading blocks of ``hashes`` (of the first ``limit``) that are cached."""
        with self._lock:
            limit = len(hashes) if limit is None else min(limit, len(hashes))
            n = 0
            while n < limit and hashes[n] in self._ref:
                n += 1
            return n

    def admissible(self, hashes: Sequence[bytes], hit: int, total_blocks: int) -> bool:
        """Whether a waiting request whose sequence needs ``total_blocks`` blocks, the first ``hit`` of them
        cached, may start: the blocks it does not share with running requests must be free now (hits held by
        none count, since touching them takes them off the free list)."""
        with self._lock:
            shared = sum(1 for h in hashes[:hit] if h in self._ref and h not in self._free)
            return total_blocks - shared <= self._available()

    def grow(self, held: list[bytes | None], keys: Sequence[bytes], upto: int) -> bool:
        """Extend a request's ``held`` blocks to ``upto`` blocks: block i is keyed ``keys[i]`` (held with the
        requests already holding it, or allocated and cached) or anonymous past ``keys``. All or nothing:
        False, changing nothing, when the free blocks cannot cover it. A block's own cached copy is taken off
        the free list before anything is evicted, so making room never evicts what the request is about to
        hit."""
        with self._lock:
            want = [keys[i] if i < len(keys) else None for i in range(len(held), upto)]
            touched = {h for h in want if h is not None and h in self._ref}  # prefix hashes never repeat
            need = sum(1 for h in want if h not in touched) + sum(1 for h in touched if h in self._free)
            if need > self._available():
                return False
            for t in touched:  # off the free list before anything is evicted
                self._free.pop(t, None)
                self._ref[t] += 1
            for h in want:
                if h in touched:
                    continue
                while len(self._ref) + self._anon >= self.capacity:
                    victim, _ = self._free.popitem(last=False)
                    del self._ref[victim]
                if h is None:
                    self._anon += 1
                else:
                    self._ref[h] = 1
            held.extend(want)
            return True

    def seal(self, held: list[bytes | None], index: int, key: bytes) -> None:
        """Block ``index`` of a request filled up while decoding: cache it under ``key`` (vLLM hashes every
        full block, the generated ones too)."""
        with self._lock:
            if held[index] is not None:
                return
            self._anon -= 1
            if key in self._ref:  # already cached (the same generated block): share it, free our copy
                if key in self._free:
                    del self._free[key]
                self._ref[key] += 1
            else:
                self._ref[key] = 1
            held[index] = key

    def free(self, held: list[bytes | None]) -> None:
        """Give back a request's blocks, last first: cached ones no other request holds join the LRU end in
        that order (the tail of the sequence is evicted before its head), anonymous ones are simply free."""
        with self._lock:
            for h in reversed(held):
                if h is None:
                    self._anon -= 1
                    continue
                self._ref[h] -= 1
                if self._ref[h] == 0:
                    self._free[h] = None
            held.clear()


@dataclass(frozen=True)
class OffloadConfig:
    kind: str  # an --offload choice (kvtier/tiers.py OFFLOAD_KINDS), or remote
    chunk_tokens: int = 256
    tier: OffloadTierConfig | None = None  # the tier's flags (None: their defaults)


class _Measured:
    """Load accounting and the fetch gate, shared by the in-process and the remote offload tier."""

    PROBE_S = 5.0  # re-measure the tier at least this often, even when the gate says recompute
    gated = True  # False (--no-fetch-gate): every hit is loaded, as an engine without a gate does
    DEGRADED_S = 30.0  # /health says degraded while the last failure is this recent
    BREAK_AFTER = 3  # consecutive failed calls open the breaker: the tier is bypassed (recompute) ...
    BYPASS_S = 10.0  # ... this long, then one call probes it (a failed probe opens it again)
    kvpt: int
    errors = 0  # failed calls to the tier (a cache server, or an in-process Redis/S3/file tier)
    last_error = ""
    last_error_at = 0.0

    @property
    def recent_error(self) -> str | None:
        """The last failure of the tier if it happened within DEGRADED_S, else None."""
        if self.last_error and time.monotonic() - self.last_error_at < self.DEGRADED_S:
            return self.last_error
        return None

    def _init_measured(self) -> None:
        self._lock = threading.Lock()
        self.consecutive_errors = 0
        self.bypass_until = 0.0
        self.bypassed_loads = 0  # requests recomputed without asking the tier: its breaker was open
        self.bypassed_stores = 0  # stores not attempted for the same reason
        self.loaded_bytes = 0
        self.load_seconds = 0.0
        self.loads = 0
        self.stored_bytes = 0
        self.store_seconds = 0.0
        self.chunks_loaded = 0
        self.last_load_at = 0.0
        self._bw_ewma: float | None = None

    def _note_error(self, message: str) -> None:
        """One failed call (a timeout, a server gone, a malformed reply): counted, and BREAK_AFTER of them in a
        row open the breaker, so a hung server costs a few requests their deadline, not every request."""
        now = time.monotonic()
        with self._lock:
            self.errors += 1
            self.last_error, self.last_error_at = message[:300], now
            self.consecutive_errors += 1
            if self.consecutive_errors >= self.BREAK_AFTER:
                self.bypass_until = now + self.BYPASS_S

    def _note_ok(self) -> None:
        with self._lock:
            self.consecutive_errors = 0

    def admit(self, what: str) -> bool:
        """Whether a call may go to the tier now. While the breaker is open the answer is no (the caller
        recomputes, or skips the store, and it is counted); once BYPASS_S has passed one caller is let
        through as the probe, and the breaker stays open for the others until the probe succeeds."""
        with self._lock:
            if self.consecutive_errors < self.BREAK_AFTER:
                return True
            now = time.monotonic()
            if now >= self.bypass_until:
                self.bypass_until = now + self.BYPASS_S
                return True
            if what == "load":
                self.bypassed_loads += 1
            else:
                self.bypassed_stores += 1
            return False

    @property
    def breaker_open(self) -> bool:
        return self.consecutive_errors >= self.BREAK_AFTER

    def _note_load(self, dt: float, nbytes: int, found: int) -> None:
        with self._lock:
            self.loaded_bytes += nbytes
            self.load_seconds += dt
            self.loads += 1
            self.chunks_loaded += found
            self.last_load_at = time.monotonic()
            if nbytes and dt > 0:
                bw = nbytes / dt
                self._bw_ewma = bw if self._bw_ewma is None else 0.7 * self._bw_ewma + 0.3 * bw

    def measured_fetch(self) -> tuple[float, float] | None:
        """(bytes/s, per-load overhead s): a moving average over recent loads (weight 0.3 on the
        newest), so a cold first read does not close the gate for good; None before the first load."""
        with self._lock:
            if self._bw_ewma is None:
                return None
            return self._bw_ewma, 0.0

    def gate(self, tokens: int, prefill_tps: float) -> bool:
        """Fetch (True) or recompute. Fetches anyway when nothing was measured yet or the last load
        is older than PROBE_S, so the estimate follows the tier (a gate that only ever recomputes
        would never learn that the tier got faster)."""
        m = self.measured_fetch()
        if not self.gated or m is None or time.monotonic() - self.last_load_at > self.PROBE_S:
            return True
        bw, rtt = m
        return should_fetch(tokens, self.kvpt, bw, rtt, prefill_tps).fetch


def offload_tiers(cfg: OffloadConfig, kv_bytes_per_token: int, connections: int = 1) -> list[Backend]:
    """The offload tier's waterfall (the tier table's ``offload_plan``), built. A chunk is one page of the paged
    tiers: no waste."""
    from kvtier.config.sim import OffloadTierConfig

    flags = cfg.tier or OffloadTierConfig()
    return open_tiers(
        offload_plan(cfg.kind, flags, Ask(page_bytes=cfg.chunk_tokens * kv_bytes_per_token, connections=connections))
    )


class Offload(_Measured):
    """The real offload tier, in process: chunk KV through kvtier's TieredStore."""

    def __init__(
        self,
        cfg: OffloadConfig,
        scope: KeyScope,
        kv_bytes_per_token: int,
        seed: int,
        tiers: list[Backend] | None = None,
    ) -> None:
        """``tiers``: the built tiers, fastest first (``offload_tiers``: the CPU tier, or CPU
        staging in front of NVMe, Redis or S3); without them, those ``cfg`` describes."""
        self.cfg = cfg
        self.scope = scope
        self.kvpt = kv_bytes_per_token
        self.recorder = Recorder()
        if tiers is None:
            tiers = offload_tiers(cfg, kv_bytes_per_token)
        self.store = TieredStore(tiers, StoreConfig(), self.recorder)
        self._remote = tiers[-1] if is_remote(cfg.kind) else None
        self.noise = NoiseBuffer(64 * 1024 * 1024, seed)
        self._bufs = threading.local()
        self._init_measured()
        self._store_pool = ThreadPoolExecutor(self.STORE_THREADS, thread_name_prefix="kvtier-sim-store")
        self._pending_stores = 0
        self.stores_skipped_busy = 0

    def _buf(self) -> memoryview:
        b = getattr(self._bufs, "b", None)
        if b is None:
            b = self._bufs.b = aligned_buffer(16 * 1024 * 1024)
        return b

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        return self.scope.keys_for_tokens(token_ids)

    def _chunks(self, key: str, nbytes: int, buf: memoryview) -> Callable[[], Iterable[memoryview]]:
        """The store's chunk source for one entry: chunks of ``len(buf)`` from a writer buffer of the noise's,
        stamped in place (engine/noise.py); ``buf`` itself serves the demotions the write causes."""
        return lambda: self.noise.chunks(key, nbytes, len(buf))

    def _failed(self, e: StorageError) -> None:
        """A failed read or write of the tier (a Redis or S3 server gone, a corrupt file): the rest is
        recomputed, and the failure counted (kvtier_sim:offload_errors) and shown by /health."""
        if isinstance(e, TierFullError) and not isinstance(e.__cause__, OSError):
            return  # no room, nothing failed
        self._note_error(str(e))

    def lookup(self, keys: Sequence[str]) -> int:
        n = 0
        for k in keys:
            if self.store.location(k) is None:
                break
            n += 1
        return n

    def load(self, keys: Sequence[str], sources: list[str] | None = None) -> tuple[float, int, int]:
        """Really read the chunks; returns (seconds, bytes, chunks found). ``sources`` gets the tier that
        served each chunk found, in order (the TTFT decomposition's tokens by tier). Runs in a worker thread."""
        buf = self._buf()
        t0 = time.perf_counter()
        nbytes = found = 0
        failed = False
        for k in keys:
            try:
                r = self.store.get(k, buf)
            except StorageError as e:
                self._failed(e)
                failed = True
                break
            if not r.hit:
                break  # evicted since the lookup: the rest is recomputed
            nbytes += r.nbytes
            found += 1
            if sources is not None:
                sources.append(r.tier or "?")
        dt = time.perf_counter() - t0
        if not failed:
            self._note_ok()
        self._note_load(dt, nbytes, found)
        return dt, nbytes, found

    def save(self, keys: Sequence[str]) -> int:
        """Store chunks not already present (the store path after prefill); returns the bytes
        written. Runs in a worker thread."""
        if not self.admit("store"):
            return 0
        buf = self._buf()
        chunk_bytes = self.cfg.chunk_tokens * self.kvpt
        t0 = time.perf_counter()
        n = 0
        errors_before, _ = self.recorder.error_total()
        failed = False
        for k in keys:
            if self.store.location(k) is not None:
                continue
            try:
                self.store.put(k, self._chunks(k, chunk_bytes, buf), chunk_bytes, buf)
                n += chunk_bytes
            except StorageError as e:
                self._failed(e)
                failed = True
                break
            errors_now, message = self.recorder.error_total()
            if errors_now > errors_before:  # a demotion to the tier below failed (the store counted it)
                self._note_error(message)
                failed = True
                break
        if not failed:
            self._note_ok()
        with self._lock:
            self.stored_bytes += n
            self.store_seconds += time.perf_counter() - t0
        return n

    # The engine's asynchronous view (the remote tier implements the same four calls).
    async def alookup(self, keys: Sequence[str]) -> int:
        return await asyncio.to_thread(self.lookup, keys)

    async def aload(self, keys: Sequence[str], sources: list[str] | None = None) -> tuple[float, int, int]:
        return await asyncio.to_thread(self.load, keys, sources)

    STORE_THREADS = 2  # the store path's own threads: a slow or hung tier never takes the request path's
    MAX_PENDING_STORES = 64  # stores queued behind them at most; past it a store is skipped, counted

    @property
    def pending_stores(self) -> int:
        return self._pending_stores

    def store_later(self, keys: Sequence[str]) -> None:
        """The store path after prefill, off the request's path and off its threads (a store waiting out a
        hung server's deadline must not delay the next request's lookup)."""
        with self._lock:
            if self._pending_stores >= self.MAX_PENDING_STORES:
                self.stores_skipped_busy += 1
                return
            self._pending_stores += 1

        def run() -> None:
            try:
                self.save(keys)
            finally:
                with self._lock:
                    self._pending_stores -= 1

        self._store_pool.submit(run)

    def usage(self) -> dict[str, Any] | None:
        u = self.store.usage()
        l1 = self.store.tier_names[0]  # the memory tier in front (CPU RAM, or a CXL tier alone)
        ctr = self.recorder.counters
        return {
            "cpu_used_bytes": u.get(l1, {}).get("used_bytes", 0),
            "cpu_capacity_bytes": u.get(l1, {}).get("capacity_bytes", 0),
            "l2_used_bytes": sum(v["used_bytes"] for k, v in u.items() if k != l1),  # NVMe, Redis or S3
            "evicted_chunks": ctr.get("demotions", 0) + ctr.get("evictions_bottom", 0),
        }

    async def aclose(self) -> None:
        pass

    def close(self) -> None:
        """Stores not begun are dropped. A remote tier with stores in flight or recent failures is aborted first
        (those stores fail at once, its cleanup gets a second a call: what they wrote is deleted anyway), so a
        hung server cannot hold the sim's exit."""
        abort = getattr(self._remote, "abort", None)
        if abort is not None and (self._pending_stores or self.recent_error is not None):
            abort()
        self._store_pool.shutdown(wait=True, cancel_futures=True)
        self.store.close()


__all__ = ["GpuPrefixCache", "Offload", "OffloadConfig", "block_hashes", "BLOCK_TOKENS"]
