"""The report's plots: matplotlib (the ``plot`` extra) on the Agg backend, each figure returned as PNG bytes.

Each function takes the loaded results of one kind (several are overlaid, one colour per result) and
returns ``(title, what it answers, png bytes)`` or None when no result has the data. Large series are
reduced before plotting (a CDF to 1,000 quantiles), so a 100k-request result draws as fast as a small one.
"""

from __future__ import annotations

import datetime as dt
import io
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvtier.errors import UnsupportedError
from kvtier.report.figures import Loaded

Plot = tuple[str, str, bytes]
QUANTILES = np.linspace(0.0, 1.0, 1001)
PCT_KEYS = (("p50", 50.0), ("p90", 90.0), ("p95", 95.0), ("p99", 99.0), ("p999", 99.9), ("p9999", 99.99))


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    # labels are outside text (result labels, device and tier names): a "$" must print, not start mathtext
    # (a "$\\frac$" in a device name crashed the report)
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt


def require_matplotlib(flag: str) -> None:
    """Without matplotlib (the ``plot`` extra), ``flag`` cannot draw: exit 4 with the install line. kvtier's CLI asks
    before running any command given ``--plot`` (cli/main.py), not after the run with no plot."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UnsupportedError(f"{flag}: drawing the plot needs matplotlib: pip install 'kvtier[plot]'") from None


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, outside text inert (the plan's plots use it too); without matplotlib,
    the install line (exit 4)."""
    require_matplotlib("--plot")
    return _plt()


MIN_WIDTH_PX = 1100
"""Every plot is drawn at least this wide: the resolution rises for a narrow figure, so its text grows with
it and legends stay legible in the report."""


def dpi_for(width_in: float) -> float:
    """The resolution that draws a figure ``width_in`` inches wide at MIN_WIDTH_PX or more (96 at least)."""
    return max(96.0, MIN_WIDTH_PX / width_in)


LEFT_MARGIN_IN = 0.95
"""The left margin in inches at least: five-digit tick labels and the y axis's name fit in it."""


def plain_log_ticks(fig: Any) -> None:
    """Log axes labelled in plain text. Mathtext is off for every string (outside text must stay inert), and
    matplotlib's default log formatters speak mathtext: their labels printed as raw ``$\\mathdefault{10^{3}}$``
    and pushed the axis names off the image. ``LogFormatter`` writes 1000, 1e+04."""
    from matplotlib.ticker import LogFormatter

    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale != "log":
                continue
            if type(axis.get_major_formatter()).__name__.startswith("LogFormatter"):
                axis.set_major_formatter(LogFormatter(labelOnlyBase=False))
            if type(axis.get_minor_formatter()).__name__.startswith("LogFormatter"):
                axis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _png(fig: Any, right_in: float = 0.0) -> bytes:
    """PNG bytes. Margins are set, not measured: bbox_inches="tight" draws every figure twice. ``right_in``: inches
    kept free at the right (a figure legend beside the panels)."""
    plain_log_ticks(fig)
    width = fig.get_size_inches()[0]
    left = max(0.08, LEFT_MARGIN_IN / width)  # room for "10000" and the axis name, any width
    right = 0.98 - right_in / width
    fig.subplots_adjust(left=left, right=right, bottom=0.16, top=0.88, wspace=0.32, hspace=0.55)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi_for(fig.get_size_inches()[0]))
    _plt().close(fig)
    return buf.getvalue()


def _label(ax: Any, xlabel: str, ylabel: str) -> None:
    """Axis names, a light grid and the legend: how every single-axes plot here ends."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _log_y(ax: Any) -> None:
    """A log y axis without minor ticks (they cost most of a figure's drawing time)."""
    from matplotlib.ticker import NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_minor_locator(NullLocator())


def _nines(p: float) -> float:
    """Percentile -> the 'nines' axis: 50 -> 0.3, 90 -> 1, 99 -> 2, 99.9 -> 3."""
    return float(-np.log10(1.0 - p / 100.0))


def _nines_axis(ax: Any) -> None:
    ticks = [50, 90, 99, 99.9, 99.99]
    ax.set_xticks([_nines(t) for t in ticks])
    ax.set_xticklabels([f"p{t:g}" for t in ticks])


def tier_latency(items: Sequence[Loaded]) -> Plot | None:
    """Per tier and direction: total, device and host latency at p50..p99.99 (the tails on a log axis)."""
    panels = sorted(
        {(t, op) for it in items for t, ts in it.bench.tiers.items() for op in ("read", "write") if getattr(ts, op).ops}
    )
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    for ax, (tier, op) in zip(axes[0], panels):
        for i, it in enumerate(items):
            ts = it.bench.tiers.get(tier)
            if ts is None or not getattr(ts, op).ops:
                continue
            o = getattr(ts, op)
            for part, style in (("latency_ms", "-"), ("device_latency_ms", "--"), ("host_latency_ms", ":")):
                d = getattr(o, part)
                pts = [(_nines(q), max(float(v), 1e-4)) for k, q in PCT_KEYS if (v := getattr(d, k)) is not None]
                if not pts:
                    continue
                xs, ys = zip(*pts)
                label = f"{it.label} {part.replace('_latency_ms', '').replace('latency_ms', 'total')}"
                ax.plot(xs, ys, style, color=f"C{i}", marker="." if style == "-" else None, label=label)
        _log_y(ax)
        ax.set_title(f"{tier} {op}")
        _nines_axis(ax)
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("ms")
    axes[0][0].legend(fontsize=7)
    return (
        "Tier latency by percentile",
        "How slow is each tier in its tail, and is it the device (dashed) or kvtier's host work (dotted)?",
        _png(fig),
    )


def throughput_and_fill(items: Sequence[Loaded]) -> Plot | None:
    """Generated tokens/s each second, and each tier's fill from the device sampler's timeline."""
    if not any(it.bench.throughput_timeline for it in items):
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, it in enumerate(items):
        tl = it.bench.throughput_timeline
        if tl:
            a.plot(
                [p.timestamp for p in tl],
                [p.throughput_tokens_per_sec for p in tl],
                ".-",
                color=f"C{i}",
                label=it.label,
            )
        dev = it.bench.device
        caps = {k: v.capacity_bytes for k, v in it.bench.tier_usage_at_end.items()}
        if dev is not None and dev.timeline:
            for j, tier in enumerate(sorted(caps)):
                pts = [
                    (p["t_s"], (p.get("tier_used_bytes") or {}).get(tier))
                    for p in dev.timeline
                    if isinstance(p.get("t_s"), (int, float))
                ]
                pts = [(t, u / caps[tier]) for t, u in pts if u is not None and caps[tier]]
                if pts:
                    b.plot(*zip(*pts), ["-", "--", ":"][j % 3], color=f"C{i}", label=f"{it.label} {tier}")
    a.set_title("generated tokens/s")
    a.set_xlabel("time since the load began, s")
    a.set_ylabel("tokens/s")
    b.set_title("tier fill (used / capacity)")
    b.set_xlabel("time since the load began, s")
    b.set_ylabel("fraction of capacity")
    b.set_ylim(0, 1.05)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return (
        "Throughput and tier fill over time",
        "Did the run reach a steady state, and when did each tier fill and start demoting?",
        _png(fig),
    )


def device_timeline(items: Sequence[Loaded]) -> Plot | None:
    have = [(it, d) for it in items if (d := it.bench.device) is not None and d.timeline]
    if not have:
        return None
    plt = _plt()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.4))
    for i, (it, stats) in enumerate(have):
        tl = [p for p in stats.timeline if isinstance(p.get("t_s"), (int, float))]  # a point must say when
        for j, dev in enumerate(stats.devices):
            t = [p["t_s"] for p in tl]
            util = [(p.get("devices") or {}).get(dev, {}).get("utilization") for p in tl]
            a.plot(t, util, ["-", "--"][j % 2], color=f"C{i}", label=f"{it.label} {dev}")
            iv = [max(p.get("interval_s") or 1.0, 1e-9) for p in tl]
            rd = [((p.get("devices") or {}).get(dev, {}).get("read_bytes") or 0) / s / 1e9 for p, s in zip(tl, iv)]
            wr = [((p.get("devices") or {}).get(dev, {}).get("write_bytes") or 0) / s / 1e9 for p, s in zip(tl, iv)]
            b.plot(t, rd, "-", color=f"C{i}", label=f"{it.label} {dev} read")
            b.plot(t, wr, ":", color=f"C{i}", label=f"{it.label} {dev} write")
    a.set_title("device utilisation")
    a.set_ylim(0, 1.05)
    a.set_ylabel("busy fraction of each interval")
    b.set_title("device throughput")
    b.set_ylabel("GB/s")
    for ax in (a, b):
        ax.set_xlabel("time since the load began, s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return (
        "The storage device over time",
        "Was the device busy, and did it move what kvtier asked (or someone else's traffic too)?",
        _png(fig),
    )


def qos(items: Sequence[Loaded]) -> Plot | None:
    classes = ("interactive", "responsive", "batch")
    rows = [(it, c, it.bench.summary.qos_metrics.get(c)) for it in items for c in classes]
    rows = [(it, c, q) for it, c, q in rows if q is not None and not q.no_data]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    width = 0.8 / len(items)
    for i, it in enumerate(items):
        xs, ys = [], []
        for k, c in enumerate(classes):
            q = it.bench.summary.qos_metrics.get(c)
            if q is not None and not q.no_data and q.sla.actual_p95_ms is not None:
                xs.append(k + i * width)
                ys.append(q.sla.actual_p95_ms)
        ax.bar(xs, ys, width, color=f"C{i}", label=f"{it.label} p95")
    labelled = False
    for k, c in enumerate(classes):  # each class's target over its own bars: from its first to its last
        q = next((q for _, cc, q in rows if cc == c), None)
        if q is not None:
            ax.hlines(
                q.sla.target_p95_ms,
                k - width / 2,
                k + (len(items) - 0.5) * width,
                colors="k",
                linestyles="--",
                label=None if labelled else "target p95",
            )
            labelled = True
    _log_y(ax)
    floor = ax.get_ylim()[0]
    for i, it in enumerate(items):  # a slot without a bar says why, rather than look like a missing result
        for k, c in enumerate(classes):
            q = it.bench.summary.qos_metrics.get(c)
            if q is None or q.no_data or q.sla.actual_p95_ms is None:
                ax.annotate("no requests", (k + i * width, floor), ha="center", va="bottom", fontsize=6,
                            rotation=90, color="0.4")  # fmt: skip
    ax.set_xticks([k + (len(items) - 1) * width / 2 for k in range(len(classes))])
    ax.set_xticklabels(classes)
    ax.set_ylabel("end-to-end p95, ms")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return ("QoS classes against their targets", "Did each class meet its p95 target?", _png(fig))


def autoscaler(items: Sequence[Loaded]) -> Plot | None:
    have = [it for it in items if it.bench.summary.autoscaling_stats]
    if not have:
        return None
    plt = _plt()
    fig, a = plt.subplots(figsize=(7, 3.4))
    b = a.twinx()
    for i, it in enumerate(have):
        ev = it.bench.summary.autoscaling_stats
        stamps = [dt.datetime.fromisoformat(e.timestamp).timestamp() for e in ev]
        t = [s - stamps[0] for s in stamps]
        a.step(t, [e.users for e in ev], where="post", color=f"C{i}", label=f"{it.label} users")
        sat = [e.saturation_level for e in ev]
        if any(s is not None for s in sat):
            b.plot(t, sat, ":", color=f"C{i}", label=f"{it.label} saturation")
    a.set_ylabel("users")
    b.set_ylabel("saturation (0..1)")
    a.set_xlabel("time since the first scaling event, s")
    a.legend(fontsize=8, loc="upper left")
    return ("Autoscaler path", "How many users could the storage carry, and where did it saturate?", _png(fig))


def read_amplification(items: Sequence[Loaded]) -> Plot | None:
    vals = [(it.label, it.bench.summary.kv_layout_stats.read_amplification) for it in items]
    vals = [(k, v) for k, v in vals if v is not None]
    if len(vals) < 2:  # one number is a table row, not a plot
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([k for k, _ in vals], [v for _, v in vals], color=[f"C{i}" for i in range(len(vals))])
    ax.set_ylabel("KV bytes read / new context bytes")
    ax.grid(axis="y", alpha=0.3)
    return ("Read amplification", "How many bytes of cached KV did each new token of context cost to read?", _png(fig))


def _cdf(ax: Any, values: np.ndarray, color: str, label: str, style: str = "-") -> None:
    if values.size == 0:
        return
    q = np.quantile(values, QUANTILES)
    ax.plot(q, QUANTILES, style, color=color, label=label)


def ttft_cdf(items: Sequence[Loaded]) -> Plot | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    drawn = False
    for i, it in enumerate(items):
        if it.records is not None:
            _cdf(ax, it.records.ttft_ok(False), f"C{i}", f"{it.label} first turn")
            _cdf(ax, it.records.ttft_ok(True), f"C{i}", f"{it.label} later turns", "--")
            drawn = True
        else:  # no requests.jsonl: the summary's percentiles
            d = it.replay.summary.ttft_s
            pts = [(v, q / 100) for k, q in PCT_KEYS if (v := getattr(d, k)) is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", color=f"C{i}", label=f"{it.label} (percentiles)")
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    from matplotlib.ticker import NullLocator

    ax.set_xscale("log")
    ax.xaxis.set_minor_locator(NullLocator())
    _label(ax, "TTFT, s", "fraction of requests")
    return (
        "TTFT distribution",
        "How long until the first token, for first turns (solid) and later turns "
        "(dashed), where cached context should pay off?",
        _png(fig),
    )


def ttft_by_turn(items: Sequence[Loaded]) -> Plot | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    drawn = False
    for i, it in enumerate(items):
        if it.records is not None:
            rec = it.records
            m = rec.ok & np.isfinite(rec.ttft_s)
            turns = sorted(set(rec.turn[m].tolist()))
            med = [float(np.median(rec.ttft_s[m & (rec.turn == t)])) for t in turns]
            p95 = [float(np.percentile(rec.ttft_s[m & (rec.turn == t)], 95)) for t in turns]
            ax.plot(turns, med, "-o", color=f"C{i}", label=f"{it.label} median")
            ax.plot(turns, p95, ":", color=f"C{i}", label=f"{it.label} p95")
            drawn = bool(turns) or drawn
        else:  # no requests.jsonl: the summary's medians
            by = it.replay.summary.ttft_degradation.ttft_s_by_turn_p50
            if by:
                ax.plot([int(k) for k in by], list(by.values()), "-o", color=f"C{i}", label=f"{it.label} median")
                drawn = True
    if not drawn:
        plt.close(fig)
        return None
    _log_y(ax)  # a log axis: the medians stay readable beside a p95 orders of magnitude above them
    ax.xaxis.get_major_locator().set_params(integer=True)
    _label(ax, "turn", "TTFT, s (log)")
    return (
        "TTFT by turn",
        "Does TTFT grow as conversations get longer (no reuse), or stay flat (the cache serves the history)?",
        _png(fig),
    )


PARTS = ("receive", "queue", "lookup", "fetch", "recompute", "first_decode", "send")


def ttft_parts(items: Sequence[Loaded]) -> Plot | None:
    """Per turn, the server's mean TTFT stacked by part (the sim's decomposition, or one measured in a real engine:
    replay --engine-log), beside the client's TTFT;
    one panel per result that has it, and the prompt's share from cache above each bar."""
    have = [(it, d) for it in items if (d := it.replay.summary.ttft_decomposition) is not None and d.requests]
    if not have:
        return None
    plt = _plt()
    cols = min(2, len(have))  # at most two panels a row: side by side, n panels were too narrow to read
    rows = -(-len(have) // cols)
    # one y scale for every panel (results side by side read as they compare), one legend beside them, off the bars
    fig, axes = plt.subplots(rows, cols, figsize=(7 * cols + 1.6, 3.6 * rows), squeeze=False, sharey=True)
    flat = list(axes.flat)
    for ax in flat[len(have) :]:
        ax.set_visible(False)
    for ax, (it, decomposition) in zip(flat, have, strict=False):
        turns = decomposition.by_turn
        x = [t.turn for t in turns]
        bottom = np.zeros(len(x))
        for k, part in enumerate(PARTS):
            v = np.array([t.seconds_mean.get(part, 0.0) * 1e3 for t in turns])
            if v.any():
                ax.bar(x, v, bottom=bottom, color=f"C{k}", label=part)
                bottom += v
        ax.plot(x, [t.ttft_s_mean * 1e3 for t in turns], "k_", markersize=18, label="client TTFT")
        for xi, t, top in zip(x, turns, bottom, strict=True):
            cached = 1.0 - t.token_share.get("recomputed", 0.0)
            ax.annotate(f"{cached:.0%}", (xi, top), ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{it.label} (% of prompt tokens from a cache)", fontsize=9)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("turn")
        ax.set_ylabel("mean TTFT, ms")
        ax.grid(alpha=0.3)
    top = max(ax.get_ylim()[1] for ax in flat[: len(have)])
    flat[0].set_ylim(top=top * 1.1)  # room for the share above the tallest bar (the axes share it)
    handles: dict[str, Any] = {}
    for ax in flat[: len(have)]:
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(list(handles.values()), list(handles), fontsize=8, loc="center right")
    return (
        "Where TTFT went, by turn",
        "Did the offload tier cut later turns' TTFT, and where did the rest go (queue, fetch, recompute)?",
        _png(fig, right_in=1.5),
    )


def tpot(items: Sequence[Loaded]) -> Plot | None:
    have = [it for it in items if it.records is not None and np.isfinite(it.records.tpot_s).any()]
    if not have:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, it in enumerate(have):
        v = it.records.tpot_s  # type: ignore[union-attr]  # filtered above
        _cdf(ax, v[np.isfinite(v)] * 1000, f"C{i}", it.label)
    _label(ax, "time per output token, ms", "fraction of requests")
    return ("Time per output token", "Did the offload tier's work slow decoding down?", _png(fig))


def hit_rates(items: Sequence[Loaded]) -> Plot | None:
    series = (
        ("prefix_cache_hit_rate_series", "-", "GPU prefix"),
        ("external_prefix_cache_hit_rate_series", "--", "external"),
        ("lmcache_lookup_hit_rate_series", ":", "LMCache lookup"),
    )
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    drawn = False
    for i, it in enumerate(items):
        for m in it.replay.server_metrics[:1]:
            for attr, style, name in series:
                pts = [(p.t, p.rate) for p in (getattr(m, attr) or []) if p.rate is not None]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{i}", label=f"{it.label} {name}")
                    drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set_ylim(0, 1.05)
    _label(ax, "time since the replay began, s", "hit rate (rolling window, 0..1)")
    return ("Server cache hit rates over time", "Was the offload tier actually hit, and did it warm up?", _png(fig))


def sessions(items: Sequence[Loaded]) -> Plot | None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3))
    labels = [it.label for it in items]
    bottom = np.zeros(len(items))
    for name, color in (("complete", "C2"), ("incomplete", "C1"), ("error", "C3")):
        v = np.array([getattr(it.replay.summary.sessions, name) for it in items], dtype=float)
        ax.bar(labels, v, bottom=bottom, color=color, label=name)
        bottom += v
    ax.set_ylabel("sessions")
    ax.legend(fontsize=8)
    return ("Sessions", "Did every virtual user finish its turns?", _png(fig))


def working_set(items: Sequence[Loaded]) -> Plot | None:
    have = [(it, ro) for it in items if (ro := it.replay.reuse_opportunity) is not None and ro.working_set]
    if not have:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for i, (it, ro) in enumerate(have):
        ws = ro.working_set
        byte = ws[0].bytes is not None
        ax.plot(
            [p.requests for p in ws],
            [(p.bytes or 0) / 2**30 if byte else p.tokens for p in ws],
            color=f"C{i}",
            label=f"{it.label}: history {ro.history_reuse_fraction or 0:.0%}, cross-session "
            f"{ro.cross_session_reuse_fraction or 0:.0%}, new {ro.new_fraction or 0:.0%}",
        )
    _label(ax, "requests sent (dataset order)", "distinct KV, GiB" if byte else "distinct tokens")
    return (
        "The dataset's reuse opportunity",
        "How much KV would an offload tier have to hold to serve this "
        "dataset's repeated prefixes, and what share of the prompt tokens is reused at all?",
        _png(fig),
    )


BENCH_PLOTS: tuple[Callable[[Sequence[Loaded]], Plot | None], ...] = (
    tier_latency,
    throughput_and_fill,
    device_timeline,
    qos,
    autoscaler,
    read_amplification,
)
REPLAY_PLOTS: tuple[Callable[[Sequence[Loaded]], Plot | None], ...] = (
    ttft_cdf,
    ttft_by_turn,
    ttft_parts,
    tpot,
    hit_rates,
    sessions,
    working_set,
)
__all__ = ["BENCH_PLOTS", "REPLAY_PLOTS", "Plot"]
