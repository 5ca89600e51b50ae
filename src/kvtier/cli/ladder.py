"""``kvtier ladder``: parse the flags (LadderConfig), measure, print the ladder and its fit, exit by status."""

from __future__ import annotations

import argparse

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.ladder import LadderConfig


def add_ladder_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser(
        "ladder",
        help="a server's TTFT by context and by the cache tier that served the prefix, verified by its counters; "
        "the fitted timing model calibrates kvtier sim",
        description="Against any OpenAI-compatible server (vLLM, vLLM + LMCache, kvtier sim): per context length and "
        "new-token count, the TTFT of a cold prompt, of the prefix from the GPU cache and from each offload tier "
        "(pushed down by a flood), each request bracketed by /metrics scrapes and verified by them; then the "
        "fitted prefill, fetch and TPOT model (kvtier sim --calibration, kvtier plan gate --from).",
    )
    add_config_arguments(p, LadderConfig)
    p.set_defaults(func=run_ladder)


def run_ladder(args: argparse.Namespace) -> int:
    from kvtier import ladder
    from kvtier.results.envelope import exit_code

    cfg = config_from_args(args, LadderConfig)
    r = ladder.run(cfg)
    if cfg.plot:
        from kvtier.report.plots_serving import ladder_png

        png = ladder_png([(cfg.output, r)])
        if png is not None:
            from kvtier.results.io import write_bytes_atomic

            write_bytes_atomic(cfg.plot, png, "--plot")
    print(render(r))
    print(f"result: {cfg.output}" + (f", plot: {cfg.plot}" if cfg.plot else ""))
    return exit_code(r.status, r.stop_reason.code)


def render(r) -> str:  # type: ignore[no-untyped-def]  # a LadderResult
    """The ladder in words: one row per (source, context, new tokens), then the fit."""
    s = r.server
    tiers = ", ".join(f"{t.name} ({t.capacity_tokens:,} tokens)" if t.capacity_tokens else t.name for t in s.tiers)
    lines = [
        f"kvtier ladder: {s.model} at {s.base_url} ({s.kind}; max_model_len {s.max_model_len}, GPU KV "
        f"{s.gpu_kv_tokens or '?'} tokens, offload tiers: {tiers or 'none'})",
        f"{'source':>10s} {'context':>8s} {'new':>6s} {'TTFT p50 (s)':>12s} {'min':>9s} {'max':>9s} {'CV':>6s} "
        f"{'verified':>9s}",
    ]
    for c in r.cells:
        med = f"{c.ttft_s_median:.4f}" if c.ttft_s_median is not None else "—"
        lo = f"{c.ttft_s_min:.4f}" if c.ttft_s_min is not None else "—"
        hi = f"{c.ttft_s_max:.4f}" if c.ttft_s_max is not None else "—"
        cv = f"{c.ttft_s_cv:.2f}" if c.ttft_s_cv is not None else "—"
        lines.append(
            f"{c.source:>10s} {c.context_tokens:>8,} {c.new_tokens:>6,} {med:>12s} {lo:>9s} {hi:>9s} "
            f"{cv:>6s} {c.verified:>4d}/{c.verified + c.unverified:<4d}"
        )
    for t in r.tpot:
        lines.append(f"TPOT at {t.running} running: {t.tpot_s if t.tpot_s is not None else '—'} s")
    f = r.fit
    if f is None:
        lines.append("fit: none (too few verified cold and GPU points)")
    else:
        pm = f.timing.prefill
        lines.append(
            f"fit: prefill_s = {pm.overhead_s:.4g} + {pm.s_per_prompt_token:.4g} x prompt + {pm.s_per_token:.4g} x "
            f"new + {pm.s_per_token_pair:.4g} x new x (cached + new/2)  "
            f"[{'superlinear' if f.superlinear else 'linear'}; median |error| "
            f"{_pct(f.prefill_fit_median_abs_rel_err)} on {f.prefill_points} fitted points, "
            f"{_pct(f.prefill_holdout_median_abs_rel_err)} on {f.prefill_holdout_points} held back]"
        )
        for fm in f.timing.fetch:
            bw = f", {fm.bytes_per_s / 1e9:.3g} GB/s" if fm.bytes_per_s else ""
            lines.append(
                f"fit: fetch from {fm.tier} = {fm.overhead_s:.4g} s + {fm.s_per_token:.4g} s/token{bw} "
                f"(median |error| {_pct(fm.median_abs_rel_err)}, {fm.points} points)"
            )
        d = f.timing.decode
        lines.append(
            f"fit: TPOT = {d.tpot_s:.4g} s + {d.s_per_extra_seq:.4g} s per extra running sequence "
            f"(median |error| {_pct(f.tpot_median_abs_rel_err)})"
        )
    for w in r.warnings:
        lines.append(f"warning: {w.message}")
    for n in s.notes:
        lines.append(f"note: {n}")
    lines.append(f"ladder ({r.status.value}, {r.stop_reason.code.value}): {r.stop_reason.message}")
    return "\n".join(lines)


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{v:.1%}"


__all__ = ["add_ladder_parser", "render"]
