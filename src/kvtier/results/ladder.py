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

from pathlib import Path
from typing import Literal

from pydantic import Field

from kvtier.config.ladder import LadderConfig
from kvtier.results.envelope import Envelope, Section
from kvtier.results.outcome import Failure


class PrefillModel(Section):
    """prefill_s(new, cached) = overhead_s + handling + s_per_token x new + s_per_token_pair x new x (cached + new/2),
    handling = s_per_prompt_token x (new + cached) + s_per_prompt_char x the prompt's characters.

    Handling is the request's own work before any compute, cached or not: its body, the chat template, tokenizing,
    block hashing; it grows with both tokens and characters, which a prompt mixes in its own proportion (the
    ladder's word text has ``prompt_chars_per_token``; an agent trace's code far fewer), so the ladder's handling
    sweep times cached prompts of two kinds of text to tell the two apart. The third term is compute per new
    token; the last is attention: each new token attends over the cached context and the new tokens before it, so
    a fresh prompt's prefill grows with the square of its length and a prefix hit's remaining prefill is not that
    of a fresh prompt of the same length. ``s_per_token_pair`` 0 is a linear model (the presets')."""

    overhead_s: float = Field(ge=0)
    s_per_token: float = Field(ge=0)
    s_per_token_pair: float = Field(0.0, ge=0)
    s_per_prompt_token: float = Field(0.0, ge=0)
    s_per_prompt_char: float = Field(0.0, ge=0)
    prompt_chars_per_token: float | None = Field(None, gt=0)  # the ladder's text: characters where none are given

    def seconds(self, new_tokens: float, cached_tokens: float = 0.0, chars: float | None = None) -> float:
        n, c = max(0.0, new_tokens), max(0.0, cached_tokens)
        return self.overhead_s + self.handling_s(n + c, chars) + self.compute_s(n, c)

    def handling_s(self, prompt_tokens: float, chars: float | None = None) -> float:
        """The handling of a prompt of ``prompt_tokens`` tokens and ``chars`` characters (None: as many as the
        ladder's own text has for that many tokens)."""
        if chars is None:
            chars = prompt_tokens * (self.prompt_chars_per_token or 0.0)
        return self.s_per_prompt_token * prompt_tokens + self.s_per_prompt_char * chars

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


class StepModel(Section):
    """How a prefill and the running batch share the engine's steps, fitted to cold prompts' TTFTs measured while
    sequences decode (the ladder's interference sweep): a step that computes a prefill chunk lasts the chunk's
    compute plus ``share`` of the batch's decode step; a decode-only step keeps the engine busy for ``share`` of
    its length (the rest is the tokens' way out: detokenizing, streaming), and a prefill that arrives after that
    starts at once. 1: decode and prefill add, one forward pass computing both; near 0: the running streams cost a
    prefill nothing; above 1: the host's work for those streams slows the engine further."""

    share: float = Field(ge=0)
    points: int
    median_abs_rel_err: float | None = None
    # the request's handling (results/ladder.py PrefillModel.handling_s) takes (1 + handling_load) of its time alone
    # while sequences run: the API server tokenizes on the cores the engine computes on (a CPU engine, a host-bound
    # one). Fitted to long cached prompts timed alone and while sequences decode; 0: not measured
    handling_load: float = Field(0.0, ge=0)
    handling_points: int = 0

    def described(self) -> str:
        """Where the model came from, in words (``Timing.figures["step"]``)."""
        out = f"fitted to {self.points} cold prompts timed while sequences decode"
        if self.handling_points:
            out += (
                f"; handling {1 + self.handling_load:.2f}x as long with sequences running, by {self.handling_points} "
                "long cached prompts timed alone and among them"
            )
        return out


def loaded_ttft(timing: Timing, prompt_tokens: float, running: int, budget: int, share: float) -> float:
    """A cold prompt's TTFT while ``running`` sequences decode, by the step model (the sim's engine,
    sim/server.py ``_steps``, follows the same rule): as alone, plus ``share`` of a decode step for each of its
    chunks (``budget`` less the decode tokens each), plus the wait for a decode-only step's busy part when it
    arrives inside one (``share``² x half a step on average, a step being busy for ``share`` of it)."""
    pm, d = timing.prefill, timing.decode.at(running) if running > 0 else 0.0
    n = max(1.0, prompt_tokens)
    chunks = -(-n // max(1, budget - running))
    busy = min(1.0, share)
    return pm.seconds(n, 0.0) + share * chunks * d + busy * busy * d / 2


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
    step: StepModel | None = None  # None: the interference was not measured (the sim then adds nothing: share 0)
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


class LoadedPoint(Section):
    """A prompt's TTFT measured while ``running`` other sequences decode (the interference sweep); ``valid`` when
    every one of them was still decoding as its first token came. A cold prompt, or (``cached_tokens`` set) a long
    cached one, whose TTFT alone, measured just before on the same prefix, is ``alone_s``."""

    running: int
    prompt_tokens: int | None
    ttft_s: float | None
    valid: bool
    why: str | None = None
    cached_tokens: int | None = None
    alone_s: float | None = None


class HandlingPoint(Section):
    """A cached prompt's TTFT from the handling sweep: ``style`` words (the ladder's usual text) or dense (single
    letters: far fewer characters per token), ``chars`` the characters of its text; ``valid`` when the server said
    it found at least ``HANDLING_HIT_SHARE`` of it cached."""

    style: Literal["words", "dense"]
    prompt_tokens: int | None
    cached_tokens: int | None
    chars: int
    ttft_s: float | None
    valid: bool


HANDLING_HIT_SHARE = 0.9


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
    loaded_median_abs_rel_err: float | None = None  # the step model's error on the interference sweep's points
    handling_median_abs_rel_err: float | None = None  # the prefill model's error on the handling sweep's points
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
    loaded: list[LoadedPoint] = []  # the interference sweep: TTFT with sequences decoding
    handling: list[HandlingPoint] = []  # the handling sweep: cached prompts of two kinds of text
    fit: LadderFit | None
    failures: dict[str, Failure]  # failed requests (measured, flood, probe) by cause
    requests_sent: int  # measured, flood and probe requests
    wall_s: float
    host_load: HostLoad | None = None
    remeasured: dict[str, int] = {}  # cells measured again for their spread: extra rounds each


class TwinCheckRow(Section):
    """One row of a sim-vs-real check (``benchmarks/sim_vs_vllm.py --ttft``): a TTFT quantile of a trace replayed
    against the real server and against the sim calibrated from the ladder, same trace, same load."""

    trace: str = Field(max_length=300)
    concurrency: int = Field(ge=1)
    offload: str = Field(max_length=100)  # the tier both ran with: none, or its kind
    quantile: Literal["p50", "p95"]
    real_s: float = Field(gt=0, lt=1e6, allow_inf_nan=False)
    twin_s: float = Field(gt=0, lt=1e6, allow_inf_nan=False)


class TwinCheck(Section):
    """``<ladder>.twin-check.json``: the latest sim-vs-real table of one ladder (``ladder_sha256``: of its file)."""

    ladder_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    written: str = Field(max_length=64)
    rows: list[TwinCheckRow] = Field(min_length=1, max_length=10_000)


TWIN_BAND = (5.0, 95.0)
"""The percentiles of the ladder's real-over-predicted ratios that bound a twin's time (its central 90 %); a check's
rows, few and each a whole replay's quantile, widen it by their extremes."""
TWIN_RATIO_BOUNDS = (1e-3, 999.0)
"""A twin error's ratios are kept within these (a point or check row past them is a broken measurement, not a
band: the ratios say it in ``basis``)."""
MAX_TWIN_CHECK_BYTES = 4 << 20


class TwinError(Section):
    """How far a twin calibrated from a ladder strays from the real server, as measured: the real time over the
    twin's lies between ``ratio_low`` and ``ratio_high`` — the central 90 % of the ratios over the ladder's own
    verified points (held-back cells and fetch points included), widened by every row of a sim-vs-real check of
    the same ladder where there is one. A time the twin predicts, t, is carried as [t x ratio_low, t x ratio_high]
    (a saving too: the fit's error is shared by the two prompts it is the difference of)."""

    ratio_low: float = Field(ge=TWIN_RATIO_BOUNDS[0], le=1)
    ratio_high: float = Field(ge=1, le=TWIN_RATIO_BOUNDS[1])
    points: int = Field(ge=0)  # ladder points behind it
    checked_rows: int = Field(0, ge=0)  # rows of a sim-vs-real check that widened it
    basis: str = Field(max_length=4000)

    def band(self, seconds: float) -> tuple[float, float]:
        return round(seconds * self.ratio_low, 6), round(seconds * self.ratio_high, 6)


def twin_check_path(ladder: str | Path) -> Path:
    p = Path(ladder)
    return p.with_name(p.name.removesuffix(".json") + ".twin-check.json")


def twin_error(fit: LadderFit, ladder: str | Path) -> TwinError:
    """The error a twin calibrated from ``fit`` (the ladder file ``ladder``) carries into every time it predicts
    (``TwinError``). A check beside the ladder (``twin_check_path``) is used only if it names this ladder's bytes."""
    import hashlib

    import numpy as np
    from pydantic import ValidationError

    ratios = [r.measured_s / r.predicted_s for r in fit.residuals if r.predicted_s > 0 and r.measured_s > 0]
    lo, hi = (float(v) for v in np.percentile(ratios, TWIN_BAND)) if ratios else (1.0, 1.0)
    basis = [f"the {TWIN_BAND[0]:g}th-{TWIN_BAND[1]:g}th percentiles of real/predicted over the ladder's {len(ratios)} "
             f"fitted, held-back and fetch points"]  # fmt: skip
    rows = 0
    check = twin_check_path(ladder)
    if check.is_file():
        try:
            if check.stat().st_size > MAX_TWIN_CHECK_BYTES:
                raise ValueError(f"larger than {MAX_TWIN_CHECK_BYTES} bytes")
            tc = TwinCheck.model_validate_json(check.read_bytes())
        except (ValidationError, ValueError, OSError) as e:
            basis.append(f"{check.name} is not a twin check ({str(e).splitlines()[0][:120]}): not used")
        else:
            if tc.ladder_sha256 != hashlib.sha256(Path(ladder).read_bytes()).hexdigest():
                basis.append(f"{check.name} checked another ladder than this file: not used")
            else:
                got = [r.real_s / r.twin_s for r in tc.rows]
                lo, hi, rows = min(lo, *got), max(hi, *got), len(got)
                basis.append(f"widened to the extremes of the {rows} rows of its sim-vs-real check {check.name} "
                             f"({tc.written})")  # fmt: skip
    low, high = max(round(min(lo, 1.0), 4), TWIN_RATIO_BOUNDS[0]), min(round(max(hi, 1.0), 4), TWIN_RATIO_BOUNDS[1])
    if (low, high) != (round(min(lo, 1.0), 4), round(max(hi, 1.0), 4)):
        basis.append(f"ratios {lo:.3g}-{hi:.3g} held within {TWIN_RATIO_BOUNDS[0]:g}-{TWIN_RATIO_BOUNDS[1]:g}")
    return TwinError(ratio_low=low, ratio_high=high, points=len(ratios), checked_rows=rows,
                     basis="; ".join(basis)[:4000])  # fmt: skip


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
    "loaded_ttft",
    "HandlingPoint",
    "HANDLING_HIT_SHARE",
    "LoadedPoint",
    "StepModel",
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
    "TwinCheck",
    "TwinCheckRow",
    "TwinError",
    "twin_check_path",
    "twin_error",
]
