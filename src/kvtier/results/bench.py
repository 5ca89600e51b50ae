"""The typed result of ``kvtier bench`` (docs/metrics.md defines every field and its formula).

Key names are the MLPerf reference's where the reference has the figure, so a reference user finds
``summary.storage_throughput_tokens_per_sec`` and ``summary.cache_stats.storage_read_device_p95_ms``
where they expect them; kvtier's additions say their unit in their name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, create_model

from kvtier.config.bench import BenchConfig
from kvtier.results.bench_facts import (
    DeviceStats,
    GpuTelemetry,
    IOTraceSource,
    IOTraceStats,
    LatencyTracing,
    LoadFacts,
    MemoryStats,
    ProcessIO,
    StorageFacts,
    ValidationStats,
    WorkloadSource,
)
from kvtier.results.envelope import Distribution, Envelope, Section
from kvtier.results.outcome import Failure
from kvtier.stats import PERCENTILE_NAMES

TIER_NAMES = ("gpu", "cpu", "storage")
OPS = ("read", "write")


class CauseStats(Section):
    ops: int
    bytes: int
    latency_ms: Distribution


class OpStats(Section):
    ops: int
    bytes: int
    latency_ms: Distribution
    device_latency_ms: Distribution
    host_latency_ms: Distribution
    device_bandwidth_bytes_per_sec: float | None
    by_cause: dict[str, CauseStats]
    errors: int


class TierStats(Section):
    read: OpStats
    write: OpStats


class TierUsage(Section):
    used_bytes: int
    capacity_bytes: int
    entries: int
    page_bytes: int | None = None  # a paged tier (CPU RAM): its page; used_bytes counts whole pages
    waste_bytes: int | None = None  # of used_bytes, what no entry uses (each entry's last page is partly empty)


class Criterion(Section):
    name: str
    target: float
    actual: float
    unit: str
    passed: bool


class StorageHealth(Section):
    """Pass/fail criteria of ``--performance-profile`` (the reference's storage_health)."""

    profile: Literal["latency", "throughput"]
    overall_status: Literal["PASS", "FAIL", "NOT-APPLICABLE"]  # NOT-APPLICABLE: no device was measured
    criteria: list[Criterion]
    passed_count: int
    total_count: int
    reason: str | None = None  # why NOT-APPLICABLE


def pct_key(prefix: str, p: str) -> str:
    """``pct_key("storage_read_device", "p95")`` -> ``storage_read_device_p95_ms``: the reference's
    per-percentile key names, made in one place for the builder and the model."""
    return f"{prefix}_{p}_ms"


def percentile_key_prefixes() -> list[str]:
    return [f"{t}_{op}" for t in TIER_NAMES for op in OPS] + [
        f"storage_{op}_{part}" for op in OPS for part in ("device", "host")
    ]


class _CacheStatsFixed(Section):
    cache_hit_rate: float | None
    cache_hits: int
    cache_misses: int
    # reads of entries other requests wrote (every lookup but a request's decode reads of its own entry), their
    # hits and rate (null when the workload reads no other request's entry: a trace without reuse); null counts in
    # results from before they were kept
    reuse_lookups: int | None = None
    reuse_hits: int | None = None
    reuse_hit_rate: float | None = None
    # the reference's counters (docs/metrics.md: how each maps onto kvtier's samples)
    gpu_entries: int
    cpu_entries: int
    storage_entries: int
    gpu_memory_used_gb: float
    cpu_memory_used_gb: float
    offloads_cpu: int
    offloads_storage: int
    prefill_writes: int
    decode_reads: int
    system_prompt_hits: int
    common_phrase_hits: int
    multi_turn_hits: int
    user_cache_hits: int
    total_read_bytes: int
    total_write_bytes: int
    total_read_gb: float
    total_write_gb: float
    read_write_ratio: float
    read_iops: int
    write_iops: int
    storage_tokens_processed: float
    tier_gpu_read_bandwidth_gbps: float
    tier_gpu_write_bandwidth_gbps: float
    tier_cpu_read_bandwidth_gbps: float
    tier_cpu_write_bandwidth_gbps: float
    tier_storage_read_bandwidth_gbps: float
    tier_storage_write_bandwidth_gbps: float
    decode_bytes_read_gb: float
    prefill_bytes_written_gb: float
    demotions: int
    promotions: int
    evictions: int
    entries_dropped: int
    entries_dropped_unreadable: int
    deduplicated_writes: int
    fragmented_fallthroughs: int = 0
    reserve_waits_expired: int = 0  # reservations whose tier's room stayed held (writes in flight, entries in use)
    reserve_wait_total_s: float = 0.0  # time writes and moves spent waiting for such room, summed over threads
    remote_own_hits: int = 0  # --remote-namespace shared: reads the shared tier served from this run's entries
    remote_cross_writer_hits: int = 0  # ... from entries another rank or an earlier run wrote
    remote_foreign_entries: int = 0  # ... misses: what was there was not the entry its key names (size, parts, expiry)
    host_memory_short: int = 0  # RAM tiers that stopped growing because the host ran short (warning host-memory-short)
    stores_dropped: int = 0  # stores no tier could take: the request went on, a later read misses
    stores_dropped_bytes: int = 0
    stores_dropped_by_cause: dict[str, int] = Field(default_factory=dict)  # no-room | entry-too-large
    nvme_read_device_p95_ms: float | None
    nvme_write_device_p95_ms: float | None
    storage_health: StorageHealth

    def percentile_ms(self, prefix: str, p: str) -> float | None:
        """A generated percentile key, e.g. ``percentile_ms("storage_read_device", "p95")``."""
        value: float | None = getattr(self, pct_key(prefix, p))
        return value

    def tier_kv_bytes_gb(self, tier: str, op: str) -> float:
        """A generated per-tier KV volume, e.g. ``tier_kv_bytes_gb("cpu", "write")`` (tier_cpu_kv_bytes_written_gb)."""
        value: float = getattr(self, f"tier_{tier}_kv_bytes_{'written' if op == 'write' else 'read'}_gb")
        return value

    def tier_bandwidth_gbps(self, tier: str, op: str) -> float:
        """The reference's per-tier bandwidth, e.g. ``tier_bandwidth_gbps("storage", "read")``."""
        value: float = getattr(self, f"tier_{tier}_{op}_bandwidth_gbps")
        return value


def _cache_stats_model() -> type[_CacheStatsFixed]:
    fields: dict[str, Any] = {}
    for t in TIER_NAMES:
        for op in OPS:
            fields[f"tier_{t}_kv_bytes_{'written' if op == 'write' else 'read'}_gb"] = (float, ...)
    for prefix in percentile_key_prefixes():
        for p in PERCENTILE_NAMES:
            fields[pct_key(prefix, p)] = (float | None, ...)
    return create_model("CacheStats", __base__=_CacheStatsFixed, **fields)


if TYPE_CHECKING:
    CacheStats = _CacheStatsFixed
else:
    CacheStats = _cache_stats_model()
    """summary.cache_stats: the reference's keys (tier_{gpu,cpu,storage}_kv_bytes_{written,read}_gb,
    {tier}_{read,write}_{p}_ms, storage_{read,write}_{device,host}_{p}_ms, ...) plus kvtier's."""


class QoSSla(Section):
    """The reference's per-class SLA: end-to-end p95 against the class's p95 target; compliance = the
    share of requests within it; met = compliance >= 0.95."""

    target_p95_ms: float
    actual_p95_ms: float | None
    compliance: float | None
    met: bool | None


class QoSStats(Section):
    no_data: bool
    total_requests: int
    latency_ms: Distribution
    sla: QoSSla
    requests: int
    failed: int
    service_latency_ms: Distribution
    end_to_end_latency_ms: Distribution
    target_latency_p95_ms: float
    target_latency_p99_ms: float
    p95_met: bool | None
    p99_met: bool | None
    sla_compliance: float | None


class MultiTurnStats(Section):
    cache_hits: int
    cache_misses: int
    hit_rate: float
    enabled: bool
    conversations_started: int
    conversations_metadata_evicted: int
    max_conversations: int
    turns_mean: float | None
    turns_max: int
    multi_turn_cache_hits: int
    multi_turn_cache_misses: int
    history_hit_rate: float | None
    history_bytes_read_gb: float
    history_restores: int


class PrefixCacheStats(Section):
    prefix_hits: int
    prefix_misses: int
    system_prompt_reuse: int
    common_phrase_reuse: int
    bytes_saved: int
    enabled: bool
    num_system_prompts: int
    system_prompt_hit_probability: float
    prefix_hit_rate: float | None
    prefix_restores: int
    prefix_bytes_read_gb: float


class LookupStats(Section):
    hits: int
    misses: int
    hit_rate: float | None
    restores: int
    bytes_read_gb: float


class KvLayoutStats(Section):
    kv_layout: Literal["entry", "chunked"]
    chunk_tokens: int | None
    new_context_gb: float
    bytes_read_gb: float
    read_amplification: float | None
    decode: LookupStats


class FillStats(Section):
    """Entries written before the load, outside the statistics."""

    entries: int
    bytes: int
    seconds: float
    bytes_per_sec: float | None


class PreconditionStats(Section):
    requested_bytes: int
    written_bytes: int
    files: int
    threads: int
    seconds: float
    bytes_per_sec: float | None
    completed: bool
    errors: list[str]
    shortfall_bytes: int | None = None  # requested - written (None: older results)
    kept_bytes: int | None = None  # still on the device when the load began (None: older results)
    kept_files: int | None = None


class StaleRunsStats(Section):
    """What earlier runs left in the cache dir at start: folders of killed runs (marker present, lock free), and
    background removals of finished runs' files, waited for before the load."""

    folders: list[str]
    bytes: int
    removed: bool
    problems: list[str]
    removals_under_way: int = 0  # earlier runs' folders a background remover was still emptying
    removal_wait_s: float = 0.0  # how long this run waited for them, before its load


class TeardownStats(Section):
    """The removal of the run's files after the result was first written (outside the load). Files of more than 4 GiB
    are handed to a background remover (``removal_pid``) instead of waited for: ``seconds`` is then the hand-off."""

    seconds: float
    storage_entries: int
    storage_bytes: int
    kept: bool
    removal: Literal["done", "background", "kept"] = "done"
    removal_pid: int | None = None


class SetupStats(Section):
    stale_runs: StaleRunsStats | None = None
    precondition: PreconditionStats | None = None
    decode_only_prepopulation: FillStats | None = None
    rag_ingest: FillStats | None = None


class RagStats(Section):
    enabled: bool
    num_docs: int
    top_k: int
    request_probability: float
    queries: int
    chunk_hits: int
    chunk_misses: int
    chunk_hit_rate: float | None
    chunks_reingested: int
    burst_bytes_gb: float
    burst_latency_ms: Distribution
    ingest: FillStats | None


class AutoscaleStep(Section):
    t_s: float
    users: int
    throughput_tokens_per_sec: float
    saturation: float | None
    storage_read_p95_ms: float | None = None
    storage_write_p95_ms: float | None = None
    queue_depth: int | None = None
    action: str
    next_users: int


class ScaleEvent(Section):
    """One change of the user count (or the capacity stop), in the reference's layout."""

    timestamp: str
    mode: Literal["qos", "capacity"]
    action: str
    users: int
    saturation_level: float | None
    read_latency_p95_ms: float | None
    write_latency_p95_ms: float | None
    throughput_tokens_per_sec: float


class AutoscalingSummary(Section):
    initial_users: int
    final_users: int
    total_scale_events: int
    peak_user_count: int | None = None
    peak_throughput_tokens_per_sec: float | None = None
    mode: Literal["qos", "capacity"]
    target_saturation: float
    algorithm: str = "kvtier"  # reference | kvtier (--autoscaler-algorithm); older results: kvtier's
    steps: list[AutoscaleStep]
    peak_users: int | None = None
    stop_reason: str | None = None


class TimelinePoint(Section):
    timestamp: float
    throughput_tokens_per_sec: float


class BenchSummary(Section):
    total_requests: int
    total_tokens: int
    elapsed_time: float
    avg_throughput_tokens_per_sec: float
    total_storage_io_time: float
    storage_throughput_tokens_per_sec: float
    requests_per_second: float
    storage_kv_tokens_per_sec: float
    storage_read_bytes_per_sec: float
    storage_write_bytes_per_sec: float
    end_to_end_latency_ms: Distribution
    storage_io_latency_ms: Distribution
    generation_latency_ms: Distribution
    queue_wait_ms: Distribution
    host_time_fraction: float | None
    cache_stats: CacheStats
    qos_metrics: dict[str, QoSStats]
    multi_turn_stats: MultiTurnStats
    prefix_cache_stats: PrefixCacheStats
    kv_layout_stats: KvLayoutStats
    rag_stats: RagStats
    autoscaling_stats: list[ScaleEvent]
    autoscaling_summary: AutoscalingSummary | None


class ModelInfo(Section):
    key: str
    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    attention: Literal["mha", "gqa", "mla"]
    num_heads: int
    hidden_dim: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_bytes_per_token: int
    tensor_parallel: int
    kv_bytes_per_token_per_rank: int


class ErrorStats(Section):
    requests_failed: int
    failures: dict[str, Failure]  # by cause: tier-full, io-error, cancelled (results/outcome.py)
    tier_operations: dict[str, int]
    first_messages: list[str]


class BenchResult(Envelope):
    """One ``kvtier bench`` run."""

    benchmark: Literal["kvtier bench"] = "kvtier bench"
    elapsed_s: float
    load_duration_s: float
    load_start_unix_s: float | None = None  # wall clock when the load began (MPI ranks line up on it)
    seed: int
    model: ModelInfo
    requests_completed: int
    requests_failed: int
    requests_abandoned: int
    requests_cut_at_stop: int
    load: LoadFacts | None = None  # None only in results written before it was recorded
    total_tokens_generated: int
    total_storage_io_latency: float
    total_generation_latency: float
    end_to_end_latencies: list[float]
    storage_latencies: list[float]
    generation_latencies: list[float]
    throughput_timeline: list[TimelinePoint]
    prefill_latencies: list[float]
    decode_latencies: list[float]
    multi_turn_cache_hits: int
    multi_turn_cache_misses: int
    summary: BenchSummary
    tiers: dict[str, TierStats]
    tier_usage_at_end: dict[str, TierUsage]
    errors: ErrorStats
    process_io: ProcessIO
    device: DeviceStats | None = None  # None only in results written before it was recorded
    io_trace: IOTraceStats | None = None  # only with --io-trace-log
    latency_tracing: LatencyTracing | None = None  # only with --enable-latency-tracing
    validation: ValidationStats | None = None  # only with --validation-trace
    gpu_telemetry: GpuTelemetry | None = None  # None only in results written before it was recorded
    memory: MemoryStats
    storage: StorageFacts
    workload_source: WorkloadSource
    setup: SetupStats
    teardown: TeardownStats | None = None
    config: BenchConfig


__all__ = [
    "BenchResult",
    "TeardownStats",
    "IOTraceStats",
    "IOTraceSource",
    "LatencyTracing",
    "ValidationStats",
    "GpuTelemetry",
    "BenchSummary",
    "CacheStats",
    "Distribution",
    "TierStats",
    "OpStats",
    "StorageHealth",
    "Criterion",
    "pct_key",
    "percentile_key_prefixes",
    "TIER_NAMES",
    "OPS",
]
