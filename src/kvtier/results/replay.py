"""The typed result of ``kvtier replay`` (summary.json; docs/metrics.md defines every field).

Per-request records go to requests.jsonl beside it (one JSON object a line, written on the hot path as the
``ReplayRecord`` TypedDict; results/records.py reads them back validated)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NotRequired, TypedDict

from pydantic import Field, TypeAdapter, ValidationError, model_validator

from kvtier.config.replay import ReplayConfig
from kvtier.errors import DatasetError
from kvtier.results.bench import GpuTelemetry
from kvtier.results.envelope import Distribution, Envelope, Section
from kvtier.results.ladder import TwinError
from kvtier.results.outcome import Failure


class ReplayRecord(TypedDict):
    """One request of a replay: a line of requests.jsonl (docs/metrics.md "requests.jsonl"). A TypedDict, not a
    model: the client fills it on the hot path, one per request, and writes it as it is."""

    user: str
    session: str
    turn: int
    session_turn: int
    max_tokens: int
    status: str  # ok | error | cut
    cause: str | None  # the failure's cause (results/outcome.py), None when ok
    error: str | None
    http_status: int | None
    replica: str | None  # the server's x-kvtier-replica
    ttft_s: float | None
    itl_s: list[float]
    e2e_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens
    start_unix_s: float | None
    # kvtier's response extension (the sim's ``kvtier.ttft_decomposition``; null from a server without it):
    prompt_sources: dict[str, int] | None  # the prompt's tokens by source: gpu, each offload tier, recomputed
    server_ttft_parts: dict[str, float] | None  # the server's time to the first token by part, seconds
    server_ttft_s: float | None  # their sum: the server's own TTFT (the client's adds the network and client)
    first_event_s: NotRequired[float]  # the first event carrying a choice (kvtier ladder's first-token time)
    # the two legs outside the server, measured on the host's one monotonic clock (the sim's stamps and the client's):
    # to_server = the sim's receipt − the client's start; to_client = the client's first token − the sim's send
    transit_s: NotRequired[dict[str, float]]
    decomposition_dropped: NotRequired[str]  # why the server's decomposition was not believed (its schema, its bounds)
    sim_timing: NotRequired[str | None]  # the sim's kvtier.timing: assumed | measured | extrapolated (docs/serving.md)
    rank: NotRequired[int]  # the MPI rank that sent it (replay/mpi.py)
    request_id: NotRequired[str]  # the X-Request-Id sent (vLLM names the engine's request after it)
    start_mono_s: NotRequired[float]  # the client's start on the host's monotonic clock (the join's transits)
    # where the decomposition came from: the sim's response (absent), or the engine's own record joined to this one
    decomposition: NotRequired[str]  # measured-in-engine
    engine: NotRequired[dict[str, Any]]  # the engine record's loads and stores (kvtier/replay/engine_join.py)


DECOMPOSITION_PARTS = frozenset(("receive", "queue", "lookup", "fetch", "recompute", "first_decode", "send"))
"""The parts of the sim's TTFT decomposition (docs/serving.md); a server naming others is not believed."""
SOURCE_NAME = re.compile(r"[a-z][a-z0-9_-]{0,31}")
"""A prompt source's name: gpu, recomputed, or an offload tier's (cpu, storage, redis, s3, nvme, ...)."""
MAX_SOURCES = 16
MAX_SOURCE_TOKENS = 1 << 40


@dataclass(frozen=True)
class Decomposition:
    """A server's TTFT decomposition that passed ``decomposition_problem``."""

    tokens: dict[str, int]
    seconds: dict[str, float]
    server_ttft_s: float


def _seconds(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 1e9


def decomposition_problem(tokens: Any, seconds: Any, total: Any) -> str | None:
    """What is wrong with a TTFT decomposition's three fields, or None: at most MAX_SOURCES sources named like
    tiers, each a count up to 2^40; only the known parts, each a finite number of seconds in [0, 1e9); a finite,
    non-negative total. The one schema of the client that receives it and the tools that read it back."""
    if (
        not isinstance(tokens, dict)
        or len(tokens) > MAX_SOURCES
        or not all(
            isinstance(k, str)
            and SOURCE_NAME.fullmatch(k)
            and isinstance(v, int)
            and not isinstance(v, bool)
            and 0 <= v <= MAX_SOURCE_TOKENS
            for k, v in tokens.items()
        )
    ):
        return f"tokens is not at most {MAX_SOURCES} sources named like tiers, each a count up to 2^40"
    if not isinstance(seconds, dict) or not all(k in DECOMPOSITION_PARTS and _seconds(v) for k, v in seconds.items()):
        return (
            f"seconds is not the known parts ({', '.join(sorted(DECOMPOSITION_PARTS))}), each a finite, "
            "non-negative number of seconds"
        )
    if not _seconds(total):
        return "server_ttft_s is not a finite, non-negative number"
    return None


NOT_OFFLOAD = ("gpu", "recomputed")
"""The prompt sources that are not an offload tier (``prompt_sources``: every other key names one)."""


def offload_sources(sources: dict[str, int]) -> dict[str, int]:
    """The offload tiers of a record's ``prompt_sources`` that served tokens, and how many each."""
    return {k: v for k, v in sources.items() if k not in NOT_OFFLOAD and v}


def tpot_s(e2e_s: float, ttft_s: float, completion_tokens: float | None) -> float | None:
    """Time per output token after the first, (e2e - TTFT) / (tokens - 1): the one rule of the replay's
    summary and the report's records; None for fewer than two tokens (or none known)."""
    if not completion_tokens or not completion_tokens > 1:  # also False for NaN
        return None
    return (e2e_s - ttft_s) / (completion_tokens - 1)


class Degradation(Section):
    median_pct: float | None
    p95_pct: float | None
    by_turn_median_pct: dict[str, float]
    ttft_s_by_turn_p50: dict[str, float]


class Sessions(Section):
    total: int
    complete: int
    incomplete: int
    error: int


class TurnDecomposition(Section):
    """One turn's requests that carried the server's TTFT decomposition (the sim's response extension)."""

    turn: int
    requests: int
    ttft_s_mean: float  # the client's TTFT
    server_ttft_s_mean: float  # the server's own, the sum of its parts
    seconds_mean: dict[str, float]  # part -> mean seconds (receive, queue, lookup, fetch, recompute, first_decode)
    token_share: dict[str, float]  # source -> the share of these requests' prompt tokens (gpu, a tier, recomputed)


class TtftDecomposition(Section):
    """Where TTFT went, by turn, and whether the parts close on the measured TTFT (docs/metrics.md)."""

    requests: int  # ok requests with the decomposition (0: none: a real vLLM without --engine-log)
    offload_hits: int = 0  # of those, requests an offload tier served
    hits_not_paying: int = 0  # of those, fetch longer than recomputing the tier's tokens at prefill_tokens_per_s
    prefill_tokens_per_s: float | None = None  # Σ recomputed tokens / Σ recompute seconds over the same requests
    # Σ the hits' fetch seconds / Σ the seconds recomputing the tokens the tiers served would have taken (at that
    # rate): above 1, the hits made TTFT worse than no tier ("hits, but the fleet got slower")
    offload_fetch_over_recompute: float | None = None
    dropped: int = 0  # requests whose server sent one that failed its schema or bounds (not counted above)
    closure_within_5pct: float | None  # the share whose parts (the server's, and both transits where measured) sum
    # within 5 % of the client's TTFT
    client_overhead_s_p50: float | None  # client TTFT minus the server's: network, HTTP and the client itself
    closure_server_only_within_5pct: float | None = None  # the same share from the server's parts alone
    transit_measured: int = 0  # requests whose transits were measured (the server's stamps on the client's clock)
    transit_to_server_s_p50: float | None = None  # the client's start to the sim's receipt (client send + loopback)
    transit_to_client_s_p50: float | None = None  # the sim's send of token 0 to the client's read (loopback + parse)
    token_share: dict[str, float]  # over every such request
    by_turn: list[TurnDecomposition]


class OffloadDegradation(Section):
    """Where the offload tier did not serve what it held, from the servers' own counters (docs/metrics.md): the
    silent degradation the placement model warns about, and a store that became a decode dependency."""

    fetch_gate_recomputes: int | None  # the sim: offload hits recomputed because its fetch gate judged them slower
    failed_loads: int | None  # the sim: loads that brought back fewer chunks than the lookup found
    bypassed_lookups: int | None  # the sim: requests recomputed without asking a tier whose breaker was open
    failed_load_blocks: int | None  # kvtier's vLLM backend: block shards whose load failed (vLLM recomputed them)
    degraded_rate: float | None  # (gate + failed + bypassed) / ok requests
    loaded_tokens: float | None  # kvtier's vLLM backend: block shards loaded x block size
    served_tokens: float | None  # vLLM: prompt tokens by source external_kv_transfer
    load_per_served_token: float | None  # loaded / served: 1 when each request loads its prefix once
    decode_dependency: bool | None  # loaded past DECODE_DEPENDENCY_FACTOR x served (None: not measurable)


class EngineJoin(Section):
    """The replay's requests joined to the engine's own records of them (``--engine-log``; docs/metrics.md):
    how many joined, what did not and why, and the join held against the engine's counters over the run."""

    logs: list[str]
    engine_segments: int  # engine starts the logs hold (a header each)
    clean_shutdowns: int  # of those, ended with a footer (its counts of dropped records)
    engine_records: int
    engine_only: int  # engine records no request of this replay names (its warm-up, another client)
    log_dropped: dict[str, int]  # records the engines dropped, by cause (queue, cap, write-error, closed)
    requests_ok: int
    joined_ok: int
    joined_share: float | None  # joined_ok / requests_ok
    unjoined: dict[str, int]  # ok requests with no engine record, by cause
    parts_dropped: dict[str, int]  # joined ok requests with prompt sources but no TTFT parts, by cause
    external_tokens: int  # Σ over every joined request (any status) of the tokens its load planned from kvtier's tiers
    external_tokens_failed: int  # of those, tokens whose blocks failed to load (recomputed)
    external_hits_counter: float | None = None  # vLLM's external_prefix_cache_hits delta over the run
    external_match: bool | None = None  # the two equal
    load_io_s: dict[str, float]  # Σ the tiers' own read time of the joined requests' loads, by tier
    load_io_s_counter: float | None = None  # kvtier:offload_load_io_seconds delta over the run (all tiers)
    load_io_ratio: float | None = None  # Σ load_io_s / the counter
    load_bytes: dict[str, int]
    load_wall_s: float  # Σ the loads' wall time (the workers' first submit to last done, per request)
    queue_s_mean: float | None = None  # mean of queue + lookup + fetch over requests with parts
    vllm_queue_s_mean: float | None = None  # vLLM's request_queue_time mean over the run (queued -> scheduled)
    recompute_s_mean: float | None = None
    vllm_prefill_s_mean: float | None = None  # vLLM's request_prefill_time mean (scheduled -> first token)


class HitRateControl(Section):
    """``--target-hit-rate``: the requests' shape, the primed server's rate over the check, and the measured run's
    (docs/metrics.md): the rate is the server's counters' (prefix-cache + connector hits) / prompt tokens queried."""

    target: float
    tolerance: float
    documents: int
    prefix_tokens: int  # of each request: its shared document
    own_tokens: int  # of each request: its own
    working_set_tokens: int
    primed: int  # requests of the priming pass (every document once)
    checked: int  # requests of the check pass
    check_rate: float | None
    check_local_rate: float | None = None  # the prefix cache's share
    check_external_rate: float | None = None  # the connector's (an offload tier's) share
    check_ok: bool
    problem: str = ""
    rate: float | None = None  # over the measured run
    local_rate: float | None = None
    external_rate: float | None = None
    within: bool | None = None  # the measured rate within the tolerance (None: no counters)


class TwinBand(Section):
    """A replay against a calibrated sim (``kvtier sim --calibration``): the error the twin carries (results/ladder.py
    ``TwinError``, as its /v1/models said) and the TTFT quantiles it measured as the interval that error allows."""

    error: TwinError
    origin: str  # the ladder the twin was calibrated from
    ttft_s: dict[str, tuple[float, float]]  # p50, p95, p99 -> (low, high)


class ReplaySummary(Section):
    requests_total: int
    requests_ok: int
    requests_failed: int  # failed requests: every cause but cut-at-stop (results/outcome.py)
    requests_cut_at_stop: int  # cut by the run's own end (a bound's grace, Ctrl+C): not counted as failed
    failures: dict[str, Failure]  # by cause: {count, first_message, http_status}
    ttft_s: Distribution
    tpot_s_mean: float | None
    e2e_s: Distribution
    input_tokens_per_s: float | None
    output_tokens_per_s: float | None
    requests_per_s: float | None
    client_cached_token_fraction: float | None
    ttft_degradation: Degradation
    sessions: Sessions
    requests_by_replica: dict[str, int]
    ttft_decomposition: TtftDecomposition | None = None  # None only in results written before it was recorded
    offload_degradation: OffloadDegradation | None = None  # None: no scraped server counts any of it
    engine_join: EngineJoin | None = None  # --engine-log: the engine's own records joined
    hit_rate_control: HitRateControl | None = None  # --target-hit-rate
    twin: TwinBand | None = None  # against a calibrated sim: its error carried onto the TTFT


class RatePoint(Section):
    t: float
    rate: float | None


class ScrapeSummary(Section):
    """One scraped server's /metrics over the run (replay/scrape.py: counter deltas, never gauges)."""

    url: str
    samples: int
    scrape_errors: int
    prefix_cache_hit_rate: float | None = None
    prefix_cache_hit_rate_overall: float | None = None
    prefix_cache_hit_rate_series: list[RatePoint] | None = None
    external_prefix_cache_hit_rate: float | None = None
    external_prefix_cache_hit_rate_overall: float | None = None
    external_prefix_cache_hit_rate_series: list[RatePoint] | None = None
    lmcache_lookup_hit_rate: float | None = None
    lmcache_lookup_hit_rate_overall: float | None = None
    lmcache_lookup_hit_rate_series: list[RatePoint] | None = None
    external_prefix_cache_queries: float | None = None
    external_prefix_cache_hits: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    # the offload tier's own counters (LMCache MP names), whole-run deltas; gauges as the most seen
    lmcache_lookup_requested_tokens: float | None = None
    lmcache_lookup_hit_tokens: float | None = None
    lmcache_lookup_hit_l1_tokens: float | None = None
    lmcache_lookup_hit_l2_tokens: float | None = None
    lmcache_chunks_loaded: float | None = None
    lmcache_chunks_stored: float | None = None
    lmcache_l1_usage_bytes_max: float | None = None
    lmcache_l2_usage_bytes_max: float | None = None
    lmcache_l1_evicted_chunks_max: float | None = None
    # vLLM's offloading connector (its own offload, or kvtier's spec): whole-run deltas
    kv_offload_load_bytes: float | None = None
    kv_offload_load_time_s: float | None = None
    kv_offload_store_bytes: float | None = None
    kv_offload_store_time_s: float | None = None
    # prompt tokens by where their KV came from (vLLM: local_compute, local_cache_hit, external_kv_transfer), and
    # the cached ones by tier (device, host, disk, ...; a load that then failed is counted there, not in by_source)
    prompt_tokens_by_source: dict[str, float] | None = None
    prompt_tokens_cached_by_source: dict[str, float] | None = None
    # kvtier's vLLM backend: block shards loaded per tier, failed loads (recomputed) and failed stores
    kvtier_offload_loaded_blocks: dict[str, float] | None = None
    kvtier_offload_load_io_s: dict[str, float] | None = None  # the tiers' own read time of the blocks loaded, by tier
    kvtier_offload_failed_loads: float | None = None
    kvtier_offload_failed_stores: float | None = None
    kvtier_offload_server_errors: float | None = None  # scheduler calls a shared store did not answer
    kvtier_offload_shared_found_blocks: float | None = None  # blocks a shared Redis/S3 namespace held for it (others')
    # a shared kvtier cache-server (kvtier cache-server): blocks loaded by a replica other than the one that stored them
    kvtier_shared_cross_replica_loads: float | None = None
    # the sim's offload degradation (kvtier sim): fetch-gate recomputes, loads that came back short, bypassed lookups
    sim_fetch_gate_recomputes: float | None = None
    sim_offload_failed_loads: float | None = None
    sim_offload_bypassed: float | None = None
    block_size: int | None = None  # vllm:cache_config_info's block_size (tokens a block, or a kvtier shard, holds)
    kv_cache_usage_perc_mean: float | None = None
    prefill_time_s_mean: float | None = None
    queue_time_s_mean: float | None = None
    ttft_server_s_mean: float | None = None


class Concurrency(Section):
    requested: int
    achieved: int
    virtual_users: int


class DatasetInfo(Section):
    path: str
    format: str
    sessions: int
    virtual_users: int
    tokenizer: str
    agentic_tool_names: list[str]
    notes: list[str] = []  # how each file's variant was read (agent traces: time units, sessions)


class ServerIdentity(Section):
    models: Any
    replica: str | None
    max_model_len: int | None = None  # the served model's, from GET /models (vLLM and the sim say it)
    launch: dict[str, Any] | None = None  # set by kvtier launch: profile, engine versions, devices, sizes, policies


class ReuseWorkingSetPoint(Section):
    """The distinct KV the dataset's first ``requests`` requests hold (replay/reuse.py)."""

    requests: int = Field(ge=0)
    tokens: int = Field(ge=0)
    bytes: int | None = Field(default=None, ge=0)


class ReuseOpportunity(Section):
    """What the dataset's prompts share, before any request (replay/reuse.py; docs/metrics.md)."""

    block_tokens: int
    requests: int
    prompt_tokens: int
    history_reuse_tokens: int
    cross_session_reuse_tokens: int
    new_tokens: int
    history_reuse_fraction: float | None
    cross_session_reuse_fraction: float | None
    new_fraction: float | None
    kv_bytes_per_token: int | None
    kv_model: str | None = None
    session_max_prompt_tokens: dict[str, float | int | None]
    kv_bytes_per_session: dict[str, int] | None
    working_set: list[ReuseWorkingSetPoint]


class HostCpu(Section):
    """The host CPU's busy share over the replay (/proc/stat: not idle, not iowait), and its timeline."""

    code: str | None  # None when sampled; proc-stat-unreadable otherwise (figures null)
    utilization: float | None
    timeline: list[dict[str, float | None]]


class Hardware(Section):
    """What the methodology asks a serving run to record of the hardware while it runs: the host CPU, and
    per GPU power, utilisation and memory where NVML answers (nulls with a code where it does not)."""

    host_cpu: HostCpu
    gpu: GpuTelemetry


class ReplayResult(Envelope):
    """One ``kvtier replay`` run (summary.json)."""

    @model_validator(mode="before")
    @classmethod
    def _synthetic_format(cls, data: Any) -> Any:
        """Results of ``replay --synthetic`` written before the fix recorded ``dataset_format: synthetic``,
        which is no value of the flag: read them as ``auto`` (``dataset.format`` keeps "synthetic")."""
        cfg = data.get("config") if isinstance(data, dict) else None
        if isinstance(cfg, dict) and cfg.get("dataset_format") == "synthetic":
            data = {**data, "config": {**cfg, "dataset_format": "auto"}}
        return data

    benchmark: Literal["kvtier replay"] = "kvtier replay"
    wall_s: float
    dataset: DatasetInfo
    concurrency: Concurrency
    server: ServerIdentity
    summary: ReplaySummary
    server_metrics: list[ScrapeSummary]
    config: ReplayConfig
    reuse_opportunity: ReuseOpportunity | None = None  # None only in results written before it was computed
    ranks: list[dict[str, Any]] | None = None  # MPI runs: one line per rank (replay/mpi.py)
    lost_ranks: list[int] | None = None  # MPI runs: ranks whose records never reached rank 0
    hardware: Hardware | None = None  # None only in results written before it was recorded


def server_metrics_of(path: Path) -> list[ScrapeSummary]:
    """The scraped servers' counters of a replay's summary.json, typed, without validating the rest of the result
    (kvtier launch --arms pools them over an arm's launches); a DatasetError names the file and the field."""
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path}: not a JSON replay summary ({e})") from None
    section = raw.get("server_metrics") if isinstance(raw, dict) else None
    try:
        return TypeAdapter(list[ScrapeSummary]).validate_python(section or [])
    except ValidationError as e:
        err = e.errors()[0]
        raise DatasetError(f"{path}: server_metrics.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None


__all__ = [
    "server_metrics_of",
    "ReuseOpportunity",
    "ReplayResult",
    "ReplaySummary",
    "ScrapeSummary",
    "Distribution",
    "DatasetInfo",
]
