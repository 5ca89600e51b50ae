"""``kvtier bench``: the MLPerf Storage v3.0 KV Cache flags, verbatim, plus kvtier's own.

The flags are BenchConfig's fields (config/bench.py); this module parses them, calls
``kvtier.bench.run``, prints, and maps the result's status to an exit code.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.bench import BenchConfig

if TYPE_CHECKING:
    from kvtier.bench.plan import Plan
    from kvtier.bench.setup import Components
    from kvtier.mpi import RunEnvironment
    from kvtier.results.bench import BenchResult


def add_bench_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser(
        "bench",
        help="multi-tier KV cache storage benchmark (MLPerf Storage KV Cache flags)",
        description="Simulated users write and read KV-cache-sized entries through a waterfall "
        "LRU over GPU (if present), CPU RAM and files on storage.",
    )
    add_config_arguments(p, BenchConfig)
    p.set_defaults(func=run_bench)


class _Lowercase(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"kvtier: {record.levelname.lower()}: {record.getMessage()}"


def configure_logging(level: str) -> logging.Logger:
    """kvtier's messages (logger ``kvtier``) on stderr from ``level`` up (--log-level): DEBUG adds
    the set-up steps, WARNING and above keep the run's warnings, ERROR silences them."""
    logger = logging.getLogger("kvtier")
    logger.setLevel(level)
    if not logger.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(_Lowercase())
        logger.addHandler(h)
    return logger


def run_bench(args: argparse.Namespace) -> int:
    from kvtier.bench import run
    from kvtier.bench.progress import Progress
    from kvtier.mpi import RunEnvironment
    from kvtier.results.bench import BenchResult
    from kvtier.results.envelope import exit_code, utc_now

    cfg = config_from_args(args, BenchConfig)
    log = configure_logging(cfg.log_level)
    env = RunEnvironment.detect(cfg.mpi_timeout)  # under mpirun with >= 2 ranks: one client of many
    default_output = f"kvtier_bench_{utc_now().strftime('%Y%m%d-%H%M%S')}.json"
    if not env.distributed and cfg.num_clients > 1:
        return launch_clients(cfg, cfg.output or default_output)
    if env.distributed:  # without --output, every rank takes rank 0's default name
        return run_bench_rank(cfg, env, log, default_output)
    if cfg.output is None:
        cfg = cfg.model_copy(update={"output": default_output})

    def on_start(plan: Plan, comp: Components) -> None:
        print(
            f"kvtier bench: {cfg.model} ({plan.model.kv_bytes_per_token_per_rank(cfg.tensor_parallel)} B/token"
            f"{' per rank' if cfg.tensor_parallel > 1 else ''}), {cfg.num_users} users, {cfg.duration:g} s, "
            f"tiers {' > '.join(comp.store.tier_names)}, direct I/O {'on' if comp.file_tier.direct else 'off'}, "
            f"{plan.io_slots} I/O slots, seed {plan.seed}",
            file=sys.stderr,
        )
        if not comp.trace_mode:  # what the run may write to the disk, and where, before it does
            print(
                f"kvtier bench: the file tier may write up to {comp.file_tier.capacity_bytes / 2**30:.1f} GiB under "
                f"{comp.cache_dir} (--storage-capacity-gb; removed at the end)",
                file=sys.stderr,
            )
        for w in [*plan.warnings, *comp.warnings]:
            log.warning(w.message)

    with Progress(cfg.progress) as prog:
        result = run(cfg, env=env, on_start=on_start, on_tick=prog.tick, handle_signals=True)
    assert isinstance(result, BenchResult)  # a local run's
    print_summary(result, Path(cfg.output or ""))
    return exit_code(result.status, result.stop_reason.code)


def launch_clients(cfg: BenchConfig, output: str) -> int:
    """``--num-clients N``: this same run as N MPI ranks on this host (mpirun from Open MPI), each rank's command line
    re-made from the config (``config_argv``: one client each, the aggregate at ``output``). The exit status is the
    aggregate's, read back typed (mpirun --enable-recovery reports 0 whatever the ranks did)."""
    import os
    import time

    from kvtier.child import start
    from kvtier.config.base import config_argv
    from kvtier.errors import KvtierError
    from kvtier.mpi import mpirun_argv, require_mpi
    from kvtier.results import load
    from kvtier.results.aggregate import BenchAggregate
    from kvtier.results.envelope import exit_code

    n = cfg.num_clients
    rank = cfg.model_copy(update={"num_clients": 1, "output": output})
    cmd = mpirun_argv(["kvtier", "bench", *config_argv(rank)], n, mpirun=require_mpi(f"--num-clients {n}"))
    print(f"kvtier bench: {n} clients: {' '.join(cmd)}", file=sys.stderr)
    t0 = time.time()
    # in the terminal's group: Ctrl+C reaches the ranks, which write their partial results before the aggregate
    rc = start(cmd, name="mpirun", stdout=None, group=False).finish(cfg.mpi_timeout + 30)
    try:
        if os.path.getmtime(output) < t0:
            return rc or 1  # no aggregate from this run
        agg = load(output)
    except (OSError, KvtierError):
        return rc or 1
    if not isinstance(agg, BenchAggregate):
        return rc or 1
    return exit_code(agg.status, agg.stop_reason.code)


def run_bench_rank(cfg: BenchConfig, rank: RunEnvironment, log: logging.Logger, default_output: str) -> int:
    """One rank of an MPI run (bench/mpi.py); rank 0 prints the aggregate."""
    from kvtier.bench import run
    from kvtier.results.aggregate import BenchAggregate
    from kvtier.results.envelope import exit_code
    from kvtier.results.outcome import closing_lines

    if rank.rank == 0:
        print(
            f"kvtier bench: rank 0 of {rank.size} ({rank.host}); per-rank results beside "
            f"{cfg.output or default_output}",
            file=sys.stderr,
        )
    from kvtier.errors import KvtierError, exit_code_for

    try:
        out = run(cfg, env=rank, default_output=default_output, handle_signals=True)
    except KvtierError as e:
        if not rank.lost:
            raise
        for line in str(e).splitlines():
            print(f"kvtier: error: {line}", file=sys.stderr)
        return rank.exit(exit_code_for(e))
    if isinstance(out, BenchAggregate):
        t = out.totals
        lat = out.latency
        print(
            f"kvtier bench (MPI, {out.ranks_reported}/{out.ranks_launched} ranks, {out.status.value}): "
            f"{t.requests_completed:,} requests, read {t.storage_read_bytes_per_sec / 1e9:.3f} GB/s, "
            f"write {t.storage_write_bytes_per_sec / 1e9:.3f} GB/s; end-to-end p95 "
            f"{lat.end_to_end_latency_ms.get('p95')} ms over {lat.samples:,} samples pooled; "
            f"start skew {out.skew.start_s:.3f} s; result: {cfg.output or default_output}"
        )
        for w in out.warnings:
            log.warning(w.message)
        for line in closing_lines(out.status, out.stop_reason, t.failures, t.requests_completed):
            print(line)
    return rank.exit(exit_code(out.status, out.stop_reason.code))


VIRTUAL_DISK = re.compile(r"^(x?vd[a-z]+|nbd\d+)")
"""Block devices of a hypervisor (virtio, Xen) or the network: their latency is the host's, not a drive's."""


def health_lines(result: BenchResult) -> list[str]:
    """The storage-health verdict in words: each criterion with its target and what was measured, and, when the
    latency criteria fail on a virtual disk, why that is expected there."""
    h = result.summary.cache_stats.storage_health
    if h.overall_status == "NOT-APPLICABLE":
        return [f"storage health ({h.profile} profile): not applicable: {h.reason}"]
    met = sum(c.passed for c in h.criteria)
    out = [f"storage health ({h.profile} profile): {h.overall_status}, {met} of {len(h.criteria)} criteria met"]
    for c in h.criteria:
        actual = f"{c.actual:,.2f} {c.unit}" if c.unit != "ratio" else f"{c.actual:.2f}"
        out.append(f"  {'pass' if c.passed else 'FAIL'}  {c.name}: measured {actual}")
    latency_failed = any(not c.passed and "P95" in c.name and "Storage" in c.name for c in h.criteria)
    disks = [d for d in (result.device.devices if result.device else []) if VIRTUAL_DISK.match(d)]
    if latency_failed and disks:
        out.append(
            f"  the storage tier is on {', '.join(disks)}, a virtual disk: its latency is the hypervisor's and "
            "its neighbours', and the latency criteria are a local NVMe drive's; run on the device under "
            "test (--cache-dir on it) to judge a drive"
        )
    return out


def workload_line(result: BenchResult) -> str:
    """Where the run's requests came from, in words: the trace or dataset by name, or the synthetic users."""
    w = result.workload_source
    if w.kind == "trace":
        names = ", ".join(Path(f).name for f in w.files[:3]) + (f" (+{len(w.files) - 3})" if len(w.files) > 3 else "")
        return f"{w.format} trace {names}: {w.requests:,} requests" + (
            f", {w.skipped_rows:,} rows skipped" if w.skipped_rows else ""
        )
    if w.kind == "dataset":
        return f"{w.format} dataset {Path(w.path).name}: {w.conversations:,} conversations, {w.turns:,} turns"
    if w.kind == "io-trace":
        return f"I/O trace {Path(w.path).name}: {w.rows:,} rows"
    return f"synthetic users ({', '.join(w.profiles)})"


def print_summary(result: BenchResult, path: Path) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from kvtier.results.outcome import closing_lines

    s = result.summary
    cs = s.cache_stats
    t = Table(title=Text(f"kvtier bench — {result.model.key} — {result.status.value}"), show_header=True)
    t.add_column("metric")
    t.add_column("value", justify="right")

    def fmt(v: float | int | None, unit: str = "") -> str:
        return "—" if v is None else (f"{v:,.2f}{unit}" if isinstance(v, float) else f"{v:,}{unit}")

    health = cs.storage_health
    rows = [
        ("workload", workload_line(result)),
        ("requests completed / failed", f"{result.requests_completed:,} / {result.requests_failed:,}"),
        *(
            [
                (
                    "arrival, workers, allocation bound",
                    f"{result.load.arrival}, {result.load.workers:,}, {result.load.alloc_bound} "
                    f"({result.load.max_concurrent_allocs or 'none'})",
                ),
                (
                    "queue wait p95 ms, requests dropped",
                    f"{fmt(s.queue_wait_ms.p95)}, {result.load.requests_dropped:,}",
                ),
            ]
            if result.load is not None
            else []
        ),
        ("throughput (generated tokens/s)", fmt(s.avg_throughput_tokens_per_sec)),
        ("storage throughput, MLPerf formula (tokens/s)", fmt(s.storage_throughput_tokens_per_sec)),
        ("KV tokens moved / s (read + written)", fmt(s.storage_kv_tokens_per_sec)),
        (
            "storage read / write GiB/s (MLPerf keys)",
            f"{cs.tier_storage_read_bandwidth_gbps:.3f} / {cs.tier_storage_write_bandwidth_gbps:.3f}",
        ),
        (
            "read / write GB/s (all tiers)",
            f"{s.storage_read_bytes_per_sec / 1e9:.3f} / {s.storage_write_bytes_per_sec / 1e9:.3f}",
        ),
        ("end-to-end latency p50 / p95 ms", f"{fmt(s.end_to_end_latency_ms.p50)} / {fmt(s.end_to_end_latency_ms.p95)}"),
        ("storage I/O latency p95 ms", fmt(s.storage_io_latency_ms.p95)),
        ("cache hit rate, MLPerf formula (a request's reads of its own entry included)", fmt(cs.cache_hit_rate)),
        (
            "reuse hit rate (reads of entries other requests wrote)",
            fmt(cs.reuse_hit_rate) if cs.reuse_lookups else "— (no request read another's entry)",
        ),
        ("storage write device p95 ms", fmt(cs.percentile_ms("storage_write_device", "p95"))),
        ("storage read device p95 ms", fmt(cs.percentile_ms("storage_read_device", "p95"))),
        ("demotions / evictions", f"{cs.demotions:,} / {cs.evictions:,}"),
        ("host time fraction", fmt(s.host_time_fraction)),
        (
            f"storage health ({health.profile})",
            "not applicable (no device measured)"
            if health.overall_status == "NOT-APPLICABLE"
            else f"{health.overall_status} ({health.passed_count} of {health.total_count} criteria met: below)",
        ),
        (
            "peak RSS GiB (bound)",
            f"{result.memory.peak_rss_bytes / 2**30:.2f} ({result.memory.bound_bytes / 2**30:.2f})",
        ),
    ]
    if result.io_trace is not None:  # nothing moved: the rates are of the logged operations, not a device's
        moved = ("GiB/s", "GB/s", "tokens/s", "latency")
        rows = [
            (k + " — logged, no I/O" if any(m in k for m in moved) and "health" not in k else k, v) for k, v in rows
        ]
    for k, v in rows:
        t.add_row(Text(k), Text(v))  # outside text (model names, paths): never markup
    c = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 120)
    c.print(t)
    for line in health_lines(result):
        c.print(Text(line), highlight=False)
    for w in result.warnings:  # the message is outside text (paths, servers' words): never markup
        c.print(Text.assemble(("warning: ", "yellow"), w.message), highlight=False)
    if result.io_trace is not None:
        it = result.io_trace
        c.print(
            Text(
                f"I/O trace: {it.rows:,} operations -> {it.path} ({it.file_bytes:,} bytes"
                f"{', zstd' if it.compressed else ''}; {it.rows_per_sec or 0:,.0f} rows/s)"
            ),
            highlight=False,
        )
    c.print(Text(f"result: {path}"), highlight=False)
    td = result.teardown
    if td is not None and td.removal == "background":
        c.print(
            Text(
                f"removing this run's {td.storage_bytes / 1e9:.1f} GB of entry files in the background (pid "
                f"{td.removal_pid}); the next run in this --cache-dir waits for it"
            ),
            highlight=False,
        )
    for line in closing_lines(result.status, result.stop_reason, result.errors.failures, result.requests_completed):
        c.print(Text(line), highlight=False)
    if result.io_trace is not None:
        c.print(
            Text(
                f"next: kvtier trace stats {result.io_trace.path} (what the trace holds), then kvtier trace "
                "replay on the device under test to measure it"
            ),
            highlight=False,
        )
        return
    c.print(
        Text(
            f"next: kvtier report {path} --html report.html (the run's plots: latency by tier, the timeline, QoS)"
            + (
                ""
                if result.load is None or not result.load.requests_dropped
                else "; fewer --num-users, or --arrival closed (users wait instead of being dropped), to see the "
                "device unsaturated"
            )
        ),
        highlight=False,
    )
