"""``kvtier plan`` answers in the report: their figures (for the tables and ``kvtier compare``), their status
rows, and their plots — the same PNGs ``kvtier plan ... --plot`` writes (one drawing each, here)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.config.base import config_argv
from kvtier.costs import min_context_for_fetch
from kvtier.report.figures import HIGHER, LOWER, Figure, Loaded
from kvtier.report.plots import Plot, _label, _plt, _png

PLAN_KINDS = {
    "kvtier plan bytes": "plan-bytes",
    "kvtier plan breakeven": "plan-breakeven",
    "kvtier plan gate": "plan-gate",
    "kvtier plan capacity": "plan-capacity",
    "kvtier plan fetch": "plan-fetch",
    "kvtier plan value": "plan-value",
    "kvtier plan retention": "plan-retention",
    "kvtier plan recommend": "plan-recommend",
    "kvtier plan views": "plan-views",
}
PLAN_TITLES = {
    "plan-bytes": "KV bytes per token (kvtier plan bytes)",
    "plan-breakeven": "Fetch vs recompute break-even (kvtier plan breakeven)",
    "plan-gate": "Fetch gate (kvtier plan gate)",
    "plan-capacity": "Capacity (kvtier plan capacity)",
    "plan-fetch": "Measured fetch vs recompute (kvtier plan fetch)",
    "plan-value": "Does the tier pay? (kvtier plan value)",
    "plan-retention": "Retention and the LRU hit curve (kvtier plan retention)",
    "plan-recommend": "Recommended placement (kvtier plan recommend)",
    "plan-views": "One trace, three views (kvtier plan views)",
}


# -- the PNGs (kvtier plan --plot writes the same) ---------------------------------------------------------------
def breakeven_png(r: Any) -> bytes:
    """Time to have the prefix's KV against context: recompute, and fetch per link (compressed and not), the
    break-even context of each link marked."""
    plt = _plt()
    kvpt, tps, comp, mark = r.kv_bytes_per_token, r.prefill_tokens_per_s, r.compression, r.context_tokens
    ctx = np.unique(np.geomspace(1, max(mark * 16, 1 << 17), 300).astype(int))
    fig, ax = plt.subplots(figsize=(9, 5.5))
    ax.plot(ctx, ctx / tps, "k-", lw=2, label=f"recompute ({tps:,.0f} tok/s)")
    for link in r.links:
        bw, rtt = link.net_bw_bytes_per_s, link.rtt_s
        shown = f"fetch {link.net_bw}, RTT {link.rtt}"
        (line,) = ax.plot(ctx, rtt + ctx * kvpt / (bw * comp), label=shown + (f", {comp:g}×" if comp != 1 else ""))
        if comp != 1:
            ax.plot(ctx, rtt + ctx * kvpt / bw, ls="--", lw=1, color=line.get_color(), label=shown + ", uncompressed")
        c0 = min_context_for_fetch(kvpt, bw, rtt, tps, comp)
        if c0 is not None and ctx[0] <= c0 <= ctx[-1]:
            ax.axvline(c0, color=line.get_color(), ls=":", lw=1)
            ax.annotate(
                f"break-even {c0:,.0f} tok",
                (c0, c0 / tps),
                textcoords="offset points",
                xytext=(5, -12),
                fontsize=8,
                color=line.get_color(),
            )
    ax.axvline(mark, color="grey", ls="--", lw=1, label=f"context {mark:,}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title(f"{r.model}: fetch vs recompute ({kvpt / 1024:,.4g} KiB/token)")
    _label(ax, "context (tokens)", "time to have the prefix's KV (s)")
    return _png(fig)


def retention_png(r: Any) -> bytes:
    """Two panels: the hit rate against LRU capacity (the tiers' cumulative capacities marked) and the working set
    over the trace."""
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    gb = [c.capacity_bytes / 1e9 for c in r.curve]
    ax.plot(gb, [c.hit_fraction * 100 for c in r.curve], "k-", label="hit rate, % of tokens")
    ax.axhline(r.reused_tokens / r.accessed_tokens * 100, ls=":", c="grey", label="every reuse (no capacity limit)")
    for t in r.tiers:
        at = t.cumulative_capacity_tokens * r.kv_bytes_per_token / 1e9
        ax.axvline(at, ls="--", lw=1)
        ax.annotate(t.tier, (at, 2), rotation=90)
    ax.set_xscale("log")
    ax.set_title("hit rate against capacity (exact LRU stack distances)")
    _label(ax, f"LRU capacity, GB ({r.model})", "hit rate, %")
    xs = [p.t for p in r.working_set]
    bx.plot(xs, [p.distinct_bytes / 1e9 for p in r.working_set], "k-", label="distinct KV so far")
    bx.plot(xs, [p.interval_bytes / 1e9 for p in r.working_set], "b-", label="distinct KV in the interval")
    bx.set_title("working set over the trace")
    _label(bx, "seconds" if r.unit == "s" else "requests", "GB")
    return _png(fig)


def recommend_png(recommendations: Sequence[tuple[str, Any]]) -> bytes | None:
    """TTFT p95 (mean and 95 % interval across trials) and the prompt's share from offload against CPU GB, a line
    per NVMe size and load (and per sweep, labelled, when several are drawn); the SLO when one was asked."""
    plt = _plt()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    drew = False
    for name, r in recommendations:
        for conc in sorted({p.concurrency for p in r.points}):
            for nvme in sorted({p.nvme_gb for p in r.points}):
                line = [p for p in r.points if p.concurrency == conc and p.nvme_gb == nvme and p.ttft_p95_s.mean]
                if not line:
                    continue
                drew = True
                label = (f"{name}: " if name else "") + f"NVMe {nvme:g} GB, c={conc}"
                xs = [p.cpu_gb for p in line]
                mean = [p.ttft_p95_s.mean or 0.0 for p in line]
                # the 95 % interval as the table gives it: its low end clipped at 0 (a TTFT is never below 0)
                low = [
                    m - max(0.0, p.ttft_p95_s.low if p.ttft_p95_s.low is not None else m) for p, m in zip(line, mean)
                ]
                high = [(p.ttft_p95_s.high if p.ttft_p95_s.high is not None else m) - m for p, m in zip(line, mean)]
                ax.errorbar(xs, mean, yerr=[low, high], marker="o", capsize=3, label=label)
                bx.plot(xs, [(p.offload_hit_share.mean or 0) * 100 for p in line], marker="o", label=label)
        if r.slo_ttft_p95_s is not None:
            ax.axhline(r.slo_ttft_p95_s, ls="--", c="red", label=f"SLO {r.slo_ttft_p95_s:g} s")
    if not drew:
        plt.close(fig)
        return None
    _label(ax, "CPU offload GB", "TTFT p95, s (mean, 95 % CI)")
    _label(bx, "CPU offload GB", "prompt tokens from offload, %")
    return _png(fig)


def _first(draw: Callable[[Any], bytes | None], title: str, answers: str) -> Callable[..., Plot | None]:
    """A report plot of the first answer of a kind that draws (several would repeat the page)."""

    def make(items: Sequence[Loaded]) -> Plot | None:
        for it in items:
            png = draw(it.plan.answer)
            if png is not None:
                return (title + ("" if len(items) == 1 else f" ({it.label})"), answers, png)
        return None

    return make


def _sweeps(items: Sequence[Loaded]) -> Plot | None:
    png = recommend_png([(it.label, it.plan.answer) for it in items])
    return (
        None
        if png is None
        else (
            "Placement sweep, as recommended",
            "Where does more CPU (or NVMe) stop buying hit rate, and which point meets the SLO?",
            png,
        )
    )


def sweep_curves(items: Sequence[Loaded], read: Callable[[str], Any]) -> Plot | None:
    """A sweep's measured curves (``kvtier plan sweep``), as ``read`` (the caller's ``kvtier plan recommend``: the
    report draws what a runner computed and imports none) reads each one's folder."""
    png = recommend_png([(it.label, read(it.path)) for it in items])
    return (
        None
        if png is None
        else ("Placement sweep", "Where does more CPU (or NVMe) stop buying hit rate, and TTFT p95 stop falling?", png)
    )


PLAN_PLOTS: dict[str, tuple[Callable[[Sequence[Loaded]], Plot | None], ...]] = {
    "plan-breakeven": (
        _first(
            breakeven_png,
            "Fetch vs recompute by context",
            "From what context does fetching the prefix's KV beat recomputing it, on each link?",
        ),
    ),
    "plan-retention": (
        _first(
            retention_png,
            "Hit rate against capacity, and the working set",
            "How much capacity does the trace's reuse need, and how much history does each tier hold?",
        ),
    ),
    "plan-recommend": (_sweeps,),
}


# -- figures and status rows ------------------------------------------------------------------------------------
def _pct(v: float | None) -> float | None:
    return None if v is None else v * 100


def plan_figures(r: Any) -> list[Figure]:
    """The figures of a plan answer that two answers are compared by (``kvtier compare``, the report's table)."""
    a, b = r.answer, r.benchmark.removeprefix("kvtier plan ")
    F = Figure
    if b == "bytes":
        if not hasattr(a, "kv_bytes_per_token"):
            return []  # the catalog: a list, not a figure
        return [
            F("KV bytes per token", a.kv_bytes_per_token, "B", LOWER),
            F("GiB per million tokens", a.gib_per_million_tokens, "GiB", LOWER),
        ]
    if b == "breakeven":
        out = [
            F("recompute s", a.recompute_s, "s", LOWER),
            F("break-even Gbit/s", a.breakeven_gbit_per_s, "Gbit/s", LOWER),
            F("break-even Gbit/s, compressed", a.breakeven_compressed_gbit_per_s, "Gbit/s", LOWER),
        ]
        return out + [F(f"fetch s ({x.net_bw}, RTT {x.rtt})", x.fetch_compressed_s, "s", LOWER) for x in a.links]
    if b == "gate":
        if hasattr(a, "cases"):
            return [F(f"fetch s ({c.case})", c.fetch_s, "s", LOWER) for c in a.cases] + (
                [F("recompute s", a.cases[0].recompute_s, "s", LOWER)] if a.cases else []
            )
        return [
            F("cells where the gate agrees with the measurement", float(a.agreed), "", HIGHER),
            F("cells checked", float(a.checked), "", ""),
        ]
    if b == "capacity":
        return [F("KV bytes per token", a.kv_bytes_per_token, "B", LOWER)] + [
            F(f"users tier {n}", float(t.users), "", HIGHER) for n, t in a.tiers.items()
        ]
    if b == "fetch":
        return [F(f"fetch p95 s ({x.tier}, {x.context_tokens:,} tokens)", x.fetch_p95_s, "s", LOWER) for x in a.rows]
    if b == "value":
        out = []
        for t in a.tiers:
            out += [
                F(f"{t.tier} hit rate %", t.hit_rate * 100, "%", HIGHER),
                F(f"{t.tier} prefill avoided s/h", t.prefill_s_avoided_per_hour, "s", HIGHER),
                F(f"{t.tier} value $/h", t.value_usd_per_hour, "$", HIGHER),
            ]
        return out
    if b == "retention":
        out = [
            F("reused share of accessed tokens %", 100 * a.reused_tokens / max(a.accessed_tokens, 1), "%", ""),
            F("distinct tokens", float(a.distinct_tokens), "", ""),
        ]
        return out + [F(f"{t.tier} serves % of tokens", t.hit_fraction * 100, "%", HIGHER) for t in a.tiers]
    if b == "recommend":
        return [F(f"TTFT p95 s ({p.point})", p.ttft_p95_s.mean, "s", LOWER) for p in a.points]
    if b == "views":
        return [
            F("(b) median |TTFT error| by turn %", _pct(a.median_abs_ttft_error), "%", LOWER),
            F("(c) median |TTFT error| by turn %", _pct(a.median_abs_storage_ttft_error), "%", LOWER),
        ]
    return []


def plan_status_rows(r: Any) -> list[tuple[str, Any]]:
    """The question asked (the flags given, as the command line spells them) and the answer in a line."""
    flags = " ".join(config_argv(r.config))
    rows: list[tuple[str, Any]] = [("asked", f"{r.benchmark} {flags}".strip())]
    a, b = r.answer, r.benchmark.removeprefix("kvtier plan ")
    if b == "gate" and hasattr(a, "cases"):
        rows.append(("verdicts", ", ".join(f"{c.case}: {c.verdict}" for c in a.cases)))
    elif b == "gate":
        rows.append(("check", f"the gate agrees with the measured faster source on {a.agreed} of {a.checked} cells"))
    elif b == "breakeven":
        rows.append(("verdicts", ", ".join(f"{x.net_bw}, RTT {x.rtt}: {x.verdict}" for x in a.links)))
    elif b == "recommend":
        rows.append(("picks", "\n".join(p.sentence for p in a.picks) or "none"))
    elif b == "views":
        rows.append(("findings", "\n".join(a.findings) or "none"))
    elif b == "value":
        pays = ", ".join(f"{t.tier}: {'—' if t.pays is None else 'yes' if t.pays else 'no'}" for t in a.tiers)
        rows.append(("pays", pays or "no offload tier"))
    return rows


__all__ = [
    "PLAN_KINDS",
    "PLAN_PLOTS",
    "PLAN_TITLES",
    "breakeven_png",
    "plan_figures",
    "plan_status_rows",
    "recommend_png",
    "retention_png",
]
