"""The benchmark loop: user threads submit requests, I/O workers serve them by QoS priority.

* Users are real threads, closed loop: think (the profile's think time), submit one request,
  wait for it, repeat. ``--request-rate`` additionally paces submissions globally.
* ``io_slots`` worker threads (``--max-concurrent-allocs``, or min(users, 32) when 0) take
  requests from one priority queue (interactive before responsive before batch, FIFO within a
  class). Each worker owns one reusable aligned buffer of ``--io-chunk-mb``; writes are zero-copy
  slices of the noise buffer, so bytes in flight are bounded by io_slots x io_chunk.
* A request: prefill writes the entry for its context; a prefill+decode request then reads it
  once and again once per decode batch (ceil(generate / batch_size) reads), as the reference
  does; a decode read that misses re-writes the entry. Then it sleeps generate x per-token time.
* Stop: --duration, --max-requests, SIGINT/SIGTERM (status partial) or the device filling up
  (ENOSPC: status partial). In-flight requests finish; queued ones are abandoned and counted.
"""

from __future__ import annotations

import dataclasses
import errno
import heapq
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from kvtier.bench.autoscale import Autoscaler
from kvtier.bench.precondition import GiB, precondition
from kvtier.bench.setup import Components
from kvtier.engine.backend import aligned_buffer
from kvtier.errors import Cancelled, StorageError, TierFullError
from kvtier.telemetry.host import proc_io
from kvtier.telemetry.recorder import Recorder, RequestRecord, clock_ns
from kvtier.engine.tiered import GetResult, NullSink
from kvtier.keys import KeyScope
from kvtier.workload.conversations import ConversationManager, ConversationSettings, conversation_requests
from kvtier.workload.layout import KVRef, hash_id_chunks, segment_chunks
from kvtier.workload.rag import RagCorpus, RagSettings
from kvtier.workload.sharegpt import dataset_requests
from kvtier.workload.users import Request, UserProfile, draws, make_users, phase_for, user_rng


CUT = "cut: the run stopped while this request was in flight"
"""Error text of requests cut short by the end of the run; counted apart from failures."""


class _Cut(Exception):
    """The run stopped between two operations of a request."""


@dataclass
class _Job:
    request: Request
    submit_ns: int
    done: threading.Event = field(default_factory=threading.Event)


class _PriorityQueue:
    """Highest priority first, FIFO within a priority; closable so waiters wake at stop."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, _Job]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self.closed = False

    def put(self, job: _Job) -> bool:
        with self._cv:
            if self.closed:
                return False
            heapq.heappush(self._heap, (-job.request.priority, next(self._seq), job))
            self._cv.notify()
            return True

    def get(self) -> _Job | None:
        with self._cv:
            while not self._heap and not self.closed:
                self._cv.wait()
            if self.closed:
                return None
            return heapq.heappop(self._heap)[2]

    def close(self) -> list[_Job]:
        with self._cv:
            self.closed = True
            left = [j for _, _, j in self._heap]
            self._heap.clear()
            self._cv.notify_all()
            return left

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap)


class _RateLimiter:
    def __init__(self, rate_per_s: float) -> None:
        self.interval_ns = int(1e9 / rate_per_s) if rate_per_s > 0 else 0
        self._next = 0
        self._lock = threading.Lock()

    def wait(self, stop: threading.Event) -> bool:
        """Block until this caller's slot; False if the run stopped meanwhile."""
        if not self.interval_ns:
            return not stop.is_set()
        with self._lock:
            now = clock_ns()
            slot = max(now, self._next)
            self._next = slot + self.interval_ns
        delay = (slot - clock_ns()) / 1e9
        return not stop.wait(delay) if delay > 0 else not stop.is_set()


@dataclass
class RunOutcome:
    start_ns: int
    load_end_ns: int
    end_ns: int
    stop_reason: str
    status: str  # complete | partial | failed
    abandoned_requests: int
    io_before: dict[str, int]
    io_after: dict[str, int]
    users: list[UserProfile]
    workload: dict[str, object] = field(default_factory=dict)


class BenchRunner:
    def __init__(self, comp: Components, recorder: Recorder) -> None:
        self.c = comp
        self.cfg = comp.config
        self.rec = recorder
        self.stop = comp.stop  # also the store's cancel event: in-flight I/O stops between chunks
        self.hard_stop = threading.Event()  # set by partial stops: cuts simulated generation short
        self._stop_reason = ""
        self._partial = False
        self._reason_lock = threading.Lock()
        self.queue = _PriorityQueue()
        self.limiter = _RateLimiter(self.cfg.request_rate)
        self.per_token_s = getattr(self.cfg.tuning.generation_timing, self.cfg.generation_mode)
        self.decode_batch = self.cfg.tuning.decode.batch_size
        self.users = make_users(self.cfg.num_users, self.cfg.tuning, comp.seed)
        self.start_ns = 0
        m = comp.model
        self.scope = KeyScope(model_name=m.key, kv_dtype=m.dtype, attention_layout=m.attention,
                              world_size=self.cfg.tensor_parallel, chunk_size=self.cfg.kv_chunk_tokens)
        conv, pc = self.cfg.tuning.conversation, self.cfg.tuning.prefix_cache
        self.settings = ConversationSettings(
            layout=self.cfg.kv_layout, chunk_tokens=self.cfg.kv_chunk_tokens,
            multi_turn=not self.cfg.disable_multi_turn, prefix_caching=not self.cfg.disable_prefix_caching,
            end_probability=conv.end_probability, max_turns_per_conv=conv.max_turns_per_conv,
            max_context_tokens=conv.max_context_tokens, num_system_prompts=pc.num_system_prompts,
            system_prompt_tokens=(int(pc.system_prompt_tokens.low), int(pc.system_prompt_tokens.high)))
        self.conversations = ConversationManager(self.cfg.max_conversations)
        self.prepopulated: list[tuple[str, int]] = []
        rt = self.cfg.tuning.rag
        self.rag = RagCorpus(RagSettings(self.cfg.rag_num_docs, self.cfg.rag_top_k, rt.request_probability,
                                         (int(rt.doc_tokens.low), int(rt.doc_tokens.high)), rt.chunk_tokens,
                                         rt.popularity_skew), comp.seed) if self.cfg.enable_rag else None
        self.setup_stats: dict[str, dict[str, float]] = {}
        self._live: dict[int, tuple[threading.Thread, threading.Event]] = {}
        self._next_uid = self.cfg.num_users
        self.autoscaler = Autoscaler(self.cfg.autoscaler_mode, self.cfg.target_saturation, self.cfg.tuning.autoscaler,
                                     self.cfg.tuning.qos_profiles) if self.cfg.enable_autoscaling else None  # type: ignore[arg-type]
        self._users_done = 0

    # -- control ---------------------------------------------------------------------------
    def request_stop(self, reason: str, partial: bool) -> None:
        with self._reason_lock:
            if not self._stop_reason:
                self._stop_reason = reason
                self._partial = partial
        if partial:
            self.hard_stop.set()
        self.stop.set()
        with self._reason_lock:
            for _, ev in self._live.values():
                ev.set()

    # -- request service -------------------------------------------------------------------
    def _entry_bytes(self, tokens: int) -> int:
        return math.ceil(self.c.model.kv_bytes(tokens) / self.cfg.tensor_parallel)

    def _serve(self, job: _Job, buf: memoryview) -> None:
        req = job.request
        store, noise, chunk, count = self.c.store, self.c.noise, self.c.io_chunk_bytes, self.rec.count
        start = clock_ns()
        storage_ns = br = bw = dec = tr = tw = hits = misses = 0
        ok, err = True, ""

        def put(key: str, tokens: int) -> int:
            """Write one KV object for this request; returns its storage time, counts its bytes."""
            nonlocal bw, tw
            if self.stop.is_set():
                raise _Cut
            nbytes = self._entry_bytes(tokens)
            res = store.put(key, lambda: noise.chunks(key, nbytes, chunk), nbytes, buf)  # type: ignore[arg-type]
            if not res.deduplicated:  # a concurrent writer of the same key wrote it, not us
                bw += nbytes
                tw += tokens
            return res.timing.total_ns

        def lookup(ref: KVRef) -> GetResult:
            """Read one KV object; a hit is counted (tokens, bytes, per-kind counters) here."""
            nonlocal hits, br, tr, storage_ns
            if self.stop.is_set():
                raise _Cut
            r = store.get(ref.key, buf)
            if r.hit:
                hits += 1
                br += r.nbytes
                tr += ref.tokens
                storage_ns += r.timing.total_ns
                count(f"lookup_{ref.kind}_hits")
                count(f"read_{ref.kind}_bytes", r.nbytes)
            return r

        rag_ns = rag_bytes = 0
        try:
            for ref in req.rag_reads:  # the RAG burst: independent lookups, misses re-ingested
                r = lookup(ref)
                if r.hit:
                    rag_ns += r.timing.total_ns
                    rag_bytes += r.nbytes
                else:
                    misses += 1
                    count("lookup_rag_misses")
                    count("restores_rag")
                    t = put(ref.key, ref.tokens)
                    rag_ns += t
                    storage_ns += t
            recompute: list[KVRef] = []
            for i, ref in enumerate(req.reads):
                if lookup(ref).hit:
                    continue
                if req.prefix_reads:  # chunked: the prefix ends at the first miss; the rest is recomputed
                    recompute = list(req.reads[i:])
                    for x in recompute:
                        count(f"lookup_{x.kind}_misses")
                    misses += len(recompute)
                    break
                misses += 1
                count(f"lookup_{ref.kind}_misses")
                if ref.kind == "prefix":  # a shared system prompt evicted from the cache: store it again
                    recompute.append(ref)
            for ref in recompute:
                count(f"restores_{ref.kind}")
            for ref in (*recompute, *req.writes):
                storage_ns += put(ref.key, ref.tokens)
            if req.decode_key is not None and req.phase == "prefill_decode" and not self.cfg.prefill_only:
                decode = KVRef(req.decode_key, req.decode_tokens, "decode")
                for i in range(1 + math.ceil(req.generate_tokens / self.decode_batch)):
                    r = lookup(decode)
                    if r.hit:
                        if i > 0:
                            dec += r.nbytes
                        continue
                    misses += 1
                    count("lookup_decode_misses")
                    if not self.cfg.decode_only:
                        storage_ns += put(req.decode_key, req.decode_tokens)
        except (_Cut, Cancelled):
            ok, err = False, CUT
        except TierFullError as e:
            ok, err = False, f"tier_full: {e}"
            cause = e.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
                self.request_stop("device full (ENOSPC)", partial=True)
        except StorageError as e:
            ok, err = False, f"storage_error: {e}"
        storage_done = clock_ns()
        gen_ns = 0
        if ok and self.per_token_s > 0:
            if self.hard_stop.wait(req.generate_tokens * self.per_token_s):
                ok, err = False, CUT
            gen_ns = clock_ns() - storage_done
        end = clock_ns()
        self.rec.request(RequestRecord(
            req.user_id, req.qos, req.phase, req.context_tokens, req.generate_tokens, job.submit_ns, start,
            storage_done, end, storage_ns, gen_ns, br, bw, dec, tr, tw, hits, misses, ok, err, req.new_tokens,
            req.turn, rag_ns, rag_bytes))
        if ok and self.cfg.max_requests and self.rec.completed_requests() >= self.cfg.max_requests:
            self.request_stop(f"--max-requests {self.cfg.max_requests} reached", partial=False)

    def _worker(self) -> None:
        buf = aligned_buffer(self.c.io_chunk_bytes)
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                self._serve(job, buf)
            except Exception as e:  # a bug must end the run visibly, not silently lose a worker
                self.rec.tier_error("runner", "serve", "request", 0, e)
                self.request_stop(f"internal error serving a request: {type(e).__name__}: {e}", partial=True)
            finally:
                job.done.set()

    def _requests(self, user: UserProfile) -> Iterator[Request]:
        if self.cfg.decode_only:
            rng = user_rng(self.c.seed, user.user_id, stream=3)
            for seq, (_, gen, think) in enumerate(draws(user, self.c.seed)):
                key, tokens = self.prepopulated[int(rng.integers(0, len(self.prepopulated)))]
                yield Request(user.user_id, seq, f"user{user.user_id}_decode_{seq:06d}", user.qos, user.priority,
                              "prefill_decode", tokens, gen, think, decode_key=key, decode_tokens=tokens)
            return
        if self.c.dataset is not None:
            mine = self.c.dataset.conversations[user.user_id::len(self.users)]
            yield from dataset_requests(user, mine, self.c.seed, self.cfg.replay_cycles, self.settings, self.scope,
                                        self.conversations)
            return
        reqs = conversation_requests(user, self.c.seed, self.settings, self.scope, self.conversations)
        if self.rag is None:
            yield from reqs
            return
        rng = user_rng(self.c.seed, user.user_id, stream=6)
        p = self.rag.settings.request_probability
        for req in reqs:
            yield dataclasses.replace(req, rag_reads=self.rag.retrieve(rng)) if rng.random() < p else req

    def _trace_requests(self) -> Iterator[Request]:
        trace = self.c.trace
        assert trace is not None
        rng = user_rng(self.c.seed, 0, stream=4)
        dist = self.cfg.tuning.qos_distribution
        cycles = max(1, self.cfg.replay_cycles)
        n = 0
        for cycle in range(cycles):
            for i, tr in enumerate(trace.requests):
                r = rng.random()
                qos = "interactive" if r < dist.interactive_probability else (
                    "responsive" if r < dist.responsive_threshold else "batch")
                prio = self.cfg.tuning.qos_profiles[qos].priority  # type: ignore[index]
                key = f"trace_c{cycle}_{i:07d}"
                common = dict(user_id=n % max(1, self.cfg.num_users), seq=n, key=key, qos=qos, priority=prio,
                              phase=phase_for(tr.input_tokens), context_tokens=tr.input_tokens,
                              generate_tokens=tr.output_tokens, think_before_s=0.0, new_tokens=tr.input_tokens,
                              arrival_s=cycle * (trace.requests[-1].arrival_s + 1.0) + tr.arrival_s)
                if self.cfg.kv_layout == "chunked" and tr.hash_ids is not None:
                    blocks = hash_id_chunks(tr.hash_ids, tr.input_tokens, trace.block_tokens or 512, self.scope)
                    yield Request(**common, reads=tuple(blocks), prefix_reads=True)  # type: ignore[arg-type]
                elif self.cfg.kv_layout == "chunked":
                    chunks = segment_chunks([(key, tr.input_tokens)], self.cfg.kv_chunk_tokens, self.scope)
                    yield Request(**common, writes=tuple(KVRef(c.key, c.tokens, "context") for c in chunks))  # type: ignore[arg-type]
                else:
                    yield Request(**common, writes=(KVRef(key, tr.input_tokens, "context"),),  # type: ignore[arg-type]
                                  decode_key=key, decode_tokens=tr.input_tokens)
                n += 1

    def _dispatch(self) -> None:
        """Open-loop trace replay: submit at the recorded arrival times (scaled by --trace-speedup)."""
        try:
            speed = self.cfg.trace_speedup
            t0 = clock_ns()
            jobs: list[_Job] = []
            limit = self.c.io_slots * 4  # bound what waits in the queue
            for req in self._trace_requests():
                if speed > 0 and req.arrival_s is not None:
                    delay = t0 / 1e9 + req.arrival_s / speed - clock_ns() / 1e9
                    if delay > 0 and self.stop.wait(delay):
                        return
                while len(self.queue) >= limit:
                    if self.stop.wait(0.001):
                        return
                    self.rec.count("dispatch_backpressure_ms")
                job = _Job(req, clock_ns())
                if not self.queue.put(job):
                    return
                jobs.append(job)
                jobs = [j for j in jobs if not j.done.is_set()] if len(jobs) > 4 * limit else jobs
            for j in jobs:
                while not j.done.wait(0.1):
                    if self.stop.is_set():
                        return
            self.request_stop("trace replay finished", partial=False)
        except Exception as e:
            self.rec.tier_error("workload", "dispatch", "trace", 0, e)
            self.request_stop(f"internal error in trace dispatch: {type(e).__name__}: {e}", partial=True)

    def _fill(self, name: str, entries: Iterator[tuple[str, int]]) -> None:
        """Write entries before the load, outside the statistics; their cost goes to setup_stats[name]."""
        buf = aligned_buffer(self.c.io_chunk_bytes)
        store, sink = self.c.store, self.c.store.sink
        store.sink = NullSink()
        t0, nbytes_total, n = clock_ns(), 0, 0
        try:
            for key, tokens in entries:
                if self.stop.is_set():
                    return
                nbytes = self._entry_bytes(tokens)
                store.put(key, lambda key=key, nbytes=nbytes: self.c.noise.chunks(key, nbytes, self.c.io_chunk_bytes),
                          nbytes, buf)
                nbytes_total += nbytes
                n += 1
        finally:
            store.sink = sink
            s = (clock_ns() - t0) / 1e9
            self.setup_stats[name] = {"entries": n, "bytes": nbytes_total, "seconds": round(s, 4),
                                      "bytes_per_sec": round(nbytes_total / s, 1) if s > 0 else None}

    def prepopulate(self) -> None:
        """--decode-only: store num_users x 10 entries first, outside the statistics."""
        def entries() -> Iterator[tuple[str, int]]:
            for user in self.users:
                for i, (ctx, _, _) in zip(range(10), draws(user, self.c.seed + 1)):
                    self.prepopulated.append((f"prepop_user{user.user_id}_{i}", ctx))
                    yield self.prepopulated[-1]
        self._fill("decode_only_prepopulation", entries())

    def _start_users(self, profiles: list[UserProfile]) -> None:
        for u in profiles:
            ev = threading.Event()
            t = threading.Thread(target=self._user, args=(u, ev), name=f"kvtier-user-{u.user_id}", daemon=True)
            with self._reason_lock:
                self._live[u.user_id] = (t, ev)
                if self.stop.is_set():
                    ev.set()
            t.start()

    def _stop_users(self, n: int) -> None:
        """Retire the n most recently started users (they finish their in-flight request)."""
        with self._reason_lock:
            for uid in sorted(self._live)[-n:]:
                self._live.pop(uid)[1].set()

    def live_users(self) -> int:
        with self._reason_lock:
            return len(self._live)

    def _autoscale(self) -> None:
        t = self.cfg.tuning.autoscaler
        scaler = self.autoscaler
        assert scaler is not None
        seen = 0
        last = clock_ns()
        while not self.stop.wait(t.interval_s):
            now = clock_ns()
            window = self.rec.requests[seen:]
            seen += len(window)
            users = self.live_users()
            action, target = scaler.step((now - self.start_ns) / 1e9, (now - last) / 1e9, window, users)
            last = now
            if scaler.stop_reason:
                self.request_stop(scaler.stop_reason, partial=False)
                return
            if target > users:
                self._start_users(make_users(target - users, self.cfg.tuning, self.c.seed, first_id=self._next_uid))
                self._next_uid += target - users
            elif target < users:
                self._stop_users(users - target)

    def _user(self, user: UserProfile, ustop: threading.Event | None = None) -> None:
        try:
            self._user_loop(user, ustop or self.stop)
        except Exception as e:  # a bug must end the run visibly, not leave a silent dead user
            self.rec.tier_error("workload", "generate", "user", 0, e)
            self.request_stop(f"internal error in user {user.user_id}: {type(e).__name__}: {e}", partial=True)

    def _user_loop(self, user: UserProfile, ustop: threading.Event) -> None:
        for req in self._requests(user):
            if ustop.wait(req.think_before_s) or self.stop.is_set() or not self.limiter.wait(self.stop):
                return
            job = _Job(req, clock_ns())
            if not self.queue.put(job):
                return
            job.done.wait()
        if self.c.dataset is not None:  # this user has replayed its share of the dataset
            with self._reason_lock:
                self._users_done += 1
                last = self._users_done == len(self.users)
            if last:
                self.request_stop("dataset replay finished", partial=False)

    # -- the run ---------------------------------------------------------------------------
    def run(self, on_tick: Callable[["BenchRunner", float], None] | None = None,
            tick_s: float = 5.0) -> RunOutcome:
        if self.cfg.precondition and self.c.file_tier is not None:
            ft = self.c.file_tier
            size = int(self.cfg.precondition_size_gb * GiB) or ft.capacity_bytes
            self.setup_stats["precondition"] = precondition(
                ft, self.c.noise, size, self.cfg.precondition_threads or self.c.io_slots, self.c.io_chunk_bytes,
                self.stop)
        if self.cfg.decode_only:
            self.prepopulate()
        if self.rag is not None:
            self._fill("rag_ingest", ((c.key, c.tokens) for c in self.rag.chunks))
        io_before = proc_io()
        self.start_ns = clock_ns()
        workers = [threading.Thread(target=self._worker, name=f"kvtier-io-{i}", daemon=True)
                   for i in range(self.c.io_slots)]
        users: list[threading.Thread] = []
        if self.c.trace is not None:
            users = [threading.Thread(target=self._dispatch, name="kvtier-trace", daemon=True)]
        for t in workers + users:
            t.start()
        if self.c.trace is None:
            self._start_users(self.users)
        if self.autoscaler is not None and self.c.trace is None and self.c.dataset is None:
            threading.Thread(target=self._autoscale, name="kvtier-autoscaler", daemon=True).start()
        deadline = self.start_ns + int(self.cfg.duration * 1e9)
        next_tick = self.start_ns + int(tick_s * 1e9)
        while not self.stop.is_set():
            now = clock_ns()
            if now >= deadline:
                self.request_stop(f"--duration {self.cfg.duration:g} s elapsed", partial=False)
                break
            self.stop.wait(min(0.1, (deadline - now) / 1e9))
            if on_tick is not None and clock_ns() >= next_tick:
                on_tick(self, (clock_ns() - self.start_ns) / 1e9)
                next_tick += int(tick_s * 1e9)
        load_end = clock_ns()
        # Stop admitting: queued requests are abandoned, in-flight ones stop between chunks.
        abandoned = self._drain(workers)
        with self._reason_lock:
            users += [t for t, _ in self._live.values()]
        for t in users:
            t.join(timeout=5)
        end = clock_ns()
        status = "partial" if self._partial else "complete"
        if not any(r.ok for r in self.rec.requests):
            status = "failed" if not self._partial else "partial"
        workload = {"setup": self.setup_stats, "conversations_started": self.conversations.started,
                    "autoscaling": self.autoscaler.stats(self.live_users()) if self.autoscaler else None,
                    "conversations_evicted": self.conversations.evicted,
                    "prepopulated_entries": len(self.prepopulated)}
        return RunOutcome(self.start_ns, load_end, end, self._stop_reason, status, abandoned, io_before,
                          proc_io(), self.users, workload)

    def _drain(self, workers: list[threading.Thread]) -> int:
        """Abandon queued requests, wait for in-flight ones. Returns how many were abandoned."""
        left = self.queue.close()
        for j in left:
            j.done.set()
        for t in workers:
            t.join()
        return len(left)
