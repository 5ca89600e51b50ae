"""The typed answers of ``kvtier plan`` and the result files that hold them.

Every answer is a ``Section`` (unknown keys are errors when read back). ``--json`` prints the answer alone;
``--output FILE`` writes it inside the envelope every kvtier result shares (``Plan*Result``: the subcommand's
config, the host, status ``complete`` and stop code ``answered``), which ``results.load`` reads back,
``kvtier report`` renders and ``kvtier compare`` sets side by side. ``kvtier plan sweep`` writes its own
``SweepResult`` (results/sweep.py)."""

from __future__ import annotations

from typing import Literal

from kvtier.config.plan import (
    BreakevenConfig,
    BytesConfig,
    CapacityConfig,
    FetchConfig,
    GateConfig,
    RecommendConfig,
    RetentionConfig,
    ValueConfig,
    ViewsConfig,
)
from kvtier.results.envelope import Envelope, Section
from kvtier.results.ladder import TwinError


# -- bytes, breakeven, gate, capacity, fetch (plan/reports.py builds them) -----------------------------------------
class CatalogRow(Section):
    model: str
    attention: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    kv_bytes_per_token: int
    gib_per_million_tokens: float
    geometry: str  # "spec": the MLPerf spec's figures, not the released model's (modelspec.SPEC_GEOMETRY)


class CatalogReport(Section):
    models: list[CatalogRow]


class BytesReport(Section):
    model: str
    attention: str
    dtype: str
    tensor_parallel: int
    kv_bytes_per_token: float
    kv_kib_per_token: float
    entry_shape_per_token: list[int]
    gib_per_million_tokens: float


class LinkCosts(Section):
    net_bw: str
    net_bw_bytes_per_s: float
    rtt: str
    rtt_s: float
    decode_local_s_per_token: float
    stream_remote_s_per_token: float
    query_shipping_s_per_token: float
    fetch_s: float
    fetch_compressed_s: float
    recompute_s: float
    breakeven_exact_bytes_per_s: float | None
    breakeven_exact_note: str
    min_context_for_fetch_tokens: float | None
    verdict: str


class BreakevenReport(Section):
    model: str
    kv_bytes_per_token: float
    context_tokens: int
    kv_bytes: float
    prefill_tokens_per_s: float
    hbm_bytes_per_s: float
    stages: int
    compression: float
    recompute_s: float
    breakeven_bytes_per_s: float
    breakeven_compressed_bytes_per_s: float
    breakeven_gbit_per_s: float
    breakeven_compressed_gbit_per_s: float
    links: list[LinkCosts]


class GateRow(Section):
    case: str
    net_bw_bytes_per_s: float
    rtt_s: float
    compression: float
    fetch_s: float
    recompute_s: float
    verdict: str
    reason: str


class GateReport(Section):
    model: str
    kv_bytes_per_token: float
    context_tokens: int
    prefill_tokens_per_s: float
    cases: list[GateRow]


class TokensNeed(Section):
    tokens: int
    kv_bytes: float
    with_headroom_bytes: float
    headroom: float


class TierHolds(Section):
    capacity_bytes: float
    tokens: int
    users: int


class CapacityReport(Section):
    model: str
    kv_bytes_per_token: float
    gib_per_million_tokens: float
    tokens: TokensNeed | None = None
    tiers: dict[str, TierHolds]


class FetchSource(Section):
    model: str
    status: str
    file: str


class FetchRow(Section):
    tier: str
    context_tokens: int
    kv_bytes: float
    measured_mean_op_bytes: float
    measured_read_mean_ms: float
    measured_read_p95_ms: float
    fetch_mean_s: float
    fetch_p95_s: float
    recompute_s: float
    verdict: str
    extrapolated: bool


class FetchReport(Section):
    source: FetchSource
    model: str
    kv_bytes_per_token: float
    rows: list[FetchRow]


# -- gate --from a ladder (plan/ladder_gate.py) --------------------------------------------------------------------
class LadderGateRow(Section):
    tier: str
    context_tokens: int
    new_tokens: int
    recompute_s: float
    fetch_s: float
    verdict: str  # fetch | recompute
    measured_cold_s: float | None  # the cell's verified median, where measured
    measured_tier_s: float | None
    measured_faster: str | None  # fetch | recompute, from the medians
    agrees: bool | None  # the verdict names the measured faster one (None: not both measured)
    extrapolated: bool  # the prompt is longer than the ladder measured


class BreakEven(Section):
    tier: str
    new_tokens: int
    context_tokens: int | None  # the shortest context at which fetching wins
    note: str


class LadderGateReport(Section):
    ladder: str
    timing_source: str
    rows: list[LadderGateRow]
    breakeven: list[BreakEven]
    checked: int  # rows with both medians measured
    agreed: int


# -- value (plan/value.py) -----------------------------------------------------------------------------------------
class Input(Section):
    name: str
    value: float | None
    unit: str
    source: Literal["measured", "given", "absent", "derived"]  # derived: from a ladder's measured curves
    note: str = ""


class TierValue(Section):
    tier: str
    tokens_served: int
    hit_rate: float  # of all prompt tokens of the ok requests
    requests_hit: int
    tokens_per_hour: float
    prefill_s_avoided_per_hour: float | None
    fetch_s_per_hour: float | None
    gpu_s_saved_per_hour: float | None  # prefill avoided - fetch
    latency_saved_per_hit_s: float | None
    in_time: str | None = None  # the hit rate and the fetch as one verdict ("hits, but the fleet got slower: ...")
    value_usd_per_hour: float | None  # gpu_cost x GPU seconds saved (prefill avoided - fetch)
    cost_usd_per_hour: float | None  # store_cost x GB / 730
    pays: bool | None
    breakeven_hit_rate: float | None
    # a calibrated twin's times (plan/value.py with_twin): the intervals its measured error allows (None where the
    # time was not the twin's); pays_tie: the value's interval holds the store's cost (or zero), so the twin cannot
    # tell whether the tier pays
    prefill_s_avoided_per_hour_band: tuple[float, float] | None = None
    fetch_s_per_hour_band: tuple[float, float] | None = None
    gpu_s_saved_per_hour_band: tuple[float, float] | None = None
    latency_saved_per_hit_s_band: tuple[float, float] | None = None
    value_usd_per_hour_band: tuple[float, float] | None = None
    pays_tie: bool = False


class LadderCheckRow(Section):
    """One part of the requests' TTFT, measured in the engine beside what a ladder's curves predict for the same
    requests: their difference is the ladder's error on this replay."""

    part: str  # fetch:<tier> (that tier's share of the requests' fetch) or recompute (the prefill of what no tier held)
    requests: int
    measured_s: float
    ladder_s: float | None  # None: the ladder has no curve for it (a tier it did not measure)
    error: float | None  # (ladder - measured) / measured


class ValueReport(Section):
    source: str
    requests: int  # ok requests with the decomposition
    wall_s: float
    prompt_tokens: int
    inputs: list[Input]
    tiers: list[TierValue]
    decomposition: str = "sim"  # where the requests' parts came from: the sim's responses, or measured-in-engine
    ladder: str | None = None  # --ladder beside an engine-measured replay
    ladder_check: list[LadderCheckRow] = []
    twin_error: TwinError | None = None  # the error every derived time carries (a ladder, or a calibrated sim's)


# -- retention (plan/retention.py) ---------------------------------------------------------------------------------
class CurvePoint(Section):
    capacity_tokens: int
    capacity_bytes: int
    hit_fraction: float  # of every block token accessed
    reuse_hit_fraction: float | None  # of the tokens that had an earlier access (the most any cache can serve)


class Window(Section):
    p10: float | None
    p50: float | None
    p90: float | None


class TierRetention(Section):
    tier: str
    capacity_bytes: int
    capacity_tokens: int
    cumulative_capacity_tokens: int  # this tier and every tier above it in the waterfall
    hit_fraction: float  # the share of all accessed tokens this tier serves
    cumulative_hit_fraction: float  # served by this tier or one above
    fills_at: float | None  # when this tier first evicts (in the stream's unit); None: never
    window: Window  # the history held down to this tier, in the stream's unit, once it has filled
    window_requests: Window  # the same in requests
    holds_whole_trace: bool


class WorkingSetPoint(Section):
    t: float
    requests: int
    distinct_tokens: int  # every block touched so far
    distinct_bytes: int
    interval_tokens: int  # the distinct blocks touched since the previous point
    interval_bytes: int


class PolicyPoint(Section):
    """At one capacity, the share of accessed tokens an exact LRU serves and the share fanout protection does
    (plan/retention.py: blocks two or more continuations followed kept over the others, up to protect_share)."""

    capacity_tokens: int
    capacity_bytes: int
    lru_hit_fraction: float
    fanout_hit_fraction: float


class RetentionReport(Section):
    source: str
    order: str
    unit: Literal["s", "requests"]
    model: str
    kv_bytes_per_token: int
    block_tokens: int
    requests: int
    accesses: int
    accessed_tokens: int
    reused_tokens: int  # accesses that had an earlier one (the most any cache can serve)
    distinct_tokens: int
    distinct_bytes: int
    span: float  # the stream's last request time, in its unit
    need_tokens: dict[str, float | None]  # the LRU capacity each reuse needs: p50, p90, p99
    tiers: list[TierRetention]
    curve: list[CurvePoint]
    working_set: list[WorkingSetPoint]
    policies: list[PolicyPoint] = []  # LRU against fanout protection, on the same accesses
    protect_share: float | None = None


# -- recommend (plan/recommend.py) ---------------------------------------------------------------------------------
class Interval(Section):
    mean: float | None
    low: float | None  # the 95 % confidence interval of the mean (None with fewer than two trials)
    high: float | None
    n: int
    sd: float | None = None  # the trials' standard deviation (None with fewer than two)
    clipped: bool = False  # an end was cut at what the quantity can be (a time below 0 s, a share outside 0-1)


class PointStats(Section):
    point: str
    cpu_gb: float
    nvme_gb: float
    concurrency: int
    trials: int  # complete trials used
    trials_not_complete: int
    ttft_p95_s: Interval
    ttft_p50_s: Interval
    gpu_hit_share: Interval  # of prompt tokens, from the GPU prefix cache
    offload_hit_share: Interval  # of prompt tokens, from the offload tiers
    requests_per_s: Interval
    cost_usd_per_hour: float | None
    meets_slo: bool | None  # None: no complete trial, or no --slo-ttft-p95
    note: str = ""
    # trials against a calibrated sim: the TTFT p95 interval widened by the twin's measured error (meets_slo and ties
    # are decided on it: more trials narrow the trials' spread, never the calibration's error)
    twin_error: TwinError | None = None
    ttft_p95_s_with_twin: Interval | None = None


class Knee(Section):
    nvme_gb: float
    concurrency: int
    hit_rate_knee_cpu_gb: float | None
    ttft_knee_cpu_gb: float | None
    points: int


class Pick(Section):
    concurrency: int
    point: str | None  # None: no point meets the SLO at this load
    by: str  # cost, or size (no cost for some tier used)
    sentence: str
    # a cheaper point (smaller, by size) whose interval reaches below the SLO without meeting it: it may meet it
    # too, so the pick is a tie, not a winner; and the trials it would need for its interval to leave the SLO
    tie_with: str | None = None
    trials_to_separate: int | None = None


class Recommendation(Section):
    source: str
    sweep_status: str
    slo_ttft_p95_s: float | None
    store_cost: dict[str, float]  # $/GB-month, given
    points: list[PointStats]
    knees: list[Knee]
    picks: list[Pick]


# -- views (plan/views.py) -----------------------------------------------------------------------------------------
class TurnView(Section):
    turn: int
    requests: int
    measured_ttft_s: float
    measured_fetch_s: float | None  # None: the server reports no fetch (a real vLLM)
    predicted_ttft_s: float | None  # (b): the bench's bandwidth
    predicted_fetch_s: float | None
    ttft_error: float | None  # predicted / measured - 1
    storage_ttft_s: float | None  # (c): the storage run's bandwidth
    storage_fetch_s: float | None
    storage_ttft_error: float | None
    # (b) from a ladder: the interval its measured error allows (results/ladder.py TwinError), and whether the
    # measured TTFT lies in it
    predicted_ttft_s_band: tuple[float, float] | None = None
    within_band: bool | None = None


class ViewInput(Section):
    name: str
    value: float | None
    unit: str
    source: str  # measured (where) or given (where)


class ViewsReport(Section):
    source: str
    requests: int
    kv_bytes_per_token: int
    inputs: list[ViewInput]
    turns: list[TurnView]
    median_abs_ttft_error: float | None  # (b) over the turns
    median_abs_storage_ttft_error: float | None  # (c)
    storage_result: str | None  # the storage run's bench result file
    findings: list[str]
    twin_error: TwinError | None = None  # --ladder: the error (b)'s predictions carry


# -- the result files ------------------------------------------------------------------------------------------
class PlanBytesResult(Envelope):
    benchmark: Literal["kvtier plan bytes"] = "kvtier plan bytes"
    config: BytesConfig
    answer: BytesReport | CatalogReport


class PlanBreakevenResult(Envelope):
    benchmark: Literal["kvtier plan breakeven"] = "kvtier plan breakeven"
    config: BreakevenConfig
    answer: BreakevenReport


class PlanGateResult(Envelope):
    benchmark: Literal["kvtier plan gate"] = "kvtier plan gate"
    config: GateConfig
    answer: GateReport | LadderGateReport


class PlanCapacityResult(Envelope):
    benchmark: Literal["kvtier plan capacity"] = "kvtier plan capacity"
    config: CapacityConfig
    answer: CapacityReport


class PlanFetchResult(Envelope):
    benchmark: Literal["kvtier plan fetch"] = "kvtier plan fetch"
    config: FetchConfig
    answer: FetchReport


class PlanValueResult(Envelope):
    benchmark: Literal["kvtier plan value"] = "kvtier plan value"
    config: ValueConfig
    answer: ValueReport


class PlanRetentionResult(Envelope):
    benchmark: Literal["kvtier plan retention"] = "kvtier plan retention"
    config: RetentionConfig
    answer: RetentionReport


class PlanRecommendResult(Envelope):
    benchmark: Literal["kvtier plan recommend"] = "kvtier plan recommend"
    config: RecommendConfig
    answer: Recommendation


class PlanViewsResult(Envelope):
    benchmark: Literal["kvtier plan views"] = "kvtier plan views"
    config: ViewsConfig
    answer: ViewsReport


PlanResult = (
    PlanBytesResult
    | PlanBreakevenResult
    | PlanGateResult
    | PlanCapacityResult
    | PlanFetchResult
    | PlanValueResult
    | PlanRetentionResult
    | PlanRecommendResult
    | PlanViewsResult
)
PLAN_RESULTS: dict[str, type[PlanResult]] = {
    str(m.model_fields["benchmark"].default): m
    for m in (
        PlanBytesResult,
        PlanBreakevenResult,
        PlanGateResult,
        PlanCapacityResult,
        PlanFetchResult,
        PlanValueResult,
        PlanRetentionResult,
        PlanRecommendResult,
        PlanViewsResult,
    )
}
"""Each plan result's model by its ``benchmark`` (what ``results.load`` dispatches on)."""
