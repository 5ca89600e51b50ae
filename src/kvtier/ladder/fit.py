"""Fit a server's timing model to its verified ladder points (results/ladder.py ``Timing``).

Prefill: TTFT of cold and GPU points = overhead + s_per_prompt_token x (n + c) + s_per_token x n + s_per_token_pair
x n x (c + n/2), n the tokens computed and c the tokens cached (both from the counters). Least squares on *relative*
error (each row divided by
its TTFT: the points span orders of magnitude, and a 10 ms error matters at 20 ms, not at 2 s), coefficients kept
non-negative by trying every subset of them and keeping the best non-negative solution (four coefficients: sixteen
small solves). The (context, new tokens) cells held back (``--holdout``) are left out and scored after.

Fetch per tier: what a tier point's TTFT leaves over the fitted prefill of what it computed, = overhead + s_per_token
x tokens served by the tier. TPOT: tpot + s_per_extra_seq x (running - 1).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from kvtier.results.ladder import (
    DecodeModel,
    FetchModel,
    FitResidual,
    HandlingPoint,
    LadderFit,
    LadderPoint,
    LoadedPoint,
    MeasuredRange,
    PrefillModel,
    StepModel,
    Timing,
    TpotPoint,
    loaded_ttft,
)

MIN_PREFILL_POINTS = 3


def nonneg_relative_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin over beta >= 0 of sum(((x beta - y) / y)^2), by trying every support set (few columns)."""
    w = 1.0 / np.maximum(np.abs(y), 1e-9)
    xw, yw = x * w[:, None], y * w
    best: tuple[float, np.ndarray] | None = None
    k = x.shape[1]
    for size in range(k, 0, -1):
        for cols in itertools.combinations(range(k), size):
            sub = xw[:, cols]
            beta_s, *_ = np.linalg.lstsq(sub, yw, rcond=None)
            if np.any(beta_s < 0):
                continue
            beta = np.zeros(k)
            beta[list(cols)] = beta_s
            err = float(np.sum((xw @ beta - yw) ** 2))
            if best is None or err < best[0] - 1e-15:
                best = (err, beta)
    return best[1] if best is not None else np.zeros(k)


def _median_abs(errs: Sequence[float]) -> float | None:
    return round(float(np.median(np.abs(errs))), 4) if len(errs) else None


def _prefill_rows(points: Sequence[LadderPoint]) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    rows, ys, nc = [], [], []
    for p in points:
        assert p.ttft_s is not None and p.prompt_tokens is not None
        c = p.cached_tokens or 0
        n = max(0, p.prompt_tokens - c)
        rows.append([1.0, float(n), n * (c + n / 2.0), float(n + c)])
        ys.append(p.ttft_s)
        nc.append((n, c))
    return np.array(rows, dtype=np.float64), np.array(ys, dtype=np.float64), nc


def fit_ladder(
    points: Sequence[LadderPoint],
    tpot: Sequence[TpotPoint],
    tiers: Sequence[str],
    kv_bytes_per_token: int | None,
    origin: str,
    loaded: Sequence[LoadedPoint] = (),
    handling: Sequence[HandlingPoint] = (),
) -> LadderFit | None:
    """The timing model from the verified points (None: too few verified cold/GPU points to fit prefill)."""
    ok = [p for p in points if p.verified and p.ttft_s is not None and p.prompt_tokens is not None]
    pre = [p for p in ok if p.source in ("cold", "gpu")]
    train = [p for p in pre if not p.held_back]
    held = [p for p in pre if p.held_back]
    if len(train) < MIN_PREFILL_POINTS:
        return None
    x, y, _ = _prefill_rows(train)
    a, b, k, h = (float(v) for v in nonneg_relative_lstsq(x, y))
    prefill, handling_err = split_handling(
        PrefillModel(overhead_s=a, s_per_token=b, s_per_token_pair=k, s_per_prompt_token=h), handling
    )
    residuals: list[FitResidual] = []

    def residual(p: LadderPoint, predicted: float) -> FitResidual:
        assert p.ttft_s is not None and p.prompt_tokens is not None
        c = p.cached_tokens or 0
        return FitResidual(
            source=p.source,
            new_tokens=p.prompt_tokens - c,
            cached_tokens=c,
            measured_s=p.ttft_s,
            predicted_s=round(predicted, 6),
            rel_err=round((predicted - p.ttft_s) / p.ttft_s, 4),
            held_back=p.held_back,
        )

    for p in pre:
        c = p.cached_tokens or 0
        residuals.append(residual(p, prefill.seconds((p.prompt_tokens or 0) - c, c)))
    fit_err = [r.rel_err for r in residuals if not r.held_back]
    hold_err = [r.rel_err for r in residuals if r.held_back]

    fetch: list[FetchModel] = []
    for tier in tiers:
        tp = [p for p in ok if p.source == tier]
        if len(tp) < 2:
            continue
        # what each point's TTFT leaves over the prefill of what it computed, then the median per cell (a point
        # that met a late store or a scheduler hiccup moves a median little, a least-squares line much)
        by_cell: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for p in tp:
            c = p.cached_tokens or 0
            left = (p.ttft_s or 0.0) - prefill.seconds((p.prompt_tokens or 0) - c, c)
            by_cell.setdefault((p.context_tokens, p.new_tokens), []).append((float(p.shown.tiers.get(tier, 0)), left))
        served = np.array([float(np.median([v[0] for v in vs])) for vs in by_cell.values()])
        yv = np.array([float(np.median([v[1] for v in vs])) for vs in by_cell.values()])
        xv = np.column_stack([np.ones(len(yv)), served])
        # absolute least squares here: a fetch's left-over can be near zero (a fast tier), so relative weights blow up
        beta, *_ = np.linalg.lstsq(xv, yv, rcond=None)
        f0, s = float(beta[0]), float(beta[1])
        if s < 0:
            f0, s = float(np.mean(yv)), 0.0
        f0 = max(0.0, f0)
        model = FetchModel(
            tier=tier,
            overhead_s=f0,
            s_per_token=s,
            points=len(tp),
            bytes_per_s=round(kv_bytes_per_token / s, 1) if kv_bytes_per_token and s > 0 else None,
        )
        errs = []
        for p in tp:
            c = p.cached_tokens or 0
            pred = prefill.seconds((p.prompt_tokens or 0) - c, c) + model.seconds(p.shown.tiers.get(tier, 0))
            errs.append((pred - (p.ttft_s or 0.0)) / (p.ttft_s or 1.0))
            residuals.append(residual(p, pred))
        model.median_abs_rel_err = _median_abs(errs)
        fetch.append(model)

    decode = DecodeModel(tpot_s=0.0)
    tpot_err: float | None = None
    tv = [t for t in tpot if t.tpot_s is not None]
    if tv:
        xt = np.column_stack([np.ones(len(tv)), [t.running - 1.0 for t in tv]])
        yt = np.array([t.tpot_s for t in tv], dtype=np.float64)
        t0, t1 = (float(v) for v in nonneg_relative_lstsq(xt, yt))
        decode = DecodeModel(tpot_s=t0, s_per_extra_seq=t1)
        tpot_err = _median_abs([(decode.at(t.running) - (t.tpot_s or 0)) / (t.tpot_s or 1) for t in tv])
    if tv:
        decode_figure = f"fitted to {len(tv)} TPOT-sweep levels"
    elif tpot:
        streams = sum(t.requests for t in tpot)
        decode_figure = f"not measured: every stream of the TPOT sweep ({streams}) came in bursts or failed: 0"
    else:
        decode_figure = "not measured (no TPOT sweep): 0"
    rng = MeasuredRange(
        max_prompt_tokens=max(p.prompt_tokens or 0 for p in ok),
        max_cached_tokens=max(p.cached_tokens or 0 for p in ok),
        max_running=max((t.running for t in tv), default=1),
    )
    timing = Timing(
        source="measured",
        origin=origin,
        prefill=prefill,
        decode=decode,
        fetch=fetch,
        range=rng,
        figures={
            "prefill": f"fitted to {len(train)} verified cold and GPU points",
            "decode": decode_figure,
            "fetch": ", ".join(f"{f.tier}: {f.points} verified points" for f in fetch) or "no offload tier",
        },
    )
    timing.step = fit_step(timing, loaded)
    if timing.step is not None:
        timing.figures["step"] = timing.step.described()
    if prefill.s_per_prompt_char > 0 or prefill.prompt_chars_per_token:
        used = sum(x.valid for x in handling)
        timing.figures["handling"] = f"split into tokens and characters by {used} cached prompts of two kinds of text"
    odd = tpot_implausible(tpot)
    fit_med, hold_med = _median_abs(fit_err), _median_abs(hold_err)
    loaded_err = timing.step.median_abs_rel_err if timing.step is not None else None
    return LadderFit(
        timing=timing,
        prefill_points=len(train),
        prefill_fit_median_abs_rel_err=fit_med,
        prefill_holdout_median_abs_rel_err=hold_med,
        prefill_holdout_points=len(held),
        tpot_median_abs_rel_err=tpot_err,
        loaded_median_abs_rel_err=loaded_err,
        handling_median_abs_rel_err=handling_err,
        superlinear=k > 0,
        residuals=residuals,
        unreliable=unreliable(fit_med, hold_med, tpot_err, loaded_err) + ([odd] if odd else []),
    )


def split_handling(pm: PrefillModel, handling: Sequence[HandlingPoint]) -> tuple[PrefillModel, float | None]:
    """The fitted handling per prompt token of the ladder's word text, split into a part per token and a part per
    character by the handling sweep (results/ladder.py ``HandlingPoint``): with the word text's characters per
    token ``rho``, handling = (h - rho x theta) x tokens + theta x characters, theta (0..h/rho) by least squares on
    relative error over the sweep's cached prompts; the word text's points are kept as the main fit has them, the
    dense ones move theta. With no valid point of either kind the model stays per token. Also the split model's
    median error on the sweep's points."""
    words = [x for x in handling if x.valid and x.style == "words" and x.ttft_s and x.prompt_tokens]
    dense = [x for x in handling if x.valid and x.style == "dense" and x.ttft_s and x.prompt_tokens]
    if not words or not dense or pm.s_per_prompt_token <= 0:
        return pm, None
    rho = float(np.median([x.chars / (x.prompt_tokens or 1) for x in words]))
    rows = words + dense
    base = [
        pm.overhead_s
        + pm.compute_s((x.prompt_tokens or 0) - (x.cached_tokens or 0), x.cached_tokens or 0)
        + pm.s_per_prompt_token * (x.prompt_tokens or 0)
        for x in rows
    ]
    ttft = np.array([x.ttft_s for x in rows], dtype=np.float64)
    xr = np.array([x.chars - rho * (x.prompt_tokens or 0) for x in rows]) / ttft
    yr = (ttft - np.array(base)) / ttft
    theta = float(np.dot(xr, yr) / np.dot(xr, xr)) if np.dot(xr, xr) > 0 else 0.0
    theta = min(pm.s_per_prompt_token / rho, max(0.0, theta))
    split = pm.model_copy(
        update={
            "s_per_prompt_token": pm.s_per_prompt_token - rho * theta,
            "s_per_prompt_char": theta,
            "prompt_chars_per_token": round(rho, 4),
        }
    )
    errs = [
        split.seconds((x.prompt_tokens or 0) - (x.cached_tokens or 0), x.cached_tokens or 0, x.chars)
        / (x.ttft_s or 1.0)
        - 1.0
        for x in rows
    ]
    return split, _median_abs(errs)


ONE_CHUNK = 10**9
"""The interference sweep's probes are at most 1,024 tokens: one chunk under any engine's step budget."""


def fit_step(timing: Timing, loaded: Sequence[LoadedPoint]) -> StepModel | None:
    """The step model's share from the interference sweep (results/ladder.py ``loaded_ttft``, with the fitted
    prefill and decode): the share in 0..MAX_SHARE, by steps of 0.01, with the least squared relative error over
    the valid probes. None: no valid probe, or no measured decode to share steps with."""
    rows = [p for p in loaded if p.valid and p.ttft_s and p.prompt_tokens and p.cached_tokens is None]
    if not rows or timing.decode.tpot_s <= 0:
        return None

    def errors(share: float) -> list[float]:
        return [
            loaded_ttft(timing, p.prompt_tokens or 0, p.running, ONE_CHUNK, share) / (p.ttft_s or 1.0) - 1.0
            for p in rows
        ]

    grid = np.arange(0.0, MAX_SHARE + 1e-9, 0.01)
    share = round(float(grid[int(np.argmin([sum(e * e for e in errors(float(x))) for x in grid]))]), 2)
    load, used = fit_handling_load(timing, loaded, share)
    return StepModel(
        share=share,
        points=len(rows),
        median_abs_rel_err=_median_abs(errors(share)),
        handling_load=load,
        handling_points=used,
    )


def fit_handling_load(timing: Timing, loaded: Sequence[LoadedPoint], share: float) -> tuple[float, int]:
    """How much slower a request's handling runs while sequences decode (results/ladder.py ``StepModel``), from
    the sweep's long cached prompts: each one's TTFT with sequences decoding less its own TTFT alone less what the
    step model already adds (``share`` of a decode step and the wait for one), over its handling alone; the median,
    0..MAX_SHARE. (0, 0) without such a probe or a handling to slow."""
    pm, loads = timing.prefill, []
    for p in loaded:
        if not (p.valid and p.cached_tokens is not None and p.ttft_s and p.alone_s and p.prompt_tokens):
            continue
        handling = pm.handling_s(p.prompt_tokens)
        if handling <= 0:
            continue
        new = max(1, p.prompt_tokens - p.cached_tokens)
        steps = loaded_ttft(timing, new, p.running, ONE_CHUNK, share) - pm.seconds(new, 0.0)
        loads.append((p.ttft_s - p.alone_s - steps) / handling)
    if not loads:
        return 0.0, 0
    return round(min(MAX_SHARE, max(0.0, float(np.median(loads)))), 2), len(loads)


MAX_SHARE = 3.0
"""The largest step share fitted: past it the sweep measures something other than steps shared."""
TPOT_FALL_BOUND = 0.25
"""A TPOT sweep whose time per token falls by more than this from one running sequence to more is implausible (a
batch step costs at least what a smaller one does): the ladder measures it again, then refuses it."""


def tpot_implausible(tpot: Sequence[TpotPoint]) -> str | None:
    """Why the TPOT sweep cannot be believed (None: it can): most of a level's streams came in bursts, or the time
    per token falls as sequences are added."""
    for t in tpot:
        ok = t.requests - t.failed
        if ok and t.bursty * 2 > ok:
            return f"the TPOT sweep is implausible: {t.bursty} of {ok} streams at {t.running} running came in bursts"
    tv = sorted((t.running, t.tpot_s) for t in tpot if t.tpot_s)
    if len(tv) >= 2:
        first = tv[0][1]
        low = min(tv[1:], key=lambda x: x[1])
        if (first - low[1]) / first > TPOT_FALL_BOUND:
            return (
                f"the TPOT sweep is implausible: time per token falls from {first * 1e3:.2f} ms at {tv[0][0]} "
                f"running to {low[1] * 1e3:.2f} ms at {low[0]}"
            )
    return None


FIT_ERR_BOUND = 0.15
"""The largest median error of the prefill fit on its own points for a fit to be used as calibration."""
HOLDOUT_ERR_BOUND = 0.25
"""The same on the cells held back from it (what it predicts; #56's aim for a twin's p95 error)."""
TPOT_ERR_BOUND = 0.25
"""The largest median error of the TPOT fit over the running-sequence levels it was fitted to."""
LOADED_ERR_BOUND = 0.25
"""The same for the step model on the interference sweep's probes (TTFT with sequences decoding)."""


def unreliable(
    fit_err: float | None, holdout_err: float | None, tpot_err: float | None, loaded_err: float | None = None
) -> list[str]:
    """Why a fit is not fit to calibrate a twin: each of its errors past its bound, in words (empty: reliable)."""
    out = []
    for err, bound, what in (
        (fit_err, FIT_ERR_BOUND, "the prefill fit's median error on its own points"),
        (holdout_err, HOLDOUT_ERR_BOUND, "its median error on the held-back cells"),
        (tpot_err, TPOT_ERR_BOUND, "the TPOT fit's median error over its levels"),
        (loaded_err, LOADED_ERR_BOUND, "the step model's median error on TTFTs with sequences decoding"),
    ):
        if err is not None and err > bound:
            out.append(f"{what} is {err:.1%} (bound {bound:.0%})")
    return out


__all__ = [
    "fit_ladder",
    "fit_step",
    "split_handling",
    "nonneg_relative_lstsq",
    "tpot_implausible",
    "unreliable",
    "FIT_ERR_BOUND",
    "HOLDOUT_ERR_BOUND",
    "TPOT_ERR_BOUND",
    "LOADED_ERR_BOUND",
]
