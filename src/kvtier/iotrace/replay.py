"""``kvtier trace replay``: a recorded I/O trace's operations against kvtier's real tiers.

The trace decides, not the waterfall: each row is done on the tier it names, through the store's
explicit placement (``TieredStore.place`` / ``move``), so the same trace moves the same bytes on any
device. Per row:

* ``Write`` (Prefill): the object is written to its tier (slices of the noise buffer, real I/O);
* ``Read`` (Decode): the object is read from wherever it is (a *missing read* when it is nowhere —
  a trace cut from a longer run — counted, no I/O);
* ``Read`` then ``Write`` (Evict): one real move, read from the upper tier and written to the lower
  (cause ``demotion``); an object the trace never wrote is written where the demotion puts it;
* ``Write`` (Promote): a move up.

Tier-0 (GPU) rows run on the CPU tier (no GPU tier here; a warning says so). Capacities default to
what the trace needs (its peak on the CPU tiers, its Tier-2 working set within the free space); a
tier that must still make room deletes its least recently used objects (the trace has no rows for
bottom-tier deletions), counted as ``dropped_objects``. Rows are dispatched at their recorded times
(``--speed``; 0 = as fast as possible) to ``--workers`` threads; one key always goes to the same worker,
so a key's rows stay in trace order. Each Prefill/Decode row is one request of the result: its
end-to-end latency runs from its scheduled time, so a device that cannot keep up shows it.

The result is a normal ``kvtier bench`` result (tiers, device telemetry, process I/O), whose
``workload_source`` is ``{"kind": "io-trace", ...}``.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

from kvtier.bench.plan import Plan
from kvtier.bench.results import build_result
from kvtier.bench.runner import RunOutcome
from kvtier.bench.setup import Components, build_components, derive
from kvtier.config.bench import BenchConfig
from kvtier.config.iotrace import TraceReplayConfig
from kvtier.engine.backend import aligned_buffer
from kvtier.errors import DatasetError, StorageError
from kvtier.results.bench import BenchResult, IOTraceSource
from kvtier.results.envelope import Status, StopCode, StopReason, WarningCode, utc_now, warning
from kvtier.telemetry.clock import MONOTONIC
from kvtier.telemetry.diskstats import DeviceSampler, devices_under
from kvtier.telemetry.host import proc_io
from kvtier.telemetry.recorder import BenchRequest, Recorder
from kvtier.tiers import KINDS
from kvtier.tracefile import TIER_BY_NUMBER, IOTrace, read_trace
from kvtier.units import GiB

TIER_OF = {k.trace_number: k.replay_as for k in KINDS.values() if k.replay_as}  # Tier-N -> the replay's tier


def peak_bytes(trace: IOTrace) -> dict[int, int]:
    """Per Tier-N: the most bytes the trace held there at once (Evict moves out; bottom deletes unseen)."""
    where: dict[int, tuple[int, int]] = {}
    live = dict.fromkeys(TIER_OF, 0)
    peak = dict(live)
    for op, size, tier, key in zip(trace.op.tolist(), trace.size.tolist(), trace.tier.tolist(), trace.key.tolist()):
        if op != 1:
            continue
        prev = where.get(key)  # a rewrite or a move: the object leaves where it was
        if prev is not None:
            live[prev[0]] -= prev[1]
        where[key] = (tier, size)
        live[tier] = live.get(tier, 0) + size
        peak[tier] = max(peak.get(tier, 0), live[tier])
    return peak


class _Replayer:
    def __init__(self, cfg: TraceReplayConfig, trace: IOTrace, plan: Plan, comp: Components, rec: Recorder) -> None:
        self.cfg, self.trace, self.plan, self.comp, self.rec = cfg, trace, plan, comp, rec
        self.clock = MONOTONIC
        self.stop = comp.stop
        self.stop_reason: StopReason | None = None
        self.partial = False
        self.counts = {"missing_reads": 0, "unknown_objects_written": 0, "moves_not_made": 0, "rows_done": 0}
        self._lock = threading.Lock()
        self.per_token = plan.model.kv_bytes_per_token_per_rank(1)
        self.evict = trace.phases.index("Evict") if "Evict" in trace.phases else -1
        self.promote = trace.phases.index("Promote") if "Promote" in trace.phases else -1

    def request_stop(self, code: StopCode, message: str, partial: bool) -> None:
        with self._lock:
            if self.stop_reason is None:
                self.stop_reason = StopReason(code=code, message=message)
                self.partial = partial
        self.stop.set()

    def _count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    # one row
    def _do(
        self,
        worker: int,
        seq: int,
        submit_ns: int,
        op: int,
        size: int,
        tier: int,
        key: str,
        phase: int,
        buf: memoryview,
    ) -> None:
        store, noise = self.comp.store, self.comp.noise
        name = TIER_OF[tier]
        chunk = len(buf)

        def source() -> Iterable[memoryview]:
            return noise.chunks(key, size, chunk)

        with self._lock:
            self.counts["rows_done"] += 1
        if op == 0 and phase == self.evict:
            return  # the move happens with its Write half
        start = self.clock.now_ns()
        ok, err, hit = True, "", True
        timing_ns = 0
        try:
            if op == 1 and phase in (self.evict, self.promote):
                if store.location(key) is None:
                    store.place(key, name, source, size, buf)
                    self._count("unknown_objects_written")
                elif not store.move(key, name, buf) and store.location(key) != name:
                    self._count("moves_not_made")
                return
            if op == 1:
                timing_ns = store.place(key, name, source, size, buf).timing.total_ns
            else:
                got = store.get(key, buf)
                hit = got.hit
                if not hit:
                    self._count("missing_reads")
                timing_ns = got.timing.total_ns
        except StorageError as e:
            ok, err = False, f"{type(e).__name__}: {e}"
            cause = e.__cause__
            if isinstance(cause, OSError) and cause.errno in (28, 122):  # ENOSPC, EDQUOT
                self.request_stop(StopCode.device_full, "device full (ENOSPC)", partial=True)
        end = self.clock.now_ns()
        tokens = size // self.per_token if self.per_token else 0
        wrote, read = (size if op == 1 and ok else 0), (size if op == 0 and ok and hit else 0)
        self.rec.request(
            BenchRequest(
                user=worker,
                qos="trace",
                phase="prefill" if op == 1 else "decode",
                context_tokens=tokens,
                generate_tokens=0,
                submit_ns=submit_ns,
                start_ns=start,
                storage_done_ns=end,
                end_ns=end,
                storage_ns=timing_ns,
                generation_ns=0,
                bytes_read=read,
                bytes_written=wrote,
                decode_bytes_read=read,
                tokens_read=tokens if read else 0,
                tokens_written=tokens if wrote else 0,
                hits=1 if op == 0 and hit else 0,
                misses=1 if op == 0 and not hit else 0,
                ok=ok,
                error=err,
                key=key,
                seq=seq,
                prefill_ns=timing_ns if op == 1 else 0,
                decode_ns=timing_ns if op == 0 else None,
                tier_ns=((name, timing_ns),),
            )
        )

    def _worker(self, i: int, q: queue.Queue[Any]) -> None:
        buf = aligned_buffer(self.plan.io_chunk_bytes)
        while True:
            item = q.get()
            if item is None or self.stop.is_set():
                return
            seq, due, op, size, tier, key, phase = item
            self._do(i, seq, due, op, size, tier, key, phase, buf)

    def run(self) -> tuple[int, int, int]:
        """Dispatch every row; returns (load start ns, load end ns, rows not done)."""
        w = self.cfg.workers
        queues: list[queue.Queue[Any]] = [queue.Queue(maxsize=256) for _ in range(w)]
        threads = [threading.Thread(target=self._worker, args=(i, q), daemon=True) for i, q in enumerate(queues)]
        for t in threads:
            t.start()
        tr, keys = self.trace, self.trace.keys
        t0 = float(tr.ts[0])
        speed = self.cfg.speed
        start = self.clock.now_ns()
        rows = zip(
            tr.ts.tolist(), tr.op.tolist(), tr.size.tolist(), tr.tier.tolist(), tr.key.tolist(), tr.phase.tolist()
        )
        for seq, (ts, op, size, tier, kid, phase) in enumerate(rows):
            due = start + int((ts - t0) / speed * 1e9) if speed > 0 else self.clock.now_ns()
            if speed > 0:
                wait = (due - self.clock.now_ns()) / 1e9
                if wait > 0 and self.stop.wait(wait):
                    break
            if self.stop.is_set():
                break
            item = (seq, due, op, size, tier, keys[kid], phase)
            q = queues[kid % w]
            while not self.stop.is_set():
                with contextlib.suppress(queue.Full):
                    q.put(item, timeout=0.1)
                    break
        for q in queues:
            if self.stop.is_set():  # stopped: what is still queued is not done (counted by the caller)
                with contextlib.suppress(queue.Empty):
                    while True:
                        q.get_nowait()
            q.put(None)  # after the last row: the worker finishes its queue first
        load_end = self.clock.now_ns()
        for t in threads:
            t.join()
        return start, load_end, max(0, len(tr) - self.counts["rows_done"])


def sizing(cfg: TraceReplayConfig, trace: IOTrace) -> tuple[float, float, str]:
    """The CPU and storage tiers' GB, and the sentence that says where each came from in the flags' terms:
    --cpu-mem-gb / --storage-capacity-gb when given, else the trace's peak bytes on those tiers plus
    headroom of --workers x the largest object (rows of different keys run on different workers, so up to
    one object per worker may be ahead of the trace's order), at the 95 % fill target."""
    peaks = peak_bytes(trace)
    slack = cfg.workers * int(trace.size.max())
    target = 0.95
    cpu_need = sum(b for t, b in peaks.items() if TIER_OF.get(t) == "cpu")  # every memory tier's rows
    cpu_gb = cfg.cpu_mem_gb or (round((cpu_need + slack) / target / GiB + 0.001, 3) if cpu_need else 0.0)
    st_need = sum(b for t, b in peaks.items() if TIER_OF.get(t) == "storage")
    st_gb = cfg.storage_capacity_gb or (round((st_need + slack) / target / GiB + 0.01, 3) if st_need else 0.01)

    def why(gb: float, given: float, flag: str, need: int, tiers: str) -> str:
        if given:
            return f"{gb:g} GB (--{flag})"
        if not need:
            return f"{gb:g} GB (the trace has no {tiers} rows)"
        return (
            f"{gb:g} GB (--{flag} 0: the trace's {tiers} peak {need / GiB:.3f} GiB + --workers {cfg.workers} x "
            f"the largest object {int(trace.size.max()) / GiB:.3f} GiB, at {target:.0%} fill)"
        )

    def labels(tier: str) -> str:
        return "Tier-" + "/".join(str(t) for t in sorted(TIER_OF) if TIER_OF[t] == tier)

    said = (
        f"CPU tier {why(cpu_gb, cfg.cpu_mem_gb, 'cpu-mem-gb', cpu_need, labels('cpu'))}, storage tier "
        f"{why(st_gb, cfg.storage_capacity_gb, 'storage-capacity-gb', st_need, labels('storage'))}"
    )
    return cpu_gb, st_gb, said


def _bench_config(cfg: TraceReplayConfig, trace: IOTrace) -> tuple[BenchConfig, list[Any]]:
    notes: list[Any] = []
    cpu_gb, st_gb, said = sizing(cfg, trace)
    target = 0.95
    print(f"kvtier trace replay: {said}", file=sys.stderr)
    dur = trace.duration_s / cfg.speed if cfg.speed > 0 else trace.duration_s
    values: dict[str, Any] = {
        "model": cfg.model,
        "num_users": cfg.workers,
        "duration": max(dur, 0.001),
        "gpu_mem_gb": 0,
        "cpu_mem_gb": cpu_gb,
        "cache_dir": cfg.cache_dir,
        "storage_capacity_gb": st_gb,
        "direct_io": cfg.direct_io,
        "io_chunk_mb": cfg.io_chunk_mb,
        "max_concurrent_allocs": cfg.workers,
        "generation_mode": "none",
        "seed": 0,
        "output": cfg.output,
        "xlsx_output": cfg.xlsx_output,
        "disable_multi_turn": True,
        "disable_prefix_caching": True,
        "progress": "none",
        "noise_mb": 64,
        "tuning": {"eviction": {"target_usage_ratio": target, "large_entry_limit_ratio": 1.0}},
    }
    if (trace.tier == 0).any():
        notes.append(
            warning(
                WarningCode.gpu_tier_off,
                "Tier-0 (GPU) operations of the trace were replayed on the CPU tier: "
                "kvtier trace replay has no GPU tier",
                tier0_operations=int((trace.tier == 0).sum()),
            )
        )
    return BenchConfig.model_validate(values), notes


def run(cfg: TraceReplayConfig, *, handle_signals: bool = False) -> BenchResult:
    """Replay ``cfg.trace`` and return (and write) its bench result."""
    from kvtier.bench import close_timed, record_teardown
    from kvtier.results.io import check_output_path, write_json
    from kvtier.results.xlsx import write_xlsx

    check_output_path("--output", cfg.output)
    check_output_path("--xlsx-output", cfg.xlsx_output)
    trace = read_trace(cfg.trace, cfg.max_bad_rows, cfg.max_rows)
    remote = sorted({int(t) for t in trace.tier.tolist() if int(t) not in TIER_OF})
    if remote:  # a trace of a run with Redis/S3 tiers: their rows have no tier here to run on
        names = ", ".join(f"Tier-{t} ({TIER_BY_NUMBER.get(t, '?')})" for t in remote)
        raise DatasetError(
            f"{cfg.trace}: rows on {names}: kvtier trace replay replays the local tiers only; "
            "replay the run itself with kvtier bench --redis-url/--s3-bucket instead"
        )
    bench_cfg, notes = _bench_config(cfg, trace)
    started = utc_now()
    plan = derive(bench_cfg)
    rec = Recorder(clock=MONOTONIC)
    comp = build_components(plan, rec)
    try:
        rp = _Replayer(cfg, trace, plan, comp, rec)
        devices, how = devices_under(comp.file_tier.directory)
        sampler = DeviceSampler(devices, 1.0) if devices else None
        previous: dict[signal.Signals, Any] = {}
        codes = {signal.SIGINT: StopCode.interrupted, signal.SIGTERM: StopCode.terminated}

        def on_signal(n: int, _frame: object) -> None:
            code = codes[signal.Signals(n)]
            rp.request_stop(code, f"{code.value} ({signal.Signals(n).name})", True)

        if handle_signals and threading.current_thread() is threading.main_thread():
            for s in codes:
                previous[s] = signal.signal(s, on_signal)
        try:
            if sampler is not None:
                sampler.start()
            io_before, unix0 = proc_io(), time.time()
            start, load_end, left = rp.run()
            if sampler is not None:
                sampler.stop()
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        end = MONOTONIC.now_ns()
        stop = rp.stop_reason or StopReason(
            code=StopCode.trace_finished, message=f"every row of {cfg.trace} was replayed"
        )
        status = Status.partial if rp.partial else Status.complete
        outcome = RunOutcome(
            start, load_end, end, stop, status, left, io_before, proc_io(), [], start_unix_s=unix0, device=sampler
        )
        result = build_result(plan, comp, rec, outcome, started, how)
        # the bench's warning about its user templates' largest entry does not apply to a trace
        result.warnings = [*notes, *(w for w in result.warnings if w.code != WarningCode.entry_exceeds_tier.value)]
        result.workload_source = IOTraceSource(
            path=cfg.trace,
            rows=len(trace),
            rows_skipped=trace.rows_skipped,
            duration_s=round(trace.duration_s, 6),
            speed=cfg.speed,
            workers=cfg.workers,
            tier_map={f"Tier-{t}": TIER_OF[t] for t in sorted(set(trace.tier.tolist()))},
            missing_reads=rp.counts["missing_reads"],
            unknown_objects_written=rp.counts["unknown_objects_written"],
            moves_not_made=rp.counts["moves_not_made"],
            dropped_objects=int(rec.counters.get("evictions_bottom", 0) + rec.counters.get("evictions_dropped", 0)),
            rows_not_done=left,
        )
        if cfg.output:
            write_json(result, cfg.output, flag="--output")
    finally:
        closed = close_timed(comp)
    record_teardown(result, closed, kept=False)
    if cfg.output:
        write_json(result, cfg.output, flag="--output")
    if cfg.xlsx_output:
        write_xlsx(result, cfg.xlsx_output)
    return result


__all__ = ["run", "peak_bytes"]
