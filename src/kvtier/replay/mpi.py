"""``kvtier replay`` as one rank of an MPI run: the virtual users split disjointly across ranks, each
rank streaming its share on its own event loop, one result pooled by rank 0.

Every rank reads the dataset and cuts the same virtual users (the order is deterministic); rank r
takes users r, r + N, r + 2N, ... — together exactly the users one process would run — and its share
of ``--concurrency`` (C // N, one more for the first C % N ranks). Only rank 0 scrapes the servers'
/metrics and sends the warm-up requests. The ranks start together (rank 0 sends one start time, as in
bench/mpi.py). Each rank writes ``OUTDIR/rank_<r>/`` (requests.jsonl, summary.json) as it ends, then
sends its records to rank 0, which writes ``OUTDIR/requests.jsonl`` (the union, each row with its
``rank``) and ``OUTDIR/summary.json``: TTFT/TPOT/end-to-end percentiles and sessions computed over the
union (exact), the servers' figures from its own scrapes, and ``ranks`` (one line per rank). A rank
that sends nothing within ``--mpi-timeout`` is named in the result, which is then partial.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError, KvtierError
from kvtier.mpi import RunEnvironment
from kvtier.replay.driver import execute, prepare, write_outputs
from kvtier.replay.plan import ReplayPlan
from kvtier.results.envelope import ResultWarning, Status, StopCode, StopReason, WarningCode, warning
from kvtier.results.outcome import Failure, judge
from kvtier.results.replay import ReplayResult


def rank_plan(plan: ReplayPlan, r: RunEnvironment) -> ReplayPlan:
    cfg = plan.config
    out = str(Path(cfg.output) / f"rank_{r.rank}") if cfg.output else None
    mine = r.mine(plan.users)
    update: dict[str, Any] = {"concurrency": max(1, r.share(cfg.concurrency)), "output": out}
    if r.rank != 0:
        update["warmup"] = 0
    return dataclasses.replace(plan, users=mine, config=cfg.model_copy(update=update), scrape=r.rank == 0)


def run_rank(cfg: ReplayConfig, r: RunEnvironment, handle_signals: bool = True) -> ReplayResult:
    """This rank's share of the replay; rank 0 returns (and writes) the pooled result."""
    from kvtier.replay.results import degradation_warnings, offload_degradation, twin_band
    from kvtier.replay.summary import summarize

    plan: ReplayPlan | None = None
    problem = None
    try:
        if cfg.target_hit_rate is not None:  # one priming and one check of the server's counters: one process
            raise ConfigError("--target-hit-rate: a replay of one process (not under mpirun, nor --num-clients)")
        plan = prepare(cfg)
    except KvtierError as e:
        problem = f"rank {r.rank} ({r.host}): {e}"
    r.wait(r.start(problem=problem))
    assert plan is not None
    mine = rank_plan(plan, r)
    result, records = execute(mine, handle_signals)
    for rec in records:
        rec["rank"] = r.rank
    if mine.config.output:
        write_outputs(result, records, mine.config.output)
    contribution = {
        "rank": r.rank,
        "host": r.host,
        "records": records,
        "status": result.status.value,
        "stop_code": result.stop_reason.code.value,
        "wall_s": result.wall_s,
        "achieved": result.concurrency.achieved,
        "users": len(mine.users),
        "warnings": [w.model_dump(mode="json") for w in result.warnings],
    }
    got = r.gather(contribution)
    if r.rank != 0 or got is None:
        return result
    union = [rec for k in sorted(got) for rec in got[k]["records"]]
    lost = [k for k in range(r.size) if k not in got]
    wall = max(c["wall_s"] for c in got.values())
    summary = summarize(union, len(plan.users), cfg.num_rounds, wall)
    warnings = [w for w in result.warnings if w.code not in (WarningCode.concurrency_not_reached,)]
    for k, c in sorted(got.items()):
        if k != 0:
            warnings += [
                ResultWarning.model_validate(w)
                for w in c["warnings"]
                if w["code"] != WarningCode.concurrency_not_reached
            ]
    if lost:
        warnings.append(
            warning(
                WarningCode.ranks_lost,
                f"rank(s) {', '.join(map(str, lost))} sent no records within --mpi-timeout {cfg.mpi_timeout:g} s: "
                "their users are missing from the pooled result",
                lost_ranks=lost,
            )
        )
    # said again over the union: failures, and the servers' degradation counts (rank 0 scraped them) per request
    again = (WarningCode.requests_failed, WarningCode.offload_degraded, WarningCode.offload_decode_dependency)
    warnings = [w for w in warnings if w.code not in again]
    summary["offload_degradation"] = degraded = offload_degradation(result.server_metrics, summary["requests_ok"])
    warnings += degradation_warnings(degraded)
    summary["twin"] = twin_band(result.server.model_dump(), cfg.model, dict(summary["ttft_s"]))  # over the union's TTFT
    if cfg.engine_log:  # every rank joined its own records; the engines' logs joined again over the union
        from kvtier.replay.engine_join import engine_checks, join, join_warnings
        from kvtier.results.engine_log import read_engine_log

        warnings = [
            w for w in warnings if w.code not in (WarningCode.engine_join_incomplete, WarningCode.engine_counts_differ)
        ]
        summary["engine_join"] = joined = engine_checks(
            join(union, read_engine_log(cfg.engine_log)), union, result.server_metrics
        )
        warnings += join_warnings(joined)
    partial = bool(lost) or any(c["status"] == "partial" for c in got.values())
    stop = result.stop_reason
    if stop.code == StopCode.too_many_failures:  # rank 0's own verdict: decided again over the union
        stop = StopReason(code=StopCode.dataset_finished, message="every virtual user ran")
    if lost:
        stop = StopReason(code=stop.code, message=f"lost rank(s) {lost}; {stop.message}")
    failures = {c: Failure.model_validate(f) for c, f in summary["failures"].items()}
    status, stop, failed = judge(
        Status.partial if partial else Status.complete if summary["requests_total"] else Status.failed,
        stop,
        summary["requests_ok"],
        failures,
        cfg.max_failure_rate,
    )
    warnings += failed
    pooled = result.model_copy(
        update={
            "status": status,
            "stop_reason": stop,
            "warnings": warnings,
            "wall_s": round(wall, 3),
            "summary": type(result.summary).model_validate(summary),
            "concurrency": result.concurrency.model_copy(
                update={
                    "requested": cfg.concurrency,
                    "achieved": sum(c["achieved"] for c in got.values()),
                    "virtual_users": len(plan.users),
                }
            ),
            "dataset": result.dataset.model_copy(update={"virtual_users": len(plan.users)}),
            "config": plan.config,
            "ranks": [
                {
                    "rank": k,
                    "host": c["host"],
                    "status": c["status"],
                    "stop_code": c["stop_code"],
                    "virtual_users": c["users"],
                    "requests": len(c["records"]),
                    "achieved_concurrency": c["achieved"],
                    "wall_s": c["wall_s"],
                }
                for k, c in sorted(got.items())
            ],
            "lost_ranks": lost,
        }
    )
    pooled = ReplayResult.model_validate(pooled.model_dump(mode="json"))
    if cfg.output:
        write_outputs(pooled, union, cfg.output)
    return pooled


__all__ = ["run_rank", "rank_plan"]
