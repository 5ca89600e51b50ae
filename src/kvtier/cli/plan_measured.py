"""``kvtier plan retention|sweep|recommend|views``: the planner fed by measurement (a trace's reuse, a grid of
sims and replays, one trace seen three ways). Parses the flags, calls ``kvtier.plan``, prints the table or the
JSON of the typed report; ``cli/plan.py`` has the shared model flags and printing."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.plan import _emit, _model, _model_args, _positive, _table, _tier, _tier_numbers
from kvtier.errors import ConfigError
from kvtier.modelspec import build_catalog, resolve_model
from kvtier.units import fmt_seconds


# -- retention -------------------------------------------------------------------------------------
def _stream(a: argparse.Namespace) -> Any:
    from kvtier.plan import retention

    given = [x for x in (a.trace, a.dataset, a.from_) if x]
    if len(given) != 1:
        raise ConfigError("--trace / --dataset / --from: give exactly one (a Mooncake trace, a replay dataset, or a "
                          "replay result)")  # fmt: skip
    if a.trace:
        return retention.stream_from_trace(a.trace)
    if a.from_:
        return retention.stream_from_replay(a.from_)
    from kvtier.config.replay import ReplayConfig
    from kvtier.replay.driver import load_users

    if a.concurrency < 1:
        raise ConfigError("--concurrency: must be >= 1")
    cfg = ReplayConfig(
        dataset=a.dataset, dataset_format=a.dataset_format, tokenizer=a.tokenizer, num_rounds=a.num_rounds,
        min_chunk_rounds=a.min_chunk_rounds, reuse_block_tokens=a.block_tokens,
    )  # fmt: skip
    cfg, _, users, tokenizer, _ = load_users(cfg)
    order = retention.closed_loop_order([len(u.turns) for u in users], a.concurrency)
    return retention.stream_from_users(
        users, tokenizer.encode, a.block_tokens, order, source=a.dataset,
        order_text=f"a closed loop of {a.concurrency} virtual users at equal service times (one step a request)",
    )  # fmt: skip


def _h_bytes(n: float) -> str:
    from kvtier.iotrace.stats import human_bytes

    return human_bytes(n)


def _size(tokens: float, bpt: int) -> str:
    return f"{tokens:,.0f} tokens ({_h_bytes(tokens * bpt)})"


def _span(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    return fmt_seconds(v) if unit == "s" else f"{v:,.0f} req"


def cmd_retention(a: argparse.Namespace) -> int:
    from kvtier.plan.retention import retention_report

    m = _model(a)
    bpt = int(m.kv_bytes_per_token_per_rank(a.tp))
    stream = _stream(a)
    tiers = [_tier(x) for x in a.tier or []]
    r = retention_report(stream, m.key, bpt, [(n, b / 1e9) for n, b in tiers])
    u = r.unit
    lines = [
        f"{r.source}: {r.requests:,} requests, {r.accesses:,} block accesses of {r.block_tokens} tokens over "
        f"{_span(r.span, u)}; order: {r.order}",
        f"{m.key} at {bpt:,} B/token: accessed {_size(r.accessed_tokens, bpt)}, of which "
        f"{r.reused_tokens / r.accessed_tokens:.1%} had an earlier access; distinct {_size(r.distinct_tokens, bpt)} "
        "(an LRU this large misses only cold blocks)",
    ]
    nt = r.need_tokens
    if nt["p50"] is not None:
        lines.append(
            f"the LRU capacity a reuse needs: p50 {_size(nt['p50'], bpt)}, p90 {_size(nt['p90'] or 0, bpt)}, "
            f"p99 {_size(nt['p99'] or 0, bpt)}"
        )
    for t in r.tiers:
        if t.holds_whole_trace:
            held = "never fills: holds the whole trace"
        else:
            held = (
                f"holds the last {_span(t.window.p50, u)} of history (p10 {_span(t.window.p10, u)}, p90 "
                f"{_span(t.window.p90, u)}" + (f"; {t.window_requests.p50:,.0f} requests" if u == "s" else "")
                + f") once full at {_span(t.fills_at, u)}"
            )  # fmt: skip
        lines.append(
            f"{t.tier} {t.capacity_bytes / 1e9:g} GB ({t.capacity_tokens:,} tokens): serves {t.hit_fraction:.1%} "
            f"of the tokens ({t.cumulative_hit_fraction:.1%} with the tiers above); down to it the waterfall {held}"
        )
    table = _table("hit rate against LRU capacity (exact stack distances)", ["capacity", "tokens", "hit", "of reuse"])
    for c in r.curve:
        table.add_row(
            _h_bytes(c.capacity_bytes), f"{c.capacity_tokens:,}", f"{c.hit_fraction:.1%}",
            "—" if c.reuse_hit_fraction is None else f"{c.reuse_hit_fraction:.1%}",
        )  # fmt: skip
    if a.plot:
        plot_retention(a.plot, r)
        lines.append(f"plot: {a.plot}")
    _emit(a, r, table, lines)
    return 0


def plot_retention(path: str, r: Any) -> None:
    """Two panels: the hit rate against capacity (the tiers' cumulative capacities marked) and the working set
    over the trace."""
    from kvtier.report.plots import pyplot

    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    gb = [c.capacity_bytes / 1e9 for c in r.curve]
    ax.plot(gb, [c.hit_fraction * 100 for c in r.curve], "k-", label="hit rate, % of tokens")
    ax.axhline(r.reused_tokens / r.accessed_tokens * 100, ls=":", c="grey", label="every reuse (no capacity limit)")
    for t in r.tiers:
        ax.axvline(t.cumulative_capacity_tokens * r.kv_bytes_per_token / 1e9, ls="--", lw=1)
        ax.annotate(t.tier, (t.cumulative_capacity_tokens * r.kv_bytes_per_token / 1e9, 2), rotation=90)
    ax.set_xscale("log")
    ax.set_xlabel(f"LRU capacity, GB ({r.model})")
    ax.set_ylabel("hit rate, %")
    ax.legend(loc="upper left")
    ax.set_title("hit rate against capacity (exact LRU stack distances)")
    xs = [p.t for p in r.working_set]
    bx.plot(xs, [p.distinct_bytes / 1e9 for p in r.working_set], "k-", label="distinct KV so far")
    bx.plot(xs, [p.interval_bytes / 1e9 for p in r.working_set], "b-", label="distinct KV in the interval")
    bx.set_xlabel("seconds" if r.unit == "s" else "requests")
    bx.set_ylabel("GB")
    bx.legend(loc="upper left")
    bx.set_title("working set over the trace")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- sweep / recommend -----------------------------------------------------------------------------
def cmd_sweep(a: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from kvtier.plan.sweep import parse_list, run_sweep
    from kvtier.results.envelope import exit_code
    from kvtier.results.sweep import SweepGrid

    if a.trials < 1:
        raise ConfigError("--trials: must be >= 1")
    if a.budget < 0 or a.duration < 0:
        raise ConfigError("--budget / --duration: must be >= 0")
    if not Path(a.dataset).exists():
        raise ConfigError(f"--dataset {a.dataset}: no such file or folder")
    resolve_model(a.sim_model, build_catalog())  # an unknown model fails now, not in the first trial
    out = Path(a.output)
    g = SweepGrid(
        dataset=str(Path(a.dataset).resolve()), dataset_format=a.dataset_format,
        cpu_gb=parse_list(a.cpu_gb, "--cpu-gb"), nvme_gb=parse_list(a.nvme_gb, "--nvme-gb"),
        concurrency=[int(x) for x in parse_list(a.concurrency, "--concurrency", integer=True)], trials=a.trials,
        budget_s=a.budget, preset=a.preset, sim_model=a.sim_model, gpu_kv_gb=_positive(a.gpu_kv_gb, "--gpu-kv-gb"),
        num_rounds=a.num_rounds, max_tokens_cap=a.max_tokens_cap, duration_s=a.duration,
        nvme_dir=str(Path(a.nvme_dir or out / "nvme").resolve()), replay_args=shlex.split(a.replay_args or ""),
    )  # fmt: skip
    if 0 in g.concurrency:
        raise ConfigError("--concurrency: must be >= 1")
    r = run_sweep(g, out, lambda line: print(f"kvtier plan sweep: {line}", file=sys.stderr, flush=True))
    ran = sum(1 for t in r.trials if t.status != "not-run")
    print(f"sweep ({r.status.value}, {r.stop_reason.code.value}): {ran} of {len(r.trials)} trials in {r.wall_s:.0f} s; "
          f"{out}/sweep.json")  # fmt: skip
    return exit_code(r.status, r.stop_reason.code)


def cmd_recommend(a: argparse.Namespace) -> int:
    from kvtier.plan.recommend import recommend

    r = recommend(
        a.from_,
        _positive(a.slo_ttft_p95, "--slo-ttft-p95") if a.slo_ttft_p95 else None,
        _tier_numbers(a.store_cost, "--store-cost"),
        a.concurrency,
    )

    def iv(i: Any, f: str = ".3f") -> str:
        if i.mean is None:
            return "—"
        if i.high is None or i.low is None:
            return format(i.mean, f)
        return f"{i.mean:{f}} [{i.low:{f}}-{i.high:{f}}{'*' if i.clipped else ''}]"

    t = _table(
        f"sweep {r.source} ({r.sweep_status}): mean [95 % CI across trials; * clipped at 0 or 1]",
        ["point", "trials", "TTFT p95 s", "TTFT p50 s", "GPU hit", "offload hit", "req/s", "$/h", "meets SLO"],
    )
    for p in r.points:
        t.add_row(
            p.point, f"{p.trials}" + (f" (+{p.trials_not_complete} not complete)" if p.trials_not_complete else ""),
            iv(p.ttft_p95_s), iv(p.ttft_p50_s), iv(p.gpu_hit_share, ".1%"), iv(p.offload_hit_share, ".1%"),
            iv(p.requests_per_s, ".2f"), "—" if p.cost_usd_per_hour is None else f"{p.cost_usd_per_hour:.4f}",
            "—" if p.meets_slo is None else ("yes" if p.meets_slo else "no") + (f" ({p.note})" if p.note else ""),
        )  # fmt: skip
    lines = []
    for k in r.knees:
        if k.points >= 2:
            lines.append(
                f"knees at NVMe {k.nvme_gb:g} GB, concurrency {k.concurrency}: offload hit rate at CPU "
                f"{k.hit_rate_knee_cpu_gb if k.hit_rate_knee_cpu_gb is not None else '—'} GB, TTFT p95 at CPU "
                f"{k.ttft_knee_cpu_gb if k.ttft_knee_cpu_gb is not None else '—'} GB (90 % of the line's change)"
            )
    if a.plot:
        plot_sweep(a.plot, r)
        lines.append(f"plot: {a.plot}")
    _emit(a, r, t, lines)
    if not a.json:
        for pick in r.picks:
            print(f"recommend: {pick.sentence}")
    return 0


def plot_sweep(path: str, r: Any) -> None:
    """TTFT p95 (mean and 95 % CI) and the offload hit share against CPU GB, a line per NVMe size and load."""
    from kvtier.report.plots import pyplot

    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for conc in sorted({p.concurrency for p in r.points}):
        for nvme in sorted({p.nvme_gb for p in r.points}):
            line = [
                p for p in r.points if p.concurrency == conc and p.nvme_gb == nvme and p.ttft_p95_s.mean is not None
            ]
            if not line:
                continue
            label = f"NVMe {nvme:g} GB, c={conc}"
            xs = [p.cpu_gb for p in line]
            ys = [p.ttft_p95_s.mean for p in line]
            err = [(p.ttft_p95_s.high - p.ttft_p95_s.mean) if p.ttft_p95_s.high is not None else 0 for p in line]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
            bx.plot(xs, [(p.offload_hit_share.mean or 0) * 100 for p in line], marker="o", label=label)
    if r.slo_ttft_p95_s is not None:
        ax.axhline(r.slo_ttft_p95_s, ls="--", c="red", label=f"SLO {r.slo_ttft_p95_s:g} s")
    ax.set_xlabel("CPU offload GB")
    ax.set_ylabel("TTFT p95, s (mean, 95 % CI)")
    ax.legend()
    bx.set_xlabel("CPU offload GB")
    bx.set_ylabel("prompt tokens from offload, %")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- views -----------------------------------------------------------------------------------------
def cmd_views(a: argparse.Namespace) -> int:
    from kvtier.plan.views import views_report

    if not a.fetch_from and not a.storage and not a.ladder:
        raise ConfigError("--fetch-from / --storage / --ladder: give a bench result or a ladder to predict from, "
                          "--storage, or both")  # fmt: skip
    if a.ladder and (a.storage or a.prefill_tps or a.prefill_overhead_ms is not None):
        raise ConfigError("--ladder: the ladder's measured curves predict (b); --storage, --prefill-tps and "
                          "--prefill-overhead-ms go with the preset's model")  # fmt: skip
    r = views_report(
        a.from_, a.fetch_from, a.preset,
        prefill_tps=_positive(a.prefill_tps, "--prefill-tps") if a.prefill_tps else None,
        prefill_overhead_ms=float(a.prefill_overhead_ms) if a.prefill_overhead_ms is not None else None,
        model=a.model, storage=a.storage, storage_dir=a.storage_dir, work=a.work, ladder=a.ladder,
    )  # fmt: skip

    def ms(x: float | None) -> str:
        return "—" if x is None else f"{x * 1e3:,.2f}"

    def pct(x: float | None) -> str:
        return "—" if x is None else f"{x:+.0%}"

    t = _table(
        f"one trace, three views ({r.source}: {r.requests} requests); ms, error = predicted / measured - 1",
        ["turn", "requests", "measured TTFT", "measured fetch", "(b) TTFT", "(b) fetch", "(b) error", "(c) TTFT",
         "(c) fetch", "(c) error"],
    )  # fmt: skip
    for x in r.turns:
        t.add_row(str(x.turn), str(x.requests), ms(x.measured_ttft_s), ms(x.measured_fetch_s), ms(x.predicted_ttft_s),
                  ms(x.predicted_fetch_s), pct(x.ttft_error), ms(x.storage_ttft_s), ms(x.storage_fetch_s),
                  pct(x.storage_ttft_error))  # fmt: skip
    lines = [f"{i.name}: {i.value:g} {i.unit} ({i.source})" if i.value is not None else f"{i.name}: — ({i.source})"
             for i in r.inputs]  # fmt: skip
    lines += [f"finding: {f}" for f in r.findings]
    _emit(a, r, t, lines)
    if not a.json:

        def plain(x: float | None) -> str:
            return "—" if x is None else f"{x:.0%}"

        b, c = plain(r.median_abs_ttft_error), plain(r.median_abs_storage_ttft_error)
        print(f"median |error| by turn: (b) {b}, (c) {c}")
    return 0


def add_measured_parsers(ps: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    """The retention, sweep, recommend and views subcommands of ``kvtier plan``."""
    rt = ps.add_parser(
        "retention",
        help="how much history a tier holds before it evicts: exact LRU hit curve and retention window of a trace",
    )
    _model_args(rt)
    src = rt.add_argument_group("the accesses (one of)")
    src.add_argument("--trace", help="a Mooncake trace (hash_ids), at its arrival times")
    src.add_argument("--dataset", help="a replay dataset, walked as a closed loop of --concurrency users")
    src.add_argument("--from", dest="from_", help="a kvtier replay result: its dataset as its ok requests were sent")
    rt.add_argument("--dataset-format", default="auto", help="--dataset's format (as kvtier replay)")
    rt.add_argument("--tokenizer", default="auto", help="--dataset's tokenizer (as kvtier replay)")
    rt.add_argument("--num-rounds", type=int, default=5, help="--dataset: turns per virtual user (5)")
    rt.add_argument("--min-chunk-rounds", type=int, default=5, help="--dataset: as kvtier replay (5)")
    rt.add_argument("--concurrency", type=int, default=4, help="--dataset: virtual users in flight (4)")
    rt.add_argument("--block-tokens", type=int, default=256, help="--dataset: prefix block, tokens (256)")
    rt.add_argument("--tier", action="append", help="NAME=SIZE_GB, fastest first: a waterfall (e.g. gpu=40 cpu=256)")
    rt.add_argument("--plot", help="PNG: the hit curve and the working set over the trace")
    rt.set_defaults(func=cmd_retention)

    sw = ps.add_parser(
        "sweep", help="replay a dataset against the sim across a grid of CPU GB x NVMe GB x concurrency, trials each"
    )
    sw.add_argument("--dataset", required=True, help="a replay dataset (agent traces, tau2, ShareGPT, ...)")
    sw.add_argument("--dataset-format", default="auto")
    sw.add_argument("--cpu-gb", default="0,2", help="CPU offload sizes, comma separated (0: none)")
    sw.add_argument("--nvme-gb", default="0", help="NVMe offload sizes, comma separated (0: none)")
    sw.add_argument("--concurrency", default="4", help="loads: virtual users in flight, comma separated")
    sw.add_argument("--trials", type=int, default=2, help="trials per point, for the confidence interval (2)")
    sw.add_argument("--budget", type=float, default=0, help="seconds for the whole sweep (0: no bound)")
    sw.add_argument("--duration", type=float, default=0, help="seconds of dispatch per trial (0: the whole dataset)")
    sw.add_argument("--output", required=True, help="the sweep's folder (resumed when it holds one)")
    sw.add_argument("--preset", default="h100-llama3.1-8b", help="the sim's latency preset")
    sw.add_argument("--sim-model", default="llama3.1-8b", help="catalog model sizing the sim's KV (llama3.1-8b)")
    sw.add_argument("--gpu-kv-gb", default="2", help="the sim's GPU KV, GB (2)")
    sw.add_argument("--num-rounds", type=int, default=5)
    sw.add_argument("--max-tokens-cap", type=int, help="as kvtier replay")
    sw.add_argument("--nvme-dir", help="where NVMe points put their files (default OUTPUT/nvme)")
    sw.add_argument(
        "--replay-args", help='more kvtier replay flags for every trial, one string (--replay-args="--skip-too-long")'
    )
    sw.set_defaults(func=cmd_sweep)

    rc = ps.add_parser("recommend", help="the cheapest swept placement meeting a TTFT p95 SLO, with the knees")
    rc.add_argument("--from", dest="from_", required=True, help="a kvtier plan sweep folder")
    rc.add_argument("--slo-ttft-p95", help="seconds: the SLO the placement must meet (its CI's upper end)")
    rc.add_argument("--store-cost", action="append", help="TIER=$ per GB-month (cpu, nvme): rank by cost")
    rc.add_argument("--concurrency", type=int, help="only this load")
    rc.add_argument("--plot", help="PNG: TTFT p95 with its interval and the offload hit share against CPU GB")
    rc.add_argument("--json", action="store_true")
    rc.set_defaults(func=cmd_recommend)

    vw = ps.add_parser(
        "views", help="one trace, three views: a replay against the sim, the planner's prediction, a storage run"
    )
    vw.add_argument("--from", dest="from_", required=True, help="a kvtier replay folder (against the sim)")
    vw.add_argument("--fetch-from", help="a kvtier bench result of the same tier: its read bandwidth predicts (b)")
    vw.add_argument("--storage", action="store_true", help="(c): run the requests' KV I/O through kvtier trace replay")
    vw.add_argument("--storage-dir", help="(c): the storage tier's directory (default: a temporary one)")
    vw.add_argument("--work", help="(c): where the I/O trace and its bench result go (default FROM/views)")
    vw.add_argument("--preset", default="h100-llama3.1-8b", help="the sim preset whose prefill model predicts")
    vw.add_argument("--prefill-tps", help="instead of the preset's prefill rate, tokens/s")
    vw.add_argument("--prefill-overhead-ms", help="instead of the preset's per-prefill overhead")
    vw.add_argument("--model", help="catalog model of the sim's KV (default: the replay's, when in the catalog)")
    vw.add_argument(
        "--ladder",
        help="a kvtier ladder of the replay's server: (b) from its measured curves; then the "
        "replay may be against any server (a real vLLM: its prompt split from usage.cached_tokens)",
    )
    vw.add_argument("--json", action="store_true")
    vw.set_defaults(func=cmd_views)
