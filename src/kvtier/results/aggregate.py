"""The typed aggregate of an MPI bench run (rank 0's ``--output``; docs/metrics.md "MPI aggregate").

Each rank's own full result is ``<output stem>.rank_<r>.json`` (a BenchResult). The aggregate sums
what adds up, pools every latency exactly over all ranks' raw samples, and keeps the MLPerf-style
per-instance figures beside them under their own names.
"""

from __future__ import annotations

from typing import Literal

from kvtier.results.envelope import Envelope, Section
from kvtier.results.outcome import Failure
from kvtier.stats import Summary


class RankSummary(Section):
    rank: int
    host: str
    status: str
    stop_code: str
    result_file: str | None
    requests_completed: int
    requests_failed: int
    total_tokens_generated: int
    load_start_unix_s: float
    load_end_unix_s: float
    storage_throughput_tokens_per_sec: float
    storage_read_p95_ms: float | None
    # the per-instance figures the MLPerf wrapper reads, so rank 0 alone can build its table (no file
    # of another host needed)
    avg_throughput_tokens_per_sec: float | None = None
    tier_storage_read_bandwidth_gbps: float | None = None
    tier_storage_write_bandwidth_gbps: float | None = None
    storage_read_device_p95_ms: float | None = None
    storage_write_device_p95_ms: float | None = None
    decode_bytes_read_gb: float | None = None  # the figure the spec leads with at --cpu-mem-gb 0
    storage_io_p95_ms: float | None = None  # summary.storage_io_latency_ms.p95: the published "P95" is their max


class Totals(Section):
    """Sums over the ranks heard from."""

    requests_completed: int
    requests_failed: int
    failures: dict[str, Failure]  # by cause, summed over the ranks (results/outcome.py)
    total_tokens_generated: int
    avg_throughput_tokens_per_sec: float  # Σ per-rank generated tokens / the shared load window
    storage_kv_tokens_per_sec: float  # Σ per-rank
    storage_read_bytes_per_sec: float  # Σ per-rank (all tiers)
    storage_write_bytes_per_sec: float
    tier_bytes: dict[str, dict[str, int]]  # tier -> {read, written}: Σ logical bytes of completed ops
    remote_own_hits: int = 0  # Σ reads a rank's shared remote tier served from entries that rank wrote
    remote_cross_writer_hits: int = 0  # Σ reads served from entries another rank or an earlier run wrote
    remote_foreign_entries: int = 0  # Σ shared lookups that found something other than the entry the key names
    host_memory_short: int = 0  # Σ RAM tiers that stopped growing because their host ran short of memory


class PooledLatency(Section):
    """Percentiles over the union of every rank's raw samples (exact: the samples were gathered)."""

    end_to_end_latency_ms: Summary
    storage_io_latency_ms: Summary
    tiers: dict[str, dict[str, Summary]]  # tier -> read|write -> (host + device) latency
    tiers_device: dict[str, dict[str, Summary]]  # tier -> read|write -> device latency
    samples: int
    merge_seconds: float


class MLPerfStyle(Section):
    """The MLPerf wrapper's figures over these ranks, under their own names (not percentiles of anything
    when it comes to the max of per-rank P95)."""

    storage_throughput_tokens_per_sec_sum: float
    tier_storage_read_bandwidth_gbps_sum: float
    tier_storage_write_bandwidth_gbps_sum: float
    storage_read_p95_ms_max: float | None


class Skew(Section):
    start_s: float  # latest load start - earliest, over ranks
    stop_s: float  # latest load end - earliest


class BenchAggregate(Envelope):
    benchmark: Literal["kvtier bench mpi"] = "kvtier bench mpi"
    ranks_launched: int
    ranks_reported: int
    lost_ranks: list[int]
    window: dict[str, float]  # start_unix_s, deadline_unix_s (broadcast by rank 0)
    seed: int
    totals: Totals
    latency: PooledLatency
    mlperf: MLPerfStyle
    skew: Skew
    ranks: list[RankSummary]
    config: dict[str, object]


__all__ = ["BenchAggregate", "RankSummary", "Totals", "PooledLatency", "MLPerfStyle", "Skew"]
