"""Configuration of ``kvtier replay``: recorded sessions against an OpenAI-compatible server."""

from __future__ import annotations

from typing import Literal

from pydantic import field_validator, model_validator

from kvtier.config.base import StrictModel, flag, max_failure_rate_flag

DatasetFormat = Literal["auto", "agent-trace", "tau2", "sharegpt", "agentic-traces", "jsonl"]
EventLoopKind = Literal["auto", "uvloop", "asyncio"]


class ReplayConfig(StrictModel):
    """Every input of one ``kvtier replay`` run (field = flag with underscores, description = help).

    ``base_url``, ``model`` and ``dataset`` are required to run; ``kvtier launch`` leaves
    ``base_url``, ``output`` and ``metrics_url`` empty and fills them for the processes it starts.
    In a result file the config is the effective one: ``auto`` choices are replaced by what ran."""

    base_url: str | None = flag(None, "server's OpenAI API root, e.g. http://127.0.0.1:8000/v1")
    model: str | None = flag(None, "model name sent in each request (the server's served model name)")
    dataset: str | None = flag(None, "file or folder of recorded sessions")
    dataset_format: DatasetFormat = flag("auto", "format of --dataset (auto: detected per file)")
    tokenizer: str = flag(
        "auto",
        "counts prompts and recorded output text (max_tokens where a dataset has no counts): auto, tiktoken, "
        "chars, or hf:DIR — the served model's own tokenizer.json (kvtier launch passes the folder it serves)",
        pattern=r"^(auto|tiktoken|chars|hf:.+)$",
    )
    max_tokens_cap: int | None = flag(
        None,
        "cap every request's max_tokens at N (recorded replies longer than N are cut; prompts keep the recorded "
        "history): for slow servers such as a CPU build, where decode, not the cache, would take the run's time",
        ge=1,
    )
    agentic_tools: bool = flag(False, "gpt-oss mode: send a tools schema naming every function the traces call")
    num_rounds: int = flag(5, "turns per virtual user (with --synthetic: --turns unless given)", ge=1)
    synthetic: bool = flag(False, "synthetic sessions instead of --dataset: --users x --turns, --isl/--osl tokens")
    users: int = flag(8, "--synthetic: sessions", ge=1, le=100_000)
    turns: int = flag(5, "--synthetic: turns per session", ge=1, le=10_000)
    isl: int = flag(512, "--synthetic: new input tokens per turn", ge=1, le=1_000_000)
    osl: int = flag(
        128, "--synthetic: output tokens per turn (max_tokens, and the recorded reply's length)", ge=1, le=1_000_000
    )
    shared_prefix: int = flag(0, "--synthetic: tokens of a system prompt every session shares", ge=0, le=10_000_000)
    synthetic_seed: int = flag(0, "--synthetic: seed of the words")
    target_hit_rate: float | None = flag(
        None,
        "--synthetic: each request a shared document of R x --isl tokens (one of --working-set's) then its own "
        "tokens, so R of its prompt can be served from cache; the server is primed, the rate its counters give is "
        "checked before measuring, and a run that drifts from it is not complete",
        ge=0,
        le=0.98,
    )
    working_set: int = flag(
        0,
        "--target-hit-rate: tokens the caches take in between two uses of a document (documents x --isl: each "
        "request's own tokens are cached too); sized above the GPU cache and within a tier, the hits come from that "
        "tier; 0: one document per virtual user",
        ge=0,
        le=10_000_000_000,
    )
    hit_rate_tolerance: float = flag(0.02, "--target-hit-rate: how far the counters' rate may be from it", gt=0, le=0.5)
    min_chunk_rounds: int = flag(
        5, "sessions of fewer turns than this give no user (the KV offload methodology's 5; 0 = any)", ge=0
    )
    user_order: Literal["interleave", "session"] = flag(
        "interleave", "dispatch order of virtual users: round-robin over sessions, or session by session"
    )
    concurrency: int = flag(4, "virtual users in flight at once", ge=1)
    output: str | None = flag(None, "result folder (requests.jsonl, summary.json)")
    max_requests: int = flag(0, "send at most this many requests, then let those in flight finish (0 = no bound)", ge=0)
    duration: float = flag(
        0,
        "seconds to dispatch requests; then in-flight ones get --read-timeout to finish and the rest are cut "
        "(0 = no bound)",
        ge=0,
    )
    skip_too_long: bool = flag(
        False,
        "do not send prompts that cannot fit the server's max_model_len (counted and warned of either way; "
        "by default they are sent, so the server's answer is recorded)",
    )
    max_failure_rate: float = max_failure_rate_flag()
    gap_scale: float = flag(1.0, "scale of recorded think/tool gaps (0 = none)", ge=0)
    request_timeout: float = flag(64800.0, "seconds one request may take", gt=0)
    read_timeout: float = flag(600.0, "seconds a request may go without receiving a byte", gt=0)
    warmup: int = flag(4, "short throwaway requests first (excluded from the results)", ge=0)
    history: Literal["recorded", "runtime"] = flag(
        "recorded", "send each turn's recorded history, or the replies this run received"
    )
    event_loop: EventLoopKind = flag("auto", "client event loop: uvloop when installed (auto), or asyncio")
    cache_salt: str | None = flag(None, "sent as cache_salt so runs do not share cache entries")
    ignore_eos: bool = flag(
        False,
        "send ignore_eos (vLLM, SGLang): every reply decodes its max_tokens, as the trace recorded them, instead of "
        "stopping where the model emits its end of sequence (a small or random model stops early at random)",
    )
    scrape_interval: float = flag(15.0, "seconds between /metrics scrapes", gt=0)
    progress: Literal["auto", "live", "plain", "none"] = flag(
        "auto", "progress while it runs: a live table on a terminal (auto), plain lines, or none"
    )
    progress_interval: float = flag(10.0, "seconds between progress updates", gt=0)
    kv_model: str | None = flag(
        None,
        "catalog model (kvtier plan models) whose KV bytes per token size the reuse figures (default: --model, "
        "when the catalog knows it)",
    )
    reuse_block_tokens: int = flag(256, "block of the reuse-opportunity figures, tokens (LMCache's chunk)", ge=1)
    mpi_timeout: float = flag(
        600.0,
        "under mpirun: seconds a rank waits for the others at the start, and rank 0 for their records at the end",
        gt=0,
    )
    rate_window: float = flag(300.0, "seconds of the rolling hit-rate window", gt=0)
    metrics_url: list[str] = flag([], "server root to scrape (default: the base URL's root)")
    engine_log: list[str] = flag(
        [],
        "a vLLM engine's own per-request log (kvtier's offload spec with request_log set; kvtier launch passes its "
        "replicas'): each request joined to its engine record gets its prompt by tier and its TTFT by part, "
        "measured in the engine",
    )
    engine_log_wait: float = flag(
        10.0, "seconds to wait after the last request for the engines to write its record", ge=0, le=600
    )

    @field_validator("base_url", "metrics_url")
    @classmethod
    def _http(cls, v: str | list[str] | None) -> str | list[str] | None:
        for url in [v] if isinstance(v, str) else v or []:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"expected an http:// or https:// URL, got {url!r}")
        return v

    @model_validator(mode="after")
    def _hit_rate_needs_synthetic(self) -> ReplayConfig:
        if self.target_hit_rate is not None and not self.synthetic:
            raise ValueError("--target-hit-rate: controls --synthetic sessions (give --synthetic)")
        if self.working_set and self.target_hit_rate is None:
            raise ValueError("--working-set: sizes the documents of --target-hit-rate (give it)")
        if self.target_hit_rate is not None and self.concurrency < self.users:
            raise ValueError(
                f"--target-hit-rate: --concurrency {self.concurrency} below --users {self.users}: a virtual user sends "
                "its turns one after another, so the documents come round in the order of turns only with every "
                "user in flight (give --concurrency >= --users)"
            )
        return self

    def missing(self) -> list[str]:
        """Flags a run needs that are not set."""
        return [
            f"--{name.replace('_', '-')}"
            for name in ("base_url", "model", "dataset")
            if getattr(self, name) is None and not (name == "dataset" and self.synthetic)
        ]

    @property
    def server_root(self) -> str:
        """The base URL without its ``/v1`` (where /metrics and /health live)."""
        base = (self.base_url or "").rstrip("/")
        return base[:-3] if base.endswith("/v1") else base


__all__ = ["ReplayConfig", "DatasetFormat", "EventLoopKind"]
