"""The YAML tuning of ``kvtier bench``: ``Tuning`` mirrors the reference's config.yaml layout (user_templates,
qos_profiles, eviction, decode, model_configs, ...). A partial YAML file merges over the defaults (``load_tuning``);
unknown keys and bad values are errors that name the key path (``eviction.target_usage_ratio: ...``). Every key takes
effect; the two sections kvtier does not implement (``gpu_backend``, ``saturation_detection``) are refused when
given, never ignored. config/bench.py's ``BenchConfig`` carries it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, model_validator

from kvtier.config.base import StrictModel as _Strict
from kvtier.config.base import deep_merge, load_yaml, validate_config
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
