"""``kvtier plan recommend``: the cheapest placement a sweep measured meeting a TTFT p95 SLO at its load.

From a ``kvtier plan sweep`` folder (sweep.json and each trial's replay result), per point (CPU GB x NVMe GB x
concurrency), over its complete trials:

* TTFT p95 (each trial's own p95), its mean and 95 % confidence interval across trials (Student's t; one
  trial has no interval), TTFT p50, requests per second;
* the prompt tokens served by the GPU prefix cache and by the offload tiers (the sim's decomposition,
  ``summary.ttft_decomposition.token_share``), as shares, with the same interval;
* with ``--store-cost TIER=$/GB-month`` for each tier a point uses, its cost per hour.

A point **meets the SLO** when the upper end of its TTFT p95 interval is within ``--slo-ttft-p95`` (with one
trial, its p95 itself; the report says there is no interval). At each load (concurrency) the recommendation is
the cheapest point that meets it: by cost when every tier used has a cost, else the smallest (CPU GB, then NVMe
GB). A cheaper point whose interval reaches below the SLO without meeting it may meet it too: the pick is then **a
tie, not a winner**, and the report says how many trials that point would need for its interval to leave the SLO
at its spread now. Intervals are clipped at what the quantity can be (a time at 0 s, a share at 0 and 1) and say
so. Trials against a calibrated sim (``plan sweep --calibration``) carry the twin's measured error: the p95 interval is
widened by it (results/ladder.py ``TwinError``) and the verdict and ties are decided on the widened one; where the
twin's error alone reaches the SLO from a point's mean, no number of trials would tell. The knees, along CPU GB at
each NVMe size and load: the smallest size whose offload hit rate has reached
``KNEE`` of the line's whole rise (more CPU buys little hit rate beyond it), and the smallest whose TTFT p95 has
fallen ``KNEE`` of the line's whole fall.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.errors import ConfigError, DatasetError
from kvtier.plan.value import HOURS_PER_MONTH
from kvtier.results.ladder import TwinError
from kvtier.results.plan import Interval, Knee, Pick, PointStats, Recommendation

if TYPE_CHECKING:
    from kvtier.results.replay import ReplayResult

KNEE = 0.9
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    12: 2.179,
    15: 2.131,
    20: 2.086,
    25: 2.060,
    30: 2.042,
}
"""Student's t at 0.975 by degrees of freedom (a table: kvtier does not depend on scipy)."""


def t975(df: int) -> float:
    if df in _T975:
        return _T975[df]
    below = [k for k in _T975 if k < df]
    return _T975[max(below)] if df < 30 else 1.96


def interval(xs: list[float], lo: float | None = None, hi: float | None = None) -> Interval:
    """The mean and its 95 % interval (Student's t), the ends clipped at ``lo`` and ``hi``."""
    n = len(xs)
    if not n:
        return Interval(mean=None, low=None, high=None, n=0)
    m = sum(xs) / n
    if n < 2:
        return Interval(mean=round(m, 6), low=None, high=None, n=1)
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1))
    h = t975(n - 1) * sd / math.sqrt(n)
    low, high = m - h, m + h
    clipped = (lo is not None and low < lo) or (hi is not None and high > hi)
    low = max(low, lo) if lo is not None else low
    high = min(high, hi) if hi is not None else high
    return Interval(mean=round(m, 6), low=round(low, 6), high=round(high, 6), n=n, sd=round(sd, 6), clipped=clipped)


def trials_to_separate(i: Interval, x: float, most: int = 1000) -> int | None:
    """Trials a point would need for its 95 % interval to leave ``x`` (the SLO), at its spread now; None when no
    number up to ``most`` would (its mean is at ``x``, or it has no spread to go by)."""
    if i.mean is None or i.sd is None:
        return None
    gap = abs(i.mean - x)
    if gap == 0:
        return None
    if i.sd == 0:
        return i.n
    for n in range(max(2, i.n), most + 1):
        if t975(n - 1) * i.sd / math.sqrt(n) < gap:
            return n
    return None


def seconds_of(xs: list[float | None]) -> tuple[list[float], int]:
    """The latencies that can be real (finite, non-negative) and how many others there were: a trial's file is read
    from disk, and a p95 of -1 s would "meet" any SLO."""
    good = [float(x) for x in xs if x is not None and math.isfinite(x) and x >= 0]
    return good, sum(1 for x in xs if x is not None) - len(good)


def widened(i: Interval, err: TwinError | None) -> Interval | None:
    """A trials' interval widened by a calibrated twin's error (results/ladder.py ``TwinError``): its low end times
    the smallest real-over-predicted ratio, its high end times the largest (one trial: its value, so banded)."""
    if err is None or i.mean is None:
        return None
    lo, hi = i.low if i.low is not None else i.mean, i.high if i.high is not None else i.mean
    return i.model_copy(update={"low": err.band(lo)[0], "high": err.band(hi)[1]})


def reach(p: PointStats) -> Interval:
    """The interval a point's SLO verdict is decided on: widened by the twin's error where its trials had one."""
    return p.ttft_p95_s_with_twin or p.ttft_p95_s


def slo_verdict(
    p95s: list[float | None], slo_s: float | None, twin: TwinError | None = None
) -> tuple[Interval, bool | None, str, Interval | None]:
    """A point's TTFT p95 interval over its trials, whether it meets ``slo_s`` (the interval's upper end, or the one
    trial's p95; widened by ``twin``, a calibrated sim's error, where there is one), a note, and the widened
    interval; impossible p95s (negative, not finite) are left out and said."""
    good, bad = seconds_of(p95s)
    p95 = interval(good, lo=0.0)
    wide = widened(p95, twin)
    notes = [f"{bad} trial(s) with an impossible TTFT p95 left out"] if bad else []
    meets = None
    if slo_s is not None and p95.mean is not None:
        decided = wide or p95
        meets = (decided.high if decided.high is not None else p95.mean) <= slo_s
        if p95.high is None:
            notes.append("one trial: no interval" + (", the twin's error only" if wide else ""))
    return p95, meets, "; ".join(notes), wide


def _twin_of(rs: list[ReplayResult], latest: TwinError | None) -> TwinError | None:
    """The twin error a point's trials carry: ``latest`` (the sweep's ladder read now, with its latest sim-vs-real
    check: every point then carries the same error) where the trials ran on a twin, else the widest their replays
    recorded (summary.twin); None where none ran on a twin."""
    errs = [r.summary.twin.error for r in rs if r.summary.twin is not None]
    if not errs:
        return None
    if latest is not None:
        return latest
    low, high = min(e.ratio_low for e in errs), max(e.ratio_high for e in errs)
    basis = f"the widest of the errors its {len(errs)} trials recorded; the first: {errs[0].basis}"
    return errs[0].model_copy(update={"ratio_low": low, "ratio_high": high, "basis": basis[:4000]})


def _latest_twin(calibration: str | None) -> TwinError | None:
    """The sweep's ladder's twin error as it stands now (None without one, or where it no longer loads)."""
    if not calibration:
        return None
    from kvtier.errors import KvtierError
    from kvtier.results.ladder import load_fitted, twin_error

    try:
        return twin_error(load_fitted(calibration, "--calibration")[1], calibration)
    except (KvtierError, OSError):
        return None


def _cost(cpu: float, nvme: float, costs: dict[str, float]) -> float | None:
    used = {k: v for k, v in (("cpu", cpu), ("nvme", nvme)) if v > 0}
    if any(k not in costs for k in used):
        return None
    return round(sum(gb * costs[k] for k, gb in used.items()) / HOURS_PER_MONTH, 6)


def _knee(xs: list[float], ys: list[float | None], rising: bool) -> float | None:
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    if len(pts) < 2:
        return None
    first, best = pts[0][1], (max if rising else min)(y for _, y in pts)
    span = (best - first) if rising else (first - best)
    if span <= 0:
        return pts[0][0]  # nothing to gain beyond the smallest
    for x, y in pts:
        if (y - first if rising else first - y) >= KNEE * span:
            return x
    return pts[-1][0]


def recommend(
    path: str, slo_ttft_p95_s: float | None, store_cost: dict[str, float], concurrency: int | None = None
) -> Recommendation:
    from kvtier.results import load
    from kvtier.results.replay import NOT_OFFLOAD, ReplayResult
    from kvtier.results.sweep import SweepResult

    folder = Path(path)
    sweep = load(folder)
    if not isinstance(sweep, SweepResult):
        raise DatasetError(f"--from {path}: not a kvtier plan sweep result (sweep.json)")
    root = folder if folder.is_dir() else folder.parent
    by_point: dict[str, list[ReplayResult]] = {}
    missing: dict[str, int] = {}
    meta: dict[str, tuple[float, float, int]] = {}
    for t in sweep.trials:
        meta[t.point] = (t.cpu_gb, t.nvme_gb, t.concurrency)
        by_point.setdefault(t.point, [])
        if t.status != "complete":
            missing[t.point] = missing.get(t.point, 0) + 1
            continue
        r = load(root / t.path)
        if not isinstance(r, ReplayResult):
            raise DatasetError(f"{root / t.path}: not a replay result")
        by_point[t.point].append(r)
    points = []
    latest = _latest_twin(sweep.grid.calibration)
    for name, rs in by_point.items():
        cpu, nvme, conc = meta[name]
        if concurrency is not None and conc != concurrency:
            continue
        shares = [r.summary.ttft_decomposition.token_share if r.summary.ttft_decomposition else None for r in rs]
        twin = _twin_of(rs, latest)
        p95, meets, note, wide = slo_verdict([r.summary.ttft_s.p95 for r in rs], slo_ttft_p95_s, twin)
        points.append(
            PointStats(
                point=name,
                cpu_gb=cpu,
                nvme_gb=nvme,
                concurrency=conc,
                trials=len(rs),
                trials_not_complete=missing.get(name, 0),
                ttft_p95_s=p95,
                ttft_p50_s=interval(seconds_of([r.summary.ttft_s.p50 for r in rs])[0], lo=0.0),
                gpu_hit_share=interval([s.get("gpu", 0.0) for s in shares if s is not None], lo=0.0, hi=1.0),
                offload_hit_share=interval(
                    [sum(v for k, v in s.items() if k not in NOT_OFFLOAD) for s in shares if s is not None],
                    lo=0.0,
                    hi=1.0,
                ),
                requests_per_s=interval([r.summary.requests_per_s for r in rs if r.summary.requests_per_s], lo=0.0),
                cost_usd_per_hour=_cost(cpu, nvme, store_cost),
                meets_slo=meets,
                note=note,
                twin_error=twin,
                ttft_p95_s_with_twin=wide,
            )
        )
    if not points:
        raise ConfigError(f"--from {path}: no point" + (f" at --concurrency {concurrency}" if concurrency else ""))
    points.sort(key=lambda p: (p.concurrency, p.nvme_gb, p.cpu_gb))
    knees = []
    for conc in sorted({p.concurrency for p in points}):
        for nvme in sorted({p.nvme_gb for p in points}):
            line = [p for p in points if p.concurrency == conc and p.nvme_gb == nvme]
            xs = [p.cpu_gb for p in line]
            knees.append(
                Knee(
                    nvme_gb=nvme,
                    concurrency=conc,
                    points=len(line),
                    hit_rate_knee_cpu_gb=_knee(xs, [p.offload_hit_share.mean for p in line], rising=True),
                    ttft_knee_cpu_gb=_knee(xs, [p.ttft_p95_s.mean for p in line], rising=False),
                )
            )
    picks = picks_of(points, slo_ttft_p95_s) if slo_ttft_p95_s is not None else []
    return Recommendation(
        source=str(root),
        sweep_status=sweep.status.value,
        slo_ttft_p95_s=slo_ttft_p95_s,
        store_cost=store_cost,
        points=points,
        knees=knees,
        picks=picks,
    )


def picks_of(points: list[PointStats], slo: float) -> list[Pick]:
    """At each load, the cheapest point meeting the SLO (module docstring), or a tie with a cheaper point that may."""
    picks = []
    for conc in sorted({p.concurrency for p in points}):
        here = [p for p in points if p.concurrency == conc and p.ttft_p95_s.mean is not None]
        ok = [p for p in here if p.meets_slo]
        priced = all(p.cost_usd_per_hour is not None for p in ok)
        by = "cost" if ok and priced else "size"

        def rank(p: PointStats, by: str = by) -> tuple[float, ...]:
            return (p.cost_usd_per_hour or 0.0, p.cpu_gb, p.nvme_gb) if by == "cost" else (p.cpu_gb, p.nvme_gb)

        ok.sort(key=rank)
        pick = ok[0] if ok else None
        # cheaper points that may meet the SLO as well: their interval reaches below it
        maybe = sorted(
            (
                p
                for p in here
                if not p.meets_slo
                and (low := reach(p).low) is not None
                and low <= slo
                and (pick is None or rank(p) < rank(pick))
            ),
            key=rank,
        )
        picks.append(_pick(conc, pick, by, slo, maybe[0] if maybe else None, [p.point for p in maybe[1:]]))
    return picks


def _ci(i: Interval) -> str:
    if i.high is None or i.low is None:
        return " (one trial: no interval)"
    return f" (95 % CI {i.low:.3f}-{i.high:.3f} s{', clipped at 0' if i.clipped else ''}, {i.n} trials)"


def _tie(p: PointStats, slo: float, others: list[str] | None) -> tuple[str, int | None]:
    """The sentence for a cheaper point (and ``others``, dearer than it) that may meet the SLO too, and the trials
    that would tell for the cheapest. On a twin, the trials' interval must leave the SLO over the twin's ratio; where
    the twin's error alone reaches the SLO from the point's mean, no number of trials would tell."""
    i, err, w = p.ttft_p95_s, p.twin_error, p.ttft_p95_s_with_twin
    also = f" (and {', '.join(others)})" if others else ""
    if err is None or w is None or i.mean is None:
        n = trials_to_separate(i, slo)
        more = (
            f"about {n} trials of it would tell"
            if n is not None
            else "its mean is at the SLO: no number of trials would tell"
        )
        return (
            f"{p.point}{also} may meet it too (TTFT p95 {i.mean:.3f} s{_ci(i)}: its interval reaches below {slo:g} "
            f"s); {more}"
        ), n
    lo, hi = err.band(i.mean)
    alone = lo <= slo <= hi
    n = None if alone else trials_to_separate(i, slo / (err.ratio_low if lo > slo else err.ratio_high))
    if n is not None:
        more = f"about {n} trials of it would tell (the twin's error kept)"
    elif alone:
        more = (
            f"the twin's calibration error alone (real / predicted x{err.ratio_low:.2f}-x{err.ratio_high:.2f}) "
            f"reaches {slo:g} s, which no number of trials narrows: measure it on the real server"
        )
    else:
        more = "with the twin's error kept, no number of trials up to 1,000 would tell at its spread now"
    return (
        f"{p.point}{also} may meet it too (TTFT p95 {i.mean:.3f} s{_ci(i)}, {w.low:.3f}-{w.high:.3f} s with the "
        f"twin's error: it reaches below {slo:g} s); {more}"
    ), n


def _pick(
    conc: int,
    p: PointStats | None,
    by: str,
    slo: float,
    maybe: PointStats | None = None,
    others: list[str] | None = None,
) -> Pick:
    if p is None:
        sentence = f"at concurrency {conc} no placement swept meets TTFT p95 <= {slo:g} s"
        n = None
        if maybe is not None:
            tie, n = _tie(maybe, slo, others)
            sentence += f"; {tie}"
        return Pick(
            concurrency=conc,
            point=None,
            by=by,
            sentence=sentence,
            tie_with=maybe.point if maybe else None,
            trials_to_separate=n,
        )
    i = p.ttft_p95_s
    ci = _ci(i)
    if p.ttft_p95_s_with_twin is not None and p.twin_error is not None:
        w = p.ttft_p95_s_with_twin
        ci += f", {w.low:.3f}-{w.high:.3f} s with the twin's error"
    cost = f", ${p.cost_usd_per_hour:.4f}/h of store" if p.cost_usd_per_hour is not None else ""
    hit = (
        f"; {p.offload_hit_share.mean:.0%} of prompt tokens from offload"
        if p.offload_hit_share.mean is not None
        else ""
    )
    where = f"CPU {p.cpu_gb:g} GB" + (f" + NVMe {p.nvme_gb:g} GB" if p.nvme_gb else "")
    verdict, n = f"the cheapest by {by}", None
    if maybe is not None:
        tie, n = _tie(maybe, slo, others)
        verdict = f"a tie, not a winner: the cheaper {tie}"
    return Pick(
        concurrency=conc,
        point=p.point,
        by=by,
        sentence=f"at concurrency {conc}: {where} ({p.point}) meets TTFT p95 <= {slo:g} s with {i.mean:.3f} s"
        f"{ci}{cost}{hit}; {verdict}",
        tie_with=maybe.point if maybe else None,
        trials_to_separate=n,
    )


__all__ = ["Recommendation", "PointStats", "interval", "recommend", "KNEE"]
