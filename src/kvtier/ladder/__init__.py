"""kvtier ladder: what a server's TTFT does by context length and by the cache tier that served the prefix.

Library use::

    from kvtier import ladder
    from kvtier.config.ladder import LadderConfig

    r = ladder.run(LadderConfig(base_url="http://127.0.0.1:8000/v1", model="tiny", output="ladder.json"))
    print(r.status, r.fit.timing.prefill if r.fit else None)

measure.py sends the points, server.py reads the counters that verify them, fit.py fits the timing model that
``kvtier sim --calibration`` and ``kvtier plan gate --from`` take. docs/serving.md "The ladder".
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.errors import ConfigError
from kvtier.results.engine_log import check_engine_logs
from kvtier.results.envelope import Status, StopCode, StopReason, WarningCode, collect_host, iso, utc_now, warning
from kvtier.results.ladder import (
    CellStats,
    HandlingPoint,
    HostLoad,
    LadderPoint,
    LadderResult,
    LoadedPoint,
    ServerFacts,
    TpotPoint,
)
from kvtier.results.outcome import judge, tally

if TYPE_CHECKING:
    from kvtier.config.ladder import LadderConfig
    from kvtier.ladder.measure import LadderSession, Progress


def run(cfg: LadderConfig, handle_signals: bool = True, progress: Progress | None = None) -> LadderResult:
    """Measure, fit and write the ladder (``cfg.output``); Ctrl+C keeps what was measured. (``cfg.plot`` is drawn by
    the CLI, the one importer of report/: ``kvtier.report.plots_serving.ladder_png``.)"""
    from kvtier.results.io import check_output_path, write_json

    check_output_path("--output", cfg.output)
    check_output_path("--plot", cfg.plot)
    check_engine_logs(cfg.engine_log)
    if progress is None and not cfg.quiet:
        progress = _print_point
    result = asyncio.run(_run(cfg, handle_signals, progress))
    write_json(result, cfg.output)
    return result


def _print_point(p: LadderPoint) -> None:
    mark = "verified" if p.verified else f"UNVERIFIED ({p.why})"
    ttft = f"{p.ttft_s:.4f} s" if p.ttft_s is not None else "—"
    print(
        f"ladder: {p.source:>8s} context {p.context_tokens:>7,} + {p.new_tokens:<5,} prompt "
        f"{p.prompt_tokens or 0:>7,} cached {p.cached_tokens or 0:>7,} TTFT {ttft} {mark}",
        file=sys.stderr,
        flush=True,
    )


async def _run(cfg: LadderConfig, handle_signals: bool, progress: Progress | None) -> LadderResult:
    import aiohttp

    from kvtier.ladder.measure import LadderSession, Prompter, default_contexts
    from kvtier.ladder.server import describe
    from kvtier.replay.client import ClientConfig
    from kvtier.replay.driver import server_identity
    from kvtier.replay.scrape import scrape_snapshot
    from kvtier.telemetry.diskstats import DeviceSampler

    started = utc_now()
    t0 = time.monotonic()
    cpu = DeviceSampler([], 1.0)  # the machine's load over the run: a ladder measured on a busy host says so
    cpu.start()
    load_start = os.getloadavg()[0]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if handle_signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    rng = np.random.default_rng(cfg.seed)
    tokenizer = None
    if cfg.tokenizer:
        from kvtier.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(cfg.tokenizer)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_read=cfg.request_timeout)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as http:
            identity = await server_identity(http, cfg.base_url.rstrip("/"), cfg.model)
            server = describe(identity["max_model_len"], await scrape_snapshot(http, cfg.metrics_root()))
            prompter = Prompter(rng, f"{int(time.time() * 1000) % 10**9:x}", tokenizer)
            sess = LadderSession(
                http,
                ClientConfig(
                    cfg.base_url,
                    cfg.model,
                    1,
                    request_timeout_s=cfg.request_timeout,
                    read_timeout_s=cfg.request_timeout,
                    ignore_eos=not cfg.honor_eos,  # the sweeps' streams run their length (a random model stops early)
                ),
                cfg.metrics_root(),
                server,
                prompter,
                stop,
                t0 + cfg.duration if cfg.duration else None,
                cfg.max_requests,
            )
            if cfg.engine_log:
                from kvtier.results.engine_log import EngineLogTail

                sess.engine_log = EngineLogTail(cfg.engine_log)
            await sess.probe()
            largest_new = max(cfg.new_tokens)
            if server.max_model_len is None and cfg.contexts is None:
                raise ConfigError("--contexts: /models gives no max_model_len for this model: give the contexts")
            contexts = cfg.contexts or default_contexts(server.max_model_len or 0, largest_new, prompter.overhead)
            points, stop_code, plan = await _measure(cfg, sess, contexts, progress)
            tpot, loaded, handling = [], [], []
            if stop_code is None:
                tpot = await _tpot_sweep(cfg, sess, plan)
                fits = (server.max_model_len or 10**9) - prompter.overhead - 8
                probes = [n for n in cfg.loaded_prompts if n < fits]
                sizes = [n for n in cfg.handling_contexts if n < fits]
                longest = max(sizes, default=0)  # cached, timed too: what handling costs among running sequences
                for m in cfg.tpot_concurrency if probes else []:
                    if sess.bounded():
                        break
                    loaded += await sess.loaded(m, probes * cfg.repeats, cfg.loaded_tokens, longest, cfg.repeats)
                handling = await sess.handling(sizes, cfg.repeats) if sizes and not sess.bounded() else []
            stop_code = stop_code or sess.bounded()
    finally:
        cpu.stop()
        if handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
    load = HostLoad(
        cpus=os.cpu_count() or 0,
        cpu_busy_share=cpu.totals().get("cpu_utilization"),
        load1_start=round(load_start, 2),
        load1_end=round(os.getloadavg()[0], 2),
    )
    return _result(
        cfg,
        server,
        prompter,
        points,
        tpot,
        plan,
        sess,
        stop_code,
        started,
        time.monotonic() - t0,
        load,
        loaded,
        handling,
    )


TPOT_STREAMS = 8
"""Streams each level of the TPOT sweep rests on at least (rounds of ``running`` at once, at least 3)."""


async def _tpot_sweep(cfg: LadderConfig, sess: LadderSession, plan: _Plan) -> list[TpotPoint]:
    """The TPOT sweep, its levels interleaved round by round (a load that drifts over the sweep then moves every
    level alike, not the last one), each resting on at least ``TPOT_STREAMS`` streams. One that is implausible
    (ladder/fit.py ``tpot_implausible``: bursty streams, time per token falling as sequences are added) is measured
    once more with twice the rounds and four times the tokens, and the second is kept (the fit refuses it if it is
    still implausible)."""
    from kvtier.ladder.fit import tpot_implausible

    async def sweep(tokens: int, scale: int) -> tuple[list[TpotPoint], bool]:
        """The levels measured (a bound keeps those with records) and whether the sweep was whole."""
        levels = cfg.tpot_concurrency
        rounds = {m: scale * max(3, -(-TPOT_STREAMS // m)) for m in levels}
        recs: dict[int, list[dict[str, Any]]] = {m: [] for m in levels}
        for i in range(max(rounds.values(), default=0)):
            for m in levels:
                if i >= rounds[m]:
                    continue
                if sess.bounded():
                    return [sess.tpot_point(m, recs[m]) for m in levels if recs[m]], False
                recs[m] += await sess.tpot_round(m, tokens)
        return [sess.tpot_point(m, recs[m]) for m in levels], True

    first, whole = await sweep(cfg.tpot_tokens, 1)
    if not whole or tpot_implausible(first) is None:
        return first
    plan.remeasured["tpot sweep"] = 1
    again, whole = await sweep(min(4096, cfg.tpot_tokens * 4), 2)
    return again if whole else first


@dataclass
class _Plan:
    """What the grid asked for and what could not be measured (and why)."""

    sources: list[str]
    skipped: dict[str, str] = field(default_factory=dict)
    floods: dict[str, int] = field(default_factory=dict)
    cells: int = 0
    remeasured: dict[str, int] = field(default_factory=dict)  # noisy cells measured again: how many extra rounds


async def _measure(
    cfg: LadderConfig, sess: LadderSession, contexts: list[int], progress: Progress | None
) -> tuple[list[LadderPoint], str | None, _Plan]:
    from kvtier.ladder.measure import CHUNK_TOKENS, flood_sizes

    s, p = sess.server, sess.prompter
    found = [t.name for t in s.tiers]
    wanted = cfg.sources or ["cold", "gpu", *found]
    unknown = [x for x in wanted if x not in ("cold", "gpu", *found) and x not in cfg.flood_overrides()]
    if unknown:
        raise ConfigError(
            f"--sources: {unknown} are not tiers this server has (found: {found or 'none'}); a tier "
            "with no counter here needs --flood-tokens NAME=N and cannot be verified"
        )
    plan = _Plan(wanted)
    tiers = [x for x in wanted if x not in ("cold", "gpu")]
    ordered = [t for t in found if t in tiers] + [t for t in tiers if t not in found]
    floods = flood_sizes(s, ordered, cfg.flood_overrides())
    for t, (n, _, why) in floods.items():
        if n is None:
            plan.skipped[t] = why or "no flood size"
        else:
            plan.floods[t] = n
    limit = (s.max_model_len or 10**9) - 2
    cells = [(c, n, r) for c in contexts for n in cfg.new_tokens for r in range(cfg.repeats)]
    too_long = sorted({(c, n) for c, n, _ in cells if c + n + p.overhead + 8 > limit})
    for c, n in too_long:
        plan.skipped[f"context {c} + {n}"] = f"longer than the server's max_model_len {s.max_model_len}"
    cells = [x for x in cells if (x[0], x[1]) not in set(too_long)]
    order = sess.prompter.rng.permutation(len(cells))
    pairs = sorted({(c, n) for c, n, _ in cells})
    inner = [pq for pq in pairs if min(contexts) < pq[0] < max(contexts)] or pairs
    k = int(round(cfg.holdout * len(pairs))) if len(pairs) > 2 else 0
    held = {inner[i] for i in sess.prompter.rng.choice(len(inner), size=min(k, len(inner)), replace=False)}
    plan.cells = len(cells)
    points: list[LadderPoint] = []
    seq = 0

    async def group(c: int, n: int, rep: int, g: int) -> str | None:
        """One (context, new tokens) repeat: a fresh prefix measured from every source in turn; why it stopped."""
        nonlocal seq
        hb = (c, n) in held
        prefix = p.text(c)  # the template's leading tokens come before it: the first c tokens are all prefix
        for src in ["cold", "gpu", *ordered]:
            if src not in wanted and src != "cold":  # cold always runs: it puts the prefix in the caches
                continue
            why = sess.bounded()
            if why is not None:
                return why
            flood = 0
            if src not in ("cold", "gpu"):
                if src in plan.skipped:
                    continue
                _, holds, _ = floods[src]
                # what is stored after the prefix: the flood, and the two suffixes' chunks (cold and gpu points)
                if holds is not None and plan.floods[src] + c + 2 * (n + CHUNK_TOKENS) >= holds:
                    why = f"the flood and the prefix exceed what {src} and the tiers above hold ({holds:,} tokens)"
                    plan.skipped.setdefault(f"{src} at context {c}", why)
                    continue
                flood = await sess.flood(plan.floods[src], cfg.flood_concurrency)
                await sess.drain(cfg.settle)
            pt = await sess.point(prefix + " " + p.text(n, unique=False), src, c, n, rep, g, seq, flood, hb)
            seq += 1
            if src in wanted:
                points.append(pt)
                if progress is not None:
                    progress(pt)
        return None

    for g, idx in enumerate(order):
        c, n, rep = cells[idx]
        why = await group(c, n, rep, g)
        if why is not None:
            return points, why, plan
    # a cell whose repeats spread past CELL_CV_BOUND is measured again (up to --repeats more), while it stays so
    for extra in range(cfg.repeats):
        noisy = sorted({(x.context_tokens, x.new_tokens) for x in cell_stats(points) if _noisy(x)})
        for c, n in noisy:
            plan.remeasured[f"context {c} + {n}"] = extra + 1
            why = await group(c, n, cfg.repeats + extra, len(order) + extra * len(pairs) + pairs.index((c, n)))
            if why is not None:
                return points, why, plan
        if not noisy:
            break
    return points, None, plan


CELL_CV_BOUND = 0.2
"""A cell whose verified repeats' TTFTs spread more than this (their coefficient of variation) is measured again."""


def _noisy(x: CellStats) -> bool:
    return x.ttft_s_cv is not None and x.ttft_s_cv > CELL_CV_BOUND


def _load_words(load: HostLoad | None) -> str:
    if load is None or load.cpu_busy_share is None:
        return ""
    return (
        f" (the host's CPUs were {load.cpu_busy_share:.0%} busy over the run, load average {load.load1_start:g} "
        f"-> {load.load1_end:g} on {load.cpus} CPUs)"
    )


def cell_stats(points: list[LadderPoint]) -> list[CellStats]:
    cells: dict[tuple[str, int, int], list[LadderPoint]] = {}
    for p in points:
        cells.setdefault((p.source, p.context_tokens, p.new_tokens), []).append(p)
    out = []
    for (src, c, n), grp in sorted(cells.items()):
        ts = [p.ttft_s for p in grp if p.verified and p.ttft_s is not None]
        cv = statistics.pstdev(ts) / statistics.mean(ts) if len(ts) > 1 and statistics.mean(ts) > 0 else None
        out.append(
            CellStats(
                source=src,
                context_tokens=c,
                new_tokens=n,
                verified=len(ts),
                unverified=len(grp) - len(ts),
                ttft_s_median=round(statistics.median(ts), 6) if ts else None,
                ttft_s_min=min(ts) if ts else None,
                ttft_s_max=max(ts) if ts else None,
                ttft_s_cv=round(cv, 4) if cv is not None else None,
            )
        )
    return out


def _result(
    cfg: LadderConfig,
    server: Any,
    prompter: Any,
    points: list[LadderPoint],
    tpot: list[Any],
    plan: _Plan,
    sess: LadderSession,
    stop_code: str | None,
    started: Any,
    wall_s: float,
    load: HostLoad | None = None,
    loaded: list[LoadedPoint] | None = None,
    handling: list[HandlingPoint] | None = None,
) -> LadderResult:
    from kvtier.ladder.fit import fit_ladder

    loaded, handling = loaded or [], handling or []
    tiers = [x for x in plan.sources if x not in ("cold", "gpu")]
    fit = fit_ladder(points, tpot, tiers, server.kv_bytes_per_token, cfg.output, loaded, handling)
    warnings = []
    bad = [p for p in points if not p.verified]
    if bad:
        by = Counter(p.source for p in bad)
        warnings.append(
            warning(
                WarningCode.ladder_unverified,
                f"{len(bad)} of {len(points)} points unverified (left out of the fit): "
                + ", ".join(f"{s} {n}" for s, n in by.items())
                + f"; first: {bad[0].why}",
                by_source=dict(by),
            )
        )
    verified_sources = {p.source for p in points if p.verified}
    missing = [x for x in plan.sources if x not in verified_sources]
    for name, why in plan.skipped.items():
        warnings.append(warning(WarningCode.ladder_tier_unreachable, f"{name}: not measured: {why}", what=name))
    if missing:
        warnings.append(
            warning(
                WarningCode.ladder_source_unverified, f"no verified point for {', '.join(missing)}", sources=missing
            )
        )
    cells = cell_stats(points)
    still = [f"{x.source} {x.context_tokens}+{x.new_tokens}" for x in cells if _noisy(x)]
    if still:
        warnings.append(
            warning(
                WarningCode.ladder_noisy_cells,
                f"{len(still)} cells' repeats still spread more than {CELL_CV_BOUND:.0%} after "
                f"{max(plan.remeasured.values(), default=0)} extra rounds (e.g. {', '.join(still[:3])}): the machine "
                f"was busy{_load_words(load)}",
                cells=still,
                remeasured=plan.remeasured,
            )
        )
    if fit is not None and fit.unreliable:
        warnings.append(
            warning(
                WarningCode.ladder_fit_unreliable,
                f"the fit is unreliable: {'; '.join(fit.unreliable)}{_load_words(load)}; kvtier sim --calibration "
                "refuses it without --accept-unreliable",
                reasons=fit.unreliable,
            )
        )
    if stop_code is None:
        status, code, msg = Status.complete, StopCode.grid_finished, f"{len(points)} points measured"
    elif stop_code in ("duration", "max-requests"):
        status, code = Status.partial, StopCode(stop_code)
        msg = f"bounded by --{stop_code} after {len(points)} points of {plan.cells * len(plan.sources)}"
    else:
        status, code = Status.partial, StopCode(stop_code)
        msg = f"stopped ({stop_code}) after {len(points)} points; what was measured is kept"
    if not any(p.verified and p.source == "cold" for p in points):
        status, msg = Status.failed, "no verified cold point: nothing to fit a prefill model to"
    elif status == Status.complete and missing:
        status = Status.partial
        msg += f"; no verified point for {', '.join(missing)}"
    elif status == Status.complete and fit is not None and fit.unreliable:
        status = Status.partial
        msg += "; the fit is unreliable (warning ladder-fit-unreliable)"
    failures = tally(sess.failures)
    ok = sess.sent - len(sess.failures)
    status, stop, more = judge(status, StopReason(code=code, message=msg), ok, failures, cfg.max_failure_rate)
    warnings += more
    facts = ServerFacts(
        base_url=cfg.base_url,
        model=cfg.model,
        kind=server.kind,
        max_model_len=server.max_model_len,
        block_tokens=server.block_tokens,
        gpu_kv_tokens=server.gpu_kv_tokens,
        kv_bytes_per_token=server.kv_bytes_per_token,
        tiers=server.tiers,
        counters=server.counters,
        prompt_overhead_tokens=prompter.overhead,
        tokens_per_word=round(prompter.tokens_per_word, 4),
        notes=server.notes,
    )
    return LadderResult(
        status=status,
        stop_reason=stop,
        started_at=iso(started),
        finished_at=iso(utc_now()),
        host=collect_host(),
        warnings=warnings,
        config=cfg,
        server=facts,
        points=points,
        cells=cells,
        tpot=tpot,
        loaded=loaded,
        handling=handling,
        fit=fit,
        host_load=load,
        remeasured=plan.remeasured,
        failures=failures,
        requests_sent=sess.sent,
        wall_s=round(wall_s, 3),
    )


__all__ = ["run", "cell_stats"]
