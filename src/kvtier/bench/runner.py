"""The benchmark loop: user threads submit requests, I/O workers serve them by QoS priority.

* Users are real threads. ``--arrival open`` (default, the reference's load): think (the profile's
  think time), queue the next request whatever the last one did, repeat; a request that finds
  ``--max-queued`` (4 x workers) waiting is dropped and counted with its would-be bytes.
  ``--arrival closed``: a user's next request waits for its last one to end. ``--request-rate``
  additionally paces submissions globally. A trace is replayed open loop by one dispatcher thread
  at the recorded arrival times.
* ``io_slots`` worker threads (min(users, 500), as the reference's; ``--alloc-bound all-io``:
  ``--max-concurrent-allocs`` when set) take requests from one priority queue (interactive before
  responsive before batch, FIFO within a class) and serve each with the RequestService
  (bench/service.py), where ``--max-concurrent-allocs`` bounds the writes in flight (reads run on
  every worker). Each worker owns one reusable aligned buffer of ``--io-chunk-mb`` (or the
  ``--io-buffer-budget-mb`` share); a write's bytes are stamped into it, so bytes in flight are
  bounded by io_slots x io_chunk.
* Stop: --duration, --max-requests, the end of a trace or dataset, the capacity autoscaler's peak,
  SIGINT/SIGTERM or KeyboardInterrupt (partial), the device filling up (ENOSPC: partial), or an
  internal error (partial). In-flight requests finish; queued ones are abandoned and counted.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

from kvtier.bench.autoscale import StorageSample
from kvtier.bench.plan import Plan
from kvtier.bench.precondition import precondition
from kvtier.bench.queueing import _Job, _PriorityQueue, _RateLimiter
from kvtier.bench.service import RequestService, ServiceSettings
from kvtier.bench.setup import Components
from kvtier.bench.sources import decode_only_requests, prepopulated_entries, trace_requests, user_requests
from kvtier.engine.backend import aligned_buffer
from kvtier.engine.tiered import NullSink
from kvtier.results.envelope import Status, StopCode, StopReason
from kvtier.stats import percentile
from kvtier.telemetry.blocktrace import BlockTracer
from kvtier.telemetry.clock import MONOTONIC, Clock
from kvtier.telemetry.diskstats import DeviceSampler, devices_under
from kvtier.telemetry.gpu import GpuSampler
from kvtier.telemetry.host import proc_io
from kvtier.telemetry.recorder import Recorder
from kvtier.units import GiB
from kvtier.workload.rag import IngestStep
from kvtier.workload.users import Request, UserProfile, make_users


@dataclass
class RunOutcome:
    start_ns: int
    load_end_ns: int
    end_ns: int
    stop: StopReason
    status: Status
    abandoned_requests: int
    io_before: dict[str, int]
    io_after: dict[str, int]
    users: list[UserProfile]
    setup: dict[str, dict[str, object]] = field(default_factory=dict)
    prepopulated_entries: int = 0
    autoscaling: dict[str, object] | None = None
    start_unix_s: float = 0.0  # wall-clock time of start_ns
    device: DeviceSampler | None = None  # /proc/diskstats of the devices under the storage tier, sampled
    load: dict[str, object] = field(default_factory=dict)  # how the load was offered (BenchRunner.load_facts)


class BenchRunner:
    """Owns the threads, the queue and stopping; serving is the RequestService's."""

    def __init__(self, plan: Plan, comp: Components, recorder: Recorder, clock: Clock = MONOTONIC) -> None:
        self.plan = plan
        self.cfg = plan.config
        self.c = comp
        self.rec = recorder
        self.clock = clock
        self.stop = comp.stop  # also the store's cancel event: in-flight I/O stops between chunks
        self.duration_s = float(plan.config.duration)  # a gate may shorten it to a shared deadline
        self.device_resolution = ""
        self.latency_tracing: dict[str, object] | None = None  # --enable-latency-tracing's section
        self.gpu_telemetry: dict[str, object] | None = None  # NVML's figures over the load, or why none
        self.hard_stop = threading.Event()  # set by partial stops: cuts simulated generation short
        self._stop: StopReason | None = None
        self._partial = False
        self._lock = threading.Lock()
        self.queue = _PriorityQueue()
        self.limiter = _RateLimiter(self.cfg.request_rate, clock)
        w = plan.workload
        self.users = w.users
        self.service = RequestService(
            comp.store,
            comp.source,
            plan.io_chunk_bytes,
            plan.entry_bytes,
            ServiceSettings(
                decode_batch=w.decode_batch,
                per_token_s=w.per_token_s,
                prefill_only=self.cfg.prefill_only,
                decode_only=self.cfg.decode_only,
            ),
            recorder.count,
            clock,
            self.stop,
            self.hard_stop,
            alloc_slots=(
                threading.BoundedSemaphore(self.cfg.max_concurrent_allocs)
                if self.cfg.max_concurrent_allocs and self.cfg.alloc_bound == "writes"
                else None
            ),
        )
        self.max_queued = self.cfg.max_queued or 4 * plan.io_slots
        self.dropped_requests = 0
        self.dropped_request_bytes = 0
        self.queue_timeline: list[tuple[float, int]] = []  # (seconds since the load began, requests queued)
        self.start_ns = 0
        self.start_unix_s = 0.0
        self.prepopulated: list[tuple[str, int]] = []
        self.setup_stats: dict[str, dict[str, object]] = {}
        self._live: dict[int, tuple[threading.Thread, threading.Event]] = {}
        self._next_uid = self.cfg.num_users
        self._users_done = 0
        if comp.io_trace is not None:  # the trace file cannot be written (disk full): stop, partial
            comp.io_trace.on_error = self._trace_failed

    def _trace_failed(self, e: OSError) -> None:
        code = StopCode.device_full if e.errno in (errno.ENOSPC, errno.EDQUOT) else StopCode.internal_error
        self.request_stop(
            code, f"--io-trace-log: cannot write {self.cfg.io_trace_log}: {e.strerror or e}", partial=True
        )

    # -- control ---------------------------------------------------------------------------
    def request_stop(self, code: StopCode, message: str, partial: bool) -> None:
        """End the run (the first reason given wins). ``partial`` also cuts generation short."""
        with self._lock:
            if self._stop is None:
                self._stop = StopReason(code=code, message=message)
                self._partial = partial
            live = [ev for _, ev in self._live.values()]
        if partial:
            self.hard_stop.set()
        self.stop.set()
        for ev in live:
            ev.set()
        if code in (StopCode.interrupted, StopCode.terminated):  # Ctrl+C ends the run now, whatever a server does
            for tier in self.c.remote:
                abort = getattr(tier, "abort", None)
                if abort is not None:
                    abort()

    def _internal_error(self, where: str, e: Exception) -> None:
        """A bug must end the run visibly, not silently lose a thread."""
        self.rec.tier_error("runner", where, "request", 0, e)
        self.request_stop(StopCode.internal_error, f"internal error in {where}: {type(e).__name__}: {e}", partial=True)

    # -- threads ---------------------------------------------------------------------------
    def _worker(self) -> None:
        buf = aligned_buffer(self.plan.io_chunk_bytes)
        while True:
            job = self.queue.get()
            if job is None:
                return
            try:
                served = self.service.serve(job.request, job.submit_ns, buf)
                if served.device_full:
                    self.request_stop(StopCode.device_full, "device full (ENOSPC)", partial=True)
                if self.rec.unavailable is not None:  # a remote tier's server is gone: what follows would be fake
                    self.request_stop(StopCode.tier_unavailable, self.rec.unavailable, partial=True)
                self.rec.request(served.record)
                cap = self.cfg.max_requests
                if served.record.ok and cap and self.rec.completed_requests() >= cap:
                    self.request_stop(StopCode.max_requests, f"--max-requests {cap} reached", partial=False)
            except Exception as e:  # noqa: BLE001 - see _internal_error
                self._internal_error("serving a request", e)
            finally:
                job.done.set()

    def _requests(self, user: UserProfile) -> Iterator[Request]:
        if self.cfg.decode_only:
            return decode_only_requests(self.plan, user, self.prepopulated)
        return user_requests(self.plan, user)

    def _dispatch(self) -> None:
        """Open-loop trace replay: submit at the recorded arrival times (scaled by --trace-speedup)."""
        try:
            speed = self.cfg.trace_speedup
            clock = self.clock
            t0 = clock.now_ns()
            jobs: list[_Job] = []
            limit = self.plan.io_slots * 4  # bound what waits in the queue
            for req in trace_requests(self.plan):
                if speed > 0 and req.arrival_s is not None:
                    delay = t0 / 1e9 + req.arrival_s / speed - clock.now_ns() / 1e9
                    if delay > 0 and self.stop.wait(delay):
                        return
                while len(self.queue) >= limit:
                    if self.stop.wait(0.001):
                        return
                job = _Job(req, clock.now_ns())
                if not self.queue.put(job):
                    return
                jobs.append(job)
                jobs = [j for j in jobs if not j.done.is_set()] if len(jobs) > 4 * limit else jobs
            for j in jobs:
                while not j.done.wait(0.1):
                    if self.stop.is_set():
                        return
            self.request_stop(StopCode.trace_finished, "trace replay finished", partial=False)
        except Exception as e:  # noqa: BLE001 - see _internal_error
            self._internal_error("trace dispatch", e)

    def _drop(self, req: Request) -> None:
        """An open-loop request that found the queue full: counted, with the bytes it would have moved."""
        refs = (*req.reads, *req.writes, *req.rag_reads)
        nbytes = sum(self.plan.entry_bytes(r.tokens) for r in refs)
        with self._lock:
            self.dropped_requests += 1
            self.dropped_request_bytes += nbytes

    def _user(self, user: UserProfile, ustop: threading.Event) -> None:
        """A user: think, submit, repeat. Closed arrival waits for each request to end before thinking;
        open arrival (the reference's) queues the next one after the think time whatever the last one
        did, and drops a request that finds --max-queued requests waiting."""
        pending: deque[_Job] = deque()
        open_loop = self.cfg.arrival == "open"
        try:
            for req in self._requests(user):
                if ustop.wait(req.think_before_s) or self.stop.is_set() or not self.limiter.wait(self.stop):
                    return
                job = _Job(req, self.clock.now_ns())
                if open_loop and len(self.queue) >= self.max_queued:
                    self._drop(req)
                    continue
                if not self.queue.put(job):
                    return
                if open_loop:
                    pending.append(job)
                    while pending and pending[0].done.is_set():
                        pending.popleft()
                else:
                    job.done.wait()
            for j in pending:  # the dataset's end: this user's requests still queued or in flight
                j.done.wait()
            if self.plan.workload.dataset is not None:  # this user has replayed its share of the dataset
                with self._lock:
                    self._users_done += 1
                    last = self._users_done == len(self.users)
                if last:
                    self.request_stop(StopCode.dataset_finished, "dataset replay finished", partial=False)
        except Exception as e:  # noqa: BLE001 - see _internal_error
            self._internal_error(f"user {user.user_id}", e)

    def _start_users(self, profiles: list[UserProfile]) -> None:
        for u in profiles:
            ev = threading.Event()
            t = threading.Thread(target=self._user, args=(u, ev), name=f"kvtier-user-{u.user_id}", daemon=True)
            with self._lock:
                self._live[u.user_id] = (t, ev)
                if self.stop.is_set():
                    ev.set()
            t.start()

    def _stop_users(self, n: int) -> None:
        """Retire the n most recently started users (they finish their in-flight request)."""
        with self._lock:
            for uid in sorted(self._live)[-n:]:
                self._live.pop(uid)[1].set()

    def live_users(self) -> int:
        with self._lock:
            return len(self._live)

    def _storage_sample(self, now_ns: int, interval_s: float) -> StorageSample:
        """Storage read and write p95 over the last history_window_size samples, and the queue depth."""
        since = now_ns - int(self.cfg.tuning.saturation_detection.history_window_size * interval_s * 1e9)
        p95: dict[str, float | None] = {}
        for op in ("read", "write"):
            samples = self.rec.ops.get(("storage", op), [])
            recent = [s.host_ns + s.device_ns for s in list(samples) if s.end_ns >= since]
            p95[op] = None if not recent else round(float(percentile(recent, 95) or 0.0) / 1e6, 3)
        return StorageSample(p95["read"], p95["write"], len(self.queue))

    def _autoscale(self) -> None:
        scaler = self.plan.workload.autoscaler
        if scaler is None:
            return
        interval = self.cfg.tuning.autoscaler.interval_s
        seen = 0
        last = self.clock.now_ns()
        try:
            while not self.stop.wait(interval):
                now = self.clock.now_ns()
                window = self.rec.requests[seen:]
                seen += len(window)
                users = self.live_users()
                storage = self._storage_sample(now, interval)
                _, target = scaler.step((now - self.start_ns) / 1e9, (now - last) / 1e9, window, users, storage)
                last = now
                if scaler.stop_reason:
                    self.request_stop(StopCode.peak_capacity, scaler.stop_reason, partial=False)
                    return
                if target > users:
                    self._start_users(
                        make_users(target - users, self.cfg.tuning, self.plan.seed, first_id=self._next_uid)
                    )
                    self._next_uid += target - users
                elif target < users:
                    self._stop_users(users - target)
        except Exception as e:  # noqa: BLE001 - see _internal_error
            self._internal_error("the autoscaler", e)

    # -- set-up phases (outside the statistics) ----------------------------------------------
    def _fill(self, name: str, steps: list[IngestStep]) -> None:
        """Write entries (and delete evicted ones) before the load, outside the statistics; their
        cost goes to setup_stats[name]."""
        buf = aligned_buffer(self.plan.io_chunk_bytes)
        store, noise, chunk = self.c.store, self.c.source, self.plan.io_chunk_bytes
        sink = store.sink
        store.sink = NullSink()
        t0, nbytes_total, n = self.clock.now_ns(), 0, 0
        try:
            for op, key, tokens in steps:
                if self.stop.is_set():
                    return
                if op == "delete":
                    store.delete(key)
                    continue
                nbytes = self.plan.entry_bytes(tokens)
                store.put(key, partial(noise.chunks, key, nbytes, chunk), nbytes, buf)
                nbytes_total += nbytes
                n += 1
        finally:
            store.sink = sink
            s = (self.clock.now_ns() - t0) / 1e9
            self.setup_stats[name] = {
                "entries": n,
                "bytes": nbytes_total,
                "seconds": round(s, 4),
                "bytes_per_sec": round(nbytes_total / s, 1) if s > 0 else None,
            }

    def _set_up(self) -> None:
        cfg, ft = self.cfg, self.c.file_tier
        if cfg.precondition and not self.c.trace_mode:  # trace mode moves no bytes: nothing to condition
            size = int(cfg.precondition_size_gb * GiB) or 2 * ft.capacity_bytes  # the reference's default
            self.setup_stats["precondition"] = precondition(
                self.c.store,
                ft.name,
                self.c.noise,
                size,
                cfg.precondition_threads or os.cpu_count() or 4,
                self.plan.io_chunk_bytes,
                self.stop,
            )
        if cfg.decode_only:
            self.prepopulated = prepopulated_entries(self.plan)
            self._fill("decode_only_prepopulation", [("put", k, n) for k, n in self.prepopulated])
        rag = self.plan.workload.rag
        if rag is not None:
            self._fill("rag_ingest", rag.ingest_steps())
        if self.c.device is not None:  # the paths count the load's bytes, as the statistics do (set-up is apart)
            self.c.device.paths.reset()

    # -- the run ---------------------------------------------------------------------------
    def run(
        self,
        on_tick: Callable[[BenchRunner, float], None] | None = None,
        tick_s: float = 5.0,
        gate: Callable[[], float] | None = None,
    ) -> RunOutcome:
        """Set up, then load until a stop. ``gate`` (MPI: every rank set up, one shared start) is called
        between set-up and load; it returns when the load may start and how many seconds it lasts."""
        self._set_up()
        if gate is not None:
            self.duration_s = gate()
        sampler = self._device_sampler()
        tracer = self._block_tracer()
        gpus = GpuSampler(self.cfg.device_interval)
        gpus.start()
        io_before = proc_io()
        self.start_ns = self.clock.now_ns()
        self.start_unix_s = time.time()
        if self.duration_s:
            self.service.deadline_ns = self.start_ns + int(self.duration_s * 1e9)
        workers = [
            threading.Thread(target=self._worker, name=f"kvtier-io-{i}", daemon=True) for i in range(self.plan.io_slots)
        ]
        others: list[threading.Thread] = []
        tracing = self.plan.workload.trace is not None
        if tracing:
            others.append(threading.Thread(target=self._dispatch, name="kvtier-trace", daemon=True))
        if self.plan.workload.autoscaler is not None:
            others.append(threading.Thread(target=self._autoscale, name="kvtier-autoscaler", daemon=True))
        for t in workers + others:
            t.start()
        if not tracing:
            self._start_users(self.users)
        try:
            self._wait_for_end(on_tick, tick_s)
        except KeyboardInterrupt:
            self.request_stop(StopCode.interrupted, "interrupted (KeyboardInterrupt)", partial=True)
        load_end = self.clock.now_ns()
        # Stop admitting: queued requests are abandoned, in-flight ones stop between chunks.
        abandoned = self._drain(workers)
        with self._lock:
            others += [t for t, _ in self._live.values()]
        for t in others:
            t.join(timeout=5)
        if sampler is not None:
            sampler.stop()  # after the drain: the device has finished what the run asked of it
        self.gpu_telemetry = gpus.stop()
        if tracer is not None:
            hists = tracer.stop()  # first: stopping may find it printed nothing, and say so in reason
            self.latency_tracing = tracer.section(hists)
        end = self.clock.now_ns()
        stop = self._stop or StopReason(code=StopCode.internal_error, message="the run ended without a stop reason")
        status = Status.partial if self._partial else Status.complete
        if not any(r.ok for r in self.rec.requests) and not self._partial:
            status = Status.failed
        scaler = self.plan.workload.autoscaler
        return RunOutcome(
            self.start_ns,
            load_end,
            end,
            stop,
            status,
            abandoned,
            io_before,
            proc_io(),
            self.users,
            self.setup_stats,
            len(self.prepopulated),
            scaler.stats(self.cfg.num_users, self.live_users()) if scaler is not None else None,
            self.start_unix_s,
            sampler,
            self.load_facts(),
        )

    def load_facts(self) -> dict[str, object]:
        """How the load was offered (the result's ``load`` section): arrival, workers, the allocation bound,
        the queue's bound, depth over time, and the requests it dropped."""
        depths = [d for _, d in self.queue_timeline]
        return {
            "arrival": self.cfg.arrival,
            "workers": self.plan.io_slots,
            "alloc_bound": self.cfg.alloc_bound,
            "max_concurrent_allocs": self.cfg.max_concurrent_allocs,
            "max_queued": self.max_queued,
            "requests_dropped": self.dropped_requests,
            "requests_dropped_bytes": self.dropped_request_bytes,
            "queue_depth_max": max(depths) if depths else 0,
            "queue_depth_mean": round(sum(depths) / len(depths), 3) if depths else None,
            "queue_depth_timeline": [{"t_s": t, "queued": d} for t, d in self.queue_timeline],
            "alloc_wait_s": round(self.rec.counters.get("alloc_wait_ns", 0) / 1e9, 6),
        }

    def _block_tracer(self) -> BlockTracer | None:
        """--enable-latency-tracing: bpftrace on the storage tier's devices, or why not (never fatal)."""
        if not self.cfg.enable_latency_tracing:
            return None
        if self.c.trace_mode:
            return BlockTracer([], "I/O trace mode moves no bytes: nothing to trace")
        devices, _ = devices_under(self.c.file_tier.directory)
        # this process's system calls too; bpftrace ends itself once this process exits, and, in a timed run, after
        # twice its duration and ten minutes (well past the run's own end: a bound only for a run that hangs)
        bound = 2 * self.duration_s + 600 if self.duration_s else None
        return BlockTracer.start(devices, who=f"pid == {os.getpid()}", max_s=bound)

    def _device_sampler(self) -> DeviceSampler | None:
        """A running sampler of the devices under the storage tier, with kvtier's own per-interval
        figures beside each sample (requests done, storage bytes moved, tier fill)."""
        if self.c.trace_mode:
            self.device_resolution = "not sampled: I/O trace mode moves no bytes"
            return None
        devices, how = devices_under(self.c.file_tier.directory)
        self.device_resolution = how
        if not devices:
            return None
        seen = {"requests": 0, "read": 0, "write": 0}

        def ours() -> dict[str, object]:
            n = len(self.rec.requests)
            out: dict[str, object] = {"kvtier_requests_done": n - seen["requests"]}
            seen["requests"] = n
            for op in ("read", "write"):
                ops = self.rec.ops.get(("storage", op), [])
                k = len(ops)
                out[f"kvtier_storage_{op}_bytes"] = sum(x.nbytes for x in ops[seen[op] : k])
                seen[op] = k
            out["tier_used_bytes"] = {name: u["used_bytes"] for name, u in self.c.store.usage().items()}
            return out

        sampler = DeviceSampler(devices, self.cfg.device_interval, ours)
        sampler.start()
        return sampler

    def _wait_for_end(self, on_tick: Callable[[BenchRunner, float], None] | None, tick_s: float) -> None:
        clock = self.clock
        deadline = self.start_ns + int(self.duration_s * 1e9)
        next_tick = self.start_ns + int(tick_s * 1e9)
        next_sample = self.start_ns + 1_000_000_000
        while not self.stop.is_set():
            now = clock.now_ns()
            if now >= deadline:
                self.request_stop(StopCode.duration, f"--duration {self.cfg.duration:g} s elapsed", partial=False)
                return
            self.stop.wait(min(0.1, (deadline - now) / 1e9))
            if clock.now_ns() >= next_sample:  # the queue's depth, once a second
                self.queue_timeline.append((round((clock.now_ns() - self.start_ns) / 1e9, 3), len(self.queue)))
                next_sample += 1_000_000_000
            if on_tick is not None and clock.now_ns() >= next_tick:
                on_tick(self, (clock.now_ns() - self.start_ns) / 1e9)
                next_tick += int(tick_s * 1e9)

    def _drain(self, workers: list[threading.Thread]) -> int:
        """Abandon queued requests, wait for in-flight ones. Returns how many were abandoned.

        A remote tier whose server stopped answering would hold the run's end for its --remote-timeout (a hung
        Redis kept a 5 s run going 36 s): once an operation on it has been blocked STALL_CUT_S, the run is cut
        as SIGINT cuts it — its remote tiers aborted, the result partial, ``tier-unavailable``. Local I/O in
        flight is waited for: it is the device's time."""
        left = self.queue.close()
        for j in left:
            j.done.set()
        cut = False
        while any(t.is_alive() for t in workers):
            for t in workers:
                t.join(timeout=DRAIN_POLL_S)
            if cut:
                continue
            hung = [r for r in self.c.remote if getattr(r, "stalled_operations", lambda s: 0)(STALL_CUT_S)]
            if hung:
                cut = True
                names = ", ".join(r.name for r in hung)
                self._override_stop(
                    StopCode.tier_unavailable,
                    f"the {names} tier's server did not answer an operation for {STALL_CUT_S:g} s at the run's end: "
                    "its operations in flight were cut (the run is partial)",
                )
                for r in hung:
                    r.abort()  # type: ignore[attr-defined]  # stalled_operations implies abort (RedisTier)
        return len(left)

    def _override_stop(self, code: StopCode, message: str) -> None:
        """A reason found after the run's planned end (the deadline or --max-requests) replaces it: the run did
        not end as planned. An earlier partial stop (Ctrl+C, a failure) keeps its own reason."""
        with self._lock:
            if self._stop is None or not self._partial:
                self._stop = StopReason(code=code, message=message)
                self._partial = True
        self.hard_stop.set()
        self.stop.set()


DRAIN_POLL_S = 0.25
STALL_CUT_S = 5.0
"""A remote operation blocked on its server this long at the run's end is a hung server (a healthy one answers
each socket call in milliseconds; --remote-timeout, 30 s, is for a server that is slow, not one that is gone)."""

__all__ = ["BenchRunner", "RunOutcome"]
