"""``kvtier plan``: KV bytes per token, break-even, the fetch gate, capacity, measured fetch costs.

Parses the flags (units, the model), calls ``kvtier.plan.reports``, and prints a table or the JSON
of the typed report."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from pydantic import BaseModel

from kvtier import costs
from kvtier.errors import ConfigError
from kvtier.modelspec import SPEC_GEOMETRY, ModelSpec, build_catalog, resolve_model, spec_from_hf_config
from kvtier.plan import reports
from kvtier.units import fmt_bandwidth, fmt_seconds, parse_bandwidth, parse_duration


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a catalog name, or the geometry)")
    g.add_argument("--model", help="catalog model (see 'kvtier plan bytes --list')")
    g.add_argument(
        "--hf-config",
        metavar="FILE",
        help="a Hugging Face config.json (or its model folder): the released model's own geometry (layers, KV "
        "heads, head_dim, MLA ranks, dtype)",
    )
    g.add_argument("--layers", type=int)
    g.add_argument("--kv-heads", type=int)
    g.add_argument("--head-dim", type=int)
    g.add_argument("--attention", choices=["mha", "gqa", "mla"])
    g.add_argument("--kv-lora-rank", type=int, default=0)
    g.add_argument("--qk-rope-head-dim", type=int, default=0)
    g.add_argument("--dtype", help="KV dtype: fp32, fp16, bf16, fp8, fp4 (default: the model's)")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks; bytes are per rank")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _model(a: argparse.Namespace) -> ModelSpec:
    from dataclasses import replace

    if a.hf_config:
        if a.model or a.layers:
            raise ConfigError("--hf-config: give it alone, without --model or --layers")
        m = spec_from_hf_config(a.hf_config)
    elif a.model:
        m = resolve_model(a.model, build_catalog())
        if a.model in SPEC_GEOMETRY:
            print(f"kvtier plan: warning: --model {a.model}: {SPEC_GEOMETRY[a.model]}", file=sys.stderr)
    elif a.layers:
        raw: dict[str, Any] = {
            "num_layers": a.layers,
            "kv_heads": a.kv_heads or 0,
            "head_dim": a.head_dim or 0,
            "attention_type": a.attention or ("mla" if a.kv_lora_rank else "gqa"),
            "kv_lora_rank": a.kv_lora_rank,
            "qk_rope_head_dim": a.qk_rope_head_dim,
        }
        from kvtier.modelspec import spec_from_reference

        m = spec_from_reference("custom", raw)
    else:
        raise ConfigError("--model: give a catalog model, --hf-config, or --layers with --kv-heads and --head-dim")
    if a.dtype:
        m = replace(m, dtype=a.dtype)
    if a.tp < 1:
        raise ConfigError("--tp: must be >= 1")
    return m


def _positive(v: str, flag: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise ConfigError(f"{flag}: expected a number, got {v!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise ConfigError(f"{flag}: must be > 0, got {v!r}")
    return x


def _emit(a: argparse.Namespace, report: BaseModel, table: Any, lines: list[str]) -> None:
    if a.json:
        json.dump(report.model_dump(mode="json", exclude_unset=True), sys.stdout, indent=2)
        print()
        return
    from rich.console import Console
    from rich.text import Text

    c = Console(width=None if sys.stdout.isatty() else 160)  # no terminal: do not squeeze tables to 80
    for line in lines:
        c.print(Text(line), highlight=False)  # model names come from files: never markup
    if table is not None:
        c.print(table)


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


# -- bytes ---------------------------------------------------------------------------------------
def cmd_bytes(a: argparse.Namespace) -> int:
    if a.list or not (a.model or a.layers or a.hf_config):
        cat = reports.catalog_report(build_catalog())
        cols = list(reports.CatalogRow.model_fields)
        t = _table("KV bytes per token (catalog)", cols)
        for row in cat.models:
            t.add_row(*[f"{v:,}" if isinstance(v, int) else str(v) for v in row.model_dump().values()])
        _emit(a, cat, t, [])
        return 0
    r = reports.bytes_report(_model(a), a.tp)
    _emit(
        a,
        r,
        None,
        [
            f"{r.model} ({r.attention}, {r.dtype}, TP {a.tp}): {r.kv_bytes_per_token:,.0f} B/token "
            f"({r.kv_kib_per_token:,.2f} KiB); {r.gib_per_million_tokens:.2f} GiB per million tokens"
        ],
    )
    return 0


# -- breakeven -------------------------------------------------------------------------------------
def _links(bws: list[str], rtts: list[str]) -> list[reports.Link]:
    if not bws:
        raise ConfigError("--net-bw: give at least one link bandwidth")
    rtts = rtts or ["0"]
    if len(rtts) == 1:
        rtts = rtts * len(bws)
    if len(bws) == 1:
        bws = bws * len(rtts)
    if len(bws) != len(rtts):
        raise ConfigError(
            f"--net-bw / --rtt: {len(bws)} bandwidths and {len(rtts)} round trips; give one RTT, "
            "or one per bandwidth (they pair in order)"
        )
    return [reports.Link(b, parse_bandwidth(b, "--net-bw"), r, parse_duration(r, "--rtt")) for b, r in zip(bws, rtts)]


def cmd_breakeven(a: argparse.Namespace) -> int:
    m = _model(a)
    comp = _positive(a.compression, "--compression")
    links = _links(a.net_bw, a.rtt)
    r = reports.breakeven_report(
        m,
        int(_positive(a.context, "--context")),
        _positive(a.prefill_tps, "--prefill-tps"),
        parse_bandwidth(a.hbm_bw, "--hbm-bw"),
        a.stages,
        links,
        comp,
        a.tp,
    )
    rec = r.recompute_s
    t = _table(
        f"{m.key}, {r.context_tokens:,} tokens of context", ["per link"] + [f"{L.net_bw}, RTT {L.rtt}" for L in r.links]
    )
    rows: list[tuple[str, Any]] = [
        (f"decode, KV local ({a.stages} stages), per token", lambda L: fmt_seconds(L.decode_local_s_per_token)),
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
    if a.plot:
        plot_breakeven(a.plot, m.key, kvpt, r.prefill_tokens_per_s, comp, links, r.context_tokens)
        lines.append(f"plot: {a.plot}")
    _emit(a, r, t, lines)
    for L in r.links:
        if L.breakeven_exact_note and not a.json:
            print(f"note ({L.net_bw}, {L.rtt}): {L.breakeven_exact_note}", file=sys.stderr)
    return 0


def plot_breakeven(
    path: str,
    model: str,
    kvpt: float,
    tps: float,
    comp: float,
    links: list[reports.Link],
    ctx_mark: int,
) -> None:
    from kvtier.report.plots import pyplot

    plt = pyplot()
    import numpy as np

    ctx = np.unique(np.geomspace(1, max(ctx_mark * 16, 1 << 17), 300).astype(int))
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(ctx, ctx / tps, "k-", lw=2, label=f"recompute ({tps:,.0f} tok/s)")
    for link in links:
        bw_text, bw, rtt_text, rtt = link.bw_label, link.bw_bytes_per_s, link.rtt_label, link.rtt_s
        y = rtt + ctx * kvpt / (bw * comp)
        (line,) = ax.plot(ctx, y, label=f"fetch {bw_text}, RTT {rtt_text}" + (f", {comp:g}×" if comp != 1 else ""))
        if comp != 1:
            ax.plot(
                ctx,
                rtt + ctx * kvpt / bw,
                ls="--",
                lw=1,
                color=line.get_color(),
                label=f"fetch {bw_text}, RTT {rtt_text}, uncompressed",
            )
        c0 = costs.min_context_for_fetch(kvpt, bw, rtt, tps, comp)
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
    ax.axvline(ctx_mark, color="grey", ls="--", lw=1, label=f"context {ctx_mark:,}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("time to have the prefix's KV (s)")
    ax.set_title(f"{model}: fetch vs recompute ({kvpt / 1024:,.4g} KiB/token)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- gate ----------------------------------------------------------------------------------------
def _case(case: str) -> reports.GateCase:
    parts = [p.strip() for p in case.split(",")]
    if len(parts) not in (2, 3):
        raise ConfigError(f"--case {case!r}: expected BW,RTT or BW,RTT,COMPRESSION")
    comp = _positive(parts[2], f"--case {case!r}") if len(parts) == 3 else 1.0
    return reports.GateCase(
        case, parse_bandwidth(parts[0], f"--case {case!r}"), parse_duration(parts[1], f"--case {case!r}"), comp
    )


def _ints(text: str | None, flag: str) -> list[int] | None:
    """A comma-separated list of whole numbers (plan/sweep.py parse_list's rules), or None when not given."""
    from kvtier.plan.sweep import parse_list

    return [int(v) for v in parse_list(text, flag, integer=True)] if text else None


def cmd_gate_ladder(a: argparse.Namespace) -> int:
    """plan gate --from ladder.json: both sides of the gate from the server's measured curves."""
    from kvtier.plan.ladder_gate import ladder_gate_report
    from kvtier.results.ladder import load_fitted

    given = [f for f, v in (("--prefill-tps", a.prefill_tps), ("--case", a.case), ("--model", a.model)) if v]
    if given:
        raise ConfigError(f"--from: the ladder measured the server; {', '.join(given)} would be assumptions beside "
                          "it (give one or the other)")  # fmt: skip
    r, fit = load_fitted(a.from_, "--from")
    rep = ladder_gate_report(r, fit, a.from_, _ints(a.context, "--context"), _ints(a.new_tokens, "--new-tokens"))
    t = _table(f"fetch gate from the measured ladder {a.from_} ({rep.timing_source})",
               ["tier", "context", "new", "fetch (s)", "recompute (s)", "verdict", "measured faster",
                "agrees"])  # fmt: skip
    for x in rep.rows:
        t.add_row(x.tier, f"{x.context_tokens:,}", f"{x.new_tokens:,}", f"{x.fetch_s:.4f}", f"{x.recompute_s:.4f}",
                  x.verdict + (" (extrapolated)" if x.extrapolated else ""), x.measured_faster or "—",
                  "—" if x.agrees is None else ("yes" if x.agrees else "NO"))  # fmt: skip
    lines = [f"break-even ({b.tier}, {b.new_tokens:,} new tokens): "
             + (f"fetch wins from {b.context_tokens:,} tokens of context" if b.context_tokens else b.note)
             for b in rep.breakeven]  # fmt: skip
    lines.append(f"check: the gate agrees with the measured faster source on {rep.agreed} of {rep.checked} cells")
    _emit(a, rep, t, lines)
    return 0 if rep.agreed == rep.checked else 1


def cmd_gate(a: argparse.Namespace) -> int:
    if a.from_:
        return cmd_gate_ladder(a)
    if not a.context or not a.prefill_tps:
        raise ConfigError("plan gate: give --context and --prefill-tps (or --from a kvtier ladder result)")
    m = _model(a)
    if not a.case:
        raise ConfigError("--case: give at least one BW,RTT[,COMPRESSION] case")
    r = reports.gate_report(
        m,
        int(_positive(a.context, "--context")),
        _positive(a.prefill_tps, "--prefill-tps"),
        [_case(c) for c in a.case],
        a.tp,
    )
    t = _table(
        f"fetch gate: {m.key}, {r.context_tokens:,} tokens, prefill {r.prefill_tokens_per_s:,.0f} tok/s",
        ["case", "fetch (s)", "recompute (s)", "verdict"],
    )
    for row in r.cases:
        t.add_row(row.case, f"{row.fetch_s:.4f}", f"{row.recompute_s:.4f}", row.verdict)
    _emit(a, r, t, [])
    return 0


# -- capacity ------------------------------------------------------------------------------------
def _tier(spec: str) -> tuple[str, float]:
    name, _, size = spec.partition("=")
    if not size:
        raise ConfigError(f"--tier {spec!r}: expected NAME=SIZE_GB, e.g. cpu=512")
    return name, _positive(size, f"--tier {spec!r}") * 1e9


def cmd_capacity(a: argparse.Namespace) -> int:
    m = _model(a)
    r = reports.capacity_report(
        m, a.tokens, a.headroom, dict(_tier(s) for s in a.tier or []), a.tokens_per_user, a.target_usage, a.tp
    )
    lines = [
        f"{m.key}: {r.kv_bytes_per_token:,.0f} B/token; one million cached tokens = {r.gib_per_million_tokens:.2f} GiB"
    ]
    if r.tokens is not None:
        lines.append(
            f"{r.tokens.tokens:,} tokens: {r.tokens.kv_bytes / 2**30:,.2f} GiB of KV, "
            f"{r.tokens.with_headroom_bytes / 2**30:,.2f} GiB with {a.headroom:.0%} eviction headroom"
        )
    for name, tier in r.tiers.items():
        lines.append(
            f"tier {name} ({tier.capacity_bytes / 1e9:g} GB at {a.target_usage:.0%}): {tier.tokens:,} tokens = "
            f"{tier.users:,} users of {a.tokens_per_user:,} tokens"
        )
    _emit(a, r, None, lines)
    return 0


# -- measured fetch costs ------------------------------------------------------------------------
def cmd_fetch(a: argparse.Namespace) -> int:
    from kvtier.plan.measured import load_read_costs

    tier_costs, result = load_read_costs(a.from_)
    source = reports.FetchSource(model=result.model.key, status=result.status.value, file=str(a.from_))
    m = _model(a) if (a.model or a.layers or a.hf_config) else resolve_model(result.model.key, build_catalog())
    tps = _positive(a.prefill_tps, "--prefill-tps")
    r = reports.fetch_report(
        tier_costs, source, m, tps, [int(_positive(x, "--context")) for x in a.context.split(",")], a.tp
    )
    t = _table(
        f"measured fetch vs recompute ({source.file}, model {m.key}, {tps:,.0f} tok/s)",
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
    _emit(a, r, t, ["fetch cost = measured end-to-end read latency of the tier, scaled by bytes; verdict on p95"])
    return 0


def _tier_numbers(specs: list[str] | None, flag: str) -> dict[str, float]:
    out = {}
    for spec in specs or []:
        name, _, v = spec.partition("=")
        if not name or not v:
            raise ConfigError(f"{flag}: expected TIER=NUMBER, got {spec!r}")
        out[name] = _positive(v, flag)
    return out


def cmd_value(a: argparse.Namespace) -> int:
    from kvtier.plan.value import ladder_value_report, value_report

    fetch_bw: dict[str, float] = {}
    kvpt = None
    if a.ladder:
        if a.fetch_from or a.prefill_tps:
            raise ConfigError("--ladder: the ladder's measured curves replace --fetch-from and --prefill-tps")
        return _print_value(a, ladder_value_report(
            a.from_, a.ladder, gpu_cost=_positive(a.gpu_cost, "--gpu-cost") if a.gpu_cost else None,
            store_cost=_positive(a.store_cost, "--store-cost") if a.store_cost else None,
            store_gb=_tier_numbers(a.store_gb, "--store-gb")))  # fmt: skip
    if a.fetch_from:
        from kvtier.plan.measured import load_read_costs

        costs, bench = load_read_costs(a.fetch_from)
        fetch_bw = {c.tier: c.bw_mean for c in costs}
        kvpt = bench.model.kv_bytes_per_token_per_rank
    r = value_report(
        a.from_,
        prefill_tps=_positive(a.prefill_tps, "--prefill-tps") if a.prefill_tps else None,
        gpu_cost=_positive(a.gpu_cost, "--gpu-cost") if a.gpu_cost else None,
        store_cost=_positive(a.store_cost, "--store-cost") if a.store_cost else None,
        store_gb=_tier_numbers(a.store_gb, "--store-gb"),
        fetch_bw=fetch_bw,
        kv_bytes_per_token=kvpt,
    )
    return _print_value(a, r)


def _print_value(a: argparse.Namespace, r: Any) -> int:
    t = _table(
        f"does the tier pay? ({r.source}: {r.requests} requests, {r.wall_s:g} s, {r.prompt_tokens:,} prompt tokens)",
        ["tier", "hit rate", "tokens/h", "prefill avoided s/h", "fetch s/h", "latency saved/hit", "value $/h",
         "cost $/h", "pays", "break-even hit rate"],
    )  # fmt: skip

    def cell(v: float | None, f: str) -> str:
        return "—" if v is None else format(v, f)

    for x in r.tiers:
        t.add_row(
            x.tier, f"{x.hit_rate:.1%}", f"{x.tokens_per_hour:,.0f}", cell(x.prefill_s_avoided_per_hour, ",.1f"),
            cell(x.fetch_s_per_hour, ",.1f"),
            "—" if x.latency_saved_per_hit_s is None else fmt_seconds(x.latency_saved_per_hit_s),
            cell(x.value_usd_per_hour, ".4f"), cell(x.cost_usd_per_hour, ".4f"),
            "—" if x.pays is None else ("yes" if x.pays else "no"),
            "—" if x.breakeven_hit_rate is None else f"{x.breakeven_hit_rate:.2%}",
        )  # fmt: skip
    lines = []
    for i in r.inputs:
        shown = "—" if i.value is None else f"{i.value:g}"
        lines.append(f"{i.name}: {shown} {i.unit} ({i.source}{'; ' + i.note if i.note else ''})")
    _emit(a, r, t, lines)
    return 0


def add_plan_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("plan", help="placement economics: KV bytes, fetch vs recompute, capacity")
    ps = p.add_subparsers(dest="plan_command", required=True)

    b = ps.add_parser("bytes", help="KV bytes per token of a model (or --list the catalog)")
    _model_args(b)
    b.add_argument("--list", action="store_true")
    b.set_defaults(func=cmd_bytes)

    be = ps.add_parser("breakeven", help="decode placement costs and the fetch-vs-recompute break-even")
    _model_args(be)
    be.add_argument("--context", required=True, help="context tokens")
    be.add_argument("--prefill-tps", required=True, help="prefill throughput, tokens/s")
    be.add_argument("--hbm-bw", default="3.35TB/s", help="HBM bandwidth (default 3.35TB/s, H100 SXM)")
    be.add_argument("--stages", type=int, default=1, help="pipeline stages (hops per decode step)")
    be.add_argument("--net-bw", action="append", default=[], help="link bandwidth; repeat for several links")
    be.add_argument("--rtt", action="append", default=[], help="round trip; one, or one per --net-bw")
    be.add_argument("--compression", default="1", help="KV compression ratio for the fetch (default 1)")
    be.add_argument("--plot", help="PNG: fetch and recompute time against context, break-even marked")
    be.set_defaults(func=cmd_breakeven)

    g = ps.add_parser("gate", help="the fetch gate for a list of cases")
    _model_args(g)
    g.add_argument("--context", help="context tokens (with --from: comma-separated, default the ladder's cells)")
    g.add_argument("--prefill-tps", help="prefill throughput, tokens/s (not with --from: the ladder measured it)")
    g.add_argument("--case", action="append", help="BW,RTT[,COMPRESSION], e.g. 5Gbit/s,20ms,3.5")
    g.add_argument("--from", dest="from_", help="a kvtier ladder result: the server's measured prefill and fetch "
                   "curves instead of --prefill-tps and --case, checked against its own measured points")  # fmt: skip
    g.add_argument("--new-tokens", help="with --from: new tokens on the prefix, comma-separated (default the ladder's)")
    g.set_defaults(func=cmd_gate)

    c = ps.add_parser("capacity", help="bytes for N tokens, users per tier, cost of a million tokens")
    _model_args(c)
    c.add_argument("--tokens", type=int, help="cached tokens to hold")
    c.add_argument("--headroom", type=float, default=0.25, help="eviction headroom fraction (0.25)")
    c.add_argument("--tier", action="append", help="NAME=SIZE_GB (decimal GB), e.g. cpu=512 nvme=7680")
    c.add_argument("--tokens-per-user", type=int, default=16384, help="cached tokens per user (16384)")
    c.add_argument("--target-usage", type=float, default=0.8, help="fill ratio of a tier (0.8)")
    c.set_defaults(func=cmd_capacity)

    f = ps.add_parser("fetch", help="fetch vs recompute from a kvtier bench result's measured reads")
    _model_args(f)
    f.add_argument("--from", dest="from_", required=True, help="kvtier bench result JSON")
    f.add_argument("--context", default="1024,4096,16384,65536", help="context lengths, comma separated")
    f.add_argument("--prefill-tps", required=True)
    f.set_defaults(func=cmd_fetch)

    v = ps.add_parser(
        "value", help="does a KV tier pay? tokens served, prefill avoided, value against cost, from a replay"
    )
    v.add_argument(
        "--from", dest="from_", required=True, help="a kvtier replay's folder (or summary.json) against the sim"
    )
    v.add_argument("--fetch-from", help="a kvtier bench result: its tiers' measured read bandwidth as the fetch cost")
    v.add_argument("--prefill-tps", help="prefill throughput, tokens/s (default: measured from the replay)")
    v.add_argument("--gpu-cost", help="$ per GPU-hour: the value of the prefill time avoided")
    v.add_argument("--store-cost", help="$ per GB-month of the tier's capacity")
    v.add_argument("--store-gb", action="append", help="TIER=GB, the capacity paid for (e.g. cpu=64)")
    v.add_argument(
        "--ladder",
        help="a kvtier ladder of the replay's server: each request's cached tokens (usage) "
        "priced by its measured prefill curve, for a replay against any server (a real vLLM too)",
    )
    v.add_argument("--json", action="store_true", help="the report as JSON")
    v.set_defaults(func=cmd_value)

    from kvtier.cli.plan_measured import add_measured_parsers

    add_measured_parsers(ps)
