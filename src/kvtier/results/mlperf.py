"""The MLPerf Storage KV Cache results table, computed from kvtier bench results as MLPerf computes it
from the reference's (its README: "MLPerf KV Cache Benchmark Results").

Per run (one trial: every instance's result of one workload):

* throughput, tokens/s = the sum over instances of ``summary.storage_throughput_tokens_per_sec``;
* read / write bandwidth, GiB/s = the sums of ``summary.cache_stats.tier_storage_{read,write}_bandwidth_gbps``;
* P95 read latency, ms = the highest ``summary.cache_stats.storage_read_p95_ms``.

Per workload (three runs): the mean of the runs for throughput and bandwidth, the max for latency.
These keep the reference's definitions so tables stay comparable; the highest per-instance p95 is not a
percentile of anything, and the throughput key's formula is explained in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtier.results.bench import BenchResult


@dataclass(frozen=True)
class MLPerfFigures:
    throughput_tokens_per_sec: float
    read_bandwidth_gibps: float
    write_bandwidth_gibps: float
    p95_read_latency_ms: float | None
    instances: int


def run_figures(instances: Sequence[BenchResult]) -> MLPerfFigures:
    """One run's figures from its instances' results."""
    if not instances:
        raise ValueError("no instance results")
    cs = [r.summary.cache_stats for r in instances]
    p95s = [v for v in (c.percentile_ms("storage_read", "p95") for c in cs) if v is not None]
    return MLPerfFigures(
        throughput_tokens_per_sec=sum(r.summary.storage_throughput_tokens_per_sec for r in instances),
        read_bandwidth_gibps=sum(c.tier_storage_read_bandwidth_gbps for c in cs),
        write_bandwidth_gibps=sum(c.tier_storage_write_bandwidth_gbps for c in cs),
        p95_read_latency_ms=max(p95s) if p95s else None,
        instances=len(instances),
    )


class MlperfWorkload(BaseModel):
    """One MLPerf v3.0 KV cache option's fixed workload (the rules' table)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    model: str
    num_users: int
    cpu_mem_gb: float
    max_concurrent_allocs: int


class ClosedRules(BaseModel):
    """The run parameters a CLOSED submission fixes (an OPEN run may change them: ``effective`` holds what ran)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    duration: float = 300
    trials: int = 3
    inter_option_delay: float = 20.0
    seed: int = 42


class TrialSpread(BaseModel):
    """A figure across an option's trials."""

    median: float | None = None
    min: float | None = None
    max: float | None = None
    cv: float | None = None  # coefficient of variation (population)


class TrialFigures(BaseModel):
    folder: str
    seconds: float
    returncode: int | None
    pooled_storage_read_device_p95_ms: float | None = None
    pooled_storage_write_device_p95_ms: float | None = None
    pooled_end_to_end_p95_ms: float | None = None


class KvtierOptionFigures(BaseModel):
    """kvtier's figures beside the wrapper's: what the spec leads with at --cpu-mem-gb 0 (decode bytes), the
    published "P95 read latency" (the highest instance's storage time per request, max over trials), GiB/s per
    rank (rows of 1 and of 32 ranks side by side), the spread across trials, and each trial."""

    model_config = ConfigDict(extra="allow")
    partial_trials: list[str] = Field(default_factory=list)
    decode_bytes_read_gb: float = 0.0
    storage_read_p95_ms: float | None = None
    read_bandwidth_gbps_per_rank: float = 0.0
    write_bandwidth_gbps_per_rank: float = 0.0
    spread: dict[str, TrialSpread] = Field(default_factory=dict)
    trials: list[TrialFigures] = Field(default_factory=list)


class OptionSummary(BaseModel):
    """One option of the run summary: the wrapper's table under its own key names and formulas, and kvtier's."""

    model_config = ConfigDict(extra="allow")
    option: int
    aggregated_read_bandwidth_gbps: float
    aggregated_write_bandwidth_gbps: float
    aggregated_avg_throughput_tokens_per_sec: float
    aggregated_storage_throughput_tokens_per_sec: float
    aggregated_device_read_p95_ms: float | None = None
    aggregated_device_write_p95_ms: float | None = None
    aggregated_p95_latency_ms: float | None = None  # mlpstorage v3.0's: max over ranks and trials of storage I/O p95
    rank_count: int
    trial_count: int
    partial_failure: bool = False
    missing_files: list[str] = Field(default_factory=list)
    kvtier: KvtierOptionFigures = Field(default_factory=KvtierOptionFigures)


class MlperfRunSummary(BaseModel):
    """``kvcache_run_summary.json`` of ``kvtier mlperf run``: built by mlperf/run.py as this model and read back by
    ``results.load``. Its sections are typed; each option's table keeps the wrapper's own names (``OptionSummary``), and
    keys a later kvtier adds are kept (extra allowed) so an older reader still opens the file."""

    model_config = ConfigDict(extra="allow")
    schema_version: str
    benchmark: Literal["kvtier mlperf run"] = "kvtier mlperf run"
    run_datetime: str
    mode: str
    interrupted: bool
    total_ranks: int
    trials_per_option: int
    options: dict[str, OptionSummary]  # the wrapper's per-option table under its own names, plus kvtier's figures
    partial_failure: bool
    verdict: list[str]
    finished_at: str | None = None
    npernode: int | None = None
    host_count: int | None = None
    effective: ClosedRules = Field(default_factory=ClosedRules)  # the parameters the run used (CLOSED's or given)
    overrides: dict[str, Any] = Field(default_factory=dict)  # those an OPEN run changed
    system: dict[str, Any] = Field(default_factory=dict)  # drives, peak bandwidth, metric rules, the submission text
    config: dict[str, Any] = Field(default_factory=dict)  # kvtier mlperf's flags (MlperfConfig)


class MlpstorageRunSummary(BaseModel):
    """mlpstorage's own run summary, read as it is: a published run folder's ``summary.json`` or the
    ``kvcache_run_summary_<time>.json`` of a run it drove (kvtier's drop-in or the reference). It has no ``benchmark``
    key (``results.load`` knows it by its shape and names it so); its options are the table kvtier's summary keeps
    under the same names (``OptionSummary``, without kvtier's figures)."""

    model_config = ConfigDict(extra="allow")
    benchmark: Literal["mlpstorage kvcache run"] = "mlpstorage kvcache run"
    schema_version: str
    run_datetime: str
    total_ranks: int
    trials_per_option: int
    options: dict[str, OptionSummary]
    partial_failure: bool = False
    npernode: int | None = None
    host_count: int | None = None


__all__ = [
    "ClosedRules",
    "MlpstorageRunSummary",
    "KvtierOptionFigures",
    "MLPerfFigures",
    "MlperfRunSummary",
    "OptionSummary",
    "TrialSpread",
    "TrialFigures",
    "MlperfWorkload",
    "run_figures",
]
