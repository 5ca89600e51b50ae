"""The worker side of kvtier's vLLM offloading backend: blocks between the engine's KV cache and kvtier's tiers.

Each vLLM worker (one per tensor-parallel rank) owns real kvtier tiers (a TieredStore over the CPU arena, the
NVMe files, Redis or S3) holding its share of every offloaded block, under keys scoped by model, dtype,
layout and rank (``KeyScope``). Transfers are asynchronous:

* **stores** run on one thread, in the order vLLM submits them, because each carries the scheduler's plan
  (kvtier/vllm/index.py): its evictions and demotions run first, in order, then its placements in parallel on
  the I/O pool — so the worker's tiers hold exactly what the scheduler's index says;
* **loads** run on the I/O pool, one block per task, reading each block wherever the tiers hold it.

A block moves through one page-aligned host buffer per thread: gathered from the engine's per-layer pages
into the buffer, written to the tier from it (loads the other way). On the CPU build the engine's pages are
host memory; on a GPU host the buffer is registered (pinned) with CUDA so the copies are device DMA.

A load that fails (the tier lost the block, a Redis or S3 server went away, a short read) is never handed to
vLLM as data: the job still finishes (vLLM 0.32's connector asserts that transfers succeed), its bytes are
not counted, and the failed blocks' ids are reported through the connector's ``get_block_ids_with_load_errors``
(kvtier/vllm/spec.py), so vLLM recomputes them (``kv_load_failure_policy: recompute``) or fails the request.
"""

from __future__ import annotations

import atexit
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvtier.engine.backend import Backend, aligned_buffer, round_up
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import StorageError

log = logging.getLogger("kvtier.vllm")


@dataclass
class Piece:
    """One layer's (or layer group's) page of a block: ``tensor[block_id, :nbytes]``, bytes at ``offset``."""

    tensor: Any  # torch.Tensor (num_blocks, page_bytes), int8
    nbytes: int
    offset: int


class BlockLayout:
    """Where one block's bytes are in the engine's KV cache: the pages of every tensor of the KV group, in
    order, concatenated into one entry. Built from vLLM's CanonicalKVCaches (tensors of shape (num_blocks,
    page bytes), int8, and the group's references into them)."""

    def __init__(self, tensors: Sequence[tuple[Any, int]]) -> None:
        self.pieces: list[Piece] = []
        at = 0
        for t, n in tensors:
            self.pieces.append(Piece(t, n, at))
            at += n
        self.nbytes = at
        self.on_device = any(getattr(t, "is_cuda", False) for t, _ in tensors)

    @classmethod
    def from_canonical(cls, kv_caches: Any, group: int = 0) -> BlockLayout:
        seen: set[int] = set()
        pieces = []
        for ref in kv_caches.group_data_refs[group]:
            if ref.tensor_idx in seen:
                continue
            seen.add(ref.tensor_idx)
            pieces.append((kv_caches.tensors[ref.tensor_idx].tensor, ref.page_size_bytes))
        return cls(pieces)

    def gather(self, block_id: int, host: Any) -> None:
        """Copy the block's pages into ``host`` (a uint8 torch tensor over the thread's buffer)."""
        for p in self.pieces:
            host[p.offset : p.offset + p.nbytes].copy_(p.tensor[block_id, : p.nbytes].view(host.dtype))

    def scatter(self, block_id: int, host: Any) -> None:
        for p in self.pieces:
            p.tensor[block_id, : p.nbytes].copy_(host[p.offset : p.offset + p.nbytes].view(p.tensor.dtype))


@dataclass
class Result:
    job_id: int
    success: bool
    nbytes: int | None
    seconds: float | None


class BlockLoad(NamedTuple):
    """One block's load: where it came from, its bytes (0: failed) and the tier's own time for the read (ns)."""

    key: Any
    block_id: int
    nbytes: int
    tier: str = ""
    io_ns: int = 0


@dataclass
class RequestIO:
    """One request's loads on one worker (its ``tag``, vLLM's request id), for the per-request record
    (kvtier/vllm/reqlog.py): when the first was submitted and the last finished (``time.monotonic``: the host's
    CLOCK_MONOTONIC, the clock of vLLM's scheduler and of kvtier replay), and by tier the blocks and bytes loaded
    and the tier's own read time; the blocks that failed (vLLM recomputes them; a block's shards fail on every worker,
    so a block counts once)."""

    submitted_s: float | None = None
    done_s: float | None = None
    blocks: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    io_s: dict[str, float] = field(default_factory=dict)
    failed_keys: list[Any] = field(default_factory=list)  # blocks whose load failed (vLLM recomputes them)

    @property
    def failed_blocks(self) -> int:
        return len(set(self.failed_keys))

    def add(self, got: Sequence[BlockLoad], submitted_s: float, done_s: float) -> None:
        self.submitted_s = submitted_s if self.submitted_s is None else min(self.submitted_s, submitted_s)
        self.done_s = done_s if self.done_s is None else max(self.done_s, done_s)
        for g in got:
            if not g.nbytes:
                self.failed_keys.append(g.key)
                continue
            self.blocks[g.tier] = self.blocks.get(g.tier, 0) + 1
            self.nbytes[g.tier] = self.nbytes.get(g.tier, 0) + g.nbytes
            self.io_s[g.tier] = self.io_s.get(g.tier, 0.0) + g.io_ns / 1e9

    def renamed(self, prefix: str) -> RequestIO:
        """The same with every tier's name prefixed (a shared cache server's tiers in the request log)."""
        out = RequestIO(self.submitted_s, self.done_s, failed_keys=list(self.failed_keys))
        out.blocks = {prefix + k: v for k, v in self.blocks.items()}
        out.nbytes = {prefix + k: v for k, v in self.nbytes.items()}
        out.io_s = {prefix + k: v for k, v in self.io_s.items()}
        return out

    def merge(self, other: RequestIO) -> RequestIO:
        """Two reports of one request (two workers of a step, or two steps) as one."""
        out = RequestIO(self.submitted_s, self.done_s, dict(self.blocks), dict(self.nbytes), dict(self.io_s))
        out.failed_keys = [*self.failed_keys, *other.failed_keys]
        if other.submitted_s is not None:
            out.submitted_s = other.submitted_s if out.submitted_s is None else min(out.submitted_s, other.submitted_s)
        if other.done_s is not None:
            out.done_s = other.done_s if out.done_s is None else max(out.done_s, other.done_s)
        for mine, theirs in ((out.blocks, other.blocks), (out.nbytes, other.nbytes)):
            for k, v in theirs.items():
                mine[k] = mine.get(k, 0) + v
        for k, s in other.io_s.items():
            out.io_s[k] = out.io_s.get(k, 0.0) + s
        return out


class Counts:
    """What a worker did, by name (``loaded:TIER``, ``stored:TIER``, ``failed_loads``, ``failed_stores``, ``moves``,
    ``failed_moves``): the running totals, and the part not yet taken (sent to the scheduler, which puts them on
    the engine's /metrics)."""

    def __init__(self) -> None:
        self.total: collections.Counter[str] = collections.Counter()
        self._new: collections.Counter[str] = collections.Counter()
        self.last_error = ""
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1, error: str | None = None) -> None:
        with self._lock:
            self.total[name] += n
            self._new[name] += n
            if error:
                self.last_error = error[:300]

    def take(self) -> dict[str, int]:
        with self._lock:
            out, self._new = dict(self._new), collections.Counter()
            return out


class BlockWorker:
    """Asynchronous block transfers for one vLLM worker over kvtier tiers; vLLM-agnostic (the spec adapts it)."""

    def __init__(
        self,
        tiers: list[Backend],
        layout: BlockLayout,
        key_of: Callable[[Any], str],
        io_threads: int = 4,
    ) -> None:
        # the scheduler's index decides placement: a tier's whole capacity is usable, no entry is refused
        self.store = TieredStore(tiers, StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0))
        self._start(layout, key_of, io_threads, [t.name for t in tiers])

    def _start(self, layout: BlockLayout, key_of: Callable[[Any], str], io_threads: int, tier_names: list[str]) -> None:
        """The transfer machinery (threads, queues, results), whoever holds the tiers."""
        self.layout = layout
        self.key_of = key_of
        self.tier_names = tier_names
        self.counters = Counts()
        self._padded = round_up(layout.nbytes)
        self._local = threading.local()
        self.io_threads = io_threads
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvtier-vllm-io")
        self._stores: collections.deque[tuple[int, list[int], Any]] = collections.deque()
        self._results: collections.deque[Result] = collections.deque()
        self._load_errors: set[int] = set()  # engine block ids whose load failed, for vLLM
        self._lost_keys: list[Any] = []  # their offload keys, for the scheduler's index
        self._inflight: set[int] = set()  # jobs submitted and not finished
        self._request_io: dict[str, RequestIO] = {}  # by the loads' tag (vLLM's request id), until taken
        self._cv = threading.Condition()
        self._closed = False
        self._store_thread = threading.Thread(target=self._store_loop, name="kvtier-vllm-store", daemon=True)
        self._store_thread.start()
        self._store_closed = False
        atexit.register(self._close_store)  # an engine that exits without shutting its connector down

    # -- per-thread buffers -------------------------------------------------------------------
    def _buffers(self) -> tuple[memoryview, Any, memoryview]:
        """(entry buffer, the same as a uint8 torch tensor, scratch buffer for demotions)."""
        b = getattr(self._local, "b", None)
        if b is None:
            import torch

            buf = aligned_buffer(self._padded)
            if self.layout.on_device:
                pin_host_buffer(buf)
            host = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
            b = self._local.b = (buf, host, aligned_buffer(self._padded))
        return b

    # -- stores: one ordered queue ----------------------------------------------------------------
    def submit_store(self, job_id: int, block_ids: Sequence[int], plan: Any) -> None:
        """``plan``: the scheduler's StorePlan (keys_to_store in the order of ``block_ids``)."""
        with self._cv:
            self._inflight.add(job_id)
            self._stores.append((job_id, list(block_ids), plan))
            self._cv.notify_all()

    def _store_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stores and not self._closed:
                    self._cv.wait()
                if self._closed and not self._stores:
                    return
                job_id, block_ids, plan = self._stores.popleft()
            t0 = time.perf_counter()
            nbytes = 0
            try:
                nbytes = self._run_store(block_ids, plan)
            except Exception as e:  # a bug must not kill the thread: the job finishes, its blocks are unloadable
                log.exception("kvtier store job %d failed", job_id)
                self.counters.add("failed_stores", len(block_ids), f"store: {e}")
            self._finish(Result(job_id, True, nbytes, time.perf_counter() - t0))

    def _run_store(self, block_ids: list[int], plan: Any) -> int:
        keys = plan.keys_to_store
        if len(keys) != len(block_ids):
            self.counters.add("failed_stores", len(keys), f"store: {len(keys)} keys for {len(block_ids)} blocks")
            return 0
        block_of = dict(zip(keys, block_ids, strict=True))
        _, _, scratch = self._buffers()
        places: list[tuple[Any, int]] = []
        for what, key, tier in plan.actions:
            if what == "evict":
                self.store.delete(self.key_of(key))
            elif what == "move":
                if self.store.move(self.key_of(key), self.tier_names[tier], scratch):
                    self.counters.add("moves")
                elif self.store.location(self.key_of(key)) != self.tier_names[tier]:
                    self.counters.add("failed_moves")  # not held (a failed store) or the copy failed
            else:
                places.append((key, tier))
        futures = [self._pool.submit(self._place, key, block_of[key], tier) for key, tier in places]
        return sum(f.result() for f in futures)

    def _place(self, key: Any, block_id: int, tier: int) -> int:
        buf, host, scratch = self._buffers()
        self.layout.gather(block_id, host)
        n = self.layout.nbytes
        name = self.tier_names[tier]
        try:
            self.store.place(self.key_of(key), name, lambda: [buf[: self._padded]], n, scratch)
        except StorageError as e:
            self.counters.add("failed_stores", 1, f"store to {name}: {e}")
            return 0
        self.counters.add(f"stored:{name}")
        return n

    # -- loads: in parallel -----------------------------------------------------------------------
    def submit_load(self, job_id: int, keys: Sequence[Any], block_ids: Sequence[int], tag: str | None = None) -> None:
        """Load ``keys`` into the engine's blocks ``block_ids``, in parallel; ``tag`` (vLLM's request id) gathers
        the job's timing and bytes by tier for that request's record (``take_request_io``)."""
        t0 = time.monotonic()
        with self._cv:
            self._inflight.add(job_id)
        if len(keys) != len(block_ids):
            with self._cv:
                self._load_errors.update(block_ids)
                self._lost_keys.extend(keys)
            self.counters.add("failed_loads", len(block_ids), f"load: {len(keys)} keys for {len(block_ids)} blocks")
            self._account(tag, [BlockLoad(k, b, 0) for k, b in zip(keys, block_ids, strict=False)], t0)
            self._finish(Result(job_id, True, None, None))
            return
        futures = self._load_tasks(list(zip(keys, block_ids, strict=True)))
        pending = [len(futures)]
        lock = threading.Lock()
        got: list[BlockLoad] = []

        def one_done(f: Future[list[BlockLoad]]) -> None:
            with lock:
                got.extend(f.result())
                pending[0] -= 1
                last = pending[0] == 0
            if last:
                failed = [g for g in got if g.nbytes == 0]
                if failed:
                    with self._cv:
                        self._load_errors.update(g.block_id for g in failed)
                        self._lost_keys.extend(g.key for g in failed)
                done = self._account(tag, got, t0)
                total = sum(g.nbytes for g in got)
                self.counters.add("load_job:bytes", total)  # the live gate's throughput (vllm/gate.py)
                self.counters.add("load_job:ns", int((done - t0) * 1e9))
                self._finish(Result(job_id, True, total if not failed else None, done - t0))

        if not futures:
            self._account(tag, [], t0)
            self._finish(Result(job_id, True, 0, 0.0))
        for f in futures:
            f.add_done_callback(one_done)

    def _load_tasks(self, pairs: list[tuple[Any, int]]) -> list[Future[list[BlockLoad]]]:
        """The I/O pool's tasks of one load job: here one per block, in parallel."""
        return [self._pool.submit(lambda k, b: [self._load(k, b)], k, b) for k, b in pairs]

    def _account(self, tag: str | None, got: Sequence[BlockLoad], submitted_s: float) -> float:
        """A finished load job into its request's tally (when tagged); returns the time it finished."""
        done = time.monotonic()
        if tag is not None:
            with self._cv:
                self._request_io.setdefault(tag, RequestIO()).add(got, submitted_s, done)
        for g in got:
            if g.nbytes:
                self.counters.add(f"load_ns:{g.tier}", g.io_ns)
        return done

    def take_request_io(self) -> dict[str, RequestIO]:
        """The loads finished since the last call, by request (the connector sends them to the scheduler)."""
        with self._cv:
            out, self._request_io = self._request_io, {}
            return out

    def _load(self, key: Any, block_id: int) -> BlockLoad:
        buf, host, _ = self._buffers()
        skey = self.key_of(key)
        try:
            r = self.store.get(skey, buf, self.layout.nbytes)  # a shared namespace: another writer's block too
        except StorageError as e:
            self.counters.add("failed_loads", 1, f"load: {e}")
            return BlockLoad(key, block_id, 0)
        except Exception as e:
            log.exception("kvtier load of block %d failed", block_id)
            self.counters.add("failed_loads", 1, f"load: {e}")
            return BlockLoad(key, block_id, 0)
        if not r.hit or r.nbytes not in (self.layout.nbytes, self._padded):
            why = "block not held" if not r.hit else f"{r.nbytes} bytes, expected {self.layout.nbytes}"
            self.counters.add("failed_loads", 1, f"load: {why}")
            return BlockLoad(key, block_id, 0)
        self.layout.scatter(block_id, host)
        tier = r.tier or "?"
        self.counters.add(f"loaded:{tier}")
        return BlockLoad(key, block_id, r.nbytes, tier, r.timing.total_ns)

    # -- completion ---------------------------------------------------------------------------------
    def _finish(self, r: Result) -> None:
        with self._cv:
            self._results.append(r)
            self._inflight.discard(r.job_id)
            self._cv.notify_all()

    def take_results(self) -> list[Result]:
        with self._cv:
            out = list(self._results)
            self._results.clear()
            return out

    def take_load_errors(self) -> set[int]:
        with self._cv:
            out, self._load_errors = self._load_errors, set()
            return out

    def take_lost_keys(self) -> list[Any]:
        with self._cv:
            out, self._lost_keys = self._lost_keys, []
            return out

    def wait(self, job_ids: set[int], timeout_s: float | None = None) -> bool:
        """Block until every job of ``job_ids`` finished (or was already taken); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while True:
                if not job_ids & self._inflight:
                    return True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left if left is not None else 1.0)

    def usage(self) -> dict[str, dict[str, int]]:
        return self.store.usage()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._store_thread.join(timeout=30)
        self._pool.shutdown(wait=True, cancel_futures=False)
        self._close_store()

    def _close_store(self) -> None:
        """Release the tiers once: the CPU arena, and the file tier's run folder with its files."""
        if not self._store_closed:
            self._store_closed = True
            self.store.close()


def pin_host_buffer(buf: memoryview) -> None:
    """Register a host buffer with CUDA (page-locked), so device copies into it are DMA; harmless where it fails."""
    try:
        import ctypes

        import torch

        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        getattr(torch.cuda, "cudart")().cudaHostRegister(addr, len(buf), 0)  # noqa: B009 - untyped
    except Exception as e:  # noqa: BLE001 - pinning is an optimisation
        log.warning("kvtier: could not pin a %d-byte host buffer (%s); device copies stay pageable", len(buf), e)


__all__ = ["BlockLayout", "BlockWorker", "Counts", "BlockLoad", "RequestIO", "Result", "pin_host_buffer"]
