"""The typed result of ``kvtier ladder`` (ladder.json) and the timing model it fits (docs/serving.md "The ladder").

A ladder measures one server's TTFT by context length and by the cache tier that served the prefix: cold (full
prefill), GPU (the prefix again at once), and each offload tier (the prefix pushed out of every tier above it,
then asked again). Every request is bracketed by scrapes of the server's counters and is ``verified`` only when
they show the intended source. The fit (``LadderFit``) is the server's timing model — prefill as a function of
(new tokens, cached context), fetch per tier against tokens, TPOT against running sequences — and is what
``kvtier sim --calibration`` and ``kvtier plan gate --from`` read.

``Timing`` is the one shape of a latency model: a ladder's fit (``source: measured``) or a sim preset
(``source: assumed``), so every consumer evaluates time by the same formulas (``prefill_s``, ``tpot_s``,
``fetch_s``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier.config.ladder import LadderConfig
from kvtier.results.envelope import Envelope, Section
from kvtier.results.outcome import Failure


class PrefillModel(Section):
    """prefill_s(new, cached) = overhead_s + s_per_prompt_token x (new + cached) + s_per_token x new
    + s_per_token_pair x new x (cached + new / 2).

    The second term is the request's handling per prompt token, cached or not (its body, tokenization, block
    hashing); the third is compute per new token; the last is attention: each new token attends over the cached
    context and the new tokens before it, so a fresh prompt's prefill grows with the square of its length and a
    prefix hit's remaining prefill is not that of a fresh prompt of the same length. ``s_per_token_pair`` 0 is a
    linear model (the presets')."""

    overhead_s: float = Field(ge=0)
    s_per_token: float = Field(ge=0)
    s_per_token_pair: float = Field(0.0, ge=0)
    s_per_prompt_token: float = Field(0.0, ge=0)

    def seconds(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        n, c = max(0.0, new_tokens), max(0.0, cached_tokens)
        return self.overhead_s + self.s_per_prompt_token * (n + c) + self.compute_s(n, c)

    def compute_s(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """The per-token part alone (no overhead): what one prefill chunk costs. Chunks add up exactly: the
        cost of n1 then n2 tokens equals that of n1 + n2 at once."""
        n = max(0.0, new_tokens)
        return self.s_per_token * n + self.s_per_token_pair * n * (max(0.0, cached_tokens) + n / 2)


class DecodeModel(Section):
    """tpot_s(running) = tpot_s + s_per_extra_seq x (running - 1): a decode step's time with ``running``
    sequences in the batch."""

    tpot_s: float = Field(ge=0)
    s_per_extra_seq: float = Field(0.0, ge=0)

    def at(self, running: int) -> float:
        return self.tpot_s + self.s_per_extra_seq * max(0, running - 1)


class FetchModel(Section):
    """fetch_s(tokens) = overhead_s + s_per_token x tokens for one offload tier (the server's name for it): the
    TTFT a prefix served from the tier costs beyond the prefill of what it did not hold."""

    tier: str
    overhead_s: float = Field(ge=0)
    s_per_token: float = Field(ge=0)
    bytes_per_s: float | None = None  # kv_bytes_per_token / s_per_token, where the bytes per token are known
    points: int = 0
    median_abs_rel_err: float | None = None

    def seconds(self, tokens: float) -> float:
        return self.overhead_s + self.s_per_token * max(0.0, tokens)


class MeasuredRange(Section):
    """Where a measured model holds: outside it a consumer extrapolates and says so."""

    max_prompt_tokens: int
    max_cached_tokens: int
    max_running: int


class Timing(Section):
    """A latency model with its provenance: ``measured`` (a ladder's fit; ``origin`` names the file) or
    ``assumed`` (a sim preset's figures; ``origin`` names the preset, ``figures`` says where each came from)."""

    source: Literal["measured", "assumed"]
    origin: str
    prefill: PrefillModel
    decode: DecodeModel
    fetch: list[FetchModel] = Field(default_factory=list)
    range: MeasuredRange | None = None
    figures: dict[str, str] = Field(default_factory=dict)  # figure -> its source, in words

    def fetch_for(self, tier: str) -> FetchModel | None:
        return next((f for f in self.fetch if f.tier == tier), None)


class TierFacts(Section):
    """An offload tier the ladder found on the server: its name as the server calls it, how many tokens it holds
    (None: the server does not say; --flood-tokens then sizes its flood) and the counter that verifies it."""

    name: str
    capacity_tokens: int | None
    counter: str | None  # the series whose delta shows the tokens it served; None: the server exposes none


class ServerFacts(Section):
    base_url: str
    model: str
    kind: Literal["kvtier-sim", "vllm", "unknown"]
    max_model_len: int | None
    block_tokens: int | None
    gpu_kv_tokens: int | None
    kv_bytes_per_token: int | None
    tiers: list[TierFacts]
    counters: list[str]  # the verifying series the server exposes
    prompt_overhead_tokens: int  # tokens the chat template adds to a prompt (measured by two probes)
    tokens_per_word: float  # the server's tokens per filler word (measured by two probes)
    notes: list[str] = Field(default_factory=list)


class Shown(Section):
    """What the counters (and usage) showed of one request: its prompt's tokens by source."""

    gpu_hit_tokens: int | None
    external_hit_tokens: int | None
    tiers: dict[str, int] = Field(default_factory=dict)
    usage_cached_tokens: int | None
    basis: Literal["counters", "usage", "engine", "none"]  # engine: the request's own record (--engine-log)


class LadderPoint(Section):
    """One measured request (docs/metrics.md "ladder.json")."""

    seq: int  # order sent
    group: int  # the (context, new tokens, repeat) cell it belongs to
    source: str  # intended: cold, gpu, or an offload tier's name
    context_tokens: int  # the prefix asked for (nominal)
    new_tokens: int  # tokens on top of it (nominal)
    repeat: int
    prompt_tokens: int | None
    cached_tokens: int | None  # tokens the counters showed were not computed (None: unknown)
    ttft_s: float | None
    server_ttft_s: float | None
    verified: bool
    shown: Shown
    why: str | None = None  # why unverified (or failed)
    flood_tokens: int = 0  # tokens flooded right before it (to push the prefix down)
    held_back: bool = False  # kept out of the fit, used to check it
    start_unix_s: float
    status: Literal["ok", "error"]
    cause: str | None = None


class TpotPoint(Section):
    running: int
    tpot_s: float | None
    requests: int
    failed: int
    bursty: int = 0  # ok requests left out: their tokens came in a few bursts, not one by one


class CellStats(Section):
    source: str
    context_tokens: int
    new_tokens: int
    verified: int
    unverified: int
    ttft_s_median: float | None
    ttft_s_min: float | None
    ttft_s_max: float | None
    ttft_s_cv: float | None  # coefficient of variation over the verified repeats


class FitResidual(Section):
    source: str
    new_tokens: int
    cached_tokens: int
    measured_s: float
    predicted_s: float
    rel_err: float
    held_back: bool


class LadderFit(Section):
    timing: Timing
    prefill_points: int
    prefill_fit_median_abs_rel_err: float | None
    prefill_holdout_median_abs_rel_err: float | None
    prefill_holdout_points: int
    tpot_median_abs_rel_err: float | None
    superlinear: bool  # the attention term is positive: a long prompt's prefill grows faster than its length
    residuals: list[FitResidual]
    unreliable: list[str] = []  # why the fit is not fit to calibrate a twin (ladder/fit.py bounds); empty: reliable


class HostLoad(Section):
    """The machine while the ladder ran (the engine under test included, where it shares the host)."""

    cpus: int
    cpu_busy_share: float | None  # /proc/stat over the run: not idle, not iowait
    load1_start: float
    load1_end: float


class LadderResult(Envelope):
    """One ``kvtier ladder`` (ladder.json)."""

    benchmark: Literal["kvtier ladder"] = "kvtier ladder"
    config: LadderConfig
    server: ServerFacts
    points: list[LadderPoint]
    cells: list[CellStats]
    tpot: list[TpotPoint]
    fit: LadderFit | None
    failures: dict[str, Failure]  # failed requests (measured, flood, probe) by cause
    requests_sent: int  # measured, flood and probe requests
    wall_s: float
    host_load: HostLoad | None = None
    remeasured: dict[str, int] = {}  # cells measured again for their spread: extra rounds each


def load_fitted(path: str, flag: str, refuse_unreliable: str | None = None) -> tuple[LadderResult, LadderFit]:
    """A kvtier ladder result that has a fit (what ``sim --calibration``, ``plan gate --from`` and ``plan
    value|views --ladder`` read); a ConfigError naming ``flag`` otherwise. ``refuse_unreliable``: the flag that
    would accept a fit whose errors are past their bounds (``--accept-unreliable``), which is refused without it."""
    from kvtier.errors import ConfigError
    from kvtier.results import load

    r = load(path)
    if not isinstance(r, LadderResult):
        raise ConfigError(f"{flag} {path}: a {r.benchmark} result, not a kvtier ladder result")
    if r.fit is None:
        raise ConfigError(f"{flag} {path}: the ladder has no fit (status {r.status.value}: {r.stop_reason.message})")
    if refuse_unreliable and r.fit.unreliable:
        raise ConfigError(
            f"{flag} {path}: the ladder's fit is unreliable — {'; '.join(r.fit.unreliable)} — so a twin calibrated "
            f"from it would carry that error; measure again on a quieter machine (kvtier ladder), or give "
            f"{refuse_unreliable} to use it anyway"
        )
    return r, r.fit


__all__ = [
    "load_fitted",
    "CellStats",
    "DecodeModel",
    "FetchModel",
    "FitResidual",
    "LadderFit",
    "LadderPoint",
    "LadderResult",
    "MeasuredRange",
    "PrefillModel",
    "ServerFacts",
    "Shown",
    "TierFacts",
    "Timing",
    "TpotPoint",
]
