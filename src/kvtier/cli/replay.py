"""``kvtier replay``: replay recorded multi-turn sessions against an OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.errors import ConfigError, DatasetError

FIXED = ("model", "concurrency", "num_rounds", "dataset", "dataset_format", "gap_scale", "history", "user_order")


def add_replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("replay", help="replay recorded multi-turn sessions against an OpenAI-compatible server")
    p.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model")
    p.add_argument("--dataset", help="file or folder of sessions")
    p.add_argument("--dataset-format", default="auto",
                   choices=["auto", "agent-trace", "tau2", "sharegpt", "agentic-traces", "jsonl"])
    p.add_argument("--tokenizer", choices=["auto", "tiktoken", "chars"], default="auto",
                   help="counts recorded output text into max_tokens where a dataset has no counts")
    p.add_argument("--agentic-tools", action="store_true",
                   help="gpt-oss mode: send a tools schema naming every function the traces call")
    p.add_argument("--num-rounds", type=int, default=5, help="turns per virtual user (5)")
    p.add_argument("--min-chunk-rounds", type=int, default=0, help="sessions shorter than this give no user")
    p.add_argument("--user-order", choices=["interleave", "session"], default="interleave",
                   help="dispatch order of virtual users: round-robin over sessions (default) or session by session")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output", help="result folder (requests.jsonl, summary.json)")
    p.add_argument("--gap-scale", type=float, default=1.0, help="scale of recorded think/tool gaps (0 = none)")
    p.add_argument("--request-timeout", type=float, default=64800.0, help="seconds")
    p.add_argument("--warmup", type=int, default=4, help="short throwaway requests first (excluded)")
    p.add_argument("--history", choices=["recorded", "runtime"], default="recorded")
    p.add_argument("--event-loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                   help="client event loop: uvloop when installed (auto), or the stock asyncio loop")
    p.add_argument("--cache-salt", help="sent as cache_salt so runs do not share cache entries")
    p.add_argument("--scrape-interval", type=float, default=15.0, help="seconds between /metrics scrapes")
    p.add_argument("--rate-window", type=float, default=300.0, help="seconds of the rolling hit-rate window")
    p.add_argument("--metrics-url", action="append", help="server root(s) to scrape (default: the base URL's)")
    p.add_argument("compare", nargs="*", help="'compare A.json B.json': compare two summaries")
    p.set_defaults(func=run_replay)


def run_replay(a: argparse.Namespace) -> int:
    if a.compare:
        if a.compare[0] != "compare" or len(a.compare) != 3:
            raise ConfigError("usage: kvtier replay compare A/summary.json B/summary.json")
        return compare(a.compare[1], a.compare[2])
    for flag in ("base_url", "model", "dataset", "output"):
        if not getattr(a, flag):
            raise ConfigError(f"--{flag.replace('_', '-')}: required")
    if a.concurrency < 1 or a.num_rounds < 1:
        raise ConfigError("--concurrency and --num-rounds must be >= 1")
    from kvtier.replay.datasets import load_sessions, set_tokenizer, tool_schemas, virtual_users  # noqa: PLC0415

    tokenizer = set_tokenizer(a.tokenizer)
    sessions, warnings, fmt = load_sessions(a.dataset, a.dataset_format)
    a.tools = tool_schemas(sessions) if a.agentic_tools else None
    a.tokenizer_used = tokenizer
    users = virtual_users(sessions, a.num_rounds, a.min_chunk_rounds, a.user_order)
    print(f"kvtier replay: {len(sessions)} sessions in {a.dataset} ({fmt}) give {len(users)} virtual users of "
          f"{a.num_rounds} turns", file=sys.stderr)
    for w in warnings:
        print(f"kvtier: warning: {w}", file=sys.stderr)
    if not users:
        raise DatasetError(f"{a.dataset}: no session has {a.num_rounds} turns; lower --num-rounds")
    if a.concurrency > len(users):
        msg = (f"--concurrency {a.concurrency} exceeds the {len(users)} virtual users this dataset yields at "
               f"--num-rounds {a.num_rounds}: achieved concurrency is capped at {len(users)}")
        print(f"kvtier: WARNING: {msg}", file=sys.stderr)
        warnings.append(msg)
    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    from kvtier.replay.client import event_loop_kind, loop_factory  # noqa: PLC0415

    a.event_loop_used = event_loop_kind(a.event_loop)
    with asyncio.Runner(loop_factory=loop_factory(a.event_loop_used)) as runner:
        result = runner.run(_run(a, users, fmt, warnings))
    with (out / "requests.jsonl").open("w") as f:
        for r in result.pop("records"):
            f.write(json.dumps(r) + "\n")
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    print(f"replay: {s['requests_ok']}/{s['requests_total']} requests ok, TTFT p50 {s['ttft_s']['p50']} s, "
          f"degradation median {s['ttft_degradation']['median_pct']} %, sessions {s['sessions']}; {out}/summary.json")
    return 0 if s["requests_ok"] > 0 else 1


async def _run(a: argparse.Namespace, users: list[Any], fmt: str, warnings: list[str]) -> dict[str, Any]:
    import aiohttp  # noqa: PLC0415

    from kvtier.replay.client import ClientConfig, run_users  # noqa: PLC0415
    from kvtier.replay.scrape import Scraper  # noqa: PLC0415
    from kvtier.replay.summary import summarize  # noqa: PLC0415

    base = a.base_url.rstrip("/")
    root = base[:-3] if base.endswith("/v1") else base
    cfg = ClientConfig(base, a.model, a.concurrency, a.gap_scale, a.request_timeout, a.history, a.cache_salt,
                       a.tools or None)
    server: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        try:
            async with s.get(base + "/models") as r:
                server = {"models": await r.json(), "replica": r.headers.get("x-kvtier-replica")}
        except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError) as e:
            raise ConfigError(f"--base-url: {base} does not answer GET /models ({type(e).__name__})") from None
        for i in range(a.warmup):
            body = {"model": a.model, "messages": [{"role": "user", "content": f"warmup {i}"}], "max_tokens": 4}
            try:
                async with s.post(base + "/chat/completions", json=body) as r:
                    await r.read()
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    scrapers = [Scraper(u, a.scrape_interval, a.rate_window) for u in (a.metrics_url or [root])]
    scrape_stop = asyncio.Event()
    scrape_tasks = [asyncio.create_task(sc.run(scrape_stop)) for sc in scrapers]
    t0 = time.perf_counter()
    started = dt.datetime.now(dt.timezone.utc)
    records = await run_users(cfg, users, stop)
    wall = time.perf_counter() - t0
    scrape_stop.set()
    await asyncio.gather(*scrape_tasks)
    achieved = records.pop()["_achieved_concurrency"]
    summary = summarize(records, len(users), a.num_rounds, wall)
    if stop.is_set():
        warnings.append("interrupted: the result is partial")
    if achieved < a.concurrency:
        warnings.append(f"achieved concurrency {achieved} < requested {a.concurrency}")
    return {
        "kvtier_version": __version__, "benchmark": "kvtier replay", "status": "partial" if stop.is_set() else "complete",
        "started_at": started.isoformat(timespec="seconds"), "wall_s": round(wall, 3),
        "config": {"base_url": base, "model": a.model, "dataset": str(a.dataset), "dataset_format": fmt,
                   "num_rounds": a.num_rounds, "concurrency": a.concurrency, "gap_scale": a.gap_scale,
                   "user_order": a.user_order, "event_loop": a.event_loop_used,
                   "history": a.history, "cache_salt": a.cache_salt, "warmup": a.warmup,
                   "tokenizer": a.tokenizer_used, "agentic_tools": [t["function"]["name"] for t in a.tools or []],
                   "scrape_interval_s": a.scrape_interval, "rate_window_s": a.rate_window},
        "concurrency": {"requested": a.concurrency, "achieved": achieved, "virtual_users": len(users)},
        "server": server, "summary": summary, "server_metrics": [sc.summary() for sc in scrapers],
        "warnings": warnings, "records": records,
    }


def compare(pa: str, pb: str) -> int:
    def load(p: str) -> dict[str, Any]:
        try:
            return json.loads(Path(p).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DatasetError(f"{p}: cannot read a replay summary ({e})") from None

    A, B = load(pa), load(pb)
    problems = [f"{k}: {A['config'].get(k)!r} vs {B['config'].get(k)!r}" for k in FIXED
                if A["config"].get(k) != B["config"].get(k)]
    sa, sb = A["summary"]["sessions"], B["summary"]["sessions"]
    if sa["complete"] != sb["complete"] or A["concurrency"]["achieved"] != B["concurrency"]["achieved"]:
        problems.append(f"achieved sessions/concurrency differ: {sa} / {A['concurrency']['achieved']} vs "
                        f"{sb} / {B['concurrency']['achieved']}")
    rows = [("TTFT p50 s", "ttft_s", "p50"), ("TTFT p95 s", "ttft_s", "p95"),
            ("degradation median %", "ttft_degradation", "median_pct"), ("TPOT mean s", "tpot_s_mean", None)]
    for label, k, sub in rows:
        va = A["summary"][k] if sub is None else A["summary"][k][sub]
        vb = B["summary"][k] if sub is None else B["summary"][k][sub]
        print(f"{label:24} {va!s:>12} {vb!s:>12}")
    if problems:
        for p in problems:
            print(f"NOT COMPARABLE: {p}", file=sys.stderr)
        return 2
    return 0
