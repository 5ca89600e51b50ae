"""The serving side's report plots: a launch's miss storms (``--fault``), a ladder's TTFT curves and fit, and the
offload engines side by side (``launch --arms``); PNG bytes, as ``report/plots.py`` draws them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.report.figures import Loaded
from kvtier.report.plots import Plot, _label, _plt, _png


def storm_timeline(items: Sequence[Loaded]) -> Plot | None:
    """A launch's miss storms (``--fault``): the offload hit rate and TTFT p95 over the run, the kill and the
    zero-hit window marked."""
    have = [it for it in items if getattr(it.result, "faults", None)]
    if not have:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2 * len(have), figsize=(12 * len(have), 3.6), squeeze=False)
    for k, it in enumerate(have):
        hit, lat = axes[0][2 * k], axes[0][2 * k + 1]
        for f in it.launch.faults or []:
            pts = f.timeline
            if not pts:
                continue
            xs = [p.t for p in pts]
            hit.plot(xs, [(p.offload_hit_rate or 0) * 100 for p in pts], "b-", label=f"{it.label}: offload hit")
            lat.plot(xs, [p.ttft_s_p95 or 0 for p in pts], "r-", label=f"{it.label}: TTFT p95")
            t0 = f.timeline_start_unix_s if f.timeline_start_unix_s is not None else f.down_unix_s - f.at_s
            down = f.down_unix_s - t0  # the kill, in the timeline's seconds
            for ax in (hit, lat):
                ax.axvline(down, color="k", ls="--", lw=1)
                if f.zero_hit_s is not None:
                    ax.axvspan(
                        down,
                        down + f.zero_hit_s,
                        color="grey",
                        alpha=0.2,
                        label="zero-hit window" if ax is hit else None,
                    )
        _label(hit, "seconds into the replay", "prompt tokens from offload, %")
        _label(lat, "seconds into the replay", "TTFT p95 in the bin, s")
    return (
        "Miss storm",
        "When the shared tier restarts empty, how long until it serves again, and what does TTFT do meanwhile?",
        _png(fig),
    )


def ladder_png(results: Sequence[tuple[str, Any]]) -> bytes | None:
    """TTFT against context per source (``kvtier ladder``), log-log: the verified points' median per cell with
    their min-max spread, one panel per new-token count, the fitted model drawn through each source."""
    have = [(label, r) for label, r in results if any(c.verified for c in r.cells)]
    if not have:
        return None
    plt = _plt()
    from matplotlib.ticker import FuncFormatter, NullFormatter

    news = sorted({c.new_tokens for _, r in have for c in r.cells})
    fig, axes = plt.subplots(1, len(news), figsize=(6 * len(news), 4.2), squeeze=False)
    for j, n in enumerate(news):
        ax = axes[0][j]
        for i, (label, r) in enumerate(have):
            sources = sorted({c.source for c in r.cells}, key=lambda x: (x != "cold", x != "gpu", x))
            for k, src in enumerate(sources):
                cells = sorted(
                    (c for c in r.cells if c.source == src and c.new_tokens == n and c.verified),
                    key=lambda c: c.context_tokens,
                )
                if not cells:
                    continue
                xs = [c.context_tokens for c in cells]
                ys = [c.ttft_s_median for c in cells]
                err = [
                    [m - (c.ttft_s_min or m) for c, m in zip(cells, ys)],
                    [(c.ttft_s_max or m) - m for c, m in zip(cells, ys)],
                ]
                color = f"C{(i * 4 + k) % 10}"
                name = f"{label}: {src}" if len(have) > 1 else src
                ax.errorbar(xs, ys, yerr=err, marker="o", ls="none", capsize=3, color=color, label=name)
                if r.fit is not None:
                    t = r.fit.timing
                    grid = np.geomspace(min(xs), max(xs), 40)
                    if src == "cold":
                        pred = [t.prefill.seconds(x + n) for x in grid]
                    elif src == "gpu":
                        pred = [t.prefill.seconds(n, x) for x in grid]
                    else:
                        f = t.fetch_for(src)
                        pred = [t.prefill.seconds(n, x) + f.seconds(x) for x in grid] if f else []
                    if pred:
                        ax.plot(grid, pred, "-", color=color, alpha=0.6, lw=1)
        ax.set_xscale("log")
        ax.set_yscale("log")
        plain = FuncFormatter(lambda v, _: f"{v:g}")  # text.parse_math is off: log axes' default labels are mathtext
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(plain)
            axis.set_minor_formatter(NullFormatter())
        ax.set_title(f"{n:,} new tokens on the prefix", fontsize=10)
        _label(ax, "cached prefix (context), tokens", "TTFT, s (median, min-max; line: the fit)")
    return _png(fig)


def ladder_curves(items: Sequence[Loaded]) -> Plot | None:
    png = ladder_png([(it.label, it.result) for it in items])
    if png is None:
        return None
    return (
        "The tier ladder",
        "What does the same prefix cost to serve from the GPU, from each offload tier, or "
        "recomputed, as the context grows?",
        png,
    )


LADDER_PLOTS: tuple[Callable[[Sequence[Loaded]], Plot | None], ...] = (ladder_curves,)


def arms_png(results: Sequence[tuple[str, Any]]) -> bytes | None:
    """Later-turn TTFT p50 and p95 per arm (``kvtier launch --arms``), with their 95 % bootstrap intervals, and
    the prompt tokens by source beside them."""
    have = [(label, r) for label, r in results if any(s.later_ttft.n for s in r.arms)]
    if not have:
        return None
    plt = _plt()
    fig, (lat, src) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = [f"{label}: {s.arm}" if len(have) > 1 else s.arm for label, r in have for s in r.arms]
    arms = [s for _, r in have for s in r.arms]
    xs = np.arange(len(arms))
    for k, (q, off) in enumerate((("p50", -0.18), ("p95", 0.18))):
        ys = [getattr(s.later_ttft, f"{q}_s") or 0.0 for s in arms]
        lo = [y - (getattr(s.later_ttft, f"{q}_lo_s") or y) for s, y in zip(arms, ys, strict=True)]
        hi = [(getattr(s.later_ttft, f"{q}_hi_s") or y) - y for s, y in zip(arms, ys, strict=True)]
        lat.bar(xs + off, ys, width=0.34, yerr=[lo, hi], capsize=4, color=f"C{k}", label=f"later-turn TTFT {q}")
    lat.set_xticks(xs, names, rotation=15)
    _label(lat, "arm", "TTFT, s (95 % bootstrap interval)")
    bottom = np.zeros(len(arms))
    for k, key in enumerate(("local_cache_hit", "external_kv_transfer", "local_compute")):
        share = np.array([100 * s.hit_rate_by_source.get(key, 0.0) for s in arms])
        src.bar(xs, share, bottom=bottom, color=f"C{k + 2}", label=key.replace("_", " "))
        bottom += share
    src.set_xticks(xs, names, rotation=15)
    _label(src, "arm", "prompt tokens by source (vLLM's counters), %")
    return _png(fig)


def arms_bars(items: Sequence[Loaded]) -> Plot | None:
    png = arms_png([(it.label, it.result) for it in items])
    if png is None:
        return None
    return (
        "Offload engines side by side",
        "Does offloading pay on later turns, and where did their prompt tokens come from?",
        png,
    )


ARMS_PLOTS: tuple[Callable[[Sequence[Loaded]], Plot | None], ...] = (arms_bars,)


LAUNCH_PLOTS: tuple[Callable[[Sequence[Loaded]], Plot | None], ...] = (storm_timeline,)


__all__ = [
    "ARMS_PLOTS",
    "LADDER_PLOTS",
    "LAUNCH_PLOTS",
    "arms_bars",
    "arms_png",
    "ladder_curves",
    "ladder_png",
    "storm_timeline",
]
