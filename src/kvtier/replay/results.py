"""A replay's records -> its typed result (as bench/results.py is for a bench run): the summary over the
records, the run's own verdict and then the failure rule, the warnings the run implies (concurrency not
reached, scrapes that failed, an offload tier that never served a hit) and the model."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.config.replay import ReplayConfig
from kvtier.replay.client import Bounds
from kvtier.replay.engine_join import engine_checks, join_warnings
from kvtier.replay.hitrate import hit_rate_verdict, measured_rate
from kvtier.replay.summary import summarize
from kvtier.results.envelope import (
    ResultWarning,
    Status,
    StopCode,
    StopReason,
    WarningCode,
    collect_host,
    iso,
    utc_now,
    warning,
)
from kvtier.results.outcome import Failure, judge
from kvtier.results.replay import EngineJoin, HitRateControl, ReplayRecord, ReplayResult, ScrapeSummary

if TYPE_CHECKING:
    from kvtier.replay.plan import ReplayPlan


@dataclass(frozen=True)
class RunFacts:
    """What the replay's loop knows when it ends, beside the records."""

    started: dt.datetime
    server: dict[str, Any]  # what the probe found (model, max_model_len, ...)
    virtual_users: int
    fit_warnings: list[ResultWarning]
    achieved: int  # concurrency reached
    failure: str  # an internal error of the client, or ""
    signal_code: StopCode | None  # the signal that stopped it
    bounds: Bounds
    wall_s: float
    hardware: Any  # the HardwareSampler's samples
    engine_join: EngineJoin | None = None  # --engine-log: the engine's records joined to these (replay/engine_join.py)
    hit_control: HitRateControl | None = None  # --target-hit-rate: the priming's check (replay/hitrate.py)


def timing_warnings(records: list[ReplayRecord]) -> list[ResultWarning]:
    """What kind of numbers a replay against the sim measured: ``sim-timing-assumed`` when the sim's latency model
    was a preset's assumed figures, ``sim-timing-extrapolated`` when some requests were timed outside the range its
    --calibration ladder measured (counts from each response's kvtier.timing)."""
    seen = Counter(r.get("sim_timing") for r in records if r.get("sim_timing"))
    out = []
    if seen.get("assumed"):
        out.append(
            warning(
                WarningCode.sim_timing_assumed,
                f"{seen['assumed']} requests were timed by the sim's preset figures, which are assumed, not "
                "measured (kvtier sim --calibration takes a kvtier ladder of a real server)",
                requests=seen["assumed"],
            )
        )
    if seen.get("extrapolated"):
        out.append(
            warning(
                WarningCode.sim_timing_extrapolated,
                f"{seen['extrapolated']} requests were timed outside the range the sim's calibration "
                "measured (a longer prompt or more running sequences): extrapolated",
                requests=seen["extrapolated"],
            )
        )
    return out


def twin_band(server: dict[str, Any], model: str | None, ttft: dict[str, Any]) -> dict[str, Any] | None:
    """The TTFT quantiles as the interval a calibrated sim's error allows (results/replay.py ``TwinBand``), from the
    ``kvtier_timing`` its /v1/models entry for ``model`` gives; None for any other server, or one whose error is not
    a TwinError (a malformed extension is left out, not trusted)."""
    from pydantic import ValidationError

    from kvtier.results.ladder import TwinError

    entries = (server.get("models") or {}).get("data") if isinstance(server.get("models"), dict) else None
    mine = [m for m in entries or [] if isinstance(m, dict) and (model is None or m.get("id") == model)]
    timing = mine[0].get("kvtier_timing") if mine else None
    if not isinstance(timing, dict):
        return None
    try:
        err = TwinError.model_validate(timing.get("error"))
    except ValidationError:
        return None
    quantiles = {q: err.band(v) for q in ("p50", "p95", "p99") if isinstance(v := ttft.get(q), float | int)}
    return {"error": err, "origin": str(timing.get("origin", ""))[:1000], "ttft_s": quantiles}


NOT_PAYING_WARN = 0.05
"""Warn when more than this share of the requests an offload tier served fetched for longer than the recompute."""
DEGRADED_WARN = 0.05
"""Warn when more than this share of ok requests recomputed what an offload tier held (gate, failed or bypassed)."""
DECODE_DEPENDENCY_FACTOR = 1.5
"""A server that loaded more than this many tokens from its offload tier per prompt token the tier served loads
beyond each request's prefix: during decode, or again after preemptions — the store is on the decode path."""


def _total(metrics: list[ScrapeSummary], field: str) -> float | None:
    got = [v for m in metrics if (v := getattr(m, field)) is not None]
    return sum(got) if got else None


def offload_degradation(metrics: list[ScrapeSummary], requests_ok: int) -> dict[str, Any] | None:
    """The replay's ``summary.offload_degradation`` from the scraped servers' counters; None when none counts it."""
    gate, failed, bypassed = (
        _total(metrics, f) for f in ("sim_fetch_gate_recomputes", "sim_offload_failed_loads", "sim_offload_bypassed")
    )
    failed_blocks = _total(metrics, "kvtier_offload_failed_loads")
    loaded = served = None
    for m in metrics:
        if m.kvtier_offload_loaded_blocks and m.block_size:
            loaded = (loaded or 0.0) + sum(m.kvtier_offload_loaded_blocks.values()) * m.block_size
            served = (served or 0.0) + (m.prompt_tokens_by_source or {}).get("external_kv_transfer", 0.0)
    if all(v is None for v in (gate, failed, bypassed, failed_blocks, loaded)):
        return None
    sim = [v for v in (gate, failed, bypassed) if v is not None]
    ratio = round(loaded / served, 4) if loaded is not None and served else None
    return {
        "fetch_gate_recomputes": None if gate is None else int(gate),
        "failed_loads": None if failed is None else int(failed),
        "bypassed_lookups": None if bypassed is None else int(bypassed),
        "failed_load_blocks": None if failed_blocks is None else int(failed_blocks),
        "degraded_rate": round(sum(sim) / requests_ok, 6) if sim and requests_ok else None,
        "loaded_tokens": loaded,
        "served_tokens": served,
        "load_per_served_token": ratio,
        "decode_dependency": None if ratio is None else ratio > DECODE_DEPENDENCY_FACTOR,
    }


def degradation_warnings(d: dict[str, Any] | None) -> list[ResultWarning]:
    """``offload-degraded`` past DEGRADED_WARN of the ok requests (or any failed block load of kvtier's backend),
    and ``offload-decode-dependency`` when the server loaded past DECODE_DEPENDENCY_FACTOR per served token."""
    if d is None:
        return []
    out = []
    rate = d["degraded_rate"]
    if (rate is not None and rate > DEGRADED_WARN) or d["failed_load_blocks"]:
        parts = [
            f"{d[k]} {w}"
            for k, w in (
                ("fetch_gate_recomputes", "fetch-gate recomputes"),
                ("failed_loads", "failed loads"),
                ("bypassed_lookups", "lookups bypassed (breaker open)"),
                ("failed_load_blocks", "failed block loads (kvtier's vLLM backend)"),
            )
            if d[k]
        ]
        share = f" ({rate:.1%} of ok requests)" if rate is not None else ""
        out.append(
            warning(
                WarningCode.offload_degraded,
                f"the offload tier held KV that was recomputed instead{share}: {', '.join(parts)} — the "
                "silent degradation the placement model warns about (TTFT pays for a tier that is "
                "not serving)",
                degraded_rate=rate,
                **{
                    k: d[k] for k in ("fetch_gate_recomputes", "failed_loads", "bypassed_lookups", "failed_load_blocks")
                },
            )
        )
    if d["decode_dependency"]:
        out.append(
            warning(
                WarningCode.offload_decode_dependency,
                f"the server loaded {d['loaded_tokens']:,.0f} tokens from its offload tier for "
                f"{d['served_tokens']:,.0f} prompt tokens it served ({d['load_per_served_token']:g} per "
                "token): it loads beyond each request's prefix (during decode, or again after "
                "preemptions), so the store is on the decode path, not only on TTFT's",
                load_per_served_token=d["load_per_served_token"],
            )
        )
    return out


def not_paying_warnings(d: dict[str, Any]) -> list[ResultWarning]:
    """``offload-hits-not-paying``: more than NOT_PAYING_WARN of the requests an offload tier served waited longer for
    their fetch than recomputing its tokens, or the hits' fetches together took longer than the recompute they
    replaced. Said as one pair — the hit rate and the fetch time — since a high hit rate alone reads as success."""
    ratio = d.get("offload_fetch_over_recompute")
    if not (d["hits_not_paying"] > NOT_PAYING_WARN * d["offload_hits"] or (ratio is not None and ratio > 1)):
        return []
    served = sum(v for k, v in (d.get("token_share") or {}).items() if k not in ("gpu", "recomputed"))
    together = f"the offload tiers served {served:.1%} of the prompt tokens"
    if ratio is not None:
        slower = ratio > 1
        together = (
            f"{'hits, but the fleet got slower: ' if slower else ''}{together}, and fetching them took {ratio:.2f}x "
            f"the time recomputing them would have{'' if slower else ' over all'}"
        )
    return [
        warning(
            WarningCode.offload_hits_not_paying,
            f"{together}; {d['hits_not_paying']} of {d['offload_hits']} requests an offload tier served waited longer "
            f"for their fetch than recomputing those tokens would have taken at this replay's prefill rate "
            f"({d['prefill_tokens_per_s']:,.0f} tokens/s): for them the tier cost TTFT (kvtier plan value --from "
            "prices it per tier)",
            requests=d["hits_not_paying"],
            offload_hits=d["offload_hits"],
            prefill_tokens_per_s=d["prefill_tokens_per_s"],
            offload_token_share=round(served, 6),
            fetch_over_recompute=ratio,
        )
    ]


def build_result(
    plan: ReplayPlan, run: RunFacts, records: list[ReplayRecord], metrics: list[ScrapeSummary]
) -> ReplayResult:
    cfg = plan.config
    summary = summarize(records, run.virtual_users, cfg.num_rounds, run.wall_s)
    warnings = list(plan.warnings) + run.fit_warnings
    status, reason = verdict(cfg, summary, run.failure, run.signal_code, run.bounds)
    if run.hit_control is not None:
        control = run.hit_control if not run.hit_control.check_ok else measured_rate(run.hit_control, metrics)
        summary["hit_rate_control"] = control
        status, reason = hit_rate_verdict(control, status, reason)
    failures = {c: Failure.model_validate(f) for c, f in summary["failures"].items()}
    status, reason, failed = judge(status, reason, summary["requests_ok"], failures, cfg.max_failure_rate)
    warnings += failed
    if status != Status.complete:
        warnings.append(
            warning(
                WarningCode.run_not_complete,
                f"run is {status.value}: {reason.message}",
                status=status.value,
                stop_code=reason.code.value,
            )
        )
    if run.achieved < cfg.concurrency:
        warnings.append(
            warning(
                WarningCode.concurrency_not_reached,
                f"achieved concurrency {run.achieved} < requested {cfg.concurrency}",
                requested=cfg.concurrency,
                achieved=run.achieved,
            )
        )
    warnings += timing_warnings(records)
    summary["twin"] = twin_band(run.server, cfg.model, dict(summary["ttft_s"]))
    if run.engine_join is not None:
        summary["engine_join"] = joined = engine_checks(run.engine_join, records, metrics)
        warnings += join_warnings(joined)
    summary["offload_degradation"] = degraded = offload_degradation(metrics, summary["requests_ok"])
    warnings += degradation_warnings(degraded)
    warnings += not_paying_warnings(summary["ttft_decomposition"])
    dropped = [r["decomposition_dropped"] for r in records if r.get("decomposition_dropped")]
    if dropped:
        warnings.append(
            warning(
                WarningCode.decomposition_dropped,
                f"{len(dropped)} responses carried a TTFT decomposition that failed its schema or bounds and was "
                f"dropped from their records (the requests count as they went), e.g.: {dropped[0]}",
                requests=len(dropped),
            )
        )
    for m in metrics:
        if m.samples < 2:
            warnings.append(
                warning(
                    WarningCode.scrape_failed,
                    f"{m.url}/metrics: {m.samples} scrapes succeeded ({m.scrape_errors} failed): no server figures",
                    url=m.url,
                    scrape_errors=m.scrape_errors,
                )
            )
        elif offload_never_hit(m):
            asked = m.external_prefix_cache_queries or m.lmcache_lookup_requested_tokens or 0.0
            warnings.append(
                warning(
                    WarningCode.offload_never_exercised,
                    f"{m.url}: the server looked up {asked:,.0f} tokens in its offload tier and found none: "
                    "the offload tier never served a hit",
                    url=m.url,
                    external_queries_tokens=asked,
                )
            )
        elif offload_never_served(m):
            local = (m.prompt_tokens_by_source or {}).get("local_cache_hit")
            held = f"; the GPU cache served {local:,.0f} prompt tokens" if local else ""
            warnings.append(
                warning(
                    WarningCode.offload_never_used,
                    f"{m.url}: the offload tier held tokens the server looked up but served none{held}: the GPU "
                    "cache already held every prefix the tier had, so this run says nothing about the tier — "
                    "replay more requests, or give the server a smaller GPU KV cache that still holds the longest "
                    "prompt (kvtier sim --gpu-kv-gb; vLLM --num-gpu-blocks-override), so prefixes are pushed out "
                    "to the tier",
                    url=m.url,
                    gpu_cache_hit_tokens=local,
                )
            )
    return ReplayResult.model_validate(
        {
            "status": status,
            "stop_reason": reason,
            "started_at": iso(run.started),
            "finished_at": iso(utc_now()),
            "host": collect_host({"output": cfg.output, "dataset": cfg.dataset}),
            "warnings": warnings,
            "wall_s": round(run.wall_s, 3),
            "dataset": {
                "path": "synthetic" if cfg.synthetic else str(cfg.dataset),
                "format": plan.dataset.format,
                "sessions": len(plan.dataset.sessions),
                "virtual_users": run.virtual_users,
                "tokenizer": plan.tokenizer.name,
                "agentic_tool_names": [t["function"]["name"] for t in plan.tools or []],
                "notes": plan.dataset.notes,
            },
            "concurrency": {
                "requested": cfg.concurrency,
                "achieved": run.achieved,
                "virtual_users": run.virtual_users,
            },
            "server": run.server,
            "summary": summary,
            "server_metrics": metrics,
            "reuse_opportunity": plan.reuse,
            "hardware": run.hardware,
            "config": cfg,
        }
    )


def _offload_counts(m: ScrapeSummary) -> tuple[float, float, float]:
    """(tokens the server looked up in its offload tier, tokens a lookup found there, what a counter shows it
    served): vLLM's external queries and LMCache's lookups; LMCache's lookup hits (whole prompts, GPU hits
    included); vLLM's external hits and external transfer, the offloading connector's load bytes, LMCache's loaded
    chunks, kvtier's loaded blocks."""
    asked = (m.external_prefix_cache_queries or 0.0) + (m.lmcache_lookup_requested_tokens or 0.0)
    found = (m.lmcache_lookup_hit_tokens or 0.0) + (m.lmcache_lookup_hit_l1_tokens or 0.0)
    found += m.lmcache_lookup_hit_l2_tokens or 0.0
    served = (m.external_prefix_cache_hits or 0.0) + (m.prompt_tokens_by_source or {}).get("external_kv_transfer", 0.0)
    served += (m.kv_offload_load_bytes or 0.0) + (m.lmcache_chunks_loaded or 0.0)
    served += sum((m.kvtier_offload_loaded_blocks or {}).values())
    return asked, found, served


def offload_never_hit(m: ScrapeSummary) -> bool:
    """Whether the server looked tokens up in its offload tier and no counter shows a hit: vLLM's external
    prefix cache and LMCache's own lookup counters are both read, so the warning never contradicts a
    counter printed beside it (one of them showing hits is the offload tier serving)."""
    asked, found, _ = _offload_counts(m)
    return asked > 0 and found + (m.external_prefix_cache_hits or 0.0) == 0


def offload_never_served(m: ScrapeSummary) -> bool:
    """Whether the server asked its offload tier, the tier found tokens, and yet no counter shows a token served
    from it: the GPU cache already held all the tier had."""
    asked, found, served = _offload_counts(m)
    return asked > 0 and found > 0 and served == 0


def verdict(
    cfg: ReplayConfig, summary: dict[str, Any], failure: str, signal_code: StopCode | None, bounds: Bounds
) -> tuple[Status, StopReason]:
    """The run's own verdict, before the failure rule (results/outcome.py) is applied to it."""
    if failure:
        return Status.partial, StopReason(code=StopCode.internal_error, message=failure)
    if signal_code is not None:
        return Status.partial, StopReason(
            code=signal_code, message=f"{signal_code.value}: the replay stopped early; the result is partial"
        )
    status = Status.complete if summary["requests_ok"] > 0 or summary["requests_failed"] else Status.failed
    if bounds.hit == "max-requests":
        return status, StopReason(code=StopCode.max_requests, message=f"--max-requests {cfg.max_requests} sent")
    if bounds.hit == "duration":
        return status, StopReason(
            code=StopCode.duration,
            message=f"--duration {cfg.duration:g} s of dispatch ended; in-flight requests had --read-timeout "
            f"{cfg.read_timeout:g} s to finish",
        )
    return status, StopReason(code=StopCode.dataset_finished, message="every virtual user ran")
