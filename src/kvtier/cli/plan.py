"""``kvtier plan``: a table of (config, library call, printer), one row per subcommand.

The flags come from each subcommand's model (config/plan.py, built by cli/args.py); the answer from
``kvtier.plan.answers``; the printers here turn an answer into the table and lines the terminal shows
(``--json`` prints the answer alone, ``--output`` writes it in the result envelope, ``--plot`` draws the
report's figure of it). ``plan sweep`` runs trials and writes its own sweep.json."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.plan import (
    BreakevenConfig,
    BytesConfig,
    CapacityConfig,
    FetchConfig,
    GateConfig,
    PlanOutputFlags,
    RecommendConfig,
    RetentionConfig,
    SweepConfig,
    ValueConfig,
    ViewsConfig,
)
from kvtier.results.plan import (
    BreakevenReport,
    BytesReport,
    CapacityReport,
    CatalogReport,
    CatalogRow,
    FetchReport,
    GateReport,
    LadderGateReport,
    Recommendation,
    RetentionReport,
    ValueReport,
    ViewsReport,
)
from kvtier.units import GiB, fmt_bandwidth, fmt_seconds


@dataclass
class Screen:
    """What the terminal shows of an answer: lines, then a table, then lines after it (and stderr notes)."""

    lines: list[str] = field(default_factory=list)
    table: Any = None
    after: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    exit: int = 0


def _table(title: str, cols: list[str]) -> Any:
    """A rich table whose title and string cells are plain text, never markup (model names, tier names and
    file names come from outside: ``[red]`` or a stray ``[/]`` must print as written, not style or crash)."""
    from rich.table import Table
    from rich.text import Text

    class PlainTable(Table):
        def add_row(self, *cells: Any, **kw: Any) -> None:
            super().add_row(*(Text(c) if isinstance(c, str) else c for c in cells), **kw)

    t = PlainTable(title=Text(title))
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 else "right")
    return t


def _dash(v: Any, f: str = "") -> str:
    return "—" if v is None else format(v, f)


def _yes(v: bool | None) -> str:
    return "—" if v is None else ("yes" if v else "no")


# -- printers: (config, answer) -> Screen -----------------------------------------------------------------------
def show_bytes(cfg: BytesConfig, r: BytesReport | CatalogReport) -> Screen:
    if isinstance(r, CatalogReport):
        t = _table("KV bytes per token (catalog)", list(CatalogRow.model_fields))
        for row in r.models:
            t.add_row(*[f"{v:,}" if isinstance(v, int) else str(v) for v in row.model_dump().values()])
        return Screen(table=t)
    return Screen(
        [
            f"{r.model} ({r.attention}, {r.dtype}, TP {cfg.tp}): {r.kv_bytes_per_token:,.0f} B/token "
            f"({r.kv_kib_per_token:,.2f} KiB); {r.gib_per_million_tokens:.2f} GiB per million tokens"
        ]
    )


def show_breakeven(cfg: BreakevenConfig, r: BreakevenReport) -> Screen:
    comp, rec = r.compression, r.recompute_s
    t = _table(
        f"{r.model}, {r.context_tokens:,} tokens of context",
        ["per link"] + [f"{L.net_bw}, RTT {L.rtt}" for L in r.links],
    )
    rows: list[tuple[str, Callable[[Any], str]]] = [
        (f"decode, KV local ({r.stages} stages), per token", lambda L: fmt_seconds(L.decode_local_s_per_token)),
        ("decode, KV streamed from a store, per token", lambda L: fmt_seconds(L.stream_remote_s_per_token)),
        ("decode, queries shipped to the store, per token", lambda L: fmt_seconds(L.query_shipping_s_per_token)),
        ("prefix fetch, once per request", lambda L: fmt_seconds(L.fetch_s)),
        (f"prefix fetch at {comp:g}x compression", lambda L: fmt_seconds(L.fetch_compressed_s)),
        ("recompute (re-prefill)", lambda L: fmt_seconds(rec)),
        (
            f"RTT-aware break-even at this context ({comp:g}x)",
            lambda L: fmt_bandwidth(L.breakeven_exact_bytes_per_s) if L.breakeven_exact_bytes_per_s else "none",
        ),
        ("verdict (uncompressed)", lambda L: "fetch" if L.fetch_s < rec else "recompute"),
        (f"verdict ({comp:g}x)", lambda L: L.verdict),
    ]
    for label, cell in rows:
        t.add_row(label, *[cell(L) for L in r.links])
    kvpt = r.kv_bytes_per_token
    lines = [
        f"KV: {kvpt:,.0f} B/token ({kvpt / 1024:,.4g} KiB); {r.context_tokens:,} tokens = {r.kv_bytes / 1e9:.3f} GB",
        f"recompute at {r.prefill_tokens_per_s:,.0f} tok/s: {fmt_seconds(rec)}",
        f"break-even bandwidth (long-context closed form): {fmt_bandwidth(r.breakeven_bytes_per_s)}; "
        f"at {comp:g}× compression {fmt_bandwidth(r.breakeven_compressed_bytes_per_s)}",
    ]
    notes = [f"note ({L.net_bw}, {L.rtt}): {L.breakeven_exact_note}" for L in r.links if L.breakeven_exact_note]
    return Screen(lines, t, notes=notes)


def show_gate(cfg: GateConfig, r: GateReport | LadderGateReport) -> Screen:
    if isinstance(r, GateReport):
        t = _table(
            f"fetch gate: {r.model}, {r.context_tokens:,} tokens, prefill {r.prefill_tokens_per_s:,.0f} tok/s",
            ["case", "fetch (s)", "recompute (s)", "verdict"],
        )
        for row in r.cases:
            t.add_row(row.case, f"{row.fetch_s:.4f}", f"{row.recompute_s:.4f}", row.verdict)
        return Screen(table=t)
    t = _table(
        f"fetch gate from the measured ladder {cfg.from_} ({r.timing_source})",
        ["tier", "context", "new", "fetch (s)", "recompute (s)", "verdict", "measured faster", "agrees"],
    )
    for x in r.rows:
        t.add_row(
            x.tier,
            f"{x.context_tokens:,}",
            f"{x.new_tokens:,}",
            f"{x.fetch_s:.4f}",
            f"{x.recompute_s:.4f}",
            x.verdict + (" (extrapolated)" if x.extrapolated else ""),
            x.measured_faster or "—",
            "—" if x.agrees is None else ("yes" if x.agrees else "NO"),
        )
    lines = [
        f"break-even ({b.tier}, {b.new_tokens:,} new tokens): "
        + (f"fetch wins from {b.context_tokens:,} tokens of context" if b.context_tokens else b.note)
        for b in r.breakeven
    ]
    lines.append(f"check: the gate agrees with the measured faster source on {r.agreed} of {r.checked} cells")
    return Screen(lines, t, exit=0 if r.agreed == r.checked else 1)


def show_capacity(cfg: CapacityConfig, r: CapacityReport) -> Screen:
    lines = [
        f"{r.model}: {r.kv_bytes_per_token:,.0f} B/token; one million cached tokens = "
        f"{r.gib_per_million_tokens:.2f} GiB"
    ]
    if r.tokens is not None:
        lines.append(
            f"{r.tokens.tokens:,} tokens: {r.tokens.kv_bytes / GiB:,.2f} GiB of KV, "
            f"{r.tokens.with_headroom_bytes / GiB:,.2f} GiB with {cfg.headroom:.0%} eviction headroom"
        )
    for name, tier in r.tiers.items():
        lines.append(
            f"tier {name} ({tier.capacity_bytes / 1e9:g} GB at {cfg.target_usage:.0%}): {tier.tokens:,} "
            f"tokens = {tier.users:,} users of {cfg.tokens_per_user:,} tokens"
        )
    return Screen(lines)


def show_fetch(cfg: FetchConfig, r: FetchReport) -> Screen:
    t = _table(
        f"measured fetch vs recompute ({r.source.file}, model {r.model}, {cfg.prefill_tps:,.0f} tok/s)",
        ["tier", "context", "fetch mean", "fetch p95", "recompute", "verdict", "note"],
    )
    for row in r.rows:
        t.add_row(
            row.tier,
            f"{row.context_tokens:,}",
            fmt_seconds(row.fetch_mean_s),
            fmt_seconds(row.fetch_p95_s),
            fmt_seconds(row.recompute_s),
            row.verdict,
            "extrapolated" if row.extrapolated else "",
        )
    return Screen(["fetch cost = measured end-to-end read latency of the tier, scaled by bytes; verdict on p95"], t)


def show_value(cfg: ValueConfig, r: ValueReport) -> Screen:
    t = _table(
        f"does the tier pay? ({r.source}: {r.requests} requests, {r.wall_s:g} s, {r.prompt_tokens:,} prompt tokens)",
        [
            "tier",
            "hit rate",
            "tokens/h",
            "prefill avoided s/h",
            "fetch s/h",
            "latency saved/hit",
            "value $/h",
            "cost $/h",
            "pays",
            "break-even hit rate",
        ],
    )
    for x in r.tiers:
        t.add_row(
            x.tier,
            f"{x.hit_rate:.1%}",
            f"{x.tokens_per_hour:,.0f}",
            _dash(x.prefill_s_avoided_per_hour, ",.1f"),
            _dash(x.fetch_s_per_hour, ",.1f"),
            "—" if x.latency_saved_per_hit_s is None else fmt_seconds(x.latency_saved_per_hit_s),
            _dash(x.value_usd_per_hour, ".4f"),
            _dash(x.cost_usd_per_hour, ".4f"),
            _yes(x.pays),
            _dash(x.breakeven_hit_rate, ".2%"),
        )
    lines = [
        f"{i.name}: {_dash(i.value, 'g')} {i.unit} ({i.source}{'; ' + i.note if i.note else ''})" for i in r.inputs
    ]
    lines += [f"{x.tier}: {x.in_time}" for x in r.tiers if x.in_time]
    if r.twin_error is not None:
        e = r.twin_error
        lines.append(f"the twin's times carry its measured error: real / predicted x{e.ratio_low:.2f}-x"
                     f"{e.ratio_high:.2f} ({e.basis})")  # fmt: skip
        for x in r.tiers:
            if x.gpu_s_saved_per_hour_band is not None:
                lo, hi = x.gpu_s_saved_per_hour_band
                usd = x.value_usd_per_hour_band
                worth = f", value ${usd[0]:.4f}-${usd[1]:.4f}/h" if usd else ""
                tie = "; a tie: within that error the tier may or may not pay" if x.pays_tie else ""
                lines.append(f"{x.tier}: GPU s saved/h {lo:,.1f}-{hi:,.1f}{worth}{tie}")
    if r.decomposition == "measured-in-engine":
        lines.append("each request's prompt by tier and its fetch and recompute: measured in the engine (--engine-log)")
    for c in r.ladder_check:
        ladder = "no curve" if c.ladder_s is None else f"{c.ladder_s:.4f} s"
        err = "" if c.error is None else f" ({c.error:+.1%})"
        lines.append(
            f"ladder check ({r.ladder}) {c.part}: measured {c.measured_s:.4f} s over {c.requests} requests, "
            f"the ladder's curves {ladder}{err}"
        )
    return Screen(lines, t)


def _h_bytes(n: float) -> str:
    from kvtier.iotrace.stats import human_bytes

    return human_bytes(n)


def show_retention(cfg: RetentionConfig, r: RetentionReport) -> Screen:
    bpt, u = r.kv_bytes_per_token, r.unit

    def size(tokens: float) -> str:
        return f"{tokens:,.0f} tokens ({_h_bytes(tokens * bpt)})"

    def span(v: float | None) -> str:
        return "—" if v is None else fmt_seconds(v) if u == "s" else f"{v:,.0f} req"

    lines = [
        f"{r.source}: {r.requests:,} requests, {r.accesses:,} block accesses of {r.block_tokens} tokens over "
        f"{span(r.span)}; order: {r.order}",
        f"{r.model} at {bpt:,} B/token: accessed {size(r.accessed_tokens)}, of which "
        f"{r.reused_tokens / r.accessed_tokens:.1%} had an earlier access; distinct {size(r.distinct_tokens)} "
        "(an LRU this large misses only cold blocks)",
    ]
    nt = r.need_tokens
    if nt["p50"] is not None:
        lines.append(
            f"the LRU capacity a reuse needs: p50 {size(nt['p50'])}, p90 {size(nt['p90'] or 0)}, "
            f"p99 {size(nt['p99'] or 0)}"
        )
    for t in r.tiers:
        if t.holds_whole_trace:
            held = "never fills: holds the whole trace"
        else:
            held = (
                f"holds the last {span(t.window.p50)} of history (p10 {span(t.window.p10)}, p90 "
                f"{span(t.window.p90)}"
                + (f"; {t.window_requests.p50:,.0f} requests" if u == "s" else "")
                + f") once full at {span(t.fills_at)}"
            )
        lines.append(
            f"{t.tier} {t.capacity_bytes / 1e9:g} GB ({t.capacity_tokens:,} tokens): serves "
            f"{t.hit_fraction:.1%} of the tokens ({t.cumulative_hit_fraction:.1%} with the tiers above); "
            f"down to it the waterfall {held}"
        )
    if r.policies:
        lines.append(
            "fanout protection against LRU, on the same accesses (blocks two or more continuations followed kept over "
            f"the others, up to {r.protect_share:.0%} of the capacity; kvtier's vLLM index with eviction fanout):"
        )
    for p in r.policies:
        gain = (p.fanout_hit_fraction - p.lru_hit_fraction) * 100
        lines.append(
            f"  at {_h_bytes(p.capacity_bytes)} ({p.capacity_tokens:,} tokens): LRU serves {p.lru_hit_fraction:.1%}, "
            f"fanout {p.fanout_hit_fraction:.1%} ({gain:+.1f} points)"
        )
    table = _table("hit rate against LRU capacity (exact stack distances)", ["capacity", "tokens", "hit", "of reuse"])
    for c in r.curve:
        table.add_row(
            _h_bytes(c.capacity_bytes),
            f"{c.capacity_tokens:,}",
            f"{c.hit_fraction:.1%}",
            _dash(c.reuse_hit_fraction, ".1%"),
        )
    return Screen(lines, table)


def show_recommend(cfg: RecommendConfig, r: Recommendation) -> Screen:
    def iv(i: Any, f: str = ".3f") -> str:
        if i.mean is None:
            return "—"
        if i.high is None or i.low is None:
            return format(i.mean, f)
        return f"{i.mean:{f}} [{i.low:{f}}-{i.high:{f}}{'*' if i.clipped else ''}]"

    def twin(w: Any) -> str:  # a calibrated sweep: the interval widened by the twin's error, which decides
        return f" ~{w.low:.3f}-{w.high:.3f}"

    t = _table(
        f"the sweep in {r.source} ({r.sweep_status}): mean [95 % CI across trials; * clipped at 0 or 1]"
        + ("; ~ with the twin's calibration error" if any(p.twin_error for p in r.points) else ""),
        ["point", "trials", "TTFT p95 s", "TTFT p50 s", "GPU hit", "offload hit", "req/s", "$/h", "meets SLO"],
    )
    for p in r.points:
        t.add_row(
            p.point,
            f"{p.trials}" + (f" (+{p.trials_not_complete} not complete)" if p.trials_not_complete else ""),
            iv(p.ttft_p95_s) + (twin(p.ttft_p95_s_with_twin) if p.ttft_p95_s_with_twin else ""),
            iv(p.ttft_p50_s),
            iv(p.gpu_hit_share, ".1%"),
            iv(p.offload_hit_share, ".1%"),
            iv(p.requests_per_s, ".2f"),
            _dash(p.cost_usd_per_hour, ".4f"),
            "—" if p.meets_slo is None else _yes(p.meets_slo) + (f" ({p.note})" if p.note else ""),
        )
    lines = [
        f"knees at NVMe {k.nvme_gb:g} GB, concurrency {k.concurrency}: offload hit rate at CPU "
        f"{_dash(k.hit_rate_knee_cpu_gb)} GB, TTFT p95 at CPU {_dash(k.ttft_knee_cpu_gb)} GB (90 % of the "
        "line's change)"
        for k in r.knees
        if k.points >= 2
    ]
    return Screen(lines, t, after=[f"recommend: {pick.sentence}" for pick in r.picks])


def show_views(cfg: ViewsConfig, r: ViewsReport) -> Screen:
    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:,.2f}"

    def band(b: tuple[float, float] | None) -> str:  # (b) from a ladder: the interval its error allows
        return f" ({ms(b[0])}-{ms(b[1])})" if b else ""

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x:+.0%}"

    t = _table(
        f"one trace, three views ({r.source}: {r.requests} requests); ms, error = predicted / measured - 1",
        [
            "turn",
            "requests",
            "measured TTFT",
            "measured fetch",
            "(b) TTFT",
            "(b) fetch",
            "(b) error",
            "(c) TTFT",
            "(c) fetch",
            "(c) error",
        ],
    )
    for x in r.turns:
        t.add_row(
            str(x.turn),
            str(x.requests),
            ms(x.measured_ttft_s),
            ms(x.measured_fetch_s),
            ms(x.predicted_ttft_s) + band(x.predicted_ttft_s_band),
            ms(x.predicted_fetch_s),
            pct(x.ttft_error),
            ms(x.storage_ttft_s),
            ms(x.storage_fetch_s),
            pct(x.storage_ttft_error),
        )
    lines = [
        f"{i.name}: {i.value:g} {i.unit} ({i.source})" if i.value is not None else f"{i.name}: — ({i.source})"
        for i in r.inputs
    ]
    lines += [f"finding: {f}" for f in r.findings]
    b, c = _dash(r.median_abs_ttft_error, ".0%"), _dash(r.median_abs_storage_ttft_error, ".0%")
    return Screen(lines, t, after=[f"median |error| by turn: (b) {b}, (c) {c}"])


# -- the table ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sub:
    name: str
    help: str
    config: type[PlanOutputFlags]
    show: Callable[[Any, Any], Screen]


SUBCOMMANDS = (
    Sub("bytes", "KV bytes per token of a model (or --list the catalog)", BytesConfig, show_bytes),
    Sub("breakeven", "decode placement costs and the fetch-vs-recompute break-even", BreakevenConfig, show_breakeven),
    Sub("gate", "the fetch gate for a list of cases, or from a measured ladder (--from)", GateConfig, show_gate),
    Sub("capacity", "bytes for N tokens, users per tier, cost of a million tokens", CapacityConfig, show_capacity),
    Sub("fetch", "fetch vs recompute from a kvtier bench result's measured reads", FetchConfig, show_fetch),
    Sub(
        "value",
        "does a KV tier pay? tokens served, prefill avoided, value against cost, from a replay",
        ValueConfig,
        show_value,
    ),
    Sub(
        "retention",
        "how much history a tier holds before it evicts: exact LRU hit curve and retention window of a trace",
        RetentionConfig,
        show_retention,
    ),
    Sub(
        "recommend",
        "the cheapest swept placement meeting a TTFT p95 SLO, with the knees",
        RecommendConfig,
        show_recommend,
    ),
    Sub(
        "views",
        "one trace, three views: a replay against the sim, the planner's prediction, a storage run",
        ViewsConfig,
        show_views,
    ),
)
"""Each answering subcommand: its config (its flags), its printer; its library call is ``answers.ANSWERS``."""


def run_answer(args: argparse.Namespace) -> int:
    """Parse the flags into the subcommand's config, answer, print (or --json), write --output and --plot."""
    import json

    from kvtier.plan.answers import answer, plan_result
    from kvtier.results.envelope import utc_now

    sub: Sub = args.plan_sub
    cfg = config_from_args(args, sub.config)
    started = utc_now()
    if cfg.output:
        from kvtier.results.io import check_output_path

        check_output_path("--output", cfg.output)
    spec_note = _spec_note(cfg)
    r = answer(cfg)  # type: ignore[arg-type]
    shown = sub.show(cfg, r)
    plot = getattr(cfg, "plot", None)
    plotted = _plot(plot, r) if plot else False
    if cfg.output:
        from kvtier.results.io import write_json

        write_json(plan_result(cfg, r, started), cfg.output)  # type: ignore[arg-type]
    if cfg.json_:
        json.dump(r.model_dump(mode="json", exclude_unset=True), sys.stdout, indent=2)
        print()
        return shown.exit
    from rich.console import Console
    from rich.text import Text

    c = Console(width=None if sys.stdout.isatty() else 160)  # no terminal: do not squeeze tables to 80
    drew = [f"plot: {plot}" if plotted else f"plot: nothing to draw, {plot} not written"] if plot else []
    for line in shown.lines + drew + ([f"result: {cfg.output}"] if cfg.output else []):
        c.print(Text(line), highlight=False)  # model names come from files: never markup
    if shown.table is not None:
        c.print(shown.table)
    for line in shown.after:
        print(line)
    for line in ([spec_note] if spec_note else []) + shown.notes:
        print(line, file=sys.stderr)
    return shown.exit


def _spec_note(cfg: Any) -> str | None:
    """A catalog entry whose geometry is the MLPerf spec's, not the released model's, is named as such."""
    from kvtier.modelspec import SPEC_GEOMETRY

    m = getattr(cfg, "model", None)
    return f"kvtier plan: warning: --model {m}: {SPEC_GEOMETRY[m]}" if m in SPEC_GEOMETRY else None


def _plot(path: str, r: Any) -> bool:
    """Draw the answer's figure to ``path``; False when it has nothing to draw (a sweep with no measured point)."""
    from kvtier.report.plan import breakeven_png, recommend_png, retention_png
    from kvtier.results.io import write_bytes_atomic

    png: bytes | None = None
    if isinstance(r, BreakevenReport):
        png = breakeven_png(r)
    elif isinstance(r, RetentionReport):
        png = retention_png(r)
    elif isinstance(r, Recommendation):
        png = recommend_png([("", r)])
    if png is None:
        return False
    write_bytes_atomic(path, png, "--plot")
    return True


def run_sweep_cmd(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.plan.answers import sweep_grid
    from kvtier.plan.sweep import run_sweep
    from kvtier.results.envelope import exit_code

    cfg = config_from_args(args, SweepConfig)
    out = Path(cfg.output)
    r = run_sweep(sweep_grid(cfg), out, lambda line: print(f"kvtier plan sweep: {line}", file=sys.stderr, flush=True))
    ran = sum(1 for t in r.trials if t.status != "not-run")
    print(
        f"sweep ({r.status.value}, {r.stop_reason.code.value}): {ran} of {len(r.trials)} trials in {r.wall_s:.0f} s; "
        f"{out}/sweep.json"
    )
    return exit_code(r.status, r.stop_reason.code)


def add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser("plan", help="placement economics: KV bytes, fetch vs recompute, capacity, measured studies")
    ps = p.add_subparsers(dest="plan_command", required=True)
    for s in SUBCOMMANDS[:5]:
        _add(ps, s)
    sw = ps.add_parser(
        "sweep", help="replay a dataset against the sim across a grid of CPU GB x NVMe GB x concurrency, trials each"
    )
    add_config_arguments(sw, SweepConfig)
    sw.set_defaults(func=run_sweep_cmd)
    for s in SUBCOMMANDS[5:]:
        _add(ps, s)


def _add(ps: argparse._SubParsersAction, s: Sub) -> None:  # type: ignore[type-arg]
    q = ps.add_parser(s.name, help=s.help, description=(s.config.__doc__ or "").strip().replace("``", ""))
    add_config_arguments(q, s.config)
    q.set_defaults(func=run_answer, plan_sub=s)


__all__ = ["SUBCOMMANDS", "add_plan_parser"]
