"""``kvtier plan views``: one trace, three views, checked against each other.

* **(a) measured**: a replay of the trace against the sim (its folder): each ok request's TTFT as the client
  measured it, the server's fetch seconds, and its prompt tokens by source (GPU, each offload tier, recomputed).
* **(b) predicted** by the planner from costs measured elsewhere: the tier's read bandwidth from a
  ``kvtier bench`` result of the same tier (``--fetch-from``), and the sim's prefill model (its preset's
  prefill rate and per-prefill overhead, or ``--prefill-tps``/``--prefill-overhead-ms``: given, not measured).
  Each request, at its measured start time and with its measured token split, is fed through the sim's
  prefill model as a trace-driven queue: its fetch (tokens x KV bytes per token / the tier's bandwidth), then
  a FIFO prefill of ``overhead + recomputed / prefill rate`` behind the requests before it; before both, the
  admission: first come, first served while the prompt and max_tokens fit the GPU's KV (the sim's
  max_model_len, from /v1/models) beside the requests admitted, each holding its tokens until its last token
  (the preset's time per output token). What it leaves out: the GPU prefix cache's sharing of blocks,
  preemption, the decode batch's slowdown and the client's own overhead; where those matter, the error says so.
* **(c) storage**: the same requests' KV reads and writes as an I/O trace (each chunk the sim reported served
  from a tier, one read; each new chunk of a session's prompt, one write to the tier that later serves it), run
  through ``kvtier trace replay`` on kvtier's real tiers at the recorded pace; its measured read bandwidth per
  tier then predicts the fetch again, and the TTFT through the same model.

Per turn: the mean measured TTFT and fetch, the predictions, and the prediction error (predicted / measured -
1); overall, the median of the per-turn absolute errors. A large error is a finding, stated, not hidden.
"""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, DatasetError
from kvtier.plan.measured import TierReadCost, load_read_costs, read_costs
from kvtier.plan.value import decomposed_records, usage_records
from kvtier.results.io import atomic_file
from kvtier.results.ladder import LadderFit, LadderResult, Timing, TwinError, twin_error
from kvtier.results.plan import TurnView, ViewInput, ViewsReport
from kvtier.results.records import RequestRecord
from kvtier.results.replay import offload_sources
from kvtier.tiers import TIER_LABELS
from kvtier.tracefile import HEADER

CHUNK_TOKENS = 256  # the sim's offload chunk (LMCache's; sim/model.py OffloadConfig, not imported: plan is below sim)
OFFLOAD_SOURCES_TO_TIER = {"cpu": "cpu", "storage": "storage"}  # a record's source name -> the tier kind


Prefill = Callable[[int, int], tuple[float, float]]
"""(new tokens, cached tokens) -> (seconds on the one modelled GPU, seconds of latency beside it)."""
Fetch = Callable[[str, int], float | None]
"""(tier, tokens it served) -> seconds, or None where nothing says what the tier costs."""


def preset_prefill(tps: float, overhead_s: float) -> Prefill:
    """The sim preset's model: overhead + computed tokens / rate, all of it on the GPU (as the sim runs a preset)."""
    return lambda new, cached: (overhead_s + max(1, new) / tps, 0.0)


def ladder_prefill(t: Timing) -> Prefill:
    """A ladder's measured model, as a calibrated sim runs it: the compute on the GPU, the fixed cost and the
    per-prompt-token handling as latency beside it."""
    p = t.prefill
    return lambda new, cached: (p.compute_s(max(1, new), cached), p.overhead_s + p.handling_s(new + cached))


def bandwidth_fetch(bw: dict[str, float], kvpt: int) -> Fetch:
    return lambda tier, tokens: tokens * kvpt / bw[tier] if tier in bw else None


def _predict(
    rows: list[RequestRecord], fetch_s: Fetch, prefill: Prefill, gpu_tokens: int | None = None, tpot_s: float = 0.0
) -> list[tuple[float, float] | None]:
    """(TTFT, fetch) per row through the sim's model (module docstring); None where a tier that served the row
    has no fetch cost. With ``gpu_tokens`` (the GPU's KV capacity), requests are admitted first come, first served
    while their prompt and max_tokens fit beside the admitted ones, each holding its tokens until its last token
    (TTFT + (completion tokens - 1) x ``tpot_s``)."""
    free_at = 0.0
    last_admit = 0.0
    held = 0
    running: list[tuple[float, int]] = []  # (release time, tokens), a heap
    order = sorted(range(len(rows)), key=lambda i: float(rows[i].start_unix_s or 0.0))
    pred: dict[int, tuple[float, float] | None] = {}
    for i in order:
        r = rows[i]
        src: dict[str, int] = r.prompt_sources or {}
        costs = [fetch_s(k, v) for k, v in offload_sources(src).items()]
        if any(c is None for c in costs):
            pred[i] = None
            continue
        fetch = sum(c for c in costs if c is not None)
        arrival = float(r.start_unix_s or 0.0)
        t = max(arrival, last_admit)
        need = (r.prompt_tokens or 0) + r.max_tokens
        if gpu_tokens:
            while running and held + need > gpu_tokens:
                release, tokens = heapq.heappop(running)
                t = max(t, release)
                held -= tokens
        last_admit = t
        start = max(t + fetch, free_at)
        new = int(src.get("recomputed", 0))
        gpu_s, beside_s = prefill(new, (r.prompt_tokens or 0) - new)
        free_at = start + gpu_s
        first = free_at + beside_s
        pred[i] = (first - arrival, fetch)
        if gpu_tokens:
            heapq.heappush(running, (first + max(0, (r.completion_tokens or 1) - 1) * tpot_s, need))
            held += need
    return [pred[i] for i in range(len(rows))]


def write_storage_trace(rows: list[RequestRecord], kvpt: int, path: Path) -> int:
    """The requests' KV operations as an I/O trace (the MLPerf reference's CSV; module docstring); rows written."""
    chunk = CHUNK_TOKENS * kvpt
    order = sorted(rows, key=lambda r: float(r.start_unix_s or 0.0))
    # where each session's chunk i is first read from: its write goes there (it was held there when served)
    home: dict[tuple[str, int], str] = {}
    plans = []
    for r in order:
        src: dict[str, int] = r.prompt_sources or {}
        gpu = int(src.get("gpu", 0)) // CHUNK_TOKENS
        i = gpu
        reads = []
        for k, v in offload_sources(src).items():
            tier = OFFLOAD_SOURCES_TO_TIER.get(k)
            if tier is None:
                raise ConfigError(f"the storage view runs the cpu and storage tiers; the replay has {k!r}")
            for _ in range(int(v) // CHUNK_TOKENS):
                reads.append((i, tier))
                home.setdefault((r.session, i), tier)
                i += 1
        plans.append((r, reads, (r.prompt_tokens or 0) // CHUNK_TOKENS))
    written: dict[str, int] = {}
    n = 0
    with atomic_file(path) as f:  # never through a file or link planted at the name
        f.write(HEADER)
        for r, reads, full in plans:
            t = float(r.start_unix_s or 0.0)
            s = r.session
            for i, tier in reads:
                f.write(f"{t:.6f},Read,{chunk},{TIER_LABELS[tier]},{s}/{i},Decode\n")
                n += 1
            for i in range(written.get(s, 0), full):  # the prompt's new full chunks, stored after its prefill
                tier = home.get((s, i), "cpu")
                f.write(f"{t + 1e-6:.6f},Write,{chunk},{TIER_LABELS[tier]},{s}/{i},Prefill\n")
                n += 1
            written[s] = max(written.get(s, 0), full)
    return n


def _by_turn(
    rows: list[RequestRecord], b: list[tuple[float, float] | None], c: list[tuple[float, float] | None] | None
) -> list[TurnView]:
    turns: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        turns.setdefault(r.turn, []).append(i)

    def mean(xs: list[float]) -> float:
        return round(sum(xs) / len(xs), 6)

    def means(pred: list[tuple[float, float] | None] | None, idx: list[int]) -> tuple[float | None, float | None]:
        """The turn's mean predicted (TTFT, fetch); None when any of its requests has no prediction."""
        known = [p for p in (pred[i] for i in idx) if p is not None] if pred is not None else []
        if not idx or len(known) != len(idx):
            return None, None
        return mean([p[0] for p in known]), mean([p[1] for p in known])

    def error(pred: float | None, measured: float) -> float | None:
        return None if pred is None or not measured else round(pred / measured - 1, 4)

    out = []
    for turn, idx in sorted(turns.items()):
        mt = mean([float(rows[i].ttft_s or 0.0) for i in idx])
        parts = [rows[i].server_ttft_parts for i in idx]
        mf = mean([float(x.get("fetch", 0.0)) for x in parts if x]) if all(parts) else None
        pt, pf = means(b, idx)
        ct, cf = means(c, idx)
        out.append(
            TurnView(
                turn=turn,
                requests=len(idx),
                measured_ttft_s=mt,
                measured_fetch_s=mf,
                predicted_ttft_s=pt,
                predicted_fetch_s=pf,
                ttft_error=error(pt, mt),
                storage_ttft_s=ct,
                storage_fetch_s=cf,
                storage_ttft_error=error(ct, mt),
            )
        )
    return out


def _bw(costs: list[TierReadCost]) -> dict[str, float]:
    return {c.tier: c.bw_mean for c in costs}


def views_report(
    replay: str,
    fetch_from: str | None,
    preset: str = "h100-llama3.1-8b",
    prefill_tps: float | None = None,
    prefill_overhead_ms: float | None = None,
    model: str | None = None,
    storage: bool = False,
    storage_dir: str | None = None,
    work: str | None = None,
    ladder: str | None = None,
) -> ViewsReport:
    """The three views of the module docstring (``storage``: run view (c), its files under ``work``). With
    ``ladder`` (a kvtier ladder of the replay's server), view (b) predicts by the ladder's measured prefill, fetch
    and decode curves instead of a preset's, and the replay may be against any server: usage_records."""
    folder = Path(replay)
    lad: tuple[LadderResult, LadderFit] | None = None
    if ladder:
        from kvtier.results.ladder import load_fitted

        lad = load_fitted(ladder, "--ladder")
        rows, result = usage_records(folder)
    else:
        rows, result = decomposed_records(folder)
    rows = [r for r in rows if r.prompt_sources and r.ttft_s and r.start_unix_s]
    if not rows:
        raise DatasetError(f"{replay}: no ok request with its prompt's sources and a TTFT")
    if lad is not None:
        return _ladder_views(folder, rows, result, *lad, ladder or "", fetch_from, model)
    from kvtier.config.sim import load_presets
    from kvtier.modelspec import build_catalog, resolve_model

    if model:
        kvpt = int(resolve_model(model, build_catalog()).kv_bytes_per_token_per_rank(1))
        kv_src = f"given (--model {model})"
    elif result.reuse_opportunity is not None and result.reuse_opportunity.kv_bytes_per_token:
        kvpt = result.reuse_opportunity.kv_bytes_per_token
        kv_src = f"the replay's model ({result.reuse_opportunity.kv_model})"
    else:
        raise ConfigError("--model: the replay's model is not in kvtier's catalog: name the sim's --model")
    presets = load_presets()
    if preset not in presets:
        raise ConfigError(f"--preset: unknown {preset!r} (known: {', '.join(sorted(presets))})")
    p = presets[preset]
    tps = prefill_tps or float(p["prefill_tps"])
    overhead = (prefill_overhead_ms if prefill_overhead_ms is not None else float(p["prefill_overhead_ms"])) / 1e3
    inputs = [
        ViewInput(name="KV bytes per token", value=kvpt, unit="B", source=kv_src),
        ViewInput(
            name="prefill rate",
            value=tps,
            unit="tokens/s",
            source="given (--prefill-tps)" if prefill_tps else f"given (the sim preset {preset})",
        ),
        ViewInput(
            name="prefill overhead",
            value=overhead * 1e3,
            unit="ms",
            source="given (--prefill-overhead-ms)"
            if prefill_overhead_ms is not None
            else f"given (the sim preset {preset})",
        ),
    ]
    gpu_tokens = result.server.max_model_len  # the sim's: its GPU KV capacity in tokens
    tpot = float(p["tpot_ms"]) / 1e3
    inputs.append(
        ViewInput(
            name="GPU KV capacity",
            value=gpu_tokens,
            unit="tokens",
            source="measured (the server's /v1/models max_model_len: the sim's GPU KV)",
        )
    )
    inputs.append(
        ViewInput(name="time per output token", value=tpot * 1e3, unit="ms", source=f"given (the sim preset {preset})")
    )
    b: list[tuple[float, float] | None] = [None] * len(rows)
    if fetch_from:
        costs, _ = load_read_costs(fetch_from)
        for c in costs:
            inputs.append(
                ViewInput(
                    name=f"{c.tier} read bandwidth",
                    value=round(c.bw_mean / 1e9, 4),
                    unit="GB/s",
                    source=f"measured (kvtier bench {fetch_from}, {c.ops} reads of {c.mean_bytes / 2**20:.3g} MiB)",
                )
            )
        b = _predict(rows, bandwidth_fetch(_bw(costs), kvpt), preset_prefill(tps, overhead), gpu_tokens, tpot)
    c_pred = None
    storage_result = None
    if storage:
        costs_c, storage_result = _storage_run(rows, kvpt, Path(work or folder / "views"), storage_dir)
        for c in costs_c:
            inputs.append(
                ViewInput(
                    name=f"{c.tier} read bandwidth (storage view)",
                    value=round(c.bw_mean / 1e9, 4),
                    unit="GB/s",
                    source=f"measured (kvtier trace replay of these requests' KV I/O, {c.ops} reads)",
                )
            )
        c_pred = _predict(rows, bandwidth_fetch(_bw(costs_c), kvpt), preset_prefill(tps, overhead), gpu_tokens, tpot)
    turns = _by_turn(rows, b, c_pred)
    eb = [abs(t.ttft_error) for t in turns if t.ttft_error is not None]
    ec = [abs(t.storage_ttft_error) for t in turns if t.storage_ttft_error is not None]
    findings = _findings(rows, turns, result.config.max_tokens_cap)
    return ViewsReport(
        source=str(folder),
        requests=len(rows),
        kv_bytes_per_token=kvpt,
        inputs=inputs,
        turns=turns,
        median_abs_ttft_error=round(statistics.median(eb), 4) if eb else None,
        median_abs_storage_ttft_error=round(statistics.median(ec), 4) if ec else None,
        storage_result=storage_result,
        findings=findings,
    )


def _ladder_views(
    folder: Path,
    rows: list[RequestRecord],
    result: Any,
    lad: LadderResult,
    fit: LadderFit,
    path: str,
    fetch_from: str | None,
    model: str | None,
) -> ViewsReport:
    """View (b) from a ladder: the measured prefill (compute on the GPU's FIFO, the fixed cost beside it), each
    offload tier's measured fetch curve (or a bench's bandwidth for a tier the ladder did not measure), the measured
    TPOT at one running sequence, the GPU's KV capacity the ladder read from the server."""
    from kvtier.modelspec import build_catalog, resolve_model

    t = fit.timing
    kvpt = lad.server.kv_bytes_per_token or (
        resolve_model(model, build_catalog()).kv_bytes_per_token_per_rank(1) if model else 0
    )
    bw = _bw(load_read_costs(fetch_from)[0]) if fetch_from else {}

    def fetch(tier: str, tokens: int) -> float | None:
        f = t.fetch_for(tier)
        if f is not None:
            return f.seconds(tokens)
        return tokens * kvpt / bw[tier] if tier in bw and kvpt else None

    gpu_tokens = lad.server.gpu_kv_tokens or result.server.max_model_len
    tpot = t.decode.at(1)
    b = _predict(rows, fetch, ladder_prefill(t), gpu_tokens, tpot)
    p = t.prefill
    inputs = [
        ViewInput(
            name="prefill compute",
            value=p.s_per_token * 1e6,
            unit="us/token (+ attention term)",
            source=f"measured (the ladder {path})",
        ),
        ViewInput(
            name="prefill fixed cost", value=p.overhead_s * 1e3, unit="ms", source=f"measured (the ladder {path})"
        ),
        ViewInput(name="GPU KV capacity", value=gpu_tokens, unit="tokens", source="measured (the ladder's server)"),
        ViewInput(name="time per output token", value=tpot * 1e3, unit="ms", source=f"measured (the ladder {path})"),
    ]
    inputs += [
        ViewInput(
            name=f"{f.tier} fetch", value=f.s_per_token * 1e6, unit="us/token", source=f"measured (the ladder {path})"
        )
        for f in t.fetch
    ]
    if not all(r.server_ttft_parts for r in rows):
        split = "usage.cached_tokens (the server sends no per-tier split: cached = gpu)"
        inputs.append(ViewInput(name="prompt split", value=None, unit="", source=split))
    err = twin_error(fit, path)
    turns = [_banded(x, err) for x in _by_turn(rows, b, None)]
    eb = [abs(x.ttft_error) for x in turns if x.ttft_error is not None]
    inside = [x.within_band for x in turns if x.within_band is not None]
    band = (
        f"{sum(inside)} of {len(inside)} turns' measured TTFT lies within the ladder's error (real / predicted "
        f"x{err.ratio_low:.2f}-x{err.ratio_high:.2f}: {err.basis})"
    )
    return ViewsReport(
        source=str(folder),
        requests=len(rows),
        kv_bytes_per_token=kvpt,
        inputs=inputs,
        turns=turns,
        median_abs_ttft_error=round(statistics.median(eb), 4) if eb else None,
        median_abs_storage_ttft_error=None,
        storage_result=None,
        findings=[band, *_findings(rows, turns, result.config.max_tokens_cap)],
        twin_error=err,
    )


def _banded(t: TurnView, err: TwinError) -> TurnView:
    """A turn's (b) TTFT with the interval the ladder's error allows, and whether the measured TTFT lies in it."""
    if t.predicted_ttft_s is None:
        return t
    lo, hi = err.band(t.predicted_ttft_s)
    return t.model_copy(update={"predicted_ttft_s_band": (lo, hi), "within_band": lo <= t.measured_ttft_s <= hi})


UNCAPPED_ERROR = 1.0  # a turn predicted off by more than this (100 %) on an uncapped replay: the replies' decode


def _uncapped(turns: list[TurnView], cap: int | None) -> list[str]:
    """An uncapped replay whose predictions miss by more than 100 % says why and names the flag (#58 item 18: a
    replay of long replies printed errors of +82,209 % and nothing else)."""
    worst = max((abs(t.ttft_error) for t in turns if t.ttft_error is not None), default=0.0)
    if cap is not None or worst <= UNCAPPED_ERROR:
        return []
    return [
        f"the replay's replies were not capped (--max-tokens-cap): errors up to {worst:+.0%} are later turns queued "
        "behind earlier turns' long decodes, which the prediction leaves to the preset's decode time; replay with "
        "--max-tokens-cap 16 to compare the prefill and fetch views (docs/plan.md)"
    ]


def _findings(rows: list[RequestRecord], turns: list[TurnView], cap: int | None = 0) -> list[str]:
    """What the errors come from, in words: the parts the model leaves out, as measured (``cap``: the replay's
    --max-tokens-cap, None when uncapped)."""
    out = _uncapped(turns, cap)
    if not all(r.server_ttft_parts for r in rows):
        return out + [
            f"turn {t.turn}: predicted {t.predicted_ttft_s:.4f} s vs measured {t.measured_ttft_s:.4f} s "
            f"({t.ttft_error:+.0%})"
            for t in turns
            if t.ttft_error is not None and abs(t.ttft_error) > 0.2
        ]
    queue = [(r.server_ttft_parts or {}).get("queue", 0.0) for r in rows]
    ttft = [float(r.ttft_s or 0.0) for r in rows]
    if sum(ttft) > 0:
        share = sum(queue) / sum(ttft)
        if share > 0.1:
            out.append(
                f"{share:.0%} of the measured TTFT was the admission queue (waiting for GPU blocks): the "
                "prediction models it from the GPU's capacity and the preset's decode time"
            )
    server = [float(r.server_ttft_s or 0.0) for r in rows]
    client = statistics.median(t - s for t, s in zip(ttft, server))
    out.append(f"the client and loopback added {client * 1e3:.2f} ms at the median (outside the server's parts)")
    fetch = sum((r.server_ttft_parts or {}).get("fetch", 0.0) for r in rows)
    for label, key in (("(b)", "predicted_fetch_s"), ("(c)", "storage_fetch_s")):
        pred = [(getattr(t, key), t.requests) for t in turns]
        if fetch > 0 and all(p is not None for p, _ in pred):
            total = sum(p * n for p, n in pred)
            out.append(
                f"{label} fetch is {total / fetch:.2g}x the sim's measured fetch: the tier's read bandwidth "
                "under that run's load, not the sim's own chunk reads"
            )
    for t in turns:
        if t.ttft_error is not None and abs(t.ttft_error) > 0.2:
            out.append(
                f"turn {t.turn}: predicted {t.predicted_ttft_s:.4f} s vs measured {t.measured_ttft_s:.4f} s "
                f"({t.ttft_error:+.0%})"
            )
    return out


def _storage_run(
    rows: list[RequestRecord], kvpt: int, work: Path, storage_dir: str | None
) -> tuple[list[TierReadCost], str]:
    from kvtier import iotrace
    from kvtier.config.iotrace import TraceReplayConfig

    work.mkdir(parents=True, exist_ok=True)
    trace = work / "storage_trace.csv"
    write_storage_trace(rows, kvpt, trace)
    out = work / "storage_result.json"
    cfg = TraceReplayConfig(trace=str(trace), speed=1.0, output=str(out), cache_dir=storage_dir)
    result = iotrace.run_replay(cfg)  # writes the bench result to ``out``
    costs = read_costs(result)
    if not costs:
        raise DatasetError(f"{out}: the storage run completed no reads")
    return costs, str(out)


__all__ = ["ViewsReport", "TurnView", "views_report", "write_storage_trace"]
