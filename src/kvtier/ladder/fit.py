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
    LadderFit,
    LadderPoint,
    MeasuredRange,
    PrefillModel,
    Timing,
    TpotPoint,
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
    prefill = PrefillModel(overhead_s=a, s_per_token=b, s_per_token_pair=k, s_per_prompt_token=h)
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
    fit_med, hold_med = _median_abs(fit_err), _median_abs(hold_err)
    return LadderFit(
        timing=timing,
        prefill_points=len(train),
        prefill_fit_median_abs_rel_err=fit_med,
        prefill_holdout_median_abs_rel_err=hold_med,
        prefill_holdout_points=len(held),
        tpot_median_abs_rel_err=tpot_err,
        superlinear=k > 0,
        residuals=residuals,
        unreliable=unreliable(fit_med, hold_med, tpot_err),
    )


FIT_ERR_BOUND = 0.15
"""The largest median error of the prefill fit on its own points for a fit to be used as calibration."""
HOLDOUT_ERR_BOUND = 0.25
"""The same on the cells held back from it (what it predicts; #56's aim for a twin's p95 error)."""
TPOT_ERR_BOUND = 0.25
"""The largest median error of the TPOT fit over the running-sequence levels it was fitted to."""


def unreliable(fit_err: float | None, holdout_err: float | None, tpot_err: float | None) -> list[str]:
    """Why a fit is not fit to calibrate a twin: each of its errors past its bound, in words (empty: reliable)."""
    out = []
    for err, bound, what in (
        (fit_err, FIT_ERR_BOUND, "the prefill fit's median error on its own points"),
        (holdout_err, HOLDOUT_ERR_BOUND, "its median error on the held-back cells"),
        (tpot_err, TPOT_ERR_BOUND, "the TPOT fit's median error over its levels"),
    ):
        if err is not None and err > bound:
            out.append(f"{what} is {err:.1%} (bound {bound:.0%})")
    return out


__all__ = ["fit_ladder", "nonneg_relative_lstsq", "unreliable", "FIT_ERR_BOUND", "HOLDOUT_ERR_BOUND", "TPOT_ERR_BOUND"]
