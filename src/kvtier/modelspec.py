"""Model catalog as data: the attention geometry that decides how many KV bytes a token costs.

Bytes per token:
  MHA/GQA: 2 (K and V) x layers x kv_heads x head_dim x bytes_per_element
  MLA:     layers x (kv_lora_rank + qk_rope_head_dim) x bytes_per_element   (one joint latent)

The built-in entries reproduce the MLPerf Storage v3.0 KV Cache spec's bytes-per-token table.
Where the spec's geometry differs from the released model's, the entry keeps the spec's figures under
the reference's name (so bench results compare with the reference) and ``SPEC_GEOMETRY`` says how
the released model differs; the released geometry is a catalog entry of its own (``<name>-hf``), and
any released model can be read from its Hugging Face ``config.json`` (``spec_from_hf_config``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from kvtier.errors import ConfigError

AttentionKind = Literal["mha", "gqa", "mla"]

# Bits, not bytes, so that fp4 stays exact.
DTYPE_BITS: dict[str, int] = {
    "float32": 32,
    "fp32": 32,
    "float16": 16,
    "fp16": 16,
    "bfloat16": 16,
    "bf16": 16,
    "float8": 8,
    "fp8": 8,
    "fp8_e4m3": 8,
    "fp8_e5m2": 8,
    "int8": 8,
    "float4": 4,
    "fp4": 4,
    "nvfp4": 4,
    "mxfp4": 4,
}


@dataclass(frozen=True)
class ModelSpec:
    """Attention geometry of one model; all sizes in elements unless the name says bytes."""

    key: str
    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"
    attention: AttentionKind = "gqa"
    num_heads: int = 0
    hidden_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0

    def __post_init__(self) -> None:
        where = f"model_configs.{self.key}"
        if self.dtype not in DTYPE_BITS:
            raise ConfigError(f"{where}.dtype: unknown dtype {self.dtype!r} (known: {', '.join(sorted(DTYPE_BITS))})")
        if self.num_layers <= 0:
            raise ConfigError(f"{where}.num_layers: must be > 0, got {self.num_layers}")
        if self.attention == "mla":
            if self.kv_lora_rank <= 0:
                raise ConfigError(f"{where}.kv_lora_rank: MLA needs kv_lora_rank > 0")
            if self.qk_rope_head_dim < 0:
                raise ConfigError(f"{where}.qk_rope_head_dim: must be >= 0")
        else:
            if self.kv_heads <= 0:
                raise ConfigError(f"{where}.kv_heads: must be > 0, got {self.kv_heads}")
            if self.head_dim <= 0:
                raise ConfigError(f"{where}.head_dim: must be > 0, got {self.head_dim}")

    @property
    def bits_per_element(self) -> int:
        return DTYPE_BITS[self.dtype]

    @property
    def elements_per_token(self) -> int:
        if self.attention == "mla":
            return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim)
        return 2 * self.num_layers * self.kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token occupies (rounded up to whole bytes for sub-byte dtypes)."""
        return math.ceil(self.elements_per_token * self.bits_per_element / 8)

    def kv_bytes(self, num_tokens: int) -> int:
        """Bytes of a KV entry of ``num_tokens`` tokens."""
        return math.ceil(num_tokens * self.elements_per_token * self.bits_per_element / 8)

    def kv_heads_per_rank(self, tensor_parallel: int = 1) -> int:
        """KV heads one tensor-parallel rank holds: heads are split across ranks, rounded up, and
        replicated when there are more ranks than heads (each rank keeps at least one)."""
        if tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
        return max(1, -(-self.kv_heads // tensor_parallel))

    def elements_per_token_per_rank(self, tensor_parallel: int = 1) -> int:
        """KV elements per token on one tensor-parallel rank.

        MHA/GQA: K and V of ``kv_heads_per_rank`` heads. MLA: the whole joint latent — it has no
        head dimension to split, so every rank holds all of it (as vLLM does)."""
        if self.attention == "mla":
            if tensor_parallel < 1:
                raise ValueError(f"tensor_parallel must be >= 1, got {tensor_parallel}")
            return self.elements_per_token
        return 2 * self.num_layers * self.kv_heads_per_rank(tensor_parallel) * self.head_dim

    def kv_bytes_per_token_per_rank(self, tensor_parallel: int = 1) -> int:
        """Bytes of KV one token occupies on one tensor-parallel rank (see elements_per_token_per_rank)."""
        return math.ceil(self.elements_per_token_per_rank(tensor_parallel) * self.bits_per_element / 8)

    def kv_bytes_per_rank(self, num_tokens: int, tensor_parallel: int = 1) -> int:
        """Bytes of one rank's share of a KV entry of ``num_tokens`` tokens — the size of the object
        that rank writes and reads. The single rule bench, sim and plan use for TP > 1."""
        return math.ceil(num_tokens * self.elements_per_token_per_rank(tensor_parallel) * self.bits_per_element / 8)

    def shards_like_reference(self, tensor_parallel: int) -> bool:
        """Whether this per-rank size equals the MLPerf reference's (which divides every entry by TP):
        true for TP 1 and for MHA/GQA models whose KV heads divide evenly across the ranks."""
        return tensor_parallel == 1 or (self.attention != "mla" and self.kv_heads % tensor_parallel == 0)

    def entry_shape(self, seq_len: int) -> tuple[int, ...]:
        """Tensor shape of one entry: (layers, 2, seq, kv_heads, head_dim), or (layers, seq, latent) for MLA."""
        if self.attention == "mla":
            return (self.num_layers, seq_len, self.kv_lora_rank + self.qk_rope_head_dim)
        return (self.num_layers, 2, seq_len, self.kv_heads, self.head_dim)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_bytes_per_token"] = self.kv_bytes_per_token
        return d


def spec_from_reference(key: str, raw: Mapping[str, Any]) -> ModelSpec:
    """Build a spec from the reference config.yaml layout.

    Accepted fields: name, num_layers, hidden_dim, num_heads, kv_heads, dtype, and optionally
    kv_dim_per_head / head_dim, attention_type (mha|gqa|mla), kv_lora_rank, qk_rope_head_dim.
    """
    allowed = {
        "name",
        "num_layers",
        "hidden_dim",
        "num_heads",
        "kv_heads",
        "dtype",
        "kv_dim_per_head",
        "head_dim",
        "attention_type",
        "kv_lora_rank",
        "qk_rope_head_dim",
    }
    where = f"model_configs.{key}"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(raw).__name__}")
    unknown = sorted(set(raw) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(sorted(allowed))})")

    def _int(field: str, default: int | None = None) -> int:
        if field not in raw:
            if default is None:
                raise ConfigError(f"{where}.{field}: required")
            return default
        v = raw[field]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"{where}.{field}: expected a non-negative integer, got {v!r}")
        return v

    attention = str(raw.get("attention_type", "")).lower() or None
    num_layers = _int("num_layers")
    num_heads = _int("num_heads", 0)
    hidden_dim = _int("hidden_dim", 0)
    kv_heads = _int("kv_heads", num_heads)
    head_dim = _int("head_dim", 0) or _int("kv_dim_per_head", 0)
    if attention is None:
        attention = "gqa" if kv_heads and num_heads and kv_heads < num_heads else "mha"
    if attention not in ("mha", "gqa", "mla"):
        raise ConfigError(f"{where}.attention_type: expected mha, gqa or mla, got {attention!r}")
    if not head_dim and attention != "mla":
        if not num_heads or not hidden_dim:
            raise ConfigError(f"{where}: give head_dim (or kv_dim_per_head), or hidden_dim and num_heads")
        if hidden_dim % num_heads:
            raise ConfigError(f"{where}.hidden_dim: {hidden_dim} is not divisible by num_heads {num_heads}")
        head_dim = hidden_dim // num_heads
    return ModelSpec(
        key=key,
        name=str(raw.get("name", key)),
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=str(raw.get("dtype", "float16")),
        attention=attention,  # type: ignore[arg-type]
        num_heads=num_heads,
        hidden_dim=hidden_dim,
        kv_lora_rank=_int("kv_lora_rank", 0),
        qk_rope_head_dim=_int("qk_rope_head_dim", 0),
    )


# The spec's table, in the reference's config layout (so the same parser serves built-ins and YAML).
BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-1b": {"name": "Tiny 1B", "num_layers": 12, "hidden_dim": 1024, "num_heads": 8, "kv_heads": 4},
    "mistral-7b": {"name": "Mistral 7B", "num_layers": 32, "hidden_dim": 4096, "num_heads": 32, "kv_heads": 8},
    "llama2-7b": {"name": "Llama 2 7B", "num_layers": 32, "hidden_dim": 4096, "num_heads": 32, "kv_heads": 32},
    "llama3.1-8b": {"name": "Llama 3.1 8B", "num_layers": 32, "hidden_dim": 4096, "num_heads": 32, "kv_heads": 8},
    "llama3.1-70b-instruct": {
        "name": "Llama 3.1 70B Instruct",
        "num_layers": 80,
        "hidden_dim": 8192,
        "num_heads": 64,
        "kv_heads": 8,
    },
    "deepseek-v3": {
        "name": "DeepSeek V3",
        "num_layers": 61,
        "hidden_dim": 7168,
        "num_heads": 128,
        "kv_heads": 128,
        "attention_type": "mla",
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
    },
    "qwen3-32b": {
        "name": "Qwen3 32B (spec geometry)",
        "num_layers": 64,
        "hidden_dim": 5120,
        "num_heads": 64,
        "kv_heads": 8,
    },
    "qwen3-32b-hf": {  # the released Qwen3-32B's config.json: head_dim 128, bf16
        "name": "Qwen3 32B (released geometry)",
        "num_layers": 64,
        "hidden_dim": 5120,
        "num_heads": 64,
        "kv_heads": 8,
        "head_dim": 128,
        "dtype": "bfloat16",
    },
    "gpt-oss-120b": {
        "name": "GPT-OSS 120B",
        "num_layers": 36,
        "hidden_dim": 2880,
        "num_heads": 64,
        "kv_heads": 8,
        "head_dim": 64,
    },
    "gpt-oss-20b": {
        "name": "GPT-OSS 20B",
        "num_layers": 24,
        "hidden_dim": 2880,
        "num_heads": 64,
        "kv_heads": 8,
        "head_dim": 64,
    },
}


SPEC_GEOMETRY: dict[str, str] = {
    "qwen3-32b": (
        "the MLPerf spec's geometry (head_dim = hidden 5120 / 64 heads = 80: 163,840 B/token at 16 bits); the "
        "released Qwen3-32B has head_dim 128 (262,144 B/token): use qwen3-32b-hf or --hf-config for real plans"
    ),
}
"""Catalog entries whose figures are the spec's, not the released model's: name -> how they differ."""


def geometry(key: str) -> str:
    """``spec`` for an entry whose figures are the MLPerf spec's and differ from the released model's,
    else ``released``."""
    return "spec" if key in SPEC_GEOMETRY else "released"


HF_DTYPES = {
    "float32": "float32",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}
MAX_HF_CONFIG_BYTES = 4 << 20


def spec_from_hf_config(path: str, key: str | None = None) -> ModelSpec:
    """A model's attention geometry from its Hugging Face ``config.json`` (a file, or the model folder
    holding one): layers (``num_hidden_layers``), KV heads (``num_key_value_heads``, default the
    attention heads), ``head_dim`` (default hidden_size / heads), MLA ranks (``kv_lora_rank``,
    ``qk_rope_head_dim``: DeepSeek-V2/V3) and the dtype (``torch_dtype`` or ``dtype``). A multimodal
    config's ``text_config`` is read when the top level has no layers. Errors name the file and field."""
    import json
    from pathlib import Path

    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        if p.stat().st_size > MAX_HF_CONFIG_BYTES:
            raise ConfigError(f"--hf-config {p}: larger than {MAX_HF_CONFIG_BYTES} bytes: not a config.json")
        raw = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"--hf-config {p}: cannot read it ({e.strerror})") from None
    except ValueError as e:
        raise ConfigError(f"--hf-config {p}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--hf-config {p}: expected a JSON object")
    cfg = raw
    if "num_hidden_layers" not in cfg and isinstance(raw.get("text_config"), dict):
        cfg = raw["text_config"]

    def num(field: str, default: int | None = None) -> int:
        v = cfg.get(field, default)
        if v is None:
            raise ConfigError(f"--hf-config {p}: {field}: required")
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"--hf-config {p}: {field}: expected a non-negative integer, got {v!r}")
        return v

    layers = num("num_hidden_layers")
    heads = num("num_attention_heads")
    hidden = num("hidden_size", 0)
    kv_lora = num("kv_lora_rank", 0) if cfg.get("kv_lora_rank") is not None else 0
    mla = kv_lora > 0
    kv_heads = num("num_key_value_heads", heads) if cfg.get("num_key_value_heads") is not None else heads
    head_dim = num("head_dim", 0) if cfg.get("head_dim") is not None else 0
    if not head_dim and not mla:
        if not heads or hidden % heads:
            raise ConfigError(
                f"--hf-config {p}: head_dim: absent, and hidden_size {hidden} / {heads} heads is no integer"
            )
        head_dim = hidden // heads
    dtype_raw = cfg.get("torch_dtype", cfg.get("dtype", raw.get("torch_dtype", "bfloat16")))
    dtype = HF_DTYPES.get(str(dtype_raw))
    if dtype is None:
        raise ConfigError(f"--hf-config {p}: torch_dtype: {dtype_raw!r} is not one of {', '.join(HF_DTYPES)}")
    name = key or str(raw.get("_name_or_path") or (p.stem if p.name != "config.json" else p.parent.name))
    archs = raw.get("architectures")
    return ModelSpec(
        key=name,
        name=f"{name} ({archs[0] if isinstance(archs, list) and archs else raw.get('model_type', 'config.json')})",
        num_layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        attention="mla" if mla else ("gqa" if kv_heads < heads else "mha"),
        num_heads=heads,
        hidden_dim=hidden,
        kv_lora_rank=kv_lora,
        qk_rope_head_dim=num("qk_rope_head_dim", 0) if mla else 0,
    )


def build_catalog(extra: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, ModelSpec]:
    """Built-in models merged with user entries (a user entry with a built-in name replaces it)."""
    merged: dict[str, Mapping[str, Any]] = dict(BUILTIN_MODELS)
    merged.update(extra or {})
    return {k: spec_from_reference(k, v) for k, v in merged.items()}


def resolve_model(name: str, catalog: Mapping[str, ModelSpec]) -> ModelSpec:
    try:
        return catalog[name]
    except KeyError:
        import difflib

        within = sorted((k for k in catalog if name.lower() in k.lower()), key=len)  # a name cut short first
        near = list(dict.fromkeys([*within, *difflib.get_close_matches(name, list(catalog), n=3, cutoff=0.6)]))[:3]
        hint = f"; did you mean {' or '.join(repr(x) for x in near)}?" if near else ""
        raise ConfigError(f"--model: unknown model {name!r}{hint} (known: {', '.join(sorted(catalog))})") from None
