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
from kvtier.results.replay import ReplayRecord, ReplayResult, ScrapeSummary

if TYPE_CHECKING:
    from kvtier.replay.driver import ReplayPlan


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


def timing_warnings(records: list[ReplayRecord]) -> list[ResultWarning]:
    """What kind of numbers a replay against the sim measured: ``sim-timing-assumed`` when the sim's latency model
    was a preset's assumed figures, ``sim-timing-extrapolated`` when some requests were timed outside the range its
    --calibration ladder measured (counts from each response's kvtier.timing)."""
    seen = Counter(r.get("sim_timing") for r in records if r.get("sim_timing"))
    out = []
    if seen.get("assumed"):
        out.append(warning(WarningCode.sim_timing_assumed,
                           f"{seen['assumed']} requests were timed by the sim's preset figures, which are assumed, not "
                           "measured (kvtier sim --calibration takes a kvtier ladder of a real server)",
                           requests=seen["assumed"]))  # fmt: skip
    if seen.get("extrapolated"):
        out.append(warning(WarningCode.sim_timing_extrapolated,
                           f"{seen['extrapolated']} requests were timed outside the range the sim's calibration "
                           "measured (a longer prompt or more running sequences): extrapolated",
                           requests=seen["extrapolated"]))  # fmt: skip
    return out


def build_result(
    plan: ReplayPlan, run: RunFacts, records: list[ReplayRecord], metrics: list[ScrapeSummary]
) -> ReplayResult:
    cfg = plan.config
    summary = summarize(records, run.virtual_users, cfg.num_rounds, run.wall_s)
    warnings = list(plan.warnings) + run.fit_warnings
    status, reason = verdict(cfg, summary, run.failure, run.signal_code, run.bounds)
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


def offload_never_hit(m: ScrapeSummary) -> bool:
    """Whether the server looked tokens up in its offload tier and no counter shows a hit: vLLM's external
    prefix cache and LMCache's own lookup counters are both read, so the warning never contradicts a
    counter printed beside it (one of them showing hits is the offload tier serving)."""
    asked = (m.external_prefix_cache_queries or 0.0) + (m.lmcache_lookup_requested_tokens or 0.0)
    hits = (m.external_prefix_cache_hits or 0.0) + (m.lmcache_lookup_hit_tokens or 0.0)
    hits += (m.lmcache_lookup_hit_l1_tokens or 0.0) + (m.lmcache_lookup_hit_l2_tokens or 0.0)
    return asked > 0 and hits == 0


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
