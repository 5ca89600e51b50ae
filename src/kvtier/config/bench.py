"""Configuration of ``kvtier bench``: the MLPerf flags (same names, same defaults) and the YAML.

Two models:
* ``Tuning`` mirrors the reference's config.yaml layout (user_templates, qos_profiles, eviction,
  decode, model_configs, ...). A partial YAML file merges over the defaults; unknown keys and bad
  values are errors that name the key path (``eviction.target_usage_ratio: ...``).
* ``BenchConfig`` holds the command-line flags plus the tuning; it is what a result file embeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvtier.errors import ConfigError


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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
    def _ordered(self) -> "Range":
        if self.low < 0 or self.high < self.low:
            raise ValueError(f"expected 0 <= low <= high, got [{self.low}, {self.high}]")
        return self


class UserTemplate(_Strict):
    context_range: Range
    generation_range: Range
    think_time_range: Range


def _default_templates() -> dict[str, UserTemplate]:
    # MLPerf KV Cache spec section 4.1: tokens, tokens, seconds.
    raw = {
        "chatbot": ([512, 4096], [50, 200], [0.1, 0.5]),
        "coding": ([4096, 25000], [100, 500], [0.2, 1.0]),
        "document": ([4096, 16384], [200, 800], [0.3, 1.5]),
    }
    return {k: UserTemplate(context_range=c, generation_range=g, think_time_range=t)  # type: ignore[arg-type]
            for k, (c, g, t) in raw.items()}


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


def _default_qos() -> dict[str, QoSProfile]:
    rows = {"interactive": (50, 100, 150, 200, 3), "responsive": (100, 200, 350, 500, 2),
            "batch": (1000, 5000, 7500, 10000, 1)}
    return {k: QoSProfile(target_latency_p95_ms=a, target_latency_p99_ms=b, target_latency_p999_ms=c,
                          target_latency_p9999_ms=d, priority=p) for k, (a, b, c, d, p) in rows.items()}


class QoSDistribution(_Strict):
    """A user is interactive with probability p, responsive below the threshold, else batch."""

    interactive_probability: float = Field(0.15, ge=0, le=1)
    responsive_threshold: float = Field(0.50, ge=0, le=1)

    @model_validator(mode="after")
    def _ordered(self) -> "QoSDistribution":
        if self.responsive_threshold < self.interactive_probability:
            raise ValueError("responsive_threshold must be >= interactive_probability")
        return self


class Eviction(_Strict):
    target_usage_ratio: float = Field(0.8, gt=0, le=1)
    large_entry_limit_ratio: float = Field(0.95, gt=0, le=1)
    max_recursion_depth: int = Field(10, ge=1)
    max_evictions_hard_cap: int = Field(5000, ge=1)
    max_evictions_min: int = Field(1000, ge=1)


class Decode(_Strict):
    batch_size: int = Field(32, ge=1)


class ConversationTuning(_Strict):
    """Multi-turn conversations (see workload/conversations.py)."""

    max_turns_per_conv: int = Field(10, ge=1)
    end_probability: float = Field(0.2, ge=0, le=1)
    max_context_tokens: int = Field(131072, ge=1)


class PrefixCacheTuning(_Strict):
    """Shared system prompts: how many distinct ones, and their lengths in tokens."""

    num_system_prompts: int = Field(8, ge=1)
    system_prompt_tokens: Range = Field(default_factory=lambda: Range(low=256, high=2048))


class RagTuning(_Strict):
    """RAG corpus and queries (see workload/rag.py)."""

    request_probability: float = Field(0.1, ge=0, le=1)
    doc_tokens: Range = Field(default_factory=lambda: Range(low=2048, high=16384))
    chunk_tokens: int = Field(512, ge=1)
    popularity_skew: float = Field(1.0, ge=0)


class AutoscalerTuning(_Strict):
    """Autoscaling of live users (see bench/autoscale.py)."""

    interval_s: float = Field(5.0, gt=0)
    cooldown_s: float = Field(10.0, ge=0)
    min_users: int = Field(1, ge=1)
    max_users: int = Field(1000, ge=1)
    step_users: int = Field(0, ge=0, description="users added/removed per qos step; 0 = 20% of the current")
    growth_fast: float = Field(0.2, gt=0, description="capacity mode: growth above this doubles users, below x1.5")


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


class Tuning(_Strict):
    """The reference config.yaml layout. Sections for features not built yet are kept as given."""

    user_templates: dict[Literal["chatbot", "coding", "document"], UserTemplate] = Field(
        default_factory=_default_templates)
    generation_timing: GenerationTiming = Field(default_factory=GenerationTiming)
    qos_profiles: dict[Literal["interactive", "responsive", "batch"], QoSProfile] = Field(
        default_factory=_default_qos)
    qos_distribution: QoSDistribution = Field(default_factory=QoSDistribution)
    eviction: Eviction = Field(default_factory=Eviction)
    decode: Decode = Field(default_factory=Decode)
    model_configs: dict[str, ModelEntry] = Field(default_factory=dict)
    # Accepted for compatibility with reference config files; their features arrive with later
    # work (RAG, autoscaler, ShareGPT tuning) and are validated then.
    conversation: ConversationTuning = Field(default_factory=ConversationTuning)
    prefix_cache: PrefixCacheTuning = Field(default_factory=PrefixCacheTuning)
    rag: RagTuning = Field(default_factory=RagTuning)
    autoscaler: AutoscalerTuning = Field(default_factory=AutoscalerTuning)
    gpu_backend: dict[str, Any] = Field(default_factory=dict)
    sharegpt: dict[str, Any] = Field(default_factory=dict)
    saturation_detection: dict[str, Any] = Field(default_factory=dict)
    validation_limits: dict[str, Any] = Field(default_factory=dict)


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def format_validation_error(err: ValidationError, prefix: str = "", source: str = "") -> str:
    """One line per problem: ``file: key.path: message``."""
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        where = f"{prefix}{path}" if path else prefix.rstrip(".") or "config"
        lines.append(f"{source + ': ' if source else ''}{where}: {msg}")
    return "\n".join(lines)


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
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}" if mark is not None else str(p)
        raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', e)}") from e
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(raw).__name__}")
    defaults = Tuning().model_dump(mode="python")
    # Ranges dump as dicts; re-express as lists so user lists merge over them cleanly.
    merged = _deep_merge(defaults, raw)
    try:
        return Tuning.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source=str(p))) from None


GenerationMode = Literal["none", "fast", "realistic"]


class BenchConfig(_Strict):
    """Every input of one ``kvtier bench`` run. Field names are the flag names with underscores."""

    model: str = "llama3.1-8b"
    num_users: int = Field(100, ge=1, le=100_000)
    duration: float = Field(60, gt=0, description="seconds")
    gpu_mem_gb: float = Field(16, ge=0)
    num_gpus: int = Field(1, ge=1)
    tensor_parallel: int = Field(1, ge=1)
    cpu_mem_gb: float = Field(32, ge=0)
    cache_dir: str | None = None
    generation_mode: GenerationMode = "realistic"
    performance_profile: Literal["latency", "throughput"] = "latency"
    disable_multi_turn: bool = False
    disable_prefix_caching: bool = False
    enable_rag: bool = False
    rag_num_docs: int = Field(10, ge=1)
    rag_top_k: int = Field(5, ge=1)
    enable_autoscaling: bool = False
    autoscaler_mode: Literal["qos", "capacity"] = "qos"
    target_saturation: float = Field(0.8, gt=0, le=1)
    use_burst_trace: bool = False
    burst_trace_path: str | None = None
    validation_trace: str | None = None
    dataset_path: str | None = None
    max_conversations: int = Field(500, ge=1)
    output: str | None = None
    seed: int | None = None
    max_concurrent_allocs: int = Field(0, ge=0)
    request_rate: float = Field(0, ge=0)
    max_requests: int = Field(0, ge=0)
    xlsx_output: str | None = None
    config: str | None = None
    storage_capacity_gb: float = Field(0, ge=0)
    precondition: bool = False
    precondition_size_gb: float = Field(0, ge=0)
    precondition_threads: int = Field(0, ge=0)
    trace_speedup: float = Field(1.0, ge=0)
    replay_cycles: int = Field(0, ge=0)
    prefill_only: bool = False
    decode_only: bool = False
    io_trace_log: str | None = None
    enable_latency_tracing: bool = False
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    # kvtier additions
    direct_io: Literal["auto", "on", "off"] = "auto"
    promotion: Literal["none", "on-read"] = "none"
    keep_cache: bool = False
    io_chunk_mb: int = Field(64, ge=1, le=4096, description="bytes moved per I/O call, MiB")
    noise_mb: int = Field(256, ge=1, le=65536)
    progress: Literal["auto", "live", "plain", "none"] = "auto"
    progress_interval: float = Field(5.0, gt=0)
    kv_layout: Literal["entry", "chunked"] = "entry"
    trace_path: str | None = None
    trace_format: Literal["auto", "burstgpt", "azure", "mooncake"] = "auto"
    kv_chunk_tokens: int = Field(256, ge=1, le=1 << 20)
    tuning: Tuning = Field(default_factory=Tuning)

    @field_validator("model")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "BenchConfig":
        if self.prefill_only and self.decode_only:
            raise ValueError("--prefill-only and --decode-only are mutually exclusive")
        return self

    def not_yet_implemented(self) -> list[str]:
        """Flags whose features are not built in this version (they must fail, not be ignored)."""
        flags = {
            "validation_trace": "--validation-trace", "io_trace_log": "--io-trace-log",
        }
        return [flag for field, flag in flags.items() if getattr(self, field)]


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def build_bench_config(values: dict[str, Any]) -> BenchConfig:
    """Validate flag values (plus the YAML named by --config) into a BenchConfig."""
    tuning = load_tuning(values.get("config"))
    try:
        return BenchConfig.model_validate({**values, "tuning": tuning})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            loc = [str(p) for p in err["loc"]]
            where = flag_name(loc[0]) if loc else "config"
            msg = err["msg"].removeprefix("Value error, ")
            lines.append(f"{where}: {msg}" if loc else msg)
        raise ConfigError("\n".join(lines)) from None
