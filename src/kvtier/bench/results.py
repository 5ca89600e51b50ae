"""Raw samples of a bench run -> its typed result, one small builder per section.

Every field is defined in docs/metrics.md. Units: times in ms (``_ms``) or s (``_s``); "GB" in
reference-named keys is 2**30 bytes, as in the MLPerf reference; rates say their unit
(``_per_sec``). Percentiles are exact over raw samples (kvtier.stats). Only completed operations
count as work; failures are errors.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.bench.facts import (
    PROCESS_BASE_BYTES,
    device_section,
    io_trace_section,
    memory_section,
    process_io_section,
    ratio,
    source_section,
    storage_bytes_on_disk,
    storage_section,
)
from kvtier.bench.health import storage_health
from kvtier.bench.plan import Plan
from kvtier.bench.runner import RunOutcome
from kvtier.bench.service import CUT
from kvtier.bench.setup import Components
from kvtier.bench.validation import validation_section
from kvtier.bench.warnings import measurement_warnings, run_warnings
from kvtier.config.bench import BenchConfig
from kvtier.results.bench import OPS, TIER_NAMES, BenchResult, pct_key
from kvtier.results.envelope import collect_host, iso, utc_now
from kvtier.results.outcome import Failure, judge, tally
from kvtier.stats import PERCENTILE_NAMES, Summary, empty_summary, summarize_ns_as_ms
from kvtier.telemetry.recorder import BenchRequest, OpSample, Recorder
from kvtier.units import GiB


def iso_ms(unix_s: float) -> str:
    return dt.datetime.fromtimestamp(unix_s, dt.UTC).isoformat(timespec="milliseconds")


def _gb(n: float) -> float:
    return round(n / GiB, 6)


@dataclass
class _Requests:
    """The run's request records, split once."""

    all: list[BenchRequest]
    ok: list[BenchRequest]
    failed: list[BenchRequest]
    cut: list[BenchRequest]

    @classmethod
    def of(cls, records: Sequence[BenchRequest]) -> _Requests:
        recs = list(records)
        return cls(
            recs,
            [r for r in recs if r.ok],
            [r for r in recs if not r.ok and r.error != CUT],
            [r for r in recs if r.error == CUT],
        )


# -- tiers -------------------------------------------------------------------------------------
def _op_section(rec: Recorder, tier: str, op: str) -> dict[str, Any]:
    samples: list[OpSample] = rec.ops.get((tier, op), [])
    arr = np.array([(s.host_ns, s.device_ns, s.nbytes) for s in samples], dtype=np.int64).reshape(-1, 3)
    causes = np.array([s.cause for s in samples])
    by_cause = {}
    for cause in sorted(set(causes.tolist())):
        sel = causes == cause
        by_cause[cause] = {
            "ops": int(sel.sum()),
            "bytes": int(arr[sel, 2].sum()),
            "latency_ms": summarize_ns_as_ms(arr[sel, 0] + arr[sel, 1]),
        }
    dev_s = arr[:, 1].sum() / 1e9
    return {
        "ops": int(arr.shape[0]),
        "bytes": int(arr[:, 2].sum()),
        "latency_ms": summarize_ns_as_ms(arr[:, 0] + arr[:, 1]),
        "device_latency_ms": summarize_ns_as_ms(arr[:, 1]),
        "host_latency_ms": summarize_ns_as_ms(arr[:, 0]),
        "device_bandwidth_bytes_per_sec": round(arr[:, 2].sum() / dev_s, 1) if dev_s > 0 else None,
        "by_cause": by_cause,
        "errors": sum(v for (t, o, _), v in rec.errors.items() if t == tier and o == op),
    }


def tier_sections(rec: Recorder, tier_names: Sequence[str]) -> dict[str, dict[str, Any]]:
    return {name: {op: _op_section(rec, name, op) for op in OPS} for name in tier_names}


# -- summary.cache_stats -----------------------------------------------------------------------
def _pct_keys(prefix: str, stats: Summary) -> dict[str, Any]:
    return {pct_key(prefix, p): stats[p] for p in PERCENTILE_NAMES}


def _by_cause(tier: dict[str, Any] | None, op: str, cause: str, what: str) -> int:
    if tier is None:
        return 0
    value: int = tier[op]["by_cause"].get(cause, {}).get(what, 0)
    return value


def reference_cache_counts(
    plan: Plan, comp: Components, rec: Recorder, tiers: dict[str, dict[str, Any]], hits: int, wall_s: float
) -> dict[str, Any]:
    """The reference's cache_stats counters, each from kvtier's own samples (docs/metrics.md says how
    each maps): entries and memory at the end, writes into each tier, the requests' own reads and
    writes (``*_iops`` are counts, as the reference's), hits by kind, bandwidth = tier bytes / wall time."""
    c = rec.counters
    usage = comp.store.usage()
    req_read_ops = sum(_by_cause(t, "read", "request", "ops") for t in tiers.values())
    req_write_ops = sum(_by_cause(t, "write", "request", "ops") for t in tiers.values())
    req_read_bytes = sum(_by_cause(t, "read", "request", "bytes") for t in tiers.values())
    req_write_bytes = sum(_by_cause(t, "write", "request", "bytes") for t in tiers.values())
    st = tiers.get("storage")
    storage_bytes = (st["write"]["bytes"] if st else 0) + _by_cause(st, "read", "request", "bytes")
    per_token = plan.model.kv_bytes_per_token_per_rank(plan.config.tensor_parallel)
    prefix_hits, history_hits = c.get("lookup_prefix_hits", 0), c.get("lookup_history_hits", 0)
    out: dict[str, Any] = {}
    for name in TIER_NAMES:
        u = usage.get(name)
        out[f"{name}_entries"] = u["entries"] if u else 0
    for name in ("gpu", "cpu"):
        u = usage.get(name)
        out[f"{name}_memory_used_gb"] = _gb(u["used_bytes"]) if u else 0.0
    out |= {
        "offloads_cpu": tiers["cpu"]["write"]["ops"] if "cpu" in tiers else 0,
        "offloads_storage": st["write"]["ops"] if st else 0,
        "prefill_writes": req_write_ops,
        "decode_reads": sum(c.get(f"lookup_{k}_hits", 0) for k in ("decode", "history", "rag")),
        "system_prompt_hits": prefix_hits,
        "common_phrase_hits": 0,
        "multi_turn_hits": history_hits,
        "user_cache_hits": hits - prefix_hits - history_hits,
        "total_read_bytes": req_read_bytes,
        "total_write_bytes": req_write_bytes,
        "total_read_gb": _gb(req_read_bytes),
        "total_write_gb": _gb(req_write_bytes),
        "read_write_ratio": round(req_read_bytes / max(req_write_bytes, 1), 6),
        "read_iops": req_read_ops,
        "write_iops": req_write_ops,
        "storage_tokens_processed": round(storage_bytes / per_token, 3) if per_token else 0.0,
    }
    for name in TIER_NAMES:
        t = tiers.get(name)
        for op in OPS:
            out[f"tier_{name}_{op}_bandwidth_gbps"] = round(t[op]["bytes"] / GiB / wall_s, 6) if t else 0.0
    return out


DROP_CAUSES = ("no-room", "entry-too-large")


def dropped_stores(rec: Recorder) -> dict[str, Any]:
    """Stores no tier could take (bench/service.py): dropped, not failed, by cause."""
    by = {c: rec.counters.get(f"stores_dropped_{c}", 0) for c in DROP_CAUSES}
    return {
        "stores_dropped": sum(by.values()),
        "stores_dropped_bytes": rec.counters.get("stores_dropped_bytes", 0),
        "stores_dropped_by_cause": {c: n for c, n in by.items() if n},
    }


def cache_stats(
    plan: Plan,
    comp: Components,
    rec: Recorder,
    reqs: _Requests,
    tiers: dict[str, dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    profile = plan.config.performance_profile
    hits = sum(r.hits for r in reqs.all)
    misses = sum(r.misses for r in reqs.all)
    hit_rate = ratio(hits, hits + misses)
    # reads of entries other requests wrote (prefix, history, RAG, trace blocks): the reference's rate also counts
    # each request's decode reads of the entry it just wrote, which hit whether anything is reused or not
    reused = {k: v for k, v in rec.counters.items() if k.startswith("lookup_") and not k.startswith("lookup_decode_")}
    reuse_hits = sum(v for k, v in reused.items() if k.endswith("_hits"))
    reuse_lookups = reuse_hits + sum(v for k, v in reused.items() if k.endswith("_misses"))
    out: dict[str, Any] = {
        "cache_hit_rate": hit_rate,
        "cache_hits": hits,
        "cache_misses": misses,
        "reuse_lookups": reuse_lookups,
        "reuse_hits": reuse_hits,
        "reuse_hit_rate": ratio(reuse_hits, reuse_lookups) if reuse_lookups else None,
        **reference_cache_counts(plan, comp, rec, tiers, hits, wall_s),
        "decode_bytes_read_gb": _gb(sum(r.decode_bytes_read for r in reqs.ok)),
        "prefill_bytes_written_gb": _gb(
            sum(t["write"]["by_cause"].get("request", {}).get("bytes", 0) for t in tiers.values())
        ),
        "demotions": rec.counters.get("demotions", 0),
        "promotions": rec.counters.get("promotions", 0),
        "evictions": rec.counters.get("evictions_bottom", 0),
        "entries_dropped": rec.counters.get("evictions_dropped", 0),
        "entries_dropped_unreadable": rec.counters.get("entries_dropped_unreadable", 0),
        "deduplicated_writes": rec.counters.get("deduplicated_writes", 0),
        "fragmented_fallthroughs": rec.counters.get("fragmented_fallthroughs", 0),
        "reserve_waits_expired": rec.counters.get("reserve_waits_expired", 0),
        "reserve_wait_total_s": round(rec.counters.get("reserve_wait_ns", 0) / 1e9, 3),
        "remote_own_hits": rec.counters.get("remote_own_hits", 0),
        "remote_cross_writer_hits": rec.counters.get("remote_cross_writer_hits", 0),
        "remote_foreign_entries": rec.counters.get("remote_foreign_entries", 0),
        "host_memory_short": rec.counters.get("host_memory_short", 0),
        **dropped_stores(rec),
    }
    for name in TIER_NAMES:
        t = tiers.get(name)
        out[f"tier_{name}_kv_bytes_written_gb"] = _gb(t["write"]["bytes"]) if t else 0.0
        out[f"tier_{name}_kv_bytes_read_gb"] = _gb(t["read"]["bytes"]) if t else 0.0
        for op in OPS:
            out.update(_pct_keys(f"{name}_{op}", t[op]["latency_ms"] if t else empty_summary()))
    st = tiers.get("storage")
    for op in OPS:
        for part in ("device", "host"):
            out.update(_pct_keys(f"storage_{op}_{part}", st[op][f"{part}_latency_ms"] if st else empty_summary()))
        out[f"nvme_{op}_device_p95_ms"] = st[op]["device_latency_ms"]["p95"] if st else None
    if plan.config.io_trace_log:  # no tier I/O was done: a verdict on a device would be about nothing
        out["storage_health"] = {
            "profile": profile,
            "overall_status": "NOT-APPLICABLE",
            "criteria": [],
            "passed_count": 0,
            "total_count": 0,
            "reason": "--io-trace-log: no tier I/O was done (each operation is a row of the "
            "trace), so no device was measured",
        }
    else:
        out["storage_health"] = storage_health(profile, tiers, hit_rate, rec, wall_s)
    return out


# -- summary: per-feature sections -------------------------------------------------------------
def qos_section(cfg: BenchConfig, reqs: _Requests) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cls, prof in cfg.tuning.qos_profiles.items():
        rs = [r for r in reqs.ok if r.qos == cls]
        svc = np.array([r.storage_done_ns - r.submit_ns for r in rs], dtype=np.int64)
        stats = summarize_ns_as_ms(svc)
        p95, p99 = stats["p95"], stats["p99"]
        e2e_ms = np.array([r.end_ns - r.submit_ns for r in rs], dtype=np.int64) / 1e6
        e2e = summarize_ns_as_ms([r.end_ns - r.submit_ns for r in rs])
        compliance = None if not rs else round(float((e2e_ms <= prof.target_latency_p95_ms).mean()), 6)
        out[cls] = {
            # the reference's keys: end-to-end latency against the class's p95 target
            "no_data": not rs,
            "total_requests": len(rs),
            "latency_ms": e2e,
            "sla": {
                "target_p95_ms": prof.target_latency_p95_ms,
                "actual_p95_ms": e2e["p95"],
                "compliance": compliance,
                "met": None if compliance is None else compliance >= 0.95,
            },
            # kvtier's: service latency (submit -> storage done), failures, both targets
            "requests": len(rs),
            "failed": sum(1 for r in reqs.failed if r.qos == cls),
            "service_latency_ms": stats,
            "end_to_end_latency_ms": e2e,
            "target_latency_p95_ms": prof.target_latency_p95_ms,
            "target_latency_p99_ms": prof.target_latency_p99_ms,
            "p95_met": None if p95 is None else bool(p95 <= prof.target_latency_p95_ms),
            "p99_met": None if p99 is None else bool(p99 <= prof.target_latency_p99_ms),
            "sla_compliance": None if not rs else round(float((svc / 1e6 <= prof.target_latency_p95_ms).mean()), 6),
        }
    return out


def lookup_section(rec: Recorder, kind: str) -> dict[str, Any]:
    """Hits, misses, restores and bytes read of one kind of KV object (prefix, history, rag, decode...)."""
    c = rec.counters
    h, m = c.get(f"lookup_{kind}_hits", 0), c.get(f"lookup_{kind}_misses", 0)
    return {
        "hits": h,
        "misses": m,
        "hit_rate": ratio(h, h + m),
        "restores": c.get(f"restores_{kind}", 0),
        "bytes_read_gb": _gb(c.get(f"read_{kind}_bytes", 0)),
    }


def multi_turn_section(plan: Plan, rec: Recorder, reqs: _Requests) -> dict[str, Any]:
    h = lookup_section(rec, "history")
    conv = plan.workload.conversations
    return {
        # the reference's keys: previous-turn lookups (hit_rate 0 without any)
        "cache_hits": h["hits"],
        "cache_misses": h["misses"],
        "hit_rate": round(h["hits"] / max(h["hits"] + h["misses"], 1), 6),
        "enabled": not plan.config.disable_multi_turn,
        "conversations_started": conv.started,
        "conversations_metadata_evicted": conv.evicted,
        "max_conversations": plan.config.tuning.conversation.max_conversations,
        "turns_mean": round(float(np.mean([r.turn for r in reqs.ok])), 3) if reqs.ok else None,
        "turns_max": max((r.turn for r in reqs.ok), default=0),
        "multi_turn_cache_hits": h["hits"],
        "multi_turn_cache_misses": h["misses"],
        "history_hit_rate": h["hit_rate"],
        "history_bytes_read_gb": h["bytes_read_gb"],
        "history_restores": h["restores"],
    }


def prefix_section(cfg: BenchConfig, rec: Recorder) -> dict[str, Any]:
    p = lookup_section(rec, "prefix")
    pc = cfg.tuning.prefix_cache
    return {
        "prefix_hits": p["hits"],
        "prefix_misses": p["misses"],
        "system_prompt_reuse": p["hits"],
        "common_phrase_reuse": 0,
        "bytes_saved": rec.counters.get("read_prefix_bytes", 0),
        "enabled": not cfg.disable_prefix_caching,
        "num_system_prompts": min(pc.num_system_prompts, pc.max_prefix_entries),
        "system_prompt_hit_probability": pc.system_prompt_hit_probability,
        "prefix_hit_rate": p["hit_rate"],
        "prefix_restores": p["restores"],
        "prefix_bytes_read_gb": p["bytes_read_gb"],
    }


def kv_layout_section(plan: Plan, rec: Recorder, reqs: _Requests) -> dict[str, Any]:
    cfg = plan.config
    new_bytes = sum(plan.entry_bytes(r.new_tokens) for r in reqs.ok)
    read_bytes = sum(r.bytes_read for r in reqs.ok)
    return {
        "kv_layout": cfg.kv_layout,
        "chunk_tokens": cfg.kv_chunk_tokens if cfg.kv_layout == "chunked" else None,
        "new_context_gb": _gb(new_bytes),
        "bytes_read_gb": _gb(read_bytes),
        "read_amplification": ratio(read_bytes, new_bytes, 4),
        "decode": lookup_section(rec, "decode"),
    }


def rag_section(cfg: BenchConfig, rec: Recorder, reqs: _Requests, run: RunOutcome) -> dict[str, Any]:
    rag_reqs = [r for r in reqs.ok if r.rag_ns or r.rag_bytes]
    g = lookup_section(rec, "rag")
    return {
        "enabled": cfg.enable_rag,
        "num_docs": cfg.rag_num_docs,
        "top_k": cfg.rag_top_k or cfg.tuning.rag.top_k_chunks,
        "request_probability": cfg.tuning.rag.request_probability,
        "queries": len(rag_reqs),
        "chunk_hits": g["hits"],
        "chunk_misses": g["misses"],
        "chunk_hit_rate": g["hit_rate"],
        "chunks_reingested": g["restores"],
        "burst_bytes_gb": _gb(sum(r.rag_bytes for r in rag_reqs)),
        "burst_latency_ms": summarize_ns_as_ms([r.rag_ns for r in rag_reqs]),
        "ingest": run.setup.get("rag_ingest"),
    }


def autoscaling_sections(run: RunOutcome) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """(summary.autoscaling_stats, summary.autoscaling_summary): the reference's list of scale events
    and its summary, plus kvtier's every sample under ``autoscaling_summary.steps``."""
    a = run.autoscaling
    if not a:
        return [], None
    steps: list[dict[str, Any]] = list(a["steps"])  # type: ignore[call-overload]  # built by Autoscaler.stats
    events = [
        {
            "timestamp": iso_ms(run.start_unix_s + s["t_s"]),
            "mode": a["mode"],
            "action": "stop" if s["action"] == "stop" else s["action"].split()[0],
            "users": s["next_users"],
            "saturation_level": s["saturation"],
            "read_latency_p95_ms": s.get("storage_read_p95_ms"),
            "write_latency_p95_ms": s.get("storage_write_p95_ms"),
            "throughput_tokens_per_sec": s["throughput_tokens_per_sec"],
        }
        for s in steps
        if s["next_users"] != s["users"] or s["action"] == "stop"
    ]
    summary: dict[str, Any] = {
        "initial_users": a["initial_users"],
        "final_users": a["final_users"],
        "total_scale_events": len(events),
        **a,
    }
    if a["mode"] == "capacity":
        summary["peak_user_count"] = a["peak_users"]
    return events, summary


def summary_section(
    plan: Plan,
    comp: Components,
    rec: Recorder,
    reqs: _Requests,
    run: RunOutcome,
    tiers: dict[str, dict[str, Any]],
    wall_s: float,
) -> dict[str, Any]:
    cfg, ok = plan.config, reqs.ok
    host_ns = sum(s.host_ns for v in rec.ops.values() for s in v)
    dev_ns = sum(s.device_ns for v in rec.ops.values() for s in v)
    tokens = sum(r.generate_tokens for r in ok)
    storage_s = sum(r.storage_ns for r in ok) / 1e9
    events, scaling = autoscaling_sections(run)
    return {
        # the reference's figures, by its formulas (docs/metrics.md)
        "total_requests": len(ok),
        "total_tokens": tokens,
        "elapsed_time": round(wall_s, 6),
        "avg_throughput_tokens_per_sec": round(tokens / wall_s, 3),
        "total_storage_io_time": round(storage_s, 6),
        "storage_throughput_tokens_per_sec": round(tokens / storage_s, 3) if storage_s > 0 else 0.0,
        "requests_per_second": round(len(ok) / wall_s, 4),
        # kvtier's: what the tiers moved per second of wall time
        "storage_kv_tokens_per_sec": round(sum(r.tokens_read + r.tokens_written for r in ok) / wall_s, 3),
        "storage_read_bytes_per_sec": round(sum(t["read"]["bytes"] for t in tiers.values()) / wall_s, 1),
        "storage_write_bytes_per_sec": round(sum(t["write"]["bytes"] for t in tiers.values()) / wall_s, 1),
        "end_to_end_latency_ms": summarize_ns_as_ms([r.end_ns - r.submit_ns for r in ok]),
        "storage_io_latency_ms": summarize_ns_as_ms([r.storage_ns for r in ok]),
        "generation_latency_ms": summarize_ns_as_ms([r.generation_ns for r in ok]),
        "queue_wait_ms": summarize_ns_as_ms([r.start_ns - r.submit_ns for r in ok]),
        "host_time_fraction": ratio(host_ns, host_ns + dev_ns),
        "cache_stats": cache_stats(plan, comp, rec, reqs, tiers, wall_s),
        "qos_metrics": qos_section(cfg, reqs),
        "multi_turn_stats": multi_turn_section(plan, rec, reqs),
        "prefix_cache_stats": prefix_section(cfg, rec),
        "kv_layout_stats": kv_layout_section(plan, rec, reqs),
        "rag_stats": rag_section(cfg, rec, reqs, run),
        "autoscaling_stats": events,
        "autoscaling_summary": scaling,
    }


def reference_arrays(plan: Plan, rec: Recorder, reqs: _Requests, run: RunOutcome, wall_s: float) -> dict[str, Any]:
    """The reference's top-level raw data: per-request latencies in seconds (completed requests, in
    completion order), their sums, and the throughput timeline (cumulative generated tokens / elapsed
    seconds, once per second of the run)."""
    ok = reqs.ok
    done = sorted((r.end_ns - run.start_ns, r.generate_tokens) for r in ok)
    timeline, i, total = [], 0, 0
    for sec in range(1, int(wall_s) + 1):
        while i < len(done) and done[i][0] <= sec * 1e9:
            total += done[i][1]
            i += 1
        timeline.append({"timestamp": float(sec), "throughput_tokens_per_sec": round(total / sec, 3)})
    hist = lookup_section(rec, "history")
    return {
        "total_storage_io_latency": round(sum(r.storage_ns for r in ok) / 1e9, 6),
        "total_generation_latency": round(sum(r.generation_ns for r in ok) / 1e9, 6),
        "end_to_end_latencies": [(r.end_ns - r.submit_ns) / 1e9 for r in ok],
        "storage_latencies": [r.storage_ns / 1e9 for r in ok],
        "generation_latencies": [r.generation_ns / 1e9 for r in ok],
        "throughput_timeline": timeline,
        "prefill_latencies": [] if plan.config.decode_only else [r.prefill_ns / 1e9 for r in ok],
        "decode_latencies": [r.decode_ns / 1e9 for r in ok if r.decode_ns is not None],
        "multi_turn_cache_hits": hist["hits"],
        "multi_turn_cache_misses": hist["misses"],
    }


def request_cause(error: str) -> str:
    """A failed bench request's cause (results/outcome.py): tier-full, io-error or cancelled."""
    if error == CUT:
        return "cancelled"
    return "tier-full" if error.startswith("tier_full") else "io-error"


def request_failures(reqs: _Requests) -> dict[str, Failure]:
    """The run's failed and cut requests by cause."""
    return tally((request_cause(r.error), r.error, None) for r in reqs.all if not r.ok)


def errors_section(rec: Recorder, reqs: _Requests, failures: dict[str, Failure]) -> dict[str, Any]:
    return {
        "requests_failed": len(reqs.failed),
        "failures": failures,
        "tier_operations": {f"{t}.{o}.{c}": n for (t, o, c), n in sorted(rec.errors.items())},
        "first_messages": rec.error_messages[:20] + sorted({r.error for r in reqs.failed})[:5],
    }


def build_result(
    plan: Plan,
    comp: Components,
    rec: Recorder,
    run: RunOutcome,
    started_at: dt.datetime,
    resolution: str = "",
    latency_tracing: dict[str, Any] | None = None,
    gpu_telemetry: dict[str, Any] | None = None,
) -> BenchResult:
    cfg = plan.config
    reqs = _Requests.of(rec.requests)
    wall_s = max((run.end_ns - run.start_ns) / 1e9, 1e-9)
    tiers = tier_sections(rec, comp.store.tier_names)
    tp = cfg.tensor_parallel
    disk = storage_bytes_on_disk(comp, rec)  # once: both the kernel's and the device's view use it
    device = device_section(comp, run, resolution, disk)
    failures = request_failures(reqs)
    verdict = judge(run.status, run.stop, len(reqs.ok), failures, cfg.max_failure_rate)
    warnings = run_warnings(plan, comp, rec, run, tiers, verdict, dropped_stores(rec))
    io_trace = io_trace_section(comp, rec, run)
    warnings += measurement_warnings(latency_tracing, io_trace, device)
    return BenchResult.model_validate(
        {
            "status": verdict[0],
            "stop_reason": verdict[1],
            "started_at": iso(started_at),
            "finished_at": iso(utc_now()),
            "host": collect_host({"cache_dir": comp.cache_dir}),
            "warnings": warnings,
            "elapsed_s": round(wall_s, 4),
            "load_duration_s": round((run.load_end_ns - run.start_ns) / 1e9, 4),
            "load_start_unix_s": round(run.start_unix_s, 6),
            "seed": plan.seed,
            "model": {
                **plan.model.to_dict(),
                "tensor_parallel": tp,
                "kv_bytes_per_token_per_rank": plan.model.kv_bytes_per_token_per_rank(tp),
            },
            "requests_completed": len(reqs.ok),
            "requests_failed": len(reqs.failed),
            "requests_abandoned": run.abandoned_requests,
            "requests_cut_at_stop": len(reqs.cut),
            "load": run.load or None,
            "total_tokens_generated": sum(r.generate_tokens for r in reqs.ok),
            **reference_arrays(plan, rec, reqs, run, wall_s),
            "summary": summary_section(plan, comp, rec, reqs, run, tiers, wall_s),
            "tiers": tiers,
            "tier_usage_at_end": comp.store.usage(),
            "errors": errors_section(rec, reqs, failures),
            "process_io": process_io_section(run, disk),
            "device": device,
            "io_trace": io_trace,
            "latency_tracing": latency_tracing,
            "gpu_telemetry": gpu_telemetry,
            "validation": None
            if plan.validation is None
            else validation_section(plan.validation, str(cfg.validation_trace), rec.requests),
            "memory": memory_section(plan, comp),
            "storage": storage_section(comp),
            "workload_source": source_section(plan),
            "setup": {**run.setup, **({"stale_runs": comp.stale_runs} if comp.stale_runs else {})},
            # the effective config: the seed that ran, so the result re-creates the run
            "config": cfg.model_copy(update={"seed": plan.seed}),
        }
    )


__all__ = ["build_result", "storage_health", "tier_sections", "PROCESS_BASE_BYTES"]
