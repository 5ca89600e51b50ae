"""``kvtier trace stats|fio|replay``: commands on an I/O trace (kvtier.iotrace); ``kvtier trace attach``: the
latency stack of another process (a vLLM or LMCache server) with bpftrace (telemetry/blocktrace.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.iotrace import TraceAttachConfig, TraceFioConfig, TraceReplayConfig, TraceStatsConfig


def add_trace_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser(
        "trace",
        help="an I/O trace (bench --io-trace-log, or the reference's): stats, a fio job, replay on real tiers",
        description="kvtier trace stats|fio|replay FILE: what an I/O trace holds, a fio job reproducing its mix, "
        "or its operations done on kvtier's real tiers (a bench result)",
    )
    actions = p.add_subparsers(dest="trace_action", required=True)
    for name, model, text in (
        ("stats", TraceStatsConfig, "operations, bytes, sizes, read/write mix, rate over time, reuse distance"),
        ("fio", TraceFioConfig, "distil a fio job file (block sizes, mix, rate, depth, direct I/O)"),
        ("replay", TraceReplayConfig, "do the trace's operations on kvtier's real tiers; write a bench result"),
    ):
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument("trace", help="the trace CSV (.csv or .csv.zst)")
        add_config_arguments(a, model)
        if name == "fio":
            a.add_argument(
                "--no-rate",
                dest="rate",
                action="store_false",
                default=argparse.SUPPRESS,
                help="leave the job unpaced (as fast as the device goes)",
            )
        a.set_defaults(func=run_trace)
    text = "trace another process's storage latency stack with bpftrace: block layer and its system calls"
    t = actions.add_parser("attach", help=text, description=text + " (root, tracefs; see docs/bench.md)")
    add_config_arguments(t, TraceAttachConfig)
    t.set_defaults(func=run_attach)


def run_attach(a: argparse.Namespace) -> int:
    import json
    import time

    from kvtier.errors import ConfigError
    from kvtier.results.io import write_text_atomic
    from kvtier.telemetry.blocktrace import BlockTracer, whole_disks

    cfg = config_from_args(a, TraceAttachConfig)
    if cfg.pid is not None and not Path(f"/proc/{cfg.pid}").exists():
        raise ConfigError(f"--pid {cfg.pid}: no such process")
    who = cfg.who
    disks = whole_disks()
    for d in cfg.device:
        if d not in disks:
            raise ConfigError(f"--device {d}: not a whole disk here ({', '.join(disks) or 'none found'})")
    tracer = BlockTracer.start(cfg.device or disks, who=who, max_s=cfg.duration + 60)  # ends itself if we cannot
    if tracer.reason is not None:
        print(f"kvtier trace attach: not traced: {tracer.reason}", file=sys.stderr)
        return 1
    print(f"kvtier trace attach: tracing {who} and {', '.join(tracer.devices)} for {cfg.duration:g} s", file=sys.stderr)
    if tracer.degraded:
        print(f"kvtier trace attach: {tracer.degraded}", file=sys.stderr)
    try:
        time.sleep(cfg.duration)
    except KeyboardInterrupt:
        print("kvtier trace attach: stopped early", file=sys.stderr)
    section = tracer.section(tracer.stop())
    for name, h in section["histograms"].items():
        p50, p95 = h["p50_bucket"], h["p95_bucket"]
        print(
            f"{name:>20}: {h['count']:>9} events, p50 in [{p50['low']}, {p50['high']}), p95 in [{p95['low']}, "
            f"{p95['high']})"
        )
    if section["empty"]:
        print("no events: " + ", ".join(section["empty"]))
    for what, why in section["unavailable"].items():
        print(f"not traced ({what}): {why}")
    if cfg.output:
        write_text_atomic(cfg.output, json.dumps(section, indent=2))
    return 0 if section["traced"] else 1


def _h(n: float) -> str:
    from kvtier.iotrace.stats import human_bytes

    return human_bytes(n)


def run_trace(a: argparse.Namespace) -> int:
    from kvtier import iotrace

    if a.trace_action == "stats":
        s = iotrace.run_stats(config_from_args(a, TraceStatsConfig, trace=a.trace))
        print(f"{s['path']}: {s['rows']} operations over {s['duration_s']:.3f} s ({s['rows_skipped']} rows skipped)")
        print(
            f"  reads {s['read']['ops']} ({_h(s['read']['bytes'])}), writes {s['write']['ops']} "
            f"({_h(s['write']['bytes'])}); read share {s['read_fraction_ops']:.1%} of operations"
            + (f", {s['read_fraction_bytes']:.1%} of bytes" if s["read_fraction_bytes"] is not None else "")
        )
        if s["ops_per_s"] is not None:
            print(f"  rate {s['ops_per_s']:.1f} ops/s, {_h(s['bytes_per_s'])}/s; peak {s['peak_ops_per_s']:.1f} ops/s")
        for label, t in s["by_tier"].items():
            print(
                f"  {label} ({t['tier']}): read {t['read']['ops']} ({_h(t['read']['bytes'])}), "
                f"write {t['write']['ops']} ({_h(t['write']['bytes'])})"
            )
        print("  phases: " + ", ".join(f"{k} {v['ops']}" for k, v in s["by_phase"].items()))
        o = s["object_size_bytes"]
        print(
            f"  objects {s['objects']}, working set {_h(s['working_set_bytes'])}; size p50 {_h(o['p50'])}, "
            f"p95 {_h(o['p95'])}, max {_h(o['max'])}"
        )
        r = s["reuse"]
        if r["distance_bytes"]["p50"] is not None:
            print(
                f"  reuse: {r['reads_with_earlier_access']} of {r['reads']} reads had an earlier access "
                f"({r['cold_reads']} cold); distance p50 {r['distance_objects']['p50']:.0f} objects / "
                f"{_h(r['distance_bytes']['p50'])}, p95 {_h(r['distance_bytes']['p95'])}"
            )
            print(
                "  LRU hit share by cache size: "
                + ", ".join(f"{_h(c['cache_bytes'])} {c['read_hit_fraction']:.0%}" for c in r["lru_hit_curve"])
            )
        return 0
    if a.trace_action == "fio":
        cfg = config_from_args(a, TraceFioConfig, trace=a.trace)
        _, f = iotrace.run_fio(cfg)
        if "writes_per_fsync" in f:  # from a latency trace
            print(
                f"{cfg.output}: {f['read_ios']} block reads and {f['write_ios']} block writes on "
                f"{', '.join(f['tiers']) or 'the traced devices'} (rwmixread {f['rwmixread']}); iodepth {f['iodepth']} "
                f"from the queue depth seen; {f['writes_per_fsync'] or 'no'} writes per fsync; unpaced"
            )
            return 0
        print(
            f"{cfg.output}: {f['read_ios']} reads and {f['write_ios']} writes of {', '.join(f['tiers'])} "
            f"(rwmixread {f['rwmixread']}), {_h(f['read_bytes_per_s'])}/s read, {_h(f['write_bytes_per_s'])}/s "
            f"written over {f['duration_s']:.1f} s; iodepth {f['iodepth']}, up to {_h(f['buffer_bytes'])} of "
            "fio buffers"
        )
        if f["size_note"]:
            print(f"kvtier trace fio: {f['size_note']}", file=sys.stderr)
        return 0
    from kvtier.cli.bench import print_summary
    from kvtier.results.envelope import exit_code, utc_now

    rcfg = config_from_args(a, TraceReplayConfig, trace=a.trace)
    if rcfg.output is None:
        rcfg = rcfg.model_copy(update={"output": f"kvtier_trace_replay_{utc_now().strftime('%Y%m%d-%H%M%S')}.json"})
    print(f"kvtier trace replay: {rcfg.trace}, speed {rcfg.speed:g}, {rcfg.workers} workers", file=sys.stderr)
    result = iotrace.run_replay(rcfg, handle_signals=True)
    print_summary(result, Path(rcfg.output or ""))
    return exit_code(result.status, result.stop_reason.code)
