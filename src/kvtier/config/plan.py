"""Configuration of ``kvtier plan``: one model per subcommand, its fields the flags (``cli/args.py``).

The model flags (``--model``/``--hf-config``/``--layers`` ...) are one shared base, ``ModelFlags``, as the
remote tiers' flags are ``RemoteTierFlags``; ``--json`` and ``--output`` are ``PlanOutputFlags``. Quantities
with units (``--net-bw 100Gbit/s``, ``--rtt 20ms``, ``--case BW,RTT[,C]``, ``--tier NAME=GB``) are kept as the
user wrote them, so a result's config reads as its command line, and are checked here, once: the library reads
them through the methods below (``links``, ``cases``, ``tiers`` ...), which cannot fail on a validated model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from pydantic import model_validator

from kvtier.config.base import StrictModel, flag
from kvtier.errors import ConfigError
from kvtier.units import parse_bandwidth, parse_duration

MODEL = "model (a catalog name, or the geometry)"


def _checked(parse: Callable[[], object]) -> None:
    """Run a parser that raises ConfigError; a validator needs a ValueError (its message names the flag)."""
    try:
        parse()
    except ConfigError as e:
        raise ValueError(str(e)) from None


def number_list(text: str, flag: str, integer: bool = False) -> list[float]:
    """Distinct comma-separated numbers >= 0, sorted (whole numbers with ``integer``)."""
    try:
        values: list[float] = [(int if integer else float)(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v < 0 for v in values) or len(set(values)) != len(values):
        raise ConfigError(f"{flag}: expected distinct numbers >= 0, got {text!r}")
    return sorted(values)


def named_numbers(specs: list[str], flag: str) -> dict[str, float]:
    """``NAME=NUMBER`` pairs (``cpu=512``), each number > 0."""
    out: dict[str, float] = {}
    for spec in specs:
        name, _, v = spec.partition("=")
        try:
            x = float(v)
        except ValueError:
            x = float("nan")
        if not name or not v or not x > 0 or x == float("inf"):
            raise ConfigError(f"{flag} {spec!r}: expected NAME=NUMBER with a number > 0, e.g. cpu=512")
        out[name] = x
    return out


class PlanOutputFlags(StrictModel):
    """What every answering subcommand shares: the JSON on stdout, the result file."""

    json_: bool = flag(False, "print the answer as JSON (the answer alone; --output writes it in the envelope)")
    output: str | None = flag(
        None,
        "also write the answer as a kvtier result file (the envelope: config, host, status), atomically; "
        "kvtier report and kvtier compare read it",
    )


class ModelFlags(PlanOutputFlags):
    """A model: a catalog name, a Hugging Face config.json, or a geometry of one's own."""

    model: str | None = flag(None, "catalog model (see 'kvtier plan bytes --list')", group=MODEL)
    hf_config: str | None = flag(
        None,
        "a Hugging Face config.json (or its model folder): the released model's own geometry (layers, KV heads, "
        "head_dim, MLA ranks, dtype)",
        metavar="FILE",
        group=MODEL,
    )
    layers: int | None = flag(None, "layers (with --kv-heads, --head-dim: a geometry)", ge=1, group=MODEL)
    kv_heads: int | None = flag(None, "KV heads", ge=1, group=MODEL)
    head_dim: int | None = flag(None, "head dimension", ge=1, group=MODEL)
    attention: Literal["mha", "gqa", "mla"] | None = flag(None, "attention type", group=MODEL)
    kv_lora_rank: int = flag(0, "MLA: the latent KV rank", ge=0, group=MODEL)
    qk_rope_head_dim: int = flag(0, "MLA: the decoupled RoPE key dimension", ge=0, group=MODEL)
    dtype: str | None = flag(None, "KV dtype: fp32, fp16, bf16, fp8, fp4 (default: the model's)", group=MODEL)
    tp: int = flag(1, "tensor-parallel ranks; bytes are per rank", ge=1, group=MODEL)

    @model_validator(mode="after")
    def _one_model(self) -> ModelFlags:
        if self.hf_config and (self.model or self.layers):
            raise ValueError("--hf-config: give it alone, without --model or --layers")
        return self

    @property
    def model_given(self) -> bool:
        return bool(self.model or self.layers or self.hf_config)

    def require_model(self) -> None:
        if not self.model_given:
            raise ConfigError("--model: give a catalog model, --hf-config, or --layers with --kv-heads and --head-dim")


class BytesConfig(ModelFlags):
    """``kvtier plan bytes``: KV bytes per token of a model, or the catalog."""

    list_: bool = flag(False, "the catalog: every model's KV bytes per token")


class BreakevenConfig(ModelFlags):
    """``kvtier plan breakeven``: decode placement costs and the fetch-vs-recompute break-even per link."""

    context: int = flag(..., "context tokens", gt=0)
    prefill_tps: float = flag(..., "prefill throughput, tokens/s", gt=0, allow_inf_nan=False)
    hbm_bw: str = flag("3.35TB/s", "HBM bandwidth (H100 SXM's)")
    stages: int = flag(1, "pipeline stages (hops per decode step)", ge=1)
    net_bw: list[str] = flag([], "link bandwidth (100Gbit/s, 12.5GB/s); one or more", min_length=1)
    rtt: list[str] = flag([], "round trip (1ms); one, or one per --net-bw (they pair in order)")
    compression: float = flag(1.0, "KV compression ratio for the fetch", gt=0, allow_inf_nan=False)
    plot: str | None = flag(None, "PNG: fetch and recompute time against context, break-even marked")

    @model_validator(mode="after")
    def _pairs(self) -> BreakevenConfig:
        _checked(lambda: parse_bandwidth(self.hbm_bw, "--hbm-bw"))
        _checked(self.links)
        return self

    def links(self) -> list[tuple[str, float, str, float]]:
        """(bandwidth as written, bytes/s, RTT as written, seconds) per link, RTTs paired in order."""
        bws, rtts = list(self.net_bw), list(self.rtt) or ["0"]
        if len(rtts) == 1:
            rtts = rtts * len(bws)
        if len(bws) == 1:
            bws = bws * len(rtts)
        if len(bws) != len(rtts):
            raise ConfigError(
                f"--net-bw / --rtt: {len(self.net_bw)} bandwidths and {len(self.rtt)} round trips; give one RTT, "
                "or one per bandwidth (they pair in order)"
            )
        return [(b, parse_bandwidth(b, "--net-bw"), r, parse_duration(r, "--rtt")) for b, r in zip(bws, rtts)]


def gate_case(case: str) -> tuple[float, float, float]:
    """``BW,RTT[,COMPRESSION]`` -> (bytes/s, seconds, ratio)."""
    parts = [p.strip() for p in case.split(",")]
    if len(parts) not in (2, 3):
        raise ConfigError(f"--case {case!r}: expected BW,RTT or BW,RTT,COMPRESSION")
    comp = 1.0
    if len(parts) == 3:
        try:
            comp = float(parts[2])
        except ValueError:
            comp = float("nan")
        if not comp > 0 or comp == float("inf"):
            raise ConfigError(f"--case {case!r}: the compression ratio must be a number > 0")
    return parse_bandwidth(parts[0], f"--case {case!r}"), parse_duration(parts[1], f"--case {case!r}"), comp


class GateConfig(ModelFlags):
    """``kvtier plan gate``: fetch or recompute, for cases of link and compression, or from a measured ladder."""

    context: str | None = flag(None, "context tokens (with --from: comma-separated, default the ladder's cells)")
    prefill_tps: float | None = flag(
        None, "prefill throughput, tokens/s (not with --from: the ladder measured it)", gt=0, allow_inf_nan=False
    )
    case: list[str] = flag([], "BW,RTT[,COMPRESSION], e.g. 5Gbit/s,20ms,3.5")
    from_: str | None = flag(
        None,
        "a kvtier ladder result: the server's measured prefill and fetch curves instead of --prefill-tps and "
        "--case, checked against its own measured points",
    )
    new_tokens: str | None = flag(None, "with --from: new tokens on the prefix, comma-separated (default the ladder's)")

    @model_validator(mode="after")
    def _either(self) -> GateConfig:
        if self.from_:
            given = [
                f for f, v in (("--prefill-tps", self.prefill_tps), ("--case", self.case), ("--model", self.model)) if v
            ]
            if given:
                raise ValueError(
                    f"--from: the ladder measured the server; {', '.join(given)} would be assumptions "
                    "beside it (give one or the other)"
                )
            _checked(lambda: self.contexts())
            _checked(lambda: self.new_token_counts())
            return self
        if not self.context or not self.prefill_tps:
            raise ValueError("plan gate: give --context and --prefill-tps (or --from a kvtier ladder result)")
        _checked(lambda: self.context_tokens())
        if not self.case:
            raise ValueError("--case: give at least one BW,RTT[,COMPRESSION] case")
        _checked(lambda: [gate_case(c) for c in self.case])
        return self

    def context_tokens(self) -> int:
        """The one context of a gate by cases."""
        try:
            v = int(str(self.context))
        except ValueError:
            raise ConfigError(f"--context: expected a whole number of tokens, got {self.context!r}") from None
        if v <= 0:
            raise ConfigError(f"--context: must be > 0, got {v}")
        return v

    def contexts(self) -> list[int] | None:
        return [int(v) for v in number_list(self.context, "--context", integer=True)] if self.context else None

    def new_token_counts(self) -> list[int] | None:
        return [int(v) for v in number_list(self.new_tokens, "--new-tokens", integer=True)] if self.new_tokens else None


class CapacityConfig(ModelFlags):
    """``kvtier plan capacity``: bytes for N tokens, users per tier, GiB per million tokens."""

    tokens: int | None = flag(None, "cached tokens to hold", ge=0)
    headroom: float = flag(0.25, "eviction headroom fraction", ge=0, allow_inf_nan=False)
    tier: list[str] = flag([], "NAME=SIZE_GB (decimal GB), e.g. cpu=512 nvme=7680")
    tokens_per_user: int = flag(16384, "cached tokens per user", gt=0)
    target_usage: float = flag(0.8, "fill ratio of a tier", gt=0, le=1)

    @model_validator(mode="after")
    def _tiers(self) -> CapacityConfig:
        _checked(lambda: named_numbers(self.tier, "--tier"))
        return self

    def tier_bytes(self) -> dict[str, float]:
        return {k: gb * 1e9 for k, gb in named_numbers(self.tier, "--tier").items()}


class FetchConfig(ModelFlags):
    """``kvtier plan fetch``: fetch vs recompute from a kvtier bench result's measured reads."""

    from_: str = flag(..., "a kvtier bench result JSON")
    context: str = flag("1024,4096,16384,65536", "context lengths, comma separated")
    prefill_tps: float = flag(..., "prefill throughput, tokens/s", gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _contexts(self) -> FetchConfig:
        _checked(lambda: number_list(self.context, "--context", integer=True))
        if 0 in self.contexts():
            raise ValueError(f"--context: every context must be > 0, got {self.context!r}")
        return self

    def contexts(self) -> list[int]:
        return [int(x) for x in number_list(self.context, "--context", integer=True)]


class ValueConfig(PlanOutputFlags):
    """``kvtier plan value``: does a KV tier pay? Tokens served, prefill avoided, value against cost."""

    from_: str = flag(..., "a kvtier replay's folder (or summary.json) against the sim")
    fetch_from: str | None = flag(None, "a kvtier bench result: its tiers' measured read bandwidth as the fetch cost")
    prefill_tps: float | None = flag(
        None, "prefill throughput, tokens/s (default: measured from the replay)", gt=0, allow_inf_nan=False
    )
    gpu_cost: float | None = flag(None, "$ per GPU-hour: the value of the prefill time avoided", gt=0)
    store_cost: float | None = flag(None, "$ per GB-month of the tier's capacity", gt=0)
    store_gb: list[str] = flag([], "TIER=GB, the capacity paid for (e.g. cpu=64)")
    ladder: str | None = flag(
        None,
        "a kvtier ladder of the replay's server: each request's cached tokens (usage) priced by its measured "
        "prefill curve, for a replay against any server (a real vLLM too)",
    )

    @model_validator(mode="after")
    def _sources(self) -> ValueConfig:
        if self.ladder and (self.fetch_from or self.prefill_tps):
            raise ValueError("--ladder: the ladder's measured curves replace --fetch-from and --prefill-tps")
        _checked(lambda: named_numbers(self.store_gb, "--store-gb"))
        return self


class RetentionConfig(ModelFlags):
    """``kvtier plan retention``: the exact LRU hit curve and how much history each tier holds."""

    trace: str | None = flag(None, "a Mooncake trace (hash_ids), at its arrival times", group="the accesses (one of)")
    dataset: str | None = flag(
        None, "a replay dataset, walked as a closed loop of --concurrency users", group="the accesses (one of)"
    )
    from_: str | None = flag(
        None, "a kvtier replay result: its dataset as its ok requests were sent", group="the accesses (one of)"
    )
    dataset_format: str = flag("auto", "--dataset's format (as kvtier replay)")
    tokenizer: str = flag("auto", "--dataset's tokenizer (as kvtier replay)")
    num_rounds: int = flag(5, "--dataset: turns per virtual user", ge=1)
    min_chunk_rounds: int = flag(5, "--dataset: as kvtier replay", ge=1)
    concurrency: int = flag(4, "--dataset: virtual users in flight", ge=1)
    block_tokens: int = flag(256, "--dataset: prefix block, tokens", ge=1)
    tier: list[str] = flag([], "NAME=SIZE_GB, fastest first: a waterfall (e.g. gpu=40 cpu=256)")
    plot: str | None = flag(None, "PNG: the hit curve and the working set over the trace")

    @model_validator(mode="after")
    def _one_source(self) -> RetentionConfig:
        if sum(1 for x in (self.trace, self.dataset, self.from_) if x) != 1:
            raise ValueError(
                "--trace / --dataset / --from: give exactly one (a Mooncake trace, a replay dataset, or "
                "a replay result)"
            )
        _checked(lambda: named_numbers(self.tier, "--tier"))
        return self

    def tier_gb(self) -> list[tuple[str, float]]:
        return list(named_numbers(self.tier, "--tier").items())


class SweepConfig(StrictModel):
    """``kvtier plan sweep``: replays of a dataset against the sim over CPU GB x NVMe GB x concurrency."""

    dataset: str = flag(..., "a replay dataset (agent traces, tau2, ShareGPT, ...)")
    dataset_format: str = flag("auto", "the dataset's format (as kvtier replay)")
    cpu_gb: str = flag("0,2", "CPU offload sizes, comma separated (0: none)")
    nvme_gb: str = flag("0", "NVMe offload sizes, comma separated (0: none)")
    concurrency: str = flag("4", "loads: virtual users in flight, comma separated")
    trials: int = flag(2, "trials per point, for the confidence interval", ge=1)
    budget: float = flag(0.0, "seconds for the whole sweep (0: no bound)", ge=0)
    duration: float = flag(0.0, "seconds of dispatch per trial (0: the whole dataset)", ge=0)
    output: str = flag(..., "the sweep's folder (resumed when it holds one)")
    preset: str = flag("h100-llama3.1-8b", "the sim's latency preset")
    sim_model: str = flag("llama3.1-8b", "catalog model sizing the sim's KV")
    gpu_kv_gb: float = flag(2.0, "the sim's GPU KV, GB", gt=0, allow_inf_nan=False)
    num_rounds: int = flag(5, "turns per virtual user (as kvtier replay)", ge=1)
    max_tokens_cap: int | None = flag(None, "as kvtier replay", ge=1)
    nvme_dir: str | None = flag(None, "where NVMe points put their files (default OUTPUT/nvme)")
    replay_args: str | None = flag(
        None, 'more kvtier replay flags for every trial, one string (--replay-args="--skip-too-long")'
    )
    calibration: str | None = flag(
        None,
        "a kvtier ladder of the real server: every trial's sim is calibrated from it (kvtier sim --calibration), "
        "and plan recommend carries its measured error",
    )
    accept_unreliable: bool = flag(False, "as kvtier sim: use a --calibration whose fit the ladder marked unreliable")

    @model_validator(mode="after")
    def _grid(self) -> SweepConfig:
        _checked(lambda: number_list(self.cpu_gb, "--cpu-gb"))
        _checked(lambda: number_list(self.nvme_gb, "--nvme-gb"))
        _checked(lambda: number_list(self.concurrency, "--concurrency", integer=True))
        if 0 in number_list(self.concurrency, "--concurrency", integer=True):
            raise ValueError("--concurrency: must be >= 1")
        return self


class RecommendConfig(PlanOutputFlags):
    """``kvtier plan recommend``: the cheapest swept placement meeting a TTFT p95 SLO, with the knees."""

    from_: str = flag(..., "a kvtier plan sweep folder")
    slo_ttft_p95: float | None = flag(
        None, "seconds: the SLO the placement must meet (its CI's upper end)", gt=0, allow_inf_nan=False
    )
    store_cost: list[str] = flag([], "TIER=$ per GB-month (cpu, nvme): rank by cost")
    concurrency: int | None = flag(None, "only this load", ge=1)
    plot: str | None = flag(None, "PNG: TTFT p95 with its interval and the offload hit share against CPU GB")

    @model_validator(mode="after")
    def _costs(self) -> RecommendConfig:
        _checked(lambda: named_numbers(self.store_cost, "--store-cost"))
        return self


class ViewsConfig(PlanOutputFlags):
    """``kvtier plan views``: one trace, three views (a replay, the planner's prediction, a storage run)."""

    from_: str = flag(..., "a kvtier replay folder (against the sim)")
    fetch_from: str | None = flag(None, "a kvtier bench result of the same tier: its read bandwidth predicts (b)")
    storage: bool = flag(False, "(c): run the requests' KV I/O through kvtier trace replay")
    storage_dir: str | None = flag(None, "(c): the storage tier's directory (default: a temporary one)")
    work: str | None = flag(None, "(c): where the I/O trace and its bench result go (default FROM/views)")
    preset: str = flag("h100-llama3.1-8b", "the sim preset whose prefill model predicts")
    prefill_tps: float | None = flag(None, "instead of the preset's prefill rate, tokens/s", gt=0, allow_inf_nan=False)
    prefill_overhead_ms: float | None = flag(None, "instead of the preset's per-prefill overhead", ge=0)
    model: str | None = flag(None, "catalog model of the sim's KV (default: the replay's, when in the catalog)")
    ladder: str | None = flag(
        None,
        "a kvtier ladder of the replay's server: (b) from its measured curves; then the replay may be against any "
        "server (a real vLLM: its prompt split from usage.cached_tokens)",
    )

    @model_validator(mode="after")
    def _what(self) -> ViewsConfig:
        if not self.fetch_from and not self.storage and not self.ladder:
            raise ValueError(
                "--fetch-from / --storage / --ladder: give a bench result or a ladder to predict from, "
                "--storage, or both"
            )
        if self.ladder and (self.storage or self.prefill_tps or self.prefill_overhead_ms is not None):
            raise ValueError(
                "--ladder: the ladder's measured curves predict (b); --storage, --prefill-tps and "
                "--prefill-overhead-ms go with the preset's model"
            )
        return self


PlanConfig = (
    BytesConfig
    | BreakevenConfig
    | GateConfig
    | CapacityConfig
    | FetchConfig
    | ValueConfig
    | RetentionConfig
    | RecommendConfig
    | ViewsConfig
)
"""The configs of the subcommands that answer (sweep runs trials and writes its own sweep.json)."""

__all__ = [
    "BreakevenConfig",
    "BytesConfig",
    "CapacityConfig",
    "FetchConfig",
    "GateConfig",
    "ModelFlags",
    "PlanConfig",
    "PlanOutputFlags",
    "RecommendConfig",
    "RetentionConfig",
    "SweepConfig",
    "ValueConfig",
    "ViewsConfig",
    "gate_case",
    "named_numbers",
    "number_list",
]
