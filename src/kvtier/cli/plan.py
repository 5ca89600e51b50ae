"""``kvtier plan``: KV bytes per token, break-even, the fetch gate, capacity, measured fetch costs."""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kvtier.errors import ConfigError
from kvtier.modelspec import ModelSpec, build_catalog, resolve_model
from kvtier.plan import capacity, costs
from kvtier.plan.units import fmt_bandwidth, fmt_seconds, parse_bandwidth, parse_duration


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model (a catalog name, or the geometry)")
    g.add_argument("--model", help="catalog model (see 'kvtier plan bytes --list')")
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
    from dataclasses import replace  # noqa: PLC0415

    if a.model:
        m = resolve_model(a.model, build_catalog())
    elif a.layers:
        raw: dict[str, Any] = {"num_layers": a.layers, "kv_heads": a.kv_heads or 0, "head_dim": a.head_dim or 0,
                               "attention_type": a.attention or ("mla" if a.kv_lora_rank else "gqa"),
                               "kv_lora_rank": a.kv_lora_rank, "qk_rope_head_dim": a.qk_rope_head_dim}
        from kvtier.modelspec import spec_from_reference  # noqa: PLC0415
        m = spec_from_reference("custom", raw)
    else:
        raise ConfigError("--model: give a catalog model or --layers with --kv-heads and --head-dim")
    if a.dtype:
        m = replace(m, dtype=a.dtype)
    if a.tp < 1:
        raise ConfigError("--tp: must be >= 1")
    return m


def _kvpt(a: argparse.Namespace, m: ModelSpec) -> float:
    return capacity.kv_bytes_per_token(m, a.tp)


def _positive(v: str, flag: str) -> float:
    try:
        x = float(v)
    except ValueError:
        raise ConfigError(f"{flag}: expected a number, got {v!r}") from None
    if not (x > 0 and math.isfinite(x)):
        raise ConfigError(f"{flag}: must be > 0, got {v!r}")
    return x


def _emit(a: argparse.Namespace, data: dict[str, Any], table: Any, lines: list[str]) -> None:
    if a.json:
        json.dump(data, sys.stdout, indent=2)
        print()
        return
    from rich.console import Console  # noqa: PLC0415

    c = Console(width=None if sys.stdout.isatty() else 160)  # no terminal: do not squeeze tables to 80
    for line in lines:
        c.print(line, highlight=False)
    if table is not None:
        c.print(table)


def _table(title: str, cols: list[str]) -> Any:
    from rich.table import Table  # noqa: PLC0415

    t = Table(title=title)
    for i, col in enumerate(cols):
        t.add_column(col, justify="left" if i == 0 else "right")
    return t


# -- bytes ---------------------------------------------------------------------------------------
def cmd_bytes(a: argparse.Namespace) -> int:
    if a.list or not (a.model or a.layers):
        rows = []
        for key, m in build_catalog().items():
            rows.append({"model": key, "attention": m.attention, "layers": m.num_layers, "kv_heads": m.kv_heads,
                         "head_dim": m.head_dim, "dtype": m.dtype, "kv_bytes_per_token": m.kv_bytes_per_token,
                         "gib_per_million_tokens": round(capacity.gib_per_million_tokens(m), 3)})
        t = _table("KV bytes per token (catalog)", list(rows[0].keys()))
        for r in rows:
            t.add_row(*[f"{v:,}" if isinstance(v, int) else str(v) for v in r.values()])
        _emit(a, {"models": rows}, t, [])
        return 0
    m = _model(a)
    kvpt = _kvpt(a, m)
    data = {"model": m.key, "attention": m.attention, "dtype": m.dtype, "tensor_parallel": a.tp,
            "kv_bytes_per_token": kvpt, "kv_kib_per_token": kvpt / 1024,
            "entry_shape_per_token": list(m.entry_shape(1)),
            "gib_per_million_tokens": capacity.gib_per_million_tokens(m, a.tp)}
    _emit(a, data, None, [f"{m.key} ({m.attention}, {m.dtype}, TP {a.tp}): {kvpt:,.0f} B/token "
                          f"({kvpt / 1024:,.2f} KiB); {data['gib_per_million_tokens']:.2f} GiB per million tokens"])
    return 0


# -- breakeven -------------------------------------------------------------------------------------
def _pairs(bws: list[str], rtts: list[str]) -> list[tuple[str, float, str, float]]:
    if not bws:
        raise ConfigError("--net-bw: give at least one link bandwidth")
    rtts = rtts or ["0"]
    if len(rtts) == 1:
        rtts = rtts * len(bws)
    if len(bws) == 1:
        bws = bws * len(rtts)
    if len(bws) != len(rtts):
        raise ConfigError(f"--net-bw / --rtt: {len(bws)} bandwidths and {len(rtts)} round trips; give one RTT, "
                          "or one per bandwidth (they pair in order)")
    return [(b, parse_bandwidth(b, "--net-bw"), r, parse_duration(r, "--rtt")) for b, r in zip(bws, rtts)]


def cmd_breakeven(a: argparse.Namespace) -> int:
    m = _model(a)
    kvpt = _kvpt(a, m)
    ctx = int(_positive(a.context, "--context"))
    tps = _positive(a.prefill_tps, "--prefill-tps")
    comp = _positive(a.compression, "--compression")
    hbm = parse_bandwidth(a.hbm_bw, "--hbm-bw")
    pairs = _pairs(a.net_bw, a.rtt)
    rec = costs.recompute_s(ctx, tps)
    be = costs.breakeven_bandwidth(kvpt, tps)
    be_c = costs.breakeven_bandwidth(kvpt, tps, comp)
    links = []
    for bw_text, bw, rtt_text, rtt in pairs:
        try:
            exact: float | None = costs.breakeven_bandwidth_exact(ctx, kvpt, tps, rtt, comp)
            exact_note = ""
        except costs.NoBreakEven as e:
            exact, exact_note = None, str(e)
        f1 = costs.fetch_s(ctx, kvpt, bw, rtt)
        fc = costs.fetch_s(ctx, kvpt, bw, rtt, comp)
        links.append({
            "net_bw": bw_text, "net_bw_bytes_per_s": bw, "rtt": rtt_text, "rtt_s": rtt,
            "decode_local_s_per_token": costs.decode_local_s(ctx, kvpt, hbm, a.stages, rtt),
            "stream_remote_s_per_token": costs.stream_remote_s(ctx, kvpt, bw, rtt),
            "query_shipping_s_per_token": costs.query_shipping_s(m.num_layers, rtt),
            "fetch_s": f1, "fetch_compressed_s": fc, "recompute_s": rec,
            "breakeven_exact_bytes_per_s": exact, "breakeven_exact_note": exact_note,
            "min_context_for_fetch_tokens": costs.min_context_for_fetch(kvpt, bw, rtt, tps, comp),
            "verdict": "fetch" if fc < rec else "recompute",
        })
    data = {"model": m.key, "kv_bytes_per_token": kvpt, "context_tokens": ctx, "kv_bytes": ctx * kvpt,
            "prefill_tokens_per_s": tps, "hbm_bytes_per_s": hbm, "stages": a.stages, "compression": comp,
            "recompute_s": rec, "breakeven_bytes_per_s": be, "breakeven_compressed_bytes_per_s": be_c,
            "breakeven_gbit_per_s": be * 8 / 1e9, "breakeven_compressed_gbit_per_s": be_c * 8 / 1e9,
            "links": links}
    t = _table(f"{m.key}, {ctx:,} tokens of context", ["per link"] + [f"{L['net_bw']}, RTT {L['rtt']}"
                                                                     for L in links])
    rows = [
        (f"decode, KV local ({a.stages} stages), per token", lambda L: fmt_seconds(L["decode_local_s_per_token"])),
        ("decode, KV streamed from a store, per token", lambda L: fmt_seconds(L["stream_remote_s_per_token"])),
        ("decode, queries shipped to the store, per token", lambda L: fmt_seconds(L["query_shipping_s_per_token"])),
        ("prefix fetch, once per request", lambda L: fmt_seconds(L["fetch_s"])),
        (f"prefix fetch at {comp:g}x compression", lambda L: fmt_seconds(L["fetch_compressed_s"])),
        ("recompute (re-prefill)", lambda L: fmt_seconds(rec)),
        (f"RTT-aware break-even at this context ({comp:g}x)",
         lambda L: fmt_bandwidth(L["breakeven_exact_bytes_per_s"]) if L["breakeven_exact_bytes_per_s"] else "none"),
        ("verdict (uncompressed)", lambda L: "fetch" if L["fetch_s"] < rec else "recompute"),
        (f"verdict ({comp:g}x)", lambda L: L["verdict"]),
    ]
    for label, cell in rows:
        t.add_row(label, *[cell(L) for L in links])
    lines = [f"KV: {kvpt:,.0f} B/token ({kvpt / 1024:,.4g} KiB); {ctx:,} tokens = {ctx * kvpt / 1e9:.3f} GB",
             f"recompute at {tps:,.0f} tok/s: {fmt_seconds(rec)}",
             f"break-even bandwidth (long-context closed form): {fmt_bandwidth(be)}; "
             f"at {comp:g}× compression {fmt_bandwidth(be_c)}"]
    if a.plot:
        plot_breakeven(a.plot, m.key, kvpt, tps, comp, pairs, ctx)
        lines.append(f"plot: {a.plot}")
    _emit(a, data, t, lines)
    for L in links:
        if L["breakeven_exact_note"] and not a.json:
            print(f"note ({L['net_bw']}, {L['rtt']}): {L['breakeven_exact_note']}", file=sys.stderr)
    return 0


def plot_breakeven(path: str, model: str, kvpt: float, tps: float, comp: float,
                   pairs: list[tuple[str, float, str, float]], ctx_mark: int) -> None:
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        raise ConfigError("--plot: needs matplotlib (pip install 'kvtier[plot]')") from None
    import numpy as np  # noqa: PLC0415

    ctx = np.unique(np.geomspace(1, max(ctx_mark * 16, 1 << 17), 300).astype(int))
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot(ctx, ctx / tps, "k-", lw=2, label=f"recompute ({tps:,.0f} tok/s)")
    for bw_text, bw, rtt_text, rtt in pairs:
        y = rtt + ctx * kvpt / (bw * comp)
        line, = ax.plot(ctx, y, label=f"fetch {bw_text}, RTT {rtt_text}" + (f", {comp:g}×" if comp != 1 else ""))
        if comp != 1:
            ax.plot(ctx, rtt + ctx * kvpt / bw, ls="--", lw=1, color=line.get_color(),
                    label=f"fetch {bw_text}, RTT {rtt_text}, uncompressed")
        c0 = costs.min_context_for_fetch(kvpt, bw, rtt, tps, comp)
        if c0 is not None and ctx[0] <= c0 <= ctx[-1]:
            ax.axvline(c0, color=line.get_color(), ls=":", lw=1)
            ax.annotate(f"break-even {c0:,.0f} tok", (c0, c0 / tps), textcoords="offset points", xytext=(5, -12),
                        fontsize=8, color=line.get_color())
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
def cmd_gate(a: argparse.Namespace) -> int:
    m = _model(a)
    kvpt = _kvpt(a, m)
    ctx = int(_positive(a.context, "--context"))
    tps = _positive(a.prefill_tps, "--prefill-tps")
    if not a.case:
        raise ConfigError("--case: give at least one BW,RTT[,COMPRESSION] case")
    rows = []
    for case in a.case:
        parts = [p.strip() for p in case.split(",")]
        if len(parts) not in (2, 3):
            raise ConfigError(f"--case {case!r}: expected BW,RTT or BW,RTT,COMPRESSION")
        bw = parse_bandwidth(parts[0], f"--case {case!r}")
        rtt = parse_duration(parts[1], f"--case {case!r}")
        comp = _positive(parts[2], f"--case {case!r}") if len(parts) == 3 else 1.0
        d = costs.should_fetch(ctx, kvpt, bw, rtt, tps, comp)
        rows.append({"case": case, "net_bw_bytes_per_s": bw, "rtt_s": rtt, "compression": comp,
                     "fetch_s": round(d.fetch_s, 4), "recompute_s": round(d.recompute_s, 4),
                     "verdict": d.verdict, "reason": d.reason})
    t = _table(f"fetch gate: {m.key}, {ctx:,} tokens, prefill {tps:,.0f} tok/s",
               ["case", "fetch (s)", "recompute (s)", "verdict"])
    for r in rows:
        t.add_row(r["case"], f"{r['fetch_s']:.4f}", f"{r['recompute_s']:.4f}", r["verdict"])
    _emit(a, {"model": m.key, "kv_bytes_per_token": kvpt, "context_tokens": ctx, "prefill_tokens_per_s": tps,
              "cases": rows}, t, [])
    return 0


# -- capacity ------------------------------------------------------------------------------------
def cmd_capacity(a: argparse.Namespace) -> int:
    m = _model(a)
    kvpt = _kvpt(a, m)
    data: dict[str, Any] = {"model": m.key, "kv_bytes_per_token": kvpt,
                            "gib_per_million_tokens": capacity.gib_per_million_tokens(m, a.tp)}
    lines = [f"{m.key}: {kvpt:,.0f} B/token; one million cached tokens = {data['gib_per_million_tokens']:.2f} GiB"]
    if a.tokens is not None:
        plan = capacity.bytes_for_tokens(m, a.tokens, a.headroom, a.tp)
        data["tokens"] = {"tokens": a.tokens, "kv_bytes": plan.kv_bytes, "with_headroom_bytes": plan.with_headroom_bytes,
                          "headroom": a.headroom}
        lines.append(f"{a.tokens:,} tokens: {plan.kv_bytes / 2**30:,.2f} GiB of KV, "
                     f"{plan.with_headroom_bytes / 2**30:,.2f} GiB with {a.headroom:.0%} eviction headroom")
    tiers = {}
    for spec in a.tier or []:
        name, _, size = spec.partition("=")
        if not size:
            raise ConfigError(f"--tier {spec!r}: expected NAME=SIZE_GB, e.g. cpu=512")
        gb = _positive(size, f"--tier {spec!r}")
        users = capacity.users_per_tier(m, gb * 1e9, a.tokens_per_user, a.target_usage, a.tp)
        tiers[name] = {"capacity_bytes": gb * 1e9, "tokens": int(gb * 1e9 * a.target_usage / kvpt), "users": users}
        lines.append(f"tier {name} ({gb:g} GB at {a.target_usage:.0%}): {tiers[name]['tokens']:,} tokens = "
                     f"{users:,} users of {a.tokens_per_user:,} tokens")
    data["tiers"] = tiers
    _emit(a, data, None, lines)
    return 0


# -- measured fetch costs ------------------------------------------------------------------------
def cmd_fetch(a: argparse.Namespace) -> int:
    from kvtier.plan.measured import load_read_costs  # noqa: PLC0415

    tier_costs, result = load_read_costs(a.from_)
    meta = {"model": result.model.key, "status": result.status.value, "file": str(a.from_)}
    m = _model(a) if (a.model or a.layers) else resolve_model(result.model.key, build_catalog())
    kvpt = _kvpt(a, m)
    tps = _positive(a.prefill_tps, "--prefill-tps")
    contexts = [int(_positive(x, "--context")) for x in a.context.split(",")]
    rows = []
    for tc in tier_costs:
        for ctx in contexts:
            nbytes = ctx * kvpt
            f_mean, f_p95 = tc.fetch_s(nbytes, False), tc.fetch_s(nbytes, True)
            rec = costs.recompute_s(ctx, tps)
            rows.append({"tier": tc.tier, "context_tokens": ctx, "kv_bytes": nbytes,
                         "measured_mean_op_bytes": tc.mean_bytes, "measured_read_mean_ms": tc.mean_ms,
                         "measured_read_p95_ms": tc.p95_ms, "fetch_mean_s": f_mean, "fetch_p95_s": f_p95,
                         "recompute_s": rec, "verdict": "fetch" if f_p95 < rec else "recompute",
                         "extrapolated": tc.extrapolated(nbytes)})
    t = _table(f"measured fetch vs recompute ({meta['file']}, model {m.key}, {tps:,.0f} tok/s)",
               ["tier", "context", "fetch mean", "fetch p95", "recompute", "verdict", "note"])
    for r in rows:
        t.add_row(r["tier"], f"{r['context_tokens']:,}", fmt_seconds(r["fetch_mean_s"]), fmt_seconds(r["fetch_p95_s"]),
                  fmt_seconds(r["recompute_s"]), r["verdict"], "extrapolated" if r["extrapolated"] else "")
    _emit(a, {"source": meta, "model": m.key, "kv_bytes_per_token": kvpt, "rows": rows}, t,
          ["fetch cost = measured end-to-end read latency of the tier, scaled by bytes; verdict on p95"])
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
    g.add_argument("--context", required=True)
    g.add_argument("--prefill-tps", required=True)
    g.add_argument("--case", action="append", help="BW,RTT[,COMPRESSION], e.g. 5Gbit/s,20ms,3.5")
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
