"""One replay run: config -> dataset -> virtual users -> streamed requests + scrapes -> ReplayResult.

``prepare`` does everything that can fail before a request is sent (flags, tokenizer, dataset,
virtual users); ``execute`` runs the users against the server on an event loop and builds the
typed result; ``write_outputs`` writes requests.jsonl and summary.json.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError, DatasetError
from kvtier.replay.client import Bounds
from kvtier.replay.datasets import LoadedDataset, VirtualUser, load_sessions, tool_schemas, virtual_users
from kvtier.replay.plan import ReplayPlan
from kvtier.replay.results import RunFacts, build_result
from kvtier.results.engine_log import check_engine_logs
from kvtier.results.envelope import (
    ResultWarning,
    StopCode,
    WarningCode,
    utc_now,
    warning,
)
from kvtier.results.io import atomic_file, write_json
from kvtier.results.replay import ReplayRecord, ReplayResult
from kvtier.telemetry.clock import MONOTONIC, Clock
from kvtier.telemetry.hardware import HardwareSampler
from kvtier.tokenizer import Tokenizer, load_tokenizer


def load_users(cfg: ReplayConfig) -> tuple[ReplayConfig, LoadedDataset, list[VirtualUser], Tokenizer, int]:
    """The tokenizer, the dataset (or the synthetic sessions) and its virtual users, as a replay of ``cfg``
    sends them (``kvtier plan retention`` walks the same users); and the config with ``num_rounds`` filled
    for synthetic sessions, and the --min-chunk-rounds floor applied."""
    tokenizer = load_tokenizer(cfg.tokenizer)
    if cfg.synthetic:
        from kvtier.replay.synthetic import synthetic_dataset

        if cfg.dataset is not None:
            raise ConfigError("--synthetic: give either --dataset or --synthetic, not both")
        if "num_rounds" not in cfg.model_fields_set:
            cfg = cfg.model_copy(update={"num_rounds": cfg.turns})
        elif cfg.num_rounds > cfg.turns:
            raise ConfigError(f"--num-rounds {cfg.num_rounds} exceeds --turns {cfg.turns}: no virtual user")
        if cfg.target_hit_rate is not None:
            from kvtier.replay.hitrate import controlled_dataset

            if cfg.shared_prefix:
                raise ConfigError("--target-hit-rate: the shared documents are the prefix (leave --shared-prefix 0)")
            loaded = controlled_dataset(cfg, tokenizer)
        else:
            loaded = synthetic_dataset(
                cfg.users, cfg.turns, cfg.isl, cfg.osl, cfg.shared_prefix, tokenizer, cfg.synthetic_seed
            )
    else:
        assert cfg.dataset is not None  # missing() said so otherwise
        loaded = load_sessions(cfg.dataset, cfg.dataset_format, tokenizer.count)
    # synthetic sessions have the turns asked for: the methodology's floor is for recorded ones
    floor = cfg.min_chunk_rounds if not cfg.synthetic or "min_chunk_rounds" in cfg.model_fields_set else 0
    users = virtual_users(loaded.sessions, cfg.num_rounds, floor, cfg.user_order)
    if cfg.max_tokens_cap is not None:
        cap = cfg.max_tokens_cap
        users = [replace(u, turns=tuple(replace(t, max_tokens=min(t.max_tokens, cap)) for t in u.turns)) for u in users]
    if not users:
        need = max(cfg.num_rounds, floor)
        raise DatasetError(
            f"{cfg.dataset}: no session has {need} turns (--num-rounds {cfg.num_rounds}, --min-chunk-rounds "
            f"{floor}); lower them"
        )
    return cfg, loaded, users, tokenizer, floor


def prepare(cfg: ReplayConfig) -> ReplayPlan:
    """Check the flags, read the dataset and cut it into virtual users (no request is sent)."""
    from kvtier.replay.client import event_loop_kind

    if cfg.missing():
        raise ConfigError("\n".join(f"{m}: required" for m in cfg.missing()))
    cfg, loaded, users, tokenizer, floor = load_users(cfg)
    check_engine_logs(cfg.engine_log)
    if cfg.output:  # an unwritable result folder fails now, not after the run
        try:
            Path(cfg.output).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--output: cannot create {cfg.output}: {e.strerror}") from e
    effective = cfg.model_copy(
        update={
            # synthetic sessions have no file format (dataset.format says "synthetic"): the flag stays as given,
            # so the result's config reads back as a ReplayConfig (kvtier report, compare)
            "dataset_format": cfg.dataset_format if cfg.synthetic else loaded.format,
            "tokenizer": cfg.tokenizer if tokenizer.kind == "hf" else tokenizer.kind,
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
    plan.reuse = _reuse(cfg, users, tokenizer, plan.prompt_tokens)
    if cfg.tokenizer == "auto" and tokenizer.kind == "chars":  # asked for nothing, and no tokenizer is installed
        plan.warnings.append(
            warning(
                WarningCode.tokenizer_estimated,
                f"prompt tokens are estimated ({tokenizer.name}): the context checks and the reuse figures are "
                "approximate; pip install 'kvtier[tokenizer]' counts them (or --tokenizer hf:DIR, the served "
                "model's own)",
                tokenizer=tokenizer.name,
            )
        )
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


def _reuse(
    cfg: ReplayConfig, users: list[VirtualUser], tokenizer: Tokenizer, prompt_tokens: dict[str, list[int]]
) -> dict[str, Any]:
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
    out = reuse_opportunity(users, tokenizer.encode, cfg.reuse_block_tokens, bpt, prompt_tokens=prompt_tokens)
    out["kv_model"] = name if spec is not None else None
    return out


MAX_PROBE_BYTES = 1 << 20
"""Most of a /models or warm-up answer read: a model list is a few KB; a hostile server gets no more."""


async def _read_capped(r: Any, what: str) -> bytes:
    body: bytes = await r.content.read(MAX_PROBE_BYTES + 1)
    if len(body) > MAX_PROBE_BYTES:
        raise ConfigError(f"--base-url: {what} answered more than {MAX_PROBE_BYTES} bytes: refused")
    return body


async def _probe(cfg: ReplayConfig) -> dict[str, Any]:
    """The server's identity (``server_identity``), then the throwaway warm-up requests."""
    import aiohttp

    base = (cfg.base_url or "").rstrip("/")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        server = await server_identity(s, base, cfg.model or "")
        for i in range(cfg.warmup):
            warm = {"model": cfg.model, "messages": [{"role": "user", "content": f"warmup {i}"}], "max_tokens": 4}
            try:
                async with s.post(base + "/chat/completions", json=warm) as r:
                    await _read_capped(r, "a warm-up request")
            except (TimeoutError, aiohttp.ClientError, OSError, ConfigError):
                pass
    return server


async def server_identity(s: Any, base: str, model: str) -> dict[str, Any]:
    """The server's identity (GET /models, read with a cap) checked against the flags before any request: the
    server must answer, serve ``model``, and (where it says) its max_model_len is returned under ``max_model_len``
    (kvtier replay and kvtier ladder). ``s``: an aiohttp ClientSession."""
    import aiohttp

    try:
        async with s.get(base + "/models") as r:
            status, body, replica = (
                r.status,
                await _read_capped(r, "GET /models"),
                r.headers.get("x-kvtier-replica"),
            )
        if status == 404 and not base.endswith("/v1"):
            async with s.get(base + "/v1/models") as r2:
                if r2.status == 200:
                    raise ConfigError(
                        f"--base-url: {base} answers GET /models with HTTP 404, but {base}/v1/models answers: "
                        f"the OpenAI API is under /v1 (--base-url {base}/v1)"
                    )
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        if isinstance(getattr(e, "os_error", e), ConnectionRefusedError):
            raise ConfigError(f"--base-url: {base}: connection refused: is the server running?") from None
        raise ConfigError(f"--base-url: {base} does not answer GET /models ({type(e).__name__})") from None
    if status != 200:
        raise ConfigError(
            f"--base-url: GET {base}/models answered HTTP {status}: {body[:200].decode(errors='replace')}"
        )
    try:
        models = json.loads(body)
    except ValueError:
        raise ConfigError(f"--base-url: GET {base}/models did not answer JSON") from None
    entries = models.get("data") if isinstance(models, dict) else None
    served = (
        [m for m in entries if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if isinstance(entries, list)
        else []
    )
    mine = [m for m in served if m["id"] == model]
    if served and not mine:
        raise ConfigError(
            f"--model {model!r} is not served by {base} (it serves: {', '.join(m['id'] for m in served)})"
        )
    mml = mine[0].get("max_model_len") if mine else None
    server = {
        "models": models,
        "replica": replica,
        "max_model_len": mml if isinstance(mml, int) and not isinstance(mml, bool) and mml > 0 else None,
    }
    return server


def fit_check(plan: ReplayPlan, max_model_len: int | None) -> tuple[list[VirtualUser], list[ResultWarning], int]:
    """Prompts (prompt + max_tokens, counted with the replay's tokenizer) that cannot fit the server's
    max_model_len: counted and warned of; with --skip-too-long each user stops before its first such
    turn (every later turn carries it). Returns the users to run, the warnings and the turns skipped."""
    cfg = plan.config
    if max_model_len is None:
        return plan.users, [], 0
    too_long, largest, total = 0, 0, 0
    keep: list[VirtualUser] = []
    skipped = 0
    for u in plan.users:
        sizes = plan.prompt_tokens.get(u.user_id, [])
        first_bad = None
        for i, (turn, n) in enumerate(zip(u.turns, sizes, strict=False)):
            total += 1
            need = n + turn.max_tokens
            if need > max_model_len:
                too_long += 1
                largest = max(largest, need)
                if first_bad is None:
                    first_bad = i
        if cfg.skip_too_long and first_bad is not None:
            skipped += len(u.turns) - first_bad
            if first_bad:
                keep.append(dataclasses.replace(u, turns=u.turns[:first_bad]))
        else:
            keep.append(u)
    out: list[ResultWarning] = []
    if too_long:
        what = (
            f"not sent (--skip-too-long: {skipped} turns skipped, each user stopping at its first)"
            if cfg.skip_too_long
            else "sent anyway, so the server's answer is recorded (--skip-too-long skips them)"
        )
        out.append(
            warning(
                WarningCode.prompts_exceed_context,
                f"{too_long} of {total} prompts cannot fit the server's max_model_len {max_model_len} (prompt + "
                f"max_tokens counted with the {plan.tokenizer.name} tokenizer; largest {largest}): {what}",
                prompts=too_long,
                of=total,
                largest_tokens=largest,
                max_model_len=max_model_len,
                skipped_turns=skipped,
            )
        )
    return keep, out, skipped


@dataclass
class _Stop:
    """Which signal ended the run (None: it ran to the end)."""

    event: asyncio.Event
    code: StopCode | None = None

    def by(self, code: StopCode) -> None:
        if self.code is None:
            self.code = code
        self.event.set()


async def _replay(plan: ReplayPlan, handle_signals: bool, clock: Clock) -> tuple[ReplayResult, list[ReplayRecord]]:
    from kvtier.replay.client import ClientConfig, run_users
    from kvtier.replay.progress import ReplayProgress, Tally, snapshot
    from kvtier.replay.scrape import Scraper

    cfg = plan.config
    started = utc_now()
    server = await _probe(cfg)
    users, fit_warnings, skipped = fit_check(plan, server["max_model_len"])
    urls = (cfg.metrics_url or [cfg.server_root]) if plan.scrape else []
    control = None
    if plan.dataset.hit_plan is not None:  # prime the server and check its rate before any request is measured
        from kvtier.replay.hitrate import prime_and_check

        control = await prime_and_check(cfg, plan.dataset.hit_plan, urls)
        if not control.check_ok:
            users = []  # nothing is measured: the result says why (stop code hit-rate-off-target)
    if not users and control is None:
        raise DatasetError(
            f"{cfg.dataset}: --skip-too-long: every virtual user's first prompt exceeds the server's max_model_len "
            f"{server['max_model_len']}: nothing to send"
        )
    if cfg.progress != "none":
        for w in fit_warnings:
            print(f"kvtier: warning: {w.message}", file=sys.stderr)
    stop = _Stop(asyncio.Event())
    loop = asyncio.get_running_loop()
    if handle_signals and threading.current_thread() is threading.main_thread():
        loop.add_signal_handler(signal.SIGINT, stop.by, StopCode.interrupted)
        loop.add_signal_handler(signal.SIGTERM, stop.by, StopCode.terminated)
    scrapers = [Scraper(u, cfg.scrape_interval, cfg.rate_window) for u in urls]
    scrape_stop = asyncio.Event()
    ready = [asyncio.Event() for _ in scrapers]
    scrape_tasks = [asyncio.create_task(sc.run(scrape_stop, r)) for sc, r in zip(scrapers, ready, strict=True)]
    # the counters' first sample is taken before the first request: the run's deltas hold all of its work
    await asyncio.gather(*(r.wait() for r in ready))
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
        ignore_eos=cfg.ignore_eos,
    )
    records: list[ReplayRecord] = []  # filled as requests finish: kept whatever happens below
    achieved, failure = 0, ""
    gauge: dict[str, int] = {"in_flight": 0}
    flying: dict[int, int] = {}  # the requests in flight: when each began (ns)
    bounds = Bounds(cfg.max_requests, cfg.duration, cfg.read_timeout)
    in_dataset = sum(len(u.turns) for u in users)
    total = min(in_dataset, cfg.max_requests) if cfg.max_requests else in_dataset

    async def report_progress(bar: ReplayProgress) -> None:
        tally = Tally([(u.user_id, len(u.turns)) for u in users])
        while not scrape_stop.is_set():
            try:
                await asyncio.wait_for(scrape_stop.wait(), cfg.progress_interval)
            except TimeoutError:
                rates = scrapers[0].hit_rates_so_far() if scrapers else {}
                now = clock.now_ns()
                ages = [(now - t) / 1e9 for t in list(flying.values())]
                snap = snapshot(records, total, cfg.num_rounds, len(users), gauge["in_flight"], rates, tally, ages)
                bar.tick((clock.now_ns() - t0) / 1e9, snap, in_dataset, cfg.duration)

    hardware = HardwareSampler()
    hardware.start()
    with ReplayProgress(cfg.progress) as bar:
        progress_task = asyncio.create_task(report_progress(bar))
        try:
            ran = await run_users(client, users, stop.event, clock, records, gauge, bounds, flying)
            achieved = ran.achieved_concurrency
        except Exception as e:  # noqa: BLE001 - a bug must not lose the records: they are written, marked partial
            failure = f"internal error in the client: {type(e).__name__}: {e}"
        finally:
            scrape_stop.set()
            await asyncio.gather(*scrape_tasks, progress_task)
            if handle_signals and threading.current_thread() is threading.main_thread():
                loop.remove_signal_handler(signal.SIGINT)
                loop.remove_signal_handler(signal.SIGTERM)
    wall = (clock.now_ns() - t0) / 1e9
    hw = hardware.stop()
    joined = None
    if cfg.engine_log:
        from kvtier.replay import engine_join

        wait = 0.0 if stop.code is not None else cfg.engine_log_wait  # stopped: the records are as they are
        log = await asyncio.to_thread(engine_join.collect, records, cfg.engine_log, wait)
        joined = engine_join.join(records, log)
    result = build_result(
        plan,
        RunFacts(
            started, server, len(users), fit_warnings, achieved, failure, stop.code, bounds, wall, hw, joined, control
        ),
        records,
        [sc.summary() for sc in scrapers],
    )
    return result, records


def execute(
    plan: ReplayPlan, handle_signals: bool = True, clock: Clock = MONOTONIC
) -> tuple[ReplayResult, list[ReplayRecord]]:
    """Run the plan on its event loop; returns the result and the per-request records."""
    from kvtier.replay.client import loop_factory

    old = None
    if handle_signals and threading.current_thread() is threading.main_thread():
        # not the default handler: asyncio.Runner then leaves SIGINT to the loop's handler (_replay's), which stops the
        # run and keeps its records; with the default one installed (a script), the Runner cancelled the run and the
        # partial result was never written
        old = signal.signal(signal.SIGINT, _interrupt)
    try:
        with asyncio.Runner(loop_factory=loop_factory(plan.config.event_loop)) as runner:
            return runner.run(_replay(plan, handle_signals, clock))
    finally:
        if old is not None:
            signal.signal(signal.SIGINT, old)


def _interrupt(signum: int, frame: object) -> None:
    """SIGINT before the replay's own handler is installed (set-up): as Python's default, nothing to keep yet."""
    raise KeyboardInterrupt


def write_outputs(result: ReplayResult, records: list[ReplayRecord], folder: str | Path) -> Path:
    """requests.jsonl (one record a line) and summary.json in ``folder``; returns summary.json's path."""
    out = Path(folder)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--output: cannot write {out}: {e.strerror}") from e
    with atomic_file(out / "requests.jsonl") as f:  # never through a file or link planted at the name
        for r in records:
            f.write(json.dumps(r) + "\n")
    return write_json(result, out / "summary.json")


__all__ = ["ReplayPlan", "prepare", "execute", "write_outputs"]
