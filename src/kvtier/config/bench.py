"""Configuration of ``kvtier bench``: the MLPerf flags (same names, same defaults) and the YAML.

Two models:
* ``Tuning`` mirrors the reference's config.yaml layout (user_templates, qos_profiles, eviction,
  decode, model_configs, ...). A partial YAML file merges over the defaults; unknown keys and bad
  values are errors that name the key path (``eviction.target_usage_ratio: ...``). Every key takes
  effect; the two sections kvtier does not implement (``gpu_backend``, ``saturation_detection``)
  are refused when given, never ignored.
* ``BenchConfig`` holds the command-line flags plus the tuning; it is what a result file embeds,
  and ``BenchConfig.model_validate(result["config"])`` re-creates the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from kvtier.config.base import StrictModel as _Strict
from kvtier.config.base import deep_merge, flag, load_yaml, max_failure_rate_flag, validate_config
from kvtier.config.tiers import REMOTE, TierFlags, parse_tier_order
from kvtier.errors import ConfigError

QoSClass = Literal["interactive", "responsive", "batch"]


class Range(_Strict):
    """An inclusive [low, high] range, written in YAML as a two-element list."""

    low: float
    high: float

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            if len(v) != 2:
                raise ValueError(f"expected [low, high], got {list(v)}")
            return {"low": v[0], "high": v[1]}
        return v

    @model_validator(mode="after")
    def _ordered(self) -> Range:
        if self.low < 0 or self.high < self.low:
            raise ValueError(f"expected 0 <= low <= high, got [{self.low}, {self.high}]")
        return self


class UserTemplate(_Strict):
    context_range: Range
    generation_range: Range
    think_time_range: Range


def _default_templates() -> dict[Literal["chatbot", "coding", "document"], UserTemplate]:
    # MLPerf KV Cache spec section 4.1: tokens, tokens, seconds.
    raw: dict[Literal["chatbot", "coding", "document"], tuple[list[float], list[float], list[float]]] = {
        "chatbot": ([512, 4096], [50, 200], [0.1, 0.5]),
        "coding": ([4096, 25000], [100, 500], [0.2, 1.0]),
        "document": ([4096, 16384], [200, 800], [0.3, 1.5]),
    }
    return {
        k: UserTemplate(
            context_range=Range(low=c[0], high=c[1]),
            generation_range=Range(low=g[0], high=g[1]),
            think_time_range=Range(low=t[0], high=t[1]),
        )
        for k, (c, g, t) in raw.items()
    }


class GenerationTiming(_Strict):
    """Seconds of simulated GPU work per generated token, per --generation-mode."""

    none: float = Field(0.0, ge=0)
    fast: float = Field(0.002, ge=0)
    realistic: float = Field(0.030, ge=0)


class QoSProfile(_Strict):
    target_latency_p95_ms: float = Field(gt=0)
    target_latency_p99_ms: float = Field(gt=0)
    target_latency_p999_ms: float = Field(gt=0)
    target_latency_p9999_ms: float = Field(gt=0)
    priority: int = Field(ge=0)


def _default_qos() -> dict[QoSClass, QoSProfile]:
    rows: dict[QoSClass, tuple[float, float, float, float, int]] = {
        "interactive": (50, 100, 150, 200, 3),
        "responsive": (100, 200, 350, 500, 2),
        "batch": (1000, 5000, 7500, 10000, 1),
    }
    return {
        k: QoSProfile(
            target_latency_p95_ms=a,
            target_latency_p99_ms=b,
            target_latency_p999_ms=c,
            target_latency_p9999_ms=d,
            priority=p,
        )
        for k, (a, b, c, d, p) in rows.items()
    }


class QoSDistribution(_Strict):
    """A user is interactive with probability p, responsive below the threshold, else batch."""

    interactive_probability: float = Field(0.15, ge=0, le=1)
    responsive_threshold: float = Field(0.50, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> QoSDistribution:
        if self.responsive_threshold < self.interactive_probability:
            raise ValueError("responsive_threshold must be >= interactive_probability")
        return self


class Eviction(_Strict):
    """The waterfall's room-making rules (engine/tiered.py). One reservation evicts at most
    min(max_evictions_hard_cap, max(max_evictions_min, entries in the tier + 100)) victims, as the
    reference bounds one ensure-space call; past that the entry tries the next tier. ``reserve_wait_s`` is
    kvtier's: how long a write waits when all of a tier's room is held by writes in flight or entries in use
    (a request's own entry until its decode reads end) before it takes the next tier."""

    target_usage_ratio: float = Field(0.8, gt=0, le=1)
    large_entry_limit_ratio: float = Field(0.95, gt=0, le=1)
    max_recursion_depth: int = Field(10, ge=1)
    max_evictions_hard_cap: int = Field(5000, ge=1)
    max_evictions_min: int = Field(1000, ge=1)
    reserve_wait_s: float = Field(10.0, ge=0)


class Decode(_Strict):
    batch_size: int = Field(32, ge=1)


class ConversationTuning(_Strict):
    """Multi-turn conversations (see workload/conversations.py). The first three keys are the
    reference's, with its defaults; ``max_context_tokens`` is kvtier's."""

    max_conversations: int = Field(1000, ge=1, description="conversations whose metadata is kept (LRU)")
    max_turns_per_conv: int = Field(50, ge=1, description="turns after which a conversation ends")
    end_conversation_probability: float = Field(0.2, ge=0, le=1, description="chance a conversation ends after a turn")
    max_context_tokens: int = Field(131072, ge=1, description="kvtier: a conversation ends at this many tokens")


class PrefixCacheTuning(_Strict):
    """Shared system prompts (see workload/conversations.py). The first three keys are the
    reference's, with its defaults; the last two are kvtier's."""

    min_prefix_length: int = Field(
        50, ge=0, description="tokens a system prompt needs to be cached as a shared prefix; shorter ones are context"
    )
    max_prefix_entries: int = Field(1000, ge=1, description="distinct shared prefixes in use at most")
    system_prompt_hit_probability: float = Field(
        0.2, ge=0, le=1, description="share of conversations that open with a shared system prompt"
    )
    num_system_prompts: int = Field(8, ge=1, description="kvtier: distinct shared system prompts")
    system_prompt_tokens: Range = Field(
        default_factory=lambda: Range(low=256, high=2048), description="kvtier: their lengths, tokens"
    )


RetrievalDistribution = Literal["zipfian", "uniform", "random"]


class RagTuning(_Strict):
    """RAG corpus and queries (see workload/rag.py); the reference's keys and defaults."""

    chunk_size_tokens: int = Field(512, ge=1, description="tokens per document chunk (one KV entry)")
    top_k_chunks: int = Field(5, ge=1, description="chunks a query retrieves (--rag-top-k overrides)")
    max_chunk_bytes: int = Field(256 * 1024**2, ge=1, description="a chunk holds at most this many KV bytes")
    request_probability: float = Field(0.1, ge=0, le=1, description="chance a request is a RAG query")
    retrieval_distribution: RetrievalDistribution = Field(
        "zipfian", description="chunk choice within a document: zipfian (earlier chunks likelier) or uniform/random"
    )
    max_documents: int = Field(0, ge=0, description="documents kept; older ones are evicted at ingest (0 = all)")
    large_model_doc_tokens_min: int = Field(
        1024, ge=1, description="document length, models with hidden_dim >= 8192 or >= 64 layers"
    )
    large_model_doc_tokens_max: int = Field(4096, ge=1)
    small_model_doc_tokens_min: int = Field(4000, ge=1, description="document length, other models")
    small_model_doc_tokens_max: int = Field(12000, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> RagTuning:
        for size in ("large", "small"):
            lo, hi = getattr(self, f"{size}_model_doc_tokens_min"), getattr(self, f"{size}_model_doc_tokens_max")
            if hi < lo:
                raise ValueError(f"{size}_model_doc_tokens_max ({hi}) is below {size}_model_doc_tokens_min ({lo})")
        return self


class AutoscalerTuning(_Strict):
    """Autoscaling of live users (see bench/autoscale.py). The first five keys are the reference's,
    with its defaults; the last three are kvtier's."""

    min_users: int = Field(1, ge=1)
    max_users: int = Field(10000, ge=1)
    scale_up_factor: float = Field(1.2, gt=1, description="qos: users x this when scaling up")
    scale_down_factor: float = Field(0.8, gt=0, lt=1, description="qos: users x this when scaling down")
    consecutive_samples_required: int = Field(
        2, ge=1, description="qos: samples in a row past the band before the users change"
    )
    interval_s: float = Field(5.0, gt=0, description="kvtier: seconds per sample")
    cooldown_s: float = Field(10.0, ge=0, description="kvtier: seconds after a change before the next one")
    growth_fast: float = Field(
        0.2, gt=0, description="kvtier, capacity mode: growth above this doubles users, below x1.5"
    )


class GpuBackendTuning(_Strict):
    """The GPU tier's device memory (engine/gpu.py); the reference's keys and defaults."""

    memory_fraction: float = Field(0.9, gt=0, le=1, description="share of the device's memory the process may use")
    max_eviction_attempts: int = Field(
        100, ge=0, description="the reference's out-of-memory retries; kvtier reserves the tier up front (no effect)"
    )
    free_memory_threshold: float = Field(0.1, ge=0, lt=1, description="share of the device's memory kept free")


class SaturationDetection(_Strict):
    """Storage saturation thresholds of the qos autoscaler (bench/autoscale.py); the reference's keys."""

    read_latency_p95_threshold_ms: float = Field(100, gt=0)
    write_latency_p95_threshold_ms: float = Field(50, gt=0)
    queue_depth_threshold: int = Field(100, ge=1)
    history_window_size: int = Field(10, ge=1, description="samples the storage p95s are taken over")


class ModelEntry(_Strict):
    """A model in the reference's layout (head_dim = hidden_dim / num_heads unless given)."""

    name: str | None = None
    num_layers: int = Field(gt=0)
    hidden_dim: int = Field(0, ge=0)
    num_heads: int = Field(0, ge=0)
    kv_heads: int = Field(0, ge=0)
    dtype: str = "float16"
    kv_dim_per_head: int = Field(0, ge=0)
    head_dim: int = Field(0, ge=0)
    attention_type: Literal["mha", "gqa", "mla"] | None = None
    kv_lora_rank: int = Field(0, ge=0)
    qk_rope_head_dim: int = Field(0, ge=0)


class ShareGPTTuning(_Strict):
    """ShareGPT replay (``--dataset-path``): per-turn token caps and the fallback token estimate.
    0 means no cap."""

    max_context_tokens: int = Field(0, ge=0, description="cap on a turn's user (context) tokens; 0 = none")
    max_generation_tokens: int = Field(0, ge=0, description="cap on a turn's reply tokens; 0 = none")
    chars_per_token_estimate: int = Field(4, ge=1, description="characters per token when tiktoken is absent")


class ValidationLimits(_Strict):
    """Upper bounds on flag values, checked before anything starts (the reference's names)."""

    max_users: int = Field(100_000, ge=1)
    max_duration_seconds: float = Field(86_400, gt=0)
    max_gpu_memory_gb: float = Field(1024, ge=0)
    max_cpu_memory_gb: float = Field(16_384, ge=0)


class Tuning(_Strict):
    """The reference config.yaml layout: every key of the reference's file, with its default, plus
    kvtier's own keys (marked "kvtier" in their descriptions). Every key takes effect."""

    user_templates: dict[Literal["chatbot", "coding", "document"], UserTemplate] = Field(
        default_factory=_default_templates, min_length=1
    )
    generation_timing: GenerationTiming = Field(default_factory=GenerationTiming)
    qos_profiles: dict[QoSClass, QoSProfile] = Field(default_factory=_default_qos)
    qos_distribution: QoSDistribution = Field(default_factory=QoSDistribution)
    eviction: Eviction = Field(default_factory=Eviction)
    decode: Decode = Field(default_factory=Decode)
    model_configs: dict[str, ModelEntry] = Field(default_factory=dict)
    conversation: ConversationTuning = Field(default_factory=ConversationTuning)
    prefix_cache: PrefixCacheTuning = Field(default_factory=PrefixCacheTuning)
    rag: RagTuning = Field(default_factory=RagTuning)
    autoscaler: AutoscalerTuning = Field(default_factory=AutoscalerTuning)
    sharegpt: ShareGPTTuning = Field(default_factory=ShareGPTTuning)
    validation_limits: ValidationLimits = Field(default_factory=ValidationLimits)
    gpu_backend: GpuBackendTuning = Field(default_factory=GpuBackendTuning)
    saturation_detection: SaturationDetection = Field(default_factory=SaturationDetection)


def load_tuning(path: str | Path | None) -> Tuning:
    """Defaults, with the YAML file (if any) merged over them."""
    if path is None:
        return Tuning()
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"--config: cannot read {p}: {e.strerror}") from e
    try:
        raw = load_yaml(text, str(p))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    # Ranges dump as dicts; a [low, high] list in the file replaces one whole.
    merged = deep_merge(Tuning().model_dump(mode="python"), raw)
    return validate_config(Tuning, merged, source=str(p), flags=False)


GenerationMode = Literal["none", "fast", "realistic"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
ADDITIONS = "kvtier additions"


class BenchConfig(TierFlags):
    """Every input of one ``kvtier bench`` run. Field names are the flag names with underscores;
    descriptions are the ``--help`` text."""

    model: str = flag("llama3.1-8b", "model from the catalog or --config model_configs")
    num_users: int = flag(100, "simulated users", aliases=("--num_users",), ge=1, le=100_000)
    duration: float = flag(60, "seconds of load", gt=0)
    gpu_mem_gb: float = flag(
        16,
        "GPU tier per GPU, GB (without a CUDA device the tier is off, with a warning)",
        aliases=("--gpu_mem_gb",),
        ge=0,
    )
    num_gpus: int = flag(1, "GPUs whose memory forms the GPU tier", ge=1)
    tensor_parallel: int = flag(
        1, "tensor-parallel degree: each entry is one rank's share (KV heads split, MLA latent whole)", ge=1
    )
    cpu_mem_gb: float = flag(32, "CPU RAM tier, GB", aliases=("--cpu_mem_gb",), ge=0)
    cpu_page_mb: float = flag(
        0,
        "CPU tier page, MiB: entries are lists of pages, so the tier never fragments (0 = 256 tokens of the "
        "model's KV per rank, LMCache's chunk; rounded to 4 KiB or 2 MiB, at most 1/16 of the tier)",
        ge=0,
    )
    cache_dir: str | None = flag(None, "directory of the storage tier (default: a new temporary directory)")
    generation_mode: GenerationMode = flag(
        "realistic", "simulated GPU time per generated token: generation_timing none / fast / realistic (0 / 2 / 30 ms)"
    )
    performance_profile: Literal["latency", "throughput"] = flag(
        "latency",
        "pass/fail criteria in summary.cache_stats.storage_health: latency (storage p95 targets, "
        "CPU p95, hit rate) or throughput (storage bandwidth > 0)",
    )
    disable_multi_turn: bool = flag(False, "every request starts a new conversation")
    disable_prefix_caching: bool = flag(False, "no shared system prompts")
    enable_rag: bool = flag(False, "RAG queries read retrieved document chunks before their first token")
    rag_num_docs: int = flag(10, "documents in the RAG corpus", ge=1)
    rag_top_k: int = flag(0, "chunks a RAG query retrieves (0 = config rag.top_k_chunks, 5)", ge=0)
    enable_autoscaling: bool = flag(False, "change the number of live users while the run lasts")
    autoscaler_mode: Literal["qos", "capacity"] = flag(
        "qos", "qos: hold p95 latency at the target saturation; capacity: grow users until throughput falls"
    )
    target_saturation: float = flag(0.8, "qos autoscaler target: worst class p95 / its target", gt=0, le=1)
    autoscaler_algorithm: Literal["reference", "kvtier"] = flag(
        "reference",
        "the reference's autoscaler (qos: a x0.9/x1.1 band, up x1.2, down x0.8 after two samples above, a "
        "3-sample cooldown; capacity: +40 %, then +20 % while it gains 1 %, stop after two samples without; "
        "users at most 500), or kvtier's own search (bench/autoscale.py)",
        group=ADDITIONS,
    )
    use_burst_trace: bool = flag(False, "replay the BurstGPT trace at --burst-trace-path")
    burst_trace_path: str = flag(
        "BurstGPT/data/BurstGPT_1.csv", "BurstGPT CSV file or directory (with --use-burst-trace)"
    )
    validation_trace: str | None = flag(
        None,
        "real trace (Azure, BurstGPT, Mooncake; format detected) to compare the run's request sizes and "
        "inter-arrival times against: KS and relative Wasserstein distances in the result's 'validation'",
        metavar="PATH",
    )
    dataset_path: str | None = flag(None, "ShareGPT JSON file: replay its conversations turn by turn")
    max_conversations: int = flag(500, "conversations read from the --dataset-path file", ge=1)
    output: str | None = flag(None, "result JSON path (CLI default ./kvtier_bench_<timestamp>.json)")
    seed: int | None = flag(None, "seed of users, requests and data (default: random, recorded in the result)")
    max_concurrent_allocs: int = flag(
        0,
        "writes in flight at most, the reference's allocation semaphore (0 = no bound); the I/O workers are one "
        "per user, at most 500, as the reference's, their buffers sharing --io-buffer-budget-mb (--alloc-bound "
        "all-io: this many workers instead)",
        ge=0,
    )
    request_rate: float = flag(0, "global cap on submitted requests per second (0 = none)", ge=0)
    arrival: Literal["open", "closed"] = flag(
        "open",
        "open: each user thinks, then queues its next request whether or not its last one finished (the "
        "reference's load); closed: a user's next request waits for its last one to end",
        group=ADDITIONS,
    )
    max_queued: int = flag(
        0,
        "requests waiting for a worker at most (0 = 4 x workers); an open-loop request that finds the queue full "
        "is dropped and counted with its would-be bytes",
        group=ADDITIONS,
        ge=0,
    )
    alloc_bound: Literal["writes", "all-io"] = flag(
        "writes",
        "what --max-concurrent-allocs bounds: writes only, reads running on every worker (the reference's "
        "allocation semaphore; workers = min(users, 500)); or all-io, the workers themselves (kvtier's "
        "earlier bound)",
        group=ADDITIONS,
    )
    max_requests: int = flag(
        0, "stop after this many requests did their work (failed ones do not count; 0 = none)", ge=0
    )
    max_failure_rate: float = max_failure_rate_flag(group=ADDITIONS)
    xlsx_output: str | None = flag(None, "also write the result as XLSX")
    request_log: str | None = flag(
        None,
        "write one JSON line per request to FILE (under MPI each rank r writes <stem>.rank_<r>.jsonl; "
        "fields in docs/metrics.md)",
        group=ADDITIONS,
        metavar="FILE",
    )
    config: str | None = flag(None, "YAML in the reference config.yaml layout, merged over the defaults")
    storage_capacity_gb: float = flag(
        0, "storage tier capacity, GB (0 = 95% of the free space detected, as the reference)", ge=0
    )
    precondition: bool = flag(False, "write the storage device towards steady state before the run")
    precondition_size_gb: float = flag(
        0, "GB to write when preconditioning (0 = twice the storage tier's capacity)", ge=0
    )
    precondition_threads: int = flag(0, "writer threads when preconditioning (0 = the CPU count)", ge=0)
    trace_speedup: float = flag(1.0, "trace replay: arrival times divided by this (0 = as fast as possible)", ge=0)
    replay_cycles: int = flag(0, "trace or dataset replay passes (0 = repeat until the run ends)", ge=0)
    prefill_only: bool = flag(False, "prefill node: never decode")
    decode_only: bool = flag(False, "decode node: write num_users x 10 entries first, then only read them")
    io_trace_log: str | None = flag(
        None,
        "trace mode: run the whole workload but move no bytes; write one CSV row per KV operation "
        "(Timestamp,Operation,Object_Size_Bytes,Tier,Key,Phase) to PATH (.zst: zstd-compressed)",
        metavar="PATH",
    )
    enable_latency_tracing: bool = flag(
        False,
        "block-layer latency histograms (queue, device, total; request sizes) of the storage tier's devices with "
        "bpftrace while the load runs; without bpftrace or root the run goes on, with a warning",
    )
    log_level: LogLevel = flag("INFO", "Python logging level of kvtier's messages on stderr")
    # kvtier additions
    direct_io: Literal["auto", "on", "off"] = flag(
        "auto", "O_DIRECT for the storage tier: auto (use where supported), on (error if not), off", group=ADDITIONS
    )
    promotion: Literal["none", "on-read"] = flag("none", "move hits back to the fastest tier", group=ADDITIONS)
    keep_cache: bool = flag(False, "leave entry files at exit", group=ADDITIONS)
    keep_stale: bool = flag(
        False,
        "leave the run folders of killed kvtier runs in --cache-dir (only warn); by default they are removed at start",
        group=ADDITIONS,
    )
    tier_order: str | None = flag(
        None,
        "the waterfall, fastest first, e.g. gpu,cpu,redis,storage,s3 (default: that order, of the tiers configured)",
        group=REMOTE,
        metavar="LIST",
    )
    s3_cold_threshold: float | None = flag(
        None,
        "fill ratio of the file tier past which its least recently used entries are demoted to S3 "
        "(default: eviction.target_usage_ratio)",
        group=REMOTE,
        gt=0,
        le=1,
    )
    gds: Literal["auto", "on", "off"] = flag(
        "auto",
        "GPUDirect Storage (kvikio/cuFile) for the file tier: auto (where a CUDA device and cuFile exist), "
        "on (error if not), off; the choice is recorded in storage.gds",
        group=REMOTE,
    )
    gpu_native: bool = flag(
        False,
        "KV made in and read back into GPU memory (needs torch and a CUDA device): entries stamped on the device, "
        "the GPU tier device to device, GPU -> file through cuFile where --gds is used (else one pinned host "
        "buffer), reads landing in device memory; each byte's path in storage.gpu_native",
        group=ADDITIONS,
    )
    io_chunk_mb: int = flag(64, "bytes per I/O call and per-worker buffer, MiB", group=ADDITIONS, ge=1, le=4096)
    io_buffer_budget_mb: int = flag(
        1024,
        "all workers' I/O buffers together, MiB: with many workers each buffer is this / workers "
        "(at least 1 MiB) instead of --io-chunk-mb",
        group=ADDITIONS,
        ge=1,
    )
    noise_mb: int = flag(256, "static noise buffer the entries are copied from, MiB", group=ADDITIONS, ge=1, le=65536)
    payload: Literal["unique", "realistic"] = flag(
        "unique",
        "the data written: random bytes no array can deduplicate or compress (unique), or float16 KV-like values "
        "that compress a little, as real KV does (realistic); both stamped so no 4 KiB block repeats",
        group=ADDITIONS,
    )
    progress: Literal["auto", "live", "plain", "none"] = flag(
        "auto", "live table on a terminal (auto), plain lines, or nothing", group=ADDITIONS
    )
    progress_interval: float = flag(5.0, "seconds between progress updates", group=ADDITIONS, gt=0)
    device_interval: float = flag(
        1.0, "seconds between samples of the storage device's /proc/diskstats (result: device)", group=ADDITIONS, gt=0
    )
    num_clients: int = flag(
        1,
        "run N client processes on this host as one run: kvtier starts mpirun -np N itself (under mpirun, "
        "each rank is one client; see docs/bench.md 'Many processes and hosts (MPI)')",
        group=ADDITIONS,
        ge=1,
        le=1024,
    )
    mpi_timeout: float = flag(
        600.0,
        "MPI runs: seconds a rank waits for the others at set-up and for results at the end before it counts them lost",
        group=ADDITIONS,
        gt=0,
    )
    kv_layout: Literal["entry", "chunked"] = flag(
        "entry",
        "entry: one entry per turn (reference); chunked: prefix-chained token chunks (vLLM/LMCache)",
        group=ADDITIONS,
    )
    kv_chunk_tokens: int = flag(256, "tokens per chunk with --kv-layout chunked", group=ADDITIONS, ge=1, le=1 << 20)
    trace_path: str | None = flag(
        None, "replay a request trace: BurstGPT or Azure CSV, Mooncake JSONL (file or directory)", group=ADDITIONS
    )
    trace_format: Literal["auto", "burstgpt", "azure", "mooncake"] = flag(
        "auto", "format of --trace-path", group=ADDITIONS
    )
    tuning: Tuning = Field(
        default_factory=Tuning,
        description="the YAML layout (loaded from --config when not given)",
        json_schema_extra={"cli": False},
    )

    @model_validator(mode="before")
    @classmethod
    def _load_yaml(cls, data: Any) -> Any:
        """``config`` names a YAML file: load it into ``tuning`` unless the tuning is given (a
        result file carries both, and then the embedded tuning wins: the run is self-contained)."""
        if isinstance(data, dict) and data.get("config") and "tuning" not in data:
            return {**data, "tuning": load_tuning(data["config"])}
        return data

    @field_validator("model")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> BenchConfig:
        if self.prefill_only and self.decode_only:
            raise ValueError("--prefill-only and --decode-only are mutually exclusive")
        if self.shared_namespace is not None:
            if not (self.redis_url or self.s3_bucket):
                raise ValueError(
                    f"--remote-namespace {self.remote_namespace}: needs a remote tier (--redis-url, --s3-bucket)"
                )
            for on, what in ((self.enable_rag, "--enable-rag"), (self.decode_only, "--decode-only")):
                if on:  # their keys (RAG documents, prepopulated entries) do not name their content across seeds
                    raise ValueError(
                        f"{what} with --remote-namespace {self.remote_namespace}: not supported (its keys "
                        "name content only within one seed, so ranks and runs would overwrite each other)"
                    )
        lim = self.tuning.validation_limits
        checks = [
            ("--num-users", self.num_users, lim.max_users),
            ("--duration", self.duration, lim.max_duration_seconds),
            ("--gpu-mem-gb", self.gpu_mem_gb, lim.max_gpu_memory_gb),
            ("--cpu-mem-gb", self.cpu_mem_gb, lim.max_cpu_memory_gb),
        ]
        for flag_, value, limit in checks:
            if value > limit:
                raise ValueError(f"{flag_} {value:g} exceeds validation_limits ({limit:g})")
        if self.gpu_native and self.io_trace_log:
            raise ValueError(
                "--gpu-native with --io-trace-log: trace mode moves no bytes, so there is none to make on the GPU"
            )
        if self.gpu_native and self.shared_namespace is not None:
            raise ValueError(  # another writer's entry is read through read_shared into host memory only
                f"--gpu-native with --remote-namespace {self.remote_namespace}: not supported (a cross-writer hit "
                "is read into host memory, not device memory)"
            )
        if self.s3_cold_threshold is not None and not self.s3_bucket:
            raise ValueError("--s3-cold-threshold needs the S3 tier (--s3-bucket)")
        try:
            parse_tier_order(self.tier_order, self.configured_tiers())
        except ValueError as e:
            raise ValueError(f"--tier-order {self.tier_order}: {e}") from None
        return self

    def configured_tiers(self) -> list[str]:
        """The tiers the flags ask for (the GPU tier even where no device will be found)."""
        from kvtier.tiers import configured_kinds

        return configured_kinds(self)
