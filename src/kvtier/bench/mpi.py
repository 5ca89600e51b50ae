"""``kvtier bench`` as one rank of an MPI run: many processes (and hosts) loading their storage over one
shared window, with one aggregate.

Per rank r: ``<cache-dir>/rank_<r>/``, seed ``seed + r`` (rank 0 draws one seed for all when none is
given), its own full result in ``<output stem>.rank_<r>.json``. The protocol (kvtier/mpi.py, star
messages with deadlines, ``--mpi-timeout``):

1. every rank sets up (tiers, noise buffer, preconditioning, prepopulation, RAG ingest) and tells
   rank 0 it is ready, or why it cannot run (the error names its host and rank);
2. rank 0 waits for all, then sends one start time (now + 1 s) and one deadline (start + duration) —
   or, when a rank failed or never reported, an abort naming it, and every rank stops before loading;
3. every rank waits for the start, loads until the deadline, writes its own result file, then sends
   its summary and raw latency samples to rank 0;
4. rank 0 sums what adds up, pools every latency percentile over the union of the samples (exact),
   keeps the MLPerf wrapper's figures beside them, and writes ``--output``: partial when a rank was
   lost (named in ``lost_ranks``) or any rank's run was partial.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.config.bench import BenchConfig
from kvtier.config.tiers import TIER_KINDS
from kvtier.errors import ConfigError, KvtierError
from kvtier.mpi import TAG_SEED, RunAborted, RunEnvironment
from kvtier.results.aggregate import BenchAggregate
from kvtier.results.bench import OPS, BenchResult
from kvtier.results.envelope import Status, StopCode, StopReason, WarningCode, collect_host, iso, utc_now, warning
from kvtier.results.mlperf import run_figures
from kvtier.results.outcome import Failure, judge, merge
from kvtier.stats import summarize_ns_as_ms
from kvtier.telemetry.recorder import Recorder
from kvtier.tracefile import rank_trace_path

TIERS = TIER_KINDS  # every kind a rank may have (gpu, cpu, redis, storage, s3); pooled where present


def rank_path(path: str | None, rank: int, suffix: str) -> str | None:
    """``out.json`` -> ``out.rank_3.json`` (``suffix`` when the name has none)."""
    if path is None:
        return None
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank_{rank}{p.suffix or suffix}"))


def rank_config(cfg: BenchConfig, r: RunEnvironment, seed: int) -> BenchConfig:
    cache: str | None = None  # none given: each rank its own temporary directory, as a single run
    if cfg.cache_dir is not None:
        folder = Path(cfg.cache_dir) / f"rank_{r.rank}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--cache-dir: rank {r.rank} on {r.host} cannot create {folder}: {e.strerror}") from e
        cache = str(folder)
    return cfg.model_copy(
        update={
            "cache_dir": cache,
            "seed": seed + r.rank,
            "output": rank_path(cfg.output, r.rank, ".json"),
            "xlsx_output": rank_path(cfg.xlsx_output, r.rank, ".xlsx"),
            "request_log": rank_path(cfg.request_log, r.rank, ".jsonl"),
            "io_trace_log": rank_trace_path(cfg.io_trace_log, r.rank) if cfg.io_trace_log else None,
            "num_clients": 1,
        }
    )


def shared_identity(cfg: BenchConfig, env: RunEnvironment, default_output: str) -> tuple[int, str]:
    """The run's base seed and output path, the same on every rank: the given ones, or what rank 0
    chose (a drawn seed; ``default_output``, named from rank 0's clock) and sent to every rank."""
    if cfg.seed is not None and cfg.output is not None:
        return cfg.seed, cfg.output
    r = env.peers
    assert r is not None, "a rank of an MPI run"
    if r.rank == 0:
        seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
        ident = (seed, cfg.output or default_output)
        r.tell(ident, list(range(1, r.size)), TAG_SEED, cfg.mpi_timeout)
        return ident
    ok, ident = r.recv(0, TAG_SEED, cfg.mpi_timeout)
    if not ok:
        raise RunAborted(f"rank {r.rank} ({r.host}): nothing from rank 0 within --mpi-timeout {cfg.mpi_timeout:g} s")
    return int(ident[0]), str(ident[1])


class Gate:
    """Steps 1-3 of the protocol: ready -> one start and one deadline (or an abort)."""

    def __init__(self, cfg: BenchConfig, env: RunEnvironment) -> None:
        self.cfg, self.env = cfg, env
        self.passed = False
        self.window: dict[str, float] = {}

    def __call__(self) -> float:
        self.window = self.env.start(duration_s=self.cfg.duration)
        self.passed = True
        return self.env.wait(self.window)

    def report_failure(self, message: str) -> None:
        """A rank that failed before the gate says so (rank 0 then aborts every rank, naming it)."""
        try:
            self.env.start(problem=message)
        except RunAborted:
            pass  # expected: the caller raises its own error


def samples_of(rec: Recorder) -> dict[str, Any]:
    """The raw latency samples rank 0 pools, as int64 nanosecond arrays."""
    ok = [x for x in rec.requests if x.ok]
    out: dict[str, Any] = {
        "e2e": np.fromiter((x.end_ns - x.submit_ns for x in ok), np.int64, len(ok)),
        "storage": np.fromiter((x.storage_ns for x in ok), np.int64, len(ok)),
    }
    for (tier, op), ops in list(rec.ops.items()):
        out[f"{tier}.{op}"] = np.fromiter((s.host_ns + s.device_ns for s in ops), np.int64, len(ops))
        out[f"{tier}.{op}.device"] = np.fromiter((s.device_ns for s in ops), np.int64, len(ops))
    return out


def run_rank(
    cfg: BenchConfig, r: RunEnvironment, default_output: str = "kvtier_bench.json", **run_kwargs: Any
) -> BenchResult | BenchAggregate:
    """This rank's part of the run; rank 0 returns the aggregate, the others their own result.
    Without ``--output`` every rank uses rank 0's ``default_output``."""
    from kvtier.bench import run

    started = utc_now()
    seed, output = shared_identity(cfg, r, default_output)
    cfg = cfg.model_copy(update={"output": output})
    gate = Gate(cfg, r)
    rec = Recorder()
    pooled: list[BenchAggregate] = []

    def pool(result: BenchResult) -> None:
        """Send this rank's result to rank 0, which writes the aggregate: before the teardown, because Open MPI's
        mpirun follows its SIGTERM with SIGKILL after ``odls_base_sigkill_timeout`` (1 s by default) and removing
        the run's files can take longer than that."""
        contribution = {
            "rank": r.rank,
            "host": r.host,
            "result": result.model_dump(mode="json"),
            "result_file": mine.output,
            "samples": samples_of(rec),
        }
        got = r.gather(contribution)
        if r.rank != 0 or got is None:
            return
        agg = aggregate(cfg, r.size, seed, gate.window, got, started)
        if cfg.output:
            from kvtier.results.io import write_json

            write_json(agg, cfg.output, flag="--output")
        pooled.append(agg)

    try:
        mine = rank_config(cfg, r, seed)
        result = run(mine, gate=gate, recorder=rec, rank=r.rank, before_teardown=pool, **run_kwargs)
    except RunAborted:
        raise
    except (KvtierError, OSError) as e:
        if not gate.passed:
            gate.report_failure(str(e))
        raise
    assert isinstance(result, BenchResult)
    return pooled[0] if pooled else result


def _rank_window(res: BenchResult) -> tuple[float, float]:
    start = float(res.load_start_unix_s or 0.0)
    return start, start + res.load_duration_s


def pooled_latency(got: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Exact percentiles over every rank's raw samples (end to end, storage, per tier and operation)."""
    t0 = time.perf_counter()
    pooled = {
        name: np.concatenate([v["samples"].get(name, np.empty(0, np.int64)) for v in got.values()])
        for name in {n for v in got.values() for n in v["samples"]}
    }

    def per_tier(suffix: str) -> dict[str, dict[str, Any]]:
        return {
            t: {op: summarize_ns_as_ms(pooled[f"{t}.{op}{suffix}"]) for op in OPS if f"{t}.{op}{suffix}" in pooled}
            for t in TIERS
            if any(f"{t}.{op}{suffix}" in pooled for op in OPS)
        }

    latency: dict[str, Any] = {
        "end_to_end_latency_ms": summarize_ns_as_ms(pooled.get("e2e", np.empty(0, np.int64))),
        "storage_io_latency_ms": summarize_ns_as_ms(pooled.get("storage", np.empty(0, np.int64))),
        "tiers": per_tier(""),
        "tiers_device": per_tier(".device"),
        "samples": int(sum(a.size for a in pooled.values())),
    }
    latency["merge_seconds"] = round(time.perf_counter() - t0, 4)
    return latency


def _verdict(
    cfg: BenchConfig, results: dict[int, BenchResult], lost: list[int], completed: int, failures: dict[str, Failure]
) -> tuple[Status, StopReason, list[Any]]:
    """The run's status over every rank: partial with a lost or partial rank; the failure rule over the
    pooled requests (a rank's own too-many-failures is decided again here)."""
    warnings = []
    if lost:
        warnings.append(
            warning(
                WarningCode.ranks_lost,
                f"rank(s) {', '.join(map(str, lost))} sent no result within --mpi-timeout {cfg.mpi_timeout:g} s: "
                "the aggregate holds the other ranks only",
                lost_ranks=lost,
            )
        )
    for k, res in results.items():
        if res.status != Status.complete:
            warnings.append(
                warning(
                    WarningCode.rank_not_complete,
                    f"rank {k}: {res.status.value} ({res.stop_reason.code.value})",
                    rank=k,
                    status=res.status.value,
                )
            )
    partial = bool(lost) or any(res.status == Status.partial for res in results.values())
    stops = {res.stop_reason.code.value for res in results.values()}
    stops -= {StopCode.too_many_failures.value}  # decided again below, over the pooled requests
    stop_code = StopCode.duration if stops <= {"duration"} else StopCode(sorted(stops - {"duration"})[0])
    status, stop, failed = judge(
        Status.partial if partial else Status.complete,
        StopReason(
            code=stop_code,
            message=(f"lost rank(s) {lost}; " if lost else "") + f"ranks stopped by: {', '.join(sorted(stops))}",
        ),
        completed,
        failures,
        cfg.max_failure_rate,
    )
    return status, stop, warnings + failed


def _totals(results: dict[int, BenchResult], failures: dict[str, Failure], span: float) -> dict[str, Any]:
    """What adds up over the ranks."""
    rs = list(results.values())
    caches = [r.summary.cache_stats for r in rs]
    tier_bytes: dict[str, dict[str, int]] = {}
    for r in rs:
        for name, t in r.tiers.items():
            b = tier_bytes.setdefault(name, {"read": 0, "written": 0})
            b["read"] += t.read.bytes
            b["written"] += t.write.bytes
    tokens = sum(r.total_tokens_generated for r in rs)
    return {
        "requests_completed": sum(r.requests_completed for r in rs),
        "requests_failed": sum(r.requests_failed for r in rs),
        "failures": failures,
        "total_tokens_generated": tokens,
        "avg_throughput_tokens_per_sec": round(tokens / span, 3),
        "storage_kv_tokens_per_sec": round(sum(r.summary.storage_kv_tokens_per_sec for r in rs), 3),
        "storage_read_bytes_per_sec": round(sum(r.summary.storage_read_bytes_per_sec for r in rs), 1),
        "storage_write_bytes_per_sec": round(sum(r.summary.storage_write_bytes_per_sec for r in rs), 1),
        "tier_bytes": tier_bytes,
        "remote_own_hits": sum(c.remote_own_hits for c in caches),
        "remote_cross_writer_hits": sum(c.remote_cross_writer_hits for c in caches),
        "remote_foreign_entries": sum(c.remote_foreign_entries for c in caches),
        "host_memory_short": sum(c.host_memory_short for c in caches),
    }


def _rank_row(k: int, contribution: dict[str, Any], res: BenchResult) -> dict[str, Any]:
    c = res.summary.cache_stats
    start, end = _rank_window(res)
    return {
        "rank": k,
        "host": contribution["host"],
        "status": res.status,
        "stop_code": res.stop_reason.code,
        "result_file": contribution["result_file"],
        "requests_completed": res.requests_completed,
        "requests_failed": res.requests_failed,
        "total_tokens_generated": res.total_tokens_generated,
        "load_start_unix_s": start,
        "load_end_unix_s": end,
        "storage_throughput_tokens_per_sec": res.summary.storage_throughput_tokens_per_sec,
        "storage_read_p95_ms": c.percentile_ms("storage_read", "p95"),
        "storage_io_p95_ms": res.summary.storage_io_latency_ms.p95,
        "avg_throughput_tokens_per_sec": res.summary.avg_throughput_tokens_per_sec,
        "tier_storage_read_bandwidth_gbps": c.tier_storage_read_bandwidth_gbps,
        "tier_storage_write_bandwidth_gbps": c.tier_storage_write_bandwidth_gbps,
        "storage_read_device_p95_ms": c.percentile_ms("storage_read_device", "p95"),
        "storage_write_device_p95_ms": c.percentile_ms("storage_write_device", "p95"),
        "decode_bytes_read_gb": c.decode_bytes_read_gb,
    }


def aggregate(
    cfg: BenchConfig, size: int, seed: int, window: dict[str, float], got: dict[int, dict[str, Any]], started: Any
) -> BenchAggregate:
    """Rank 0's view of the run from every contribution it received (``got``: rank -> contribution), each
    rank's result validated back into its model."""
    results = {k: BenchResult.model_validate(v["result"]) for k, v in sorted(got.items())}
    lost = [k for k in range(size) if k not in got]
    failures = merge(r.errors.failures for r in results.values())
    completed = sum(r.requests_completed for r in results.values())
    status, stop, warnings = _verdict(cfg, results, lost, completed, failures)
    span = max(1e-9, window.get("deadline_unix_s", 0.0) - window.get("start_unix_s", 0.0))
    figures = run_figures(list(results.values()))  # the MLPerf table's one formula (results/mlperf.py)
    windows = [_rank_window(r) for r in results.values()]
    return BenchAggregate.model_validate(
        {
            "status": status,
            "stop_reason": stop,
            "started_at": iso(started),
            "finished_at": iso(utc_now()),
            "host": collect_host({"cache_dir": cfg.cache_dir}),
            "warnings": warnings,
            "ranks_launched": size,
            "ranks_reported": len(got),
            "lost_ranks": lost,
            "window": window,
            "seed": seed,
            "totals": _totals(results, failures, span),
            "latency": pooled_latency(got),
            "mlperf": {
                "storage_throughput_tokens_per_sec_sum": round(figures.throughput_tokens_per_sec, 3),
                "tier_storage_read_bandwidth_gbps_sum": round(figures.read_bandwidth_gibps, 6),
                "tier_storage_write_bandwidth_gbps_sum": round(figures.write_bandwidth_gibps, 6),
                "storage_read_p95_ms_max": figures.p95_read_latency_ms,
            },
            "skew": {
                "start_s": round(max(w[0] for w in windows) - min(w[0] for w in windows), 4),
                "stop_s": round(max(w[1] for w in windows) - min(w[1] for w in windows), 4),
            },
            "ranks": [_rank_row(k, got[k], res) for k, res in results.items()],
            "config": cfg.model_dump(mode="json"),
        }
    )


__all__ = ["run_rank", "aggregate", "rank_path", "RunAborted"]
