"""Configuration of ``kvtier bench``: the MLPerf flags (same names, same defaults) and the YAML.

``BenchConfig`` holds the command-line flags plus the tuning (config/tuning.py: the reference's config.yaml); it is
what a result file embeds, and ``BenchConfig.model_validate(result["config"])`` re-creates the run.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from kvtier.config.base import flag, max_failure_rate_flag
from kvtier.config.tiers import REMOTE, TierFlags, parse_tier_order
from kvtier.config.tuning import Tuning, load_tuning

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
