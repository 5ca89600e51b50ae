"""``kvtier bench``: the MLPerf Storage v3.0 KV Cache flags, verbatim, plus kvtier's own."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kvtier.config.bench import BenchConfig, build_bench_config
from kvtier.errors import ConfigError

S = argparse.SUPPRESS


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="multi-tier KV cache storage benchmark (MLPerf Storage KV Cache flags)",
                       description="Simulated users write and read KV-cache-sized entries through a waterfall "
                                   "LRU over GPU (if present), CPU RAM and files on storage.",
                       argument_default=S)
    a = p.add_argument
    a("--model", help="model from the catalog or --config model_configs (default llama3.1-8b)")
    a("--num-users", "--num_users", dest="num_users", type=int, help="simulated users (default 100)")
    a("--duration", type=float, help="seconds of load (default 60)")
    a("--gpu-mem-gb", "--gpu_mem_gb", dest="gpu_mem_gb", type=float,
      help="GPU tier per GPU, GB (default 16; without a CUDA device the tier is off, with a warning)")
    a("--num-gpus", dest="num_gpus", type=int, help="GPUs whose memory forms the GPU tier (default 1)")
    a("--tensor-parallel", dest="tensor_parallel", type=int,
      help="tensor-parallel degree: each rank stores 1/TP of an entry (default 1)")
    a("--cpu-mem-gb", "--cpu_mem_gb", dest="cpu_mem_gb", type=float, help="CPU RAM tier, GB (default 32)")
    a("--cache-dir", dest="cache_dir", help="directory of the storage tier (default: a new temporary directory)")
    a("--generation-mode", dest="generation_mode", choices=["none", "fast", "realistic"],
      help="simulated GPU time per generated token: 0 / 2 / 30 ms (default realistic)")
    a("--performance-profile", dest="performance_profile", choices=["latency", "throughput"])
    a("--disable-multi-turn", dest="disable_multi_turn", action="store_true")
    a("--disable-prefix-caching", dest="disable_prefix_caching", action="store_true")
    a("--enable-rag", dest="enable_rag", action="store_true")
    a("--rag-num-docs", dest="rag_num_docs", type=int)
    a("--rag-top-k", dest="rag_top_k", type=int)
    a("--enable-autoscaling", dest="enable_autoscaling", action="store_true")
    a("--autoscaler-mode", dest="autoscaler_mode", choices=["qos", "capacity"])
    a("--target-saturation", dest="target_saturation", type=float)
    a("--use-burst-trace", dest="use_burst_trace", action="store_true")
    a("--burst-trace-path", dest="burst_trace_path")
    a("--validation-trace", dest="validation_trace")
    a("--dataset-path", dest="dataset_path")
    a("--max-conversations", dest="max_conversations", type=int)
    a("--output", help="result JSON path (default ./kvtier_bench_<timestamp>.json)")
    a("--seed", type=int, help="seed of users, requests and data (default: random, recorded in the result)")
    a("--max-concurrent-allocs", dest="max_concurrent_allocs", type=int,
      help="I/O requests in flight at once (0 = min(users, 32))")
    a("--request-rate", dest="request_rate", type=float, help="global cap on submitted requests per second (0 = none)")
    a("--max-requests", dest="max_requests", type=int, help="stop after this many completed requests (0 = none)")
    a("--xlsx-output", dest="xlsx_output", help="also write the result as XLSX")
    a("--config", help="YAML in the reference config.yaml layout, merged over the defaults")
    a("--storage-capacity-gb", dest="storage_capacity_gb", type=float,
      help="storage tier capacity, GB (0 = 90%% of the free space detected)")
    a("--precondition", action="store_true")
    a("--precondition-size-gb", dest="precondition_size_gb", type=float)
    a("--precondition-threads", dest="precondition_threads", type=int)
    a("--trace-speedup", dest="trace_speedup", type=float)
    a("--replay-cycles", dest="replay_cycles", type=int)
    a("--prefill-only", dest="prefill_only", action="store_true")
    a("--decode-only", dest="decode_only", action="store_true")
    a("--io-trace-log", dest="io_trace_log")
    a("--enable-latency-tracing", dest="enable_latency_tracing", action="store_true",
      help="accepted for compatibility: kvtier always records the four latency layers")
    a("--log-level", dest="log_level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    g = p.add_argument_group("kvtier additions")
    g.add_argument("--direct-io", dest="direct_io", choices=["auto", "on", "off"],
                   help="O_DIRECT for the storage tier: auto (use where supported), on (error if not), off")
    g.add_argument("--promotion", choices=["none", "on-read"], help="move hits back to the fastest tier")
    g.add_argument("--keep-cache", dest="keep_cache", action="store_true", help="leave entry files at exit")
    g.add_argument("--io-chunk-mb", dest="io_chunk_mb", type=int, help="bytes per I/O call and per-worker buffer, MiB (64)")
    g.add_argument("--noise-mb", dest="noise_mb", type=int, help="static noise buffer, MiB (256)")
    g.add_argument("--progress", choices=["auto", "live", "plain", "none"])
    g.add_argument("--kv-layout", dest="kv_layout", choices=["entry", "chunked"],
                   help="entry: one entry per turn (reference); chunked: prefix-chained token chunks (vLLM/LMCache)")
    g.add_argument("--kv-chunk-tokens", dest="kv_chunk_tokens", type=int, help="tokens per chunk (256)")
    g.add_argument("--trace-path", dest="trace_path",
                   help="replay a request trace: BurstGPT or Azure CSV, Mooncake JSONL (file or directory)")
    g.add_argument("--trace-format", dest="trace_format", choices=["auto", "burstgpt", "azure", "mooncake"])
    g.add_argument("--progress-interval", dest="progress_interval", type=float, help="seconds between updates (5)")
    p.set_defaults(func=run_bench)


def _check_output_path(flag: str, path: str | None) -> None:
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag}: directory {parent} is not writable")


def run_bench(args: argparse.Namespace) -> int:
    from kvtier.bench.progress import Progress  # noqa: PLC0415
    from kvtier.bench.runner import BenchRunner  # noqa: PLC0415
    from kvtier.bench.setup import build_components  # noqa: PLC0415
    from kvtier.report.result import build_result  # noqa: PLC0415
    from kvtier.report.writers import write_json, write_xlsx  # noqa: PLC0415
    from kvtier.telemetry.recorder import Recorder  # noqa: PLC0415

    values: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    cfg: BenchConfig = build_bench_config(values)
    started = dt.datetime.now(dt.timezone.utc)
    output = cfg.output or f"kvtier_bench_{started.strftime('%Y%m%d-%H%M%S')}.json"
    _check_output_path("--output", output)
    _check_output_path("--xlsx-output", cfg.xlsx_output)

    rec = Recorder()
    comp = build_components(cfg, rec)
    try:
        runner = BenchRunner(comp, rec)
        signals = {signal.SIGINT: "interrupted (SIGINT)", signal.SIGTERM: "terminated (SIGTERM)"}
        previous = {s: signal.signal(s, lambda n, _f: runner.request_stop(signals[n], partial=True)) for s in signals}
        try:
            print(f"kvtier bench: {cfg.model} ({comp.model.kv_bytes_per_token} B/token), {cfg.num_users} users, "
                  f"{cfg.duration:g} s, tiers {' > '.join(comp.store.tier_names)}, "
                  f"direct I/O {'on' if comp.file_tier and comp.file_tier.direct else 'off'}, "
                  f"{comp.io_slots} I/O slots, seed {comp.seed}", file=sys.stderr)
            for w in comp.warnings:
                print(f"kvtier: warning: {w}", file=sys.stderr)
            with Progress(cfg.progress) as prog:
                outcome = runner.run(on_tick=prog.tick, tick_s=cfg.progress_interval)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
        result = build_result(comp, rec, outcome, started, [])
    finally:
        comp.close()
    path = write_json(result, output)
    if cfg.xlsx_output:
        write_xlsx(result, cfg.xlsx_output)
    print_summary(result, path)
    if result["status"] == "complete":
        return 0
    if "SIGINT" in result["stop_reason"]:
        return 130
    if "SIGTERM" in result["stop_reason"]:
        return 143
    return 5 if "ENOSPC" in result["stop_reason"] else 1


def print_summary(result: dict[str, Any], path: Path) -> None:
    from rich.console import Console  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415

    s = result["summary"]
    cs = s["cache_stats"]
    t = Table(title=f"kvtier bench — {result['model']['key']} — {result['status']}", show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")

    def fmt(v: Any, unit: str = "") -> str:
        return "—" if v is None else (f"{v:,.2f}{unit}" if isinstance(v, float) else f"{v:,}{unit}")

    rows = [
        ("requests completed / failed", f"{result['requests_completed']:,} / {result['requests_failed']:,}"),
        ("throughput (generated tokens/s)", fmt(s["avg_throughput_tokens_per_sec"])),
        ("storage throughput (tokens/s)", fmt(s["storage_throughput_tokens_per_sec"])),
        ("read / write GB/s (all tiers)", f"{s['storage_read_bytes_per_sec'] / 1e9:.3f} / "
                                          f"{s['storage_write_bytes_per_sec'] / 1e9:.3f}"),
        ("end-to-end latency p50 / p95 ms", f"{fmt(s['end_to_end_latency_ms']['p50'])} / "
                                            f"{fmt(s['end_to_end_latency_ms']['p95'])}"),
        ("storage I/O latency p95 ms", fmt(s["storage_io_latency_ms"]["p95"])),
        ("cache hit rate", fmt(cs["cache_hit_rate"])),
        ("storage write device p95 ms", fmt(cs["storage_write_device_p95_ms"])),
        ("storage read device p95 ms", fmt(cs["storage_read_device_p95_ms"])),
        ("demotions / evictions", f"{cs['demotions']:,} / {cs['evictions']:,}"),
        ("host time fraction", fmt(s["host_time_fraction"])),
        ("peak RSS GiB (bound)", f"{result['memory']['peak_rss_bytes'] / 2**30:.2f} "
                                 f"({result['memory']['bound_bytes'] / 2**30:.2f})"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    c = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    c.print(t)
    for w in result["warnings"]:
        c.print(f"[yellow]warning:[/yellow] {w}", highlight=False)
    c.print(f"result: {path}", highlight=False)
