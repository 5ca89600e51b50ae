"""The fetch gate and break-even from a measured ladder (``kvtier plan gate --from ladder.json``).

Instead of ``--prefill-tps`` and a link's bandwidth, each side of the gate is the server's measured curve (the
ladder's fit, results/ladder.py ``Timing``): to serve a prompt of ``new`` tokens on a ``context``-token prefix,

    recompute   prefill_s(context + new, 0)                       the whole prompt computed
    fetch(T)    prefill_s(new, context) + fetch_T.seconds(context)  the prefix from tier T, the rest computed

and the verdict is the cheaper. The ladder's own verified points are the check: for each (context, new tokens) cell
where both a cold and a tier-T median were measured, the gate's verdict must name the one that was faster.
Break-even: the shortest context at which fetching from T beats recomputing (None: it never does up to the longest
prompt measured, or it always does).
"""

from __future__ import annotations

from kvtier.results.ladder import LadderFit, LadderResult, Timing
from kvtier.results.plan import BreakEven, LadderGateReport, LadderGateRow


def _costs(t: Timing, tier: str, context: int, new: int) -> tuple[float, float]:
    f = t.fetch_for(tier)
    assert f is not None
    return t.prefill.seconds(context + new, 0), t.prefill.seconds(new, context) + f.seconds(context)


def breakeven_context(t: Timing, tier: str, new: int, longest: int) -> BreakEven:
    """Bisection on context in [1, longest] for where fetch starts to beat recompute (both grow with context;
    recompute faster, superlinear where attention shows)."""

    def wins(c: int) -> bool:
        rec, fet = _costs(t, tier, c, new)
        return fet < rec

    if wins(1):
        return BreakEven(tier=tier, new_tokens=new, context_tokens=1, note="fetching wins at any context")
    if not wins(longest):
        return BreakEven(
            tier=tier,
            new_tokens=new,
            context_tokens=None,
            note=f"recomputing wins up to {longest:,} tokens (the longest prompt measured)",
        )
    lo, hi = 1, longest
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if wins(mid) else (mid, hi)
    return BreakEven(tier=tier, new_tokens=new, context_tokens=hi, note="")


def ladder_gate_report(
    r: LadderResult,
    fit: LadderFit,
    path: str,
    contexts: list[int] | None = None,
    new_tokens: list[int] | None = None,
) -> LadderGateReport:
    """The gate at the ladder's own cells (or ``contexts`` x ``new_tokens``), checked against its medians; ``r`` and
    its ``fit`` as results/ladder.py ``load_fitted`` gives them."""
    from kvtier.errors import DatasetError

    t = fit.timing
    tiers = [f.tier for f in t.fetch]
    if not tiers:
        has = [x.name for x in r.server.tiers]
        why = "; ".join(w.message for w in r.warnings if w.code == "ladder-tier-unreachable") or "see its warnings"
        hint = (
            f"the server has {', '.join(has)}, which the ladder could not reach: {why}"
            if has
            else "measure one against a server with offloading"
        )
        raise DatasetError(f"{path}: the ladder measured no offload tier (only cold and GPU): nothing to gate; {hint}")
    med = {(c.source, c.context_tokens, c.new_tokens): c.ttft_s_median for c in r.cells}
    cells = sorted({(c.context_tokens, c.new_tokens) for c in r.cells})
    if contexts or new_tokens:
        cells = [
            (c, n)
            for c in (contexts or sorted({x for x, _ in cells}))
            for n in (new_tokens or sorted({y for _, y in cells}))
        ]
    longest = t.range.max_prompt_tokens if t.range else max(c + n for c, n in cells)
    rows = []
    for tier in tiers:
        for c, n in cells:
            rec, fet = _costs(t, tier, c, n)
            verdict = "fetch" if fet < rec else "recompute"
            mc, mt = med.get(("cold", c, n)), med.get((tier, c, n))
            faster = None if mc is None or mt is None else ("fetch" if mt < mc else "recompute")
            rows.append(
                LadderGateRow(
                    tier=tier,
                    context_tokens=c,
                    new_tokens=n,
                    recompute_s=round(rec, 6),
                    fetch_s=round(fet, 6),
                    verdict=verdict,
                    measured_cold_s=mc,
                    measured_tier_s=mt,
                    measured_faster=faster,
                    agrees=None if faster is None else faster == verdict,
                    extrapolated=c + n > longest,
                )
            )
    news = sorted({n for _, n in cells})
    be = [breakeven_context(t, tier, n, longest) for tier in tiers for n in news]
    checked = [x for x in rows if x.agrees is not None]
    return LadderGateReport(
        ladder=path,
        timing_source=t.source,
        rows=rows,
        breakeven=be,
        checked=len(checked),
        agreed=sum(1 for x in checked if x.agrees),
    )


__all__ = ["LadderGateReport", "ladder_gate_report", "breakeven_context"]
