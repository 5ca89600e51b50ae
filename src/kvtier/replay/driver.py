"""One replay run: config -> dataset -> virtual users -> streamed requests + scrapes -> ReplayResult.

``prepare`` does everything that can fail before a request is sent (flags, tokenizer, dataset,
virtual users); ``execute`` runs the users against the server on an event loop and builds the
typed result; ``write_outputs`` writes requests.jsonl and summary.json.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError, DatasetError
from kvtier.replay.datasets import LoadedDataset, VirtualUser, load_sessions, tool_schemas, virtual_users
from kvtier.report.envelope import (
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
from kvtier.report.replay import ReplayResult
from kvtier.report.writers import write_json
from kvtier.telemetry.clock import MONOTONIC, Clock
from kvtier.tokenizer import Tokenizer, load_tokenizer


@dataclass
class ReplayPlan:
    """What a replay will do, checked before anything is sent."""

    config: ReplayConfig  # effective: dataset format, tokenizer and event loop resolved
    dataset: LoadedDataset
    users: list[VirtualUser]
    tokenizer: Tokenizer
    tools: list[dict[str, Any]] | None
    warnings: list[ResultWarning] = field(default_factory=list)
    reuse: dict[str, Any] | None = None  # what the prompts share, computed before the run (replay/reuse.py)
    scrape: bool = True  # False on MPI ranks other than 0: one scraper per server


def prepare(cfg: ReplayConfig) -> ReplayPlan:
    """Check the flags, read the dataset and cut it into virtual users (no request is sent)."""
    from kvtier.replay.client import event_loop_kind

    if cfg.missing():
        raise ConfigError("\n".join(f"{m}: required" for m in cfg.missing()))
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.synthetic:
        from kvtier.replay.synthetic import synthetic_dataset

        if cfg.dataset is not None:
            raise ConfigError("--synthetic: give either --dataset or --synthetic, not both")
        if "num_rounds" not in cfg.model_fields_set:
            cfg = cfg.model_copy(update={"num_rounds": cfg.turns})
        elif cfg.num_rounds > cfg.turns:
            raise ConfigError(f"--num-rounds {cfg.num_rounds} exceeds --turns {cfg.turns}: no virtual user")
        loaded = synthetic_dataset(cfg.users, cfg.turns, cfg.isl, cfg.osl, cfg.shared_prefix, tokenizer,
                                   cfg.synthetic_seed)  # fmt: skip
    else:
        assert cfg.dataset is not None  # missing() said so otherwise
        loaded = load_sessions(cfg.dataset, cfg.dataset_format, tokenizer.count)
    users = virtual_users(loaded.sessions, cfg.num_rounds, cfg.min_chunk_rounds, cfg.user_order)
    if not users:
        raise DatasetError(f"{cfg.dataset}: no session has {cfg.num_rounds} turns; lower --num-rounds")
    if cfg.output:  # an unwritable result folder fails now, not after the run
        try:
            Path(cfg.output).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--output: cannot create {cfg.output}: {e.strerror}") from e
    effective = cfg.model_copy(
        update={
            "dataset_format": loaded.format,
            "tokenizer": tokenizer.kind,
            "event_loop": event_loop_kind(cfg.event_loop),
        }
    )
    plan = ReplayPlan(
        effective,
        loaded,
        users,
        tokenizer,
        tool_schemas(loaded.sessions) if cfg.agentic_tools else None,
        list(loaded.warnings),
    )
    plan.reuse = _reuse(cfg, users, tokenizer)
    if cfg.concurrency > len(users):
        plan.warnings.append(
            warning(
                WarningCode.concurrency_capped,
                f"--concurrency {cfg.concurrency} exceeds the {len(users)} virtual users this dataset yields at "
                f"--num-rounds {cfg.num_rounds}: achieved concurrency is capped at {len(users)}",
                requested=cfg.concurrency,
                virtual_users=len(users),
            )
        )
    return plan


def _reuse(cfg: ReplayConfig, users: list[VirtualUser], tokenizer: Tokenizer) -> dict[str, Any]:
    """The reuse opportunity, at the KV size of --kv-model (an error if unknown) or of --model when the
    catalog knows it (else token figures only)."""
    from kvtier.modelspec import build_catalog
    from kvtier.replay.reuse import reuse_opportunity

    catalog = build_catalog({})
    name = cfg.kv_model or cfg.model or ""
    spec = catalog.get(name)
    if cfg.kv_model and spec is None:
        raise ConfigError(f"--kv-model: unknown model {cfg.kv_model!r} (known: {', '.join(sorted(catalog))})")
    bpt = spec.kv_bytes_per_token_per_rank(1) if spec is not None else None
    out = reuse_opportunity(users, tokenizer.encode, cfg.reuse_block_tokens, bpt)
    out["kv_model"] = name if spec is not None else None
    return out


async def _probe(cfg: ReplayConfig) -> dict[str, Any]:
    """The server's identity (GET /models) and the throwaway warm-up requests."""
    import aiohttp

    base = (cfg.base_url or "").rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        try:
            async with s.get(base + "/models") as r:
                server = {"models": await r.json(), "replica": r.headers.get("x-kvtier-replica")}
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as e:
            raise ConfigError(f"--base-url: {base} does not answer GET /models ({type(e).__name__})") from None
        for i in range(cfg.warmup):
            body = {"model": cfg.model, "messages": [{"role": "user", "content": f"warmup {i}"}], "max_tokens": 4}
            try:
                async with s.post(base + "/chat/completions", json=body) as r:
                    await r.read()
            except (TimeoutError, aiohttp.ClientError, OSError):
                pass
    return server


@dataclass
class _Stop:
    """Which signal ended the run (None: it ran to the end)."""

    event: asyncio.Event
    code: StopCode | None = None

    def by(self, code: StopCode) -> None:
        if self.code is None:
            self.code = code
        self.event.set()


async def _replay(plan: ReplayPlan, handle_signals: bool, clock: Clock) -> tuple[ReplayResult, list[dict[str, Any]]]:
    from kvtier.replay.client import ClientConfig, run_users
    from kvtier.replay.progress import ReplayProgress, Tally, snapshot
    from kvtier.replay.scrape import Scraper
    from kvtier.replay.summary import summarize

    cfg = plan.config
    started = utc_now()
    server = await _probe(cfg)
    stop = _Stop(asyncio.Event())
    loop = asyncio.get_running_loop()
    if handle_signals and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGINT, stop.by, StopCode.interrupted)
        loop.add_signal_handler(signal.SIGTERM, stop.by, StopCode.terminated)
    urls = (cfg.metrics_url or [cfg.server_root]) if plan.scrape else []
    scrapers = [Scraper(u, cfg.scrape_interval, cfg.rate_window) for u in urls]
    scrape_stop = asyncio.Event()
    scrape_tasks = [asyncio.create_task(sc.run(scrape_stop)) for sc in scrapers]
    t0 = clock.now_ns()
    client = ClientConfig(
        base_url=(cfg.base_url or "").rstrip("/"),
        model=cfg.model or "",
        concurrency=cfg.concurrency,
        gap_scale=cfg.gap_scale,
        request_timeout_s=cfg.request_timeout,
        read_timeout_s=cfg.read_timeout,
        history=cfg.history,
        cache_salt=cfg.cache_salt,
        tools=plan.tools,
    )
    records: list[dict[str, Any]] = []  # filled as requests finish: kept whatever happens below
    achieved, failure = 0, ""
    gauge: dict[str, int] = {"in_flight": 0}
    total = sum(len(u.turns) for u in plan.users)

    async def report_progress(bar: ReplayProgress) -> None:
        tally = Tally()
        while not scrape_stop.is_set():
            try:
                await asyncio.wait_for(scrape_stop.wait(), cfg.progress_interval)
            except TimeoutError:
                rates = scrapers[0].hit_rates_so_far() if scrapers else {}
                snap = snapshot(records, total, cfg.num_rounds, len(plan.users), gauge["in_flight"], rates, tally)
                bar.tick((clock.now_ns() - t0) / 1e9, snap)

    with ReplayProgress(cfg.progress) as bar:
        progress_task = asyncio.create_task(report_progress(bar))
        try:
            achieved = (await run_users(client, plan.users, stop.event, clock, records, gauge)).achieved_concurrency
        except Exception as e:  # noqa: BLE001 - a bug must not lose the records: they are written, marked partial
            failure = f"internal error in the client: {type(e).__name__}: {e}"
        finally:
            scrape_stop.set()
            await asyncio.gather(*scrape_tasks, progress_task)
            if handle_signals and threading.current_thread() is threading.main_thread():
                loop.remove_signal_handler(signal.SIGINT)
                loop.remove_signal_handler(signal.SIGTERM)
    wall = (clock.now_ns() - t0) / 1e9
    summary = summarize(records, len(plan.users), cfg.num_rounds, wall)
    metrics = [sc.summary() for sc in scrapers]
    warnings = list(plan.warnings)
    if failure:
        status, reason = Status.partial, StopReason(code=StopCode.internal_error, message=failure)
    elif stop.code is not None:
        status = Status.partial
        reason = StopReason(
            code=stop.code, message=f"{stop.code.value}: the replay stopped early; the result is partial"
        )
    else:
        status = Status.complete if summary["requests_ok"] > 0 else Status.failed
        reason = StopReason(code=StopCode.dataset_finished, message="every virtual user ran")
    if status != Status.complete:
        warnings.append(
            warning(
                WarningCode.run_not_complete,
                f"run is {status.value}: {reason.message}",
                status=status.value,
                stop_code=reason.code.value,
            )
        )
    if achieved < cfg.concurrency:
        warnings.append(
            warning(
                WarningCode.concurrency_not_reached,
                f"achieved concurrency {achieved} < requested {cfg.concurrency}",
                requested=cfg.concurrency,
                achieved=achieved,
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
        elif (m.external_prefix_cache_queries and not m.external_prefix_cache_hits) or (
            m.lmcache_lookup_requested_tokens and not m.lmcache_lookup_hit_tokens
        ):
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
    result = ReplayResult.model_validate(
        {
            "status": status,
            "stop_reason": reason,
            "started_at": iso(started),
            "finished_at": iso(utc_now()),
            "host": collect_host({"output": cfg.output, "dataset": cfg.dataset}),
            "warnings": warnings,
            "wall_s": round(wall, 3),
            "dataset": {
                "path": "synthetic" if cfg.synthetic else str(cfg.dataset),
                "format": plan.dataset.format,
                "sessions": len(plan.dataset.sessions),
                "virtual_users": len(plan.users),
                "tokenizer": plan.tokenizer.name,
                "agentic_tool_names": [t["function"]["name"] for t in plan.tools or []],
                "notes": plan.dataset.notes,
            },
            "concurrency": {
                "requested": cfg.concurrency,
                "achieved": achieved,
                "virtual_users": len(plan.users),
            },
            "server": server,
            "summary": summary,
            "server_metrics": metrics,
            "reuse_opportunity": plan.reuse,
            "config": cfg,
        }
    )
    return result, records


def execute(
    plan: ReplayPlan, handle_signals: bool = True, clock: Clock = MONOTONIC
) -> tuple[ReplayResult, list[dict[str, Any]]]:
    """Run the plan on its event loop; returns the result and the per-request records."""
    from kvtier.replay.client import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(plan.config.event_loop)) as runner:
        return runner.run(_replay(plan, handle_signals, clock))


def write_outputs(result: ReplayResult, records: list[dict[str, Any]], folder: str | Path) -> Path:
    """requests.jsonl (one record a line) and summary.json in ``folder``; returns summary.json's path."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with (out / "requests.jsonl").open("w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    except OSError as e:
        raise ConfigError(f"--output: cannot write {out}: {e.strerror}") from e
    return write_json(result, out / "summary.json")


__all__ = ["ReplayPlan", "prepare", "execute", "write_outputs"]
