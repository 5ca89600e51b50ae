"""The bench result as XLSX: one sheet per section, and the reference's own sheets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.results.bench import BenchResult


def flatten(d: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list):
        if all(not isinstance(x, (dict, list)) for x in d):
            yield prefix, "; ".join(str(x) for x in d)
        else:
            for i, v in enumerate(d):
                yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, d


_PCT_LABELS = (("p50", "P50"), ("p95", "P95"), ("p99", "P99"), ("p999", "P99.9"), ("p9999", "P99.99"))


Rows = list[tuple[str, Any]]


def reference_sheets(r: BenchResult) -> tuple[Rows, Rows, list[tuple[Any, ...]]]:
    """The reference's XLSX layout (its column and row labels), filled from a kvtier bench result's attributes:
    'Run Parameters' and 'Performance Metrics' as (label, value) rows; 'Summary' is both as one row."""
    c = r.config
    params: Rows = [
        ("Timestamp", r.finished_at),
        ("Model", c.model),
        ("Num Users", c.num_users),
        ("Duration (s)", c.duration),
        ("GPU Memory per Card (GiB)", c.gpu_mem_gb),
        ("Num GPUs", c.num_gpus),
        ("Tensor Parallel", c.tensor_parallel),
        ("Total GPU Memory (GiB)", c.gpu_mem_gb * c.num_gpus),
        ("CPU Memory (GiB)", c.cpu_mem_gb),
        ("Generation Mode", c.generation_mode),
        ("Performance Profile", c.performance_profile),
        ("Multi-turn", not c.disable_multi_turn),
        ("Prefix Caching", not c.disable_prefix_caching),
        ("RAG Enabled", c.enable_rag),
        ("Autoscaling", c.enable_autoscaling),
        ("Seed", r.seed),
        ("Max Concurrent Allocs", c.max_concurrent_allocs),
        ("Request Rate", c.request_rate),
        ("Max Requests", c.max_requests),
        ("Dataset Path", c.dataset_path or "N/A"),
        ("Cache Dir", c.cache_dir or "temp"),
        ("Storage Capacity (GiB)", c.storage_capacity_gb),
        ("Precondition", c.precondition),
        ("Precondition Size (GiB)", c.precondition_size_gb),
        ("Precondition Threads", c.precondition_threads or os.cpu_count() or 4),
        ("Trace Speedup", c.trace_speedup),
        ("Replay Cycles", c.replay_cycles),
    ]
    s, cs = r.summary, r.summary.cache_stats
    metrics: Rows = [
        ("Total Requests", s.total_requests),
        ("Total Tokens", s.total_tokens),
        ("Elapsed Time (s)", s.elapsed_time),
        ("Avg Throughput (tok/s)", s.avg_throughput_tokens_per_sec),
        ("Storage Throughput (tok/s)", s.storage_throughput_tokens_per_sec),
        ("Requests/sec", s.requests_per_second),
    ]
    for dist, label, pcts in (
        (s.end_to_end_latency_ms, "E2E Latency", _PCT_LABELS),
        (s.storage_io_latency_ms, "Storage Latency", _PCT_LABELS),
        (s.generation_latency_ms, "Gen Latency", _PCT_LABELS[:3]),
    ):
        metrics.append((f"{label} Mean (ms)", dist.mean))
        metrics += [(f"{label} {lab} (ms)", getattr(dist, p)) for p, lab in pcts]
    for part, label in (("", "Total"), ("device", "Device"), ("host", "Host")):
        for op in ("read", "write"):
            prefix = f"storage_{op}_{part}".rstrip("_")
            metrics += [
                (f"Storage Tier {op.capitalize()} {label} {lab} (ms)", cs.percentile_ms(prefix, p))
                for p, lab in _PCT_LABELS
            ]
    metrics += [
        ("Cache Hit Rate", cs.cache_hit_rate),
        ("Read/Write Ratio", cs.read_write_ratio),
        ("Total Read (GiB)", cs.total_read_gb),
        ("Total Write (GiB)", cs.total_write_gb),
    ]
    tiers = (("gpu", "GPU"), ("cpu", "CPU"), ("storage", "Storage"))
    for op, word in (("write", "Written"), ("read", "Read")):
        metrics += [(f"Tier {lab} KV Bytes {word} (GiB)", cs.tier_kv_bytes_gb(t, op)) for t, lab in tiers]
    for t, lab in tiers:
        for op in ("read", "write"):
            metrics.append((f"Tier {lab} {op.capitalize()} Bandwidth (GiB/s)", cs.tier_bandwidth_gbps(t, op)))
    metrics += [
        ("GPU Entries", cs.gpu_entries),
        ("CPU Entries", cs.cpu_entries),
        ("Storage Entries", cs.storage_entries),
    ]
    metrics.append(("Multi-turn Hit Rate", s.multi_turn_stats.hit_rate))
    throughput = c.performance_profile == "throughput"
    na = "N/A (throughput mode)"
    qos = [
        (
            level,
            q.total_requests,
            q.latency_ms.p95,
            q.latency_ms.p99,
            na if throughput else q.sla.met,
            na if throughput else q.sla.compliance,
        )
        for level, q in s.qos_metrics.items()
        if not q.no_data
    ]
    return params, metrics, qos


def _cell(ws: Any, row: int, col: int, v: Any) -> None:
    if v is None:
        ws.write_blank(row, col, None)
    elif isinstance(v, bool):
        ws.write_boolean(row, col, v)
    elif isinstance(v, (int, float)):
        ws.write_number(row, col, v)
    else:
        ws.write_string(row, col, str(v))


def _write_reference_sheets(wb: Any, r: BenchResult, bold: Any) -> None:
    params, metrics, qos = reference_sheets(r)
    rows = params + metrics
    ws = wb.add_worksheet("Summary")
    for col, (label, v) in enumerate(rows):
        ws.write(0, col, label, bold)
        _cell(ws, 1, col, v)
    for name, (h1, h2), part in (
        ("Run Parameters", ("Parameter", "Value"), params),
        ("Performance Metrics", ("Metric", "Value"), metrics),
    ):
        ws = wb.add_worksheet(name)
        ws.write_row(0, 0, [h1, h2], bold)
        ws.set_column(0, 0, 40)
        for i, (label, v) in enumerate(part, start=1):
            ws.write(i, 0, label)
            _cell(ws, i, 1, v)
    if qos:
        ws = wb.add_worksheet("QoS Metrics")
        heads = ["QoS Level", "Total Requests", "Latency P95 (ms)", "Latency P99 (ms)", "SLA Met", "SLA Compliance"]
        ws.write_row(0, 0, heads, bold)
        for i, row in enumerate(qos, start=1):
            for col, v in enumerate(row):
                _cell(ws, i, col, v)


def write_xlsx(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    """The reference's sheets (Summary, Run Parameters, Performance Metrics, QoS Metrics) first, then
    kvtier's, one per section of the result."""
    import xlsxwriter

    r = result.model_dump(mode="json")  # kvtier's own sheets: every field of each section, flattened
    p = Path(path)
    wb = xlsxwriter.Workbook(str(p))
    bold = wb.add_format({"bold": True})
    _write_reference_sheets(wb, result, bold)
    sections = {
        "kvtier summary": {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
        | {k: v for k, v in r["summary"].items() if k not in ("cache_stats", "qos_metrics")},
        "Cache": r["summary"]["cache_stats"],
        "QoS": r["summary"]["qos_metrics"],
        # how the load was offered (arrival mode, workers, the allocation bound, the bounded queue)
        **({"Load": {k: v for k, v in r["load"].items() if k != "queue_depth_timeline"}} if r.get("load") else {}),
        "Tiers": r["tiers"],
        "Errors": r["errors"],
        "Memory+IO": {"memory": r["memory"], "process_io": r["process_io"], "storage": r["storage"]},
        "Device": {k: v for k, v in (r.get("device") or {}).items() if k != "timeline"},
        **({"Latency tracing": r["latency_tracing"]} if r.get("latency_tracing") else {}),
        **({"I/O trace": r["io_trace"]} if r.get("io_trace") else {}),
        **({"Validation": r["validation"]} if r.get("validation") else {}),
        "GPU telemetry": {k: v for k, v in (r.get("gpu_telemetry") or {}).items() if k != "timeline"},
        "Warnings": {f"{i}.{w['code']}": w["message"] for i, w in enumerate(r["warnings"])}
        | {"stop_reason.code": r["stop_reason"]["code"], "stop_reason.message": r["stop_reason"]["message"]},
        "Setup": r["setup"],
        "Host": r["host"],
        "Config": r["config"],
    }
    try:
        for name, data in sections.items():
            ws = wb.add_worksheet(name)
            ws.write_row(0, 0, ["field", "value"], bold)
            ws.set_column(0, 0, 60)
            ws.set_column(1, 1, 40)
            for row, (k, v) in enumerate(flatten(data), start=1):
                ws.write(row, 0, k)
                _cell(ws, row, 1, v)
        _device_timeline_sheet(wb, (r.get("device") or {}).get("timeline") or [], bold)
        wb.close()
    except OSError as e:
        raise KvtierError(f"--xlsx-output: cannot write {p}: {e.strerror}") from e
    return p


DEVICE_COLUMNS = (
    "read_bytes",
    "write_bytes",
    "read_ios",
    "write_ios",
    "read_await_ms",
    "write_await_ms",
    "utilization",
    "avg_queue_depth",
)


def _device_timeline_sheet(wb: Any, timeline: list[dict[str, Any]], bold: Any) -> None:
    """One row per sampling interval: each device's activity beside the CPU and kvtier's own figures."""
    ws = wb.add_worksheet("Device timeline")
    devices = sorted({d for row in timeline for d in row.get("devices", {})})
    head = ["t_s", *(f"{d}.{c}" for d in devices for c in DEVICE_COLUMNS), "cpu_utilization"]
    head += ["kvtier_requests_done", "kvtier_storage_read_bytes", "kvtier_storage_write_bytes"]
    ws.write_row(0, 0, head, bold)
    for i, row in enumerate(timeline, start=1):
        values = [row.get("t_s")]
        values += [row.get("devices", {}).get(d, {}).get(c) for d in devices for c in DEVICE_COLUMNS]
        values += [row.get(k) for k in head[len(values) :]]
        for j, v in enumerate(values):
            _cell(ws, i, j, v)
