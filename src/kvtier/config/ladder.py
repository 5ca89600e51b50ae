"""Configuration of ``kvtier ladder``: one server's TTFT by context and by the tier that served the prefix."""

from __future__ import annotations

from pydantic import field_validator, model_validator

from kvtier.config.base import StrictModel, flag, max_failure_rate_flag

GRID = "grid"
BOUNDS = "bounds"


def _int_list(v: object) -> object:
    """``"256,1024"`` (a flag) or a list (YAML, Python) -> a list of positive integers."""
    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and any(isinstance(x, str) for x in v):
        parts = [p.strip() for x in v for p in str(x).split(",") if p.strip()]
        try:
            return [int(p) for p in parts]
        except ValueError:
            raise ValueError(f"expected comma-separated whole numbers, got {','.join(map(str, v))!r}") from None
    return v


class LadderConfig(StrictModel):
    """Every input of one ``kvtier ladder`` run (field = flag with underscores, description = help)."""

    base_url: str = flag(..., "server's OpenAI API root, e.g. http://127.0.0.1:8000/v1")
    model: str = flag(..., "model name sent in each request (the server's served model name)")
    metrics_url: str | None = flag(
        None, "where the server's /metrics is (default: --base-url without /v1); its counters verify every point"
    )
    tokenizer: str | None = flag(
        None,
        "hf:DIR (the served model's tokenizer.json) to size prompts exactly; default: two probe requests measure the "
        "server's tokens per filler word",
        pattern=r"^hf:.+$",
    )
    contexts: list[int] | None = flag(
        None,
        "cached-prefix lengths, tokens, comma separated (default: log-spaced from 256 to the server's max_model_len, "
        "six points)",
        group=GRID,
    )
    new_tokens: list[int] = flag([16, 256], "new tokens on top of each prefix, comma separated", group=GRID)
    repeats: int = flag(5, "measurements of each (context, new tokens, source)", ge=1, le=1000, group=GRID)
    sources: list[str] | None = flag(
        None,
        "which sources to measure: cold, gpu and offload tier names (default: cold, gpu and every tier found)",
        group=GRID,
    )
    flood_tokens: list[str] = flag(
        [],
        "TIER=TOKENS: flood this many tokens before asking a prefix of that tier again (repeatable; default: sized "
        "from the capacities the server reports; gpu=TOKENS sizes the GPU's)",
        group=GRID,
    )
    flood_concurrency: int = flag(4, "flood requests in flight at once", ge=1, le=64, group=GRID)
    settle: float = flag(
        0.5, "seconds to wait after a flood before the measured request (the server's stores drain)", ge=0, group=GRID
    )
    tpot_concurrency: list[int] = flag(
        [1, 2, 4, 8], "running sequences of the TPOT sweep, comma separated (empty: no sweep)", group=GRID
    )
    tpot_tokens: int = flag(32, "tokens each TPOT-sweep request decodes", ge=2, le=4096, group=GRID)
    loaded_prompts: list[int] = flag(
        [64, 512, 1024],
        "cold prompts (tokens, each <= 1024: one prefill chunk) timed while the TPOT sweep's levels of sequences "
        "decode, --repeats each: how a prefill and a decode batch share the engine's steps (empty: no sweep)",
        group=GRID,
    )
    handling_contexts: list[int] = flag(
        [2048, 8192],
        "cached prompts (tokens) timed in two kinds of text, --repeats each: what a request's handling costs per "
        "token and per character; the longest is also timed alone and among the interference sweep's streams "
        "(empty: neither; longer than the server takes: left out)",
        group=GRID,
    )
    loaded_tokens: int = flag(
        512, "tokens each stream decodes while the loaded prompts are timed", ge=16, le=8192, group=GRID
    )
    honor_eos: bool = flag(
        False,
        "let the sweeps' streams stop at the model's end of sequence (by default the ladder sends ignore_eos, as "
        "vLLM and SGLang take it, so a stream decodes all its tokens; give this to a server that refuses the field)",
        group=GRID,
    )
    holdout: float = flag(
        0.2, "share of the (context, new tokens) cells held back from the fit to check it", ge=0, lt=1, group=GRID
    )
    seed: int = flag(0, "seed of the prompts' words and of the random order of the points")
    duration: float = flag(
        0, "stop measuring after this many seconds (0: no bound); what was measured is kept", ge=0, group=BOUNDS
    )
    max_requests: int = flag(0, "send at most this many requests, floods included (0: no bound)", ge=0, group=BOUNDS)
    request_timeout: float = flag(600.0, "seconds one request may take", gt=0, group=BOUNDS)
    max_failure_rate: float = max_failure_rate_flag(BOUNDS)
    engine_log: list[str] = flag(
        [],
        "the server's own per-request log (kvtier's vLLM offload spec, request_log): each point verified by its "
        "request's record (its prompt by source, from inside the engine) instead of the counters' deltas",
    )
    output: str = flag("ladder.json", "the result file")
    plot: str | None = flag(None, "also draw TTFT against context per source (log-log, with the spread) to this PNG")
    quiet: bool = flag(False, "no line per measured point on stderr")

    @field_validator("contexts", "new_tokens", "tpot_concurrency", "loaded_prompts", "handling_contexts", mode="before")
    @classmethod
    def _lists(cls, v: object) -> object:
        return _int_list(v)

    @field_validator("sources", "flood_tokens", mode="before")
    @classmethod
    def _names(cls, v: object) -> object:
        if isinstance(v, str):
            v = [v]
        if isinstance(v, list):
            return [p.strip() for x in v for p in str(x).split(",") if p.strip()]
        return v

    @model_validator(mode="after")
    def _check(self) -> LadderConfig:
        for name in ("contexts", "new_tokens", "tpot_concurrency", "loaded_prompts", "handling_contexts"):
            vals = getattr(self, name) or []
            bad = [x for x in vals if x < 1]
            if bad:
                raise ValueError(f"{name}: every value must be >= 1, got {bad}")
        if any(x > 1024 for x in self.loaded_prompts):
            raise ValueError(f"loaded_prompts: each must be <= 1024 tokens (one chunk), got {self.loaded_prompts}")
        if self.contexts is not None and not self.contexts:
            raise ValueError("contexts: give at least one length")
        if not self.new_tokens:
            raise ValueError("new_tokens: give at least one count")
        for spec in self.flood_tokens:
            name, _, n = spec.partition("=")
            if not name or not n.strip().isdigit() or int(n) < 1:
                raise ValueError(f"flood_tokens: {spec!r}: expected TIER=TOKENS with TOKENS >= 1")
        return self

    def flood_overrides(self) -> dict[str, int]:
        return {k: int(v) for k, _, v in (s.partition("=") for s in self.flood_tokens)}

    def metrics_root(self) -> str:
        if self.metrics_url:
            return self.metrics_url.rstrip("/")
        root = self.base_url.rstrip("/")
        return root[: -len("/v1")] if root.endswith("/v1") else root


__all__ = ["LadderConfig"]
