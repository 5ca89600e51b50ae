"""Build the result of a bench run from raw samples. Every field is defined in docs/metrics.md.

Units: times in ms (``_ms``) or s (``_s``); "GB" in reference-named keys is 2**30 bytes, as in the
MLPerf reference; rates say their unit (``_per_sec``). Percentiles are exact over raw samples.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import numpy as np

from kvtier import __version__
from kvtier.bench.runner import CUT, RunOutcome
from kvtier.bench.setup import Components
from kvtier.telemetry.host import host_facts, mem_total_bytes, peak_rss_bytes
from kvtier.telemetry.recorder import PCT_NAMES, Recorder, latency_stats_ms

GB = 1024**3
SCHEMA_VERSION = 1
PROCESS_BASE_BYTES = 256 * 1024**2
"""Allowance for the interpreter, numpy, threads and bookkeeping in the documented memory bound."""


def _gb(n: int | float) -> float:
    return round(n / GB, 6)


def _pct_keys(prefix: str, stats: dict[str, Any]) -> dict[str, Any]:
    return {f"{prefix}_{p}_ms": stats[p] for p in PCT_NAMES}


def _source(comp: Components) -> dict[str, Any]:
    if comp.trace is not None:
        t = comp.trace
        return {"kind": "trace", "format": t.format, "files": t.files, "requests": len(t.requests),
                "skipped_rows": t.skipped_rows, "block_tokens": t.block_tokens}
    if comp.dataset is not None:
        d = comp.dataset
        return {"kind": "dataset", "format": "sharegpt", "path": d.path, "conversations": len(d.conversations),
                "turns": sum(len(c.turns) for c in d.conversations), "tokenizer": d.tokenizer,
                "skipped_records": d.skipped_records}
    return {"kind": "synthetic", "profiles": sorted(comp.config.tuning.user_templates)}


def tier_section(rec: Recorder, tier: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for op in ("read", "write"):
        samples = rec.ops.get((tier, op), [])
        arr = np.array([(s.host_ns, s.device_ns, s.nbytes) for s in samples], dtype=np.int64).reshape(-1, 3)
        causes: dict[str, dict[str, Any]] = {}
        for cause in sorted({s.cause for s in samples}):
            sel = np.array([s.cause == cause for s in samples])
            causes[cause] = {"ops": int(sel.sum()), "bytes": int(arr[sel, 2].sum()),
                             "latency_ms": latency_stats_ms(arr[sel, 0] + arr[sel, 1])}
        total_ns = arr[:, 0] + arr[:, 1]
        dev_s = arr[:, 1].sum() / 1e9
        out[op] = {
            "ops": int(arr.shape[0]),
            "bytes": int(arr[:, 2].sum()),
            "latency_ms": latency_stats_ms(total_ns),
            "device_latency_ms": latency_stats_ms(arr[:, 1]),
            "host_latency_ms": latency_stats_ms(arr[:, 0]),
            "device_bandwidth_bytes_per_sec": round(arr[:, 2].sum() / dev_s, 1) if dev_s > 0 else None,
            "by_cause": causes,
            "errors": sum(v for (t, o, _), v in rec.errors.items() if t == tier and o == op),
        }
    return out


def build_result(comp: Components, rec: Recorder, run: RunOutcome, started_at: dt.datetime,
                 warnings: list[str]) -> dict[str, Any]:
    cfg = comp.config
    reqs = rec.requests
    ok = [r for r in reqs if r.ok]
    failed = [r for r in reqs if not r.ok and r.error != CUT]
    cut = [r for r in reqs if r.error == CUT]
    wall_s = max((run.end_ns - run.start_ns) / 1e9, 1e-9)
    tokens_generated = sum(r.generate_tokens for r in ok)

    e2e = [r.end_ns - r.submit_ns for r in ok]
    storage = [r.storage_ns for r in ok]
    gen = [r.generation_ns for r in ok]
    queue = [r.start_ns - r.submit_ns for r in ok]
    hits = sum(r.hits for r in reqs)
    misses = sum(r.misses for r in reqs)
    tokens_io = sum(r.tokens_read + r.tokens_written for r in ok)

    tiers = {name: tier_section(rec, name) for name in comp.store.tier_names}
    host_ns = sum(s.host_ns for v in rec.ops.values() for s in v)
    dev_ns = sum(s.device_ns for v in rec.ops.values() for s in v)

    cache_stats: dict[str, Any] = {
        "cache_hit_rate": round(hits / (hits + misses), 6) if hits + misses else None,
        "cache_hits": hits,
        "cache_misses": misses,
        "decode_bytes_read_gb": _gb(sum(r.decode_bytes_read for r in ok)),
        "prefill_bytes_written_gb": _gb(sum(s.nbytes for t in comp.store.tier_names
                                            for s in rec.ops.get((t, "write"), []) if s.cause == "request")),
        "demotions": rec.counters.get("demotions", 0),
        "promotions": rec.counters.get("promotions", 0),
        "evictions": rec.counters.get("evictions_bottom", 0),
        "entries_dropped": rec.counters.get("evictions_dropped", 0),
        "deduplicated_writes": rec.counters.get("deduplicated_writes", 0),
    }
    for name in ("gpu", "cpu", "storage"):
        t = tiers.get(name)
        cache_stats[f"tier_{name}_kv_bytes_written_gb"] = _gb(t["write"]["bytes"]) if t else 0.0
        cache_stats[f"tier_{name}_kv_bytes_read_gb"] = _gb(t["read"]["bytes"]) if t else 0.0
        for op in ("read", "write"):
            stats = t[op]["latency_ms"] if t else {p: None for p in PCT_NAMES}
            cache_stats.update(_pct_keys(f"{name}_{op}", stats))
    st = tiers.get("storage")
    for op in ("read", "write"):
        for part in ("device", "host"):
            stats = st[op][f"{part}_latency_ms"] if st else {p: None for p in PCT_NAMES}
            cache_stats.update(_pct_keys(f"storage_{op}_{part}", stats))
        cache_stats[f"nvme_{op}_device_p95_ms"] = st[op]["device_latency_ms"]["p95"] if st else None

    qos: dict[str, Any] = {}
    for cls, prof in cfg.tuning.qos_profiles.items():
        rs = [r for r in ok if r.qos == cls]
        svc = np.array([r.storage_done_ns - r.submit_ns for r in rs], dtype=np.int64)
        stats = latency_stats_ms(svc)
        qos[cls] = {
            "requests": len(rs),
            "failed": sum(1 for r in failed if r.qos == cls),
            "service_latency_ms": stats,
            "end_to_end_latency_ms": latency_stats_ms([r.end_ns - r.submit_ns for r in rs]),
            "target_latency_p95_ms": prof.target_latency_p95_ms,
            "target_latency_p99_ms": prof.target_latency_p99_ms,
            "p95_met": None if not rs else bool(stats["p95"] <= prof.target_latency_p95_ms),  # type: ignore[operator]
            "p99_met": None if not rs else bool(stats["p99"] <= prof.target_latency_p99_ms),  # type: ignore[operator]
            "sla_compliance": None if not rs else round(
                float((svc / 1e6 <= prof.target_latency_p95_ms).mean()), 6),
        }

    st_read = st["read"]["bytes"] if st else 0
    st_write = st["write"]["bytes"] if st else 0
    io_delta = {k: run.io_after.get(k, 0) - run.io_before.get(k, 0) for k in ("read_bytes", "write_bytes")}
    ft = comp.file_tier
    on_disk_w = sum(ft.stored_size(s.nbytes) for s in rec.ops.get(("storage", "write"), [])) if ft else 0
    on_disk_r = sum(ft.stored_size(s.nbytes) for s in rec.ops.get(("storage", "read"), [])) if ft else 0
    cancel_w = rec.cancelled.get(("storage", "write"), [0, 0])
    cancel_r = rec.cancelled.get(("storage", "read"), [0, 0])
    expect_w = on_disk_w + cancel_w[1]
    expect_r = on_disk_r + cancel_r[1]
    io_check = {
        "storage_tier_bytes_written_on_disk": on_disk_w,
        "storage_tier_bytes_read_on_disk": on_disk_r,
        "cancelled_ops": {"write": cancel_w[0], "read": cancel_r[0]},
        "cancelled_bytes": {"write": cancel_w[1], "read": cancel_r[1]},
        "process_write_bytes": io_delta["write_bytes"],
        "process_read_bytes": io_delta["read_bytes"],
        "write_ratio": round(io_delta["write_bytes"] / expect_w, 4) if expect_w else None,
        "read_ratio": round(io_delta["read_bytes"] / expect_r, 4) if expect_r else None,
    }

    cpu_cap = cfg.cpu_mem_gb * GB
    bound = comp.noise.nbytes + comp.io_slots * comp.io_chunk_bytes + cpu_cap + PROCESS_BASE_BYTES
    peak = peak_rss_bytes()

    all_warnings = list(comp.warnings) + list(warnings)
    if cfg.enable_rag:
        all_warnings.append("--enable-rag: the RAG corpus was ingested before the run; its writes are reported in "
                            "summary.rag_stats.ingest and excluded from the tier statistics")
    if run.workload.get("prepopulated_entries"):
        all_warnings.append(f"--decode-only: {run.workload['prepopulated_entries']} entries were written before the "
                            "run and are excluded from the statistics")
    if ft is not None and not ft.direct and st_write < 0.5 * mem_total_bytes():
        all_warnings.append("working set fits in page cache and direct I/O is off: reads may be served from RAM "
                            "(fadvise DONTNEED is applied, but check process_io)")
    n_err = sum(rec.errors.values()) + len(failed)
    if n_err:
        all_warnings.append(f"{n_err} errors seen (failed requests and tier operations); see 'errors'")
    if run.status != "complete":
        all_warnings.append(f"run is {run.status}: {run.stop_reason}")

    ctr = rec.counters
    kvpt = comp.model.kv_bytes_per_token / cfg.tensor_parallel

    def kind(k: str) -> dict[str, Any]:
        h, m = ctr.get(f"lookup_{k}_hits", 0), ctr.get(f"lookup_{k}_misses", 0)
        return {"hits": h, "misses": m, "hit_rate": round(h / (h + m), 6) if h + m else None,
                "restores": ctr.get(f"restores_{k}", 0), "bytes_read_gb": _gb(ctr.get(f"read_{k}_bytes", 0))}

    new_bytes = sum(r.new_tokens for r in ok) * kvpt
    read_bytes = sum(r.bytes_read for r in ok)
    history = kind("history")
    multi_turn_stats = {
        "enabled": not cfg.disable_multi_turn,
        "conversations_started": run.workload.get("conversations_started", 0),
        "conversations_metadata_evicted": run.workload.get("conversations_evicted", 0),
        "max_conversations": cfg.max_conversations,
        "turns_mean": round(float(np.mean([r.turn for r in ok])), 3) if ok else None,
        "turns_max": max((r.turn for r in ok), default=0),
        "multi_turn_cache_hits": history["hits"], "multi_turn_cache_misses": history["misses"],
        "history_hit_rate": history["hit_rate"], "history_bytes_read_gb": history["bytes_read_gb"],
        "history_restores": history["restores"],
    }
    prefix = kind("prefix")
    prefix_cache_stats = {
        "enabled": not cfg.disable_prefix_caching,
        "num_system_prompts": cfg.tuning.prefix_cache.num_system_prompts,
        "prefix_hits": prefix["hits"], "prefix_misses": prefix["misses"], "prefix_hit_rate": prefix["hit_rate"],
        "prefix_restores": prefix["restores"], "prefix_bytes_read_gb": prefix["bytes_read_gb"],
    }
    kv_layout = {
        "kv_layout": cfg.kv_layout,
        "chunk_tokens": cfg.kv_chunk_tokens if cfg.kv_layout == "chunked" else None,
        "new_context_gb": _gb(new_bytes),
        "bytes_read_gb": _gb(read_bytes),
        "read_amplification": round(read_bytes / new_bytes, 4) if new_bytes else None,
        "decode": kind("decode"),
    }

    rag_reqs = [r for r in ok if r.rag_ns or r.rag_bytes]
    rag = kind("rag")
    rag_stats = {
        "enabled": cfg.enable_rag,
        "num_docs": cfg.rag_num_docs, "top_k": cfg.rag_top_k,
        "request_probability": cfg.tuning.rag.request_probability,
        "queries": len(rag_reqs),
        "chunk_hits": rag["hits"], "chunk_misses": rag["misses"], "chunk_hit_rate": rag["hit_rate"],
        "chunks_reingested": rag["restores"],
        "burst_bytes_gb": _gb(sum(r.rag_bytes for r in rag_reqs)),
        "burst_latency_ms": latency_stats_ms([r.rag_ns for r in rag_reqs]),
        "ingest": run.workload.get("setup", {}).get("rag_ingest"),
    }

    summary = {
        "avg_throughput_tokens_per_sec": round(tokens_generated / wall_s, 3),
        "storage_throughput_tokens_per_sec": round(tokens_io / wall_s, 3),
        "requests_per_second": round(len(ok) / wall_s, 4),
        "storage_read_bytes_per_sec": round(sum(t["read"]["bytes"] for t in tiers.values()) / wall_s, 1),
        "storage_write_bytes_per_sec": round(sum(t["write"]["bytes"] for t in tiers.values()) / wall_s, 1),
        "end_to_end_latency_ms": latency_stats_ms(e2e),
        "storage_io_latency_ms": latency_stats_ms(storage),
        "generation_latency_ms": latency_stats_ms(gen),
        "queue_wait_ms": latency_stats_ms(queue),
        "host_time_fraction": round(host_ns / (host_ns + dev_ns), 6) if host_ns + dev_ns else None,
        "cache_stats": cache_stats,
        "qos_metrics": qos,
        "multi_turn_stats": multi_turn_stats,
        "prefix_cache_stats": prefix_cache_stats,
        "kv_layout_stats": kv_layout,
        "rag_stats": rag_stats,
        "autoscaling_stats": run.workload.get("autoscaling") or {"enabled": False},
    }
    return {
        "kvtier_version": __version__,
        "result_schema_version": SCHEMA_VERSION,
        "benchmark": "kvtier bench",
        "status": run.status,
        "stop_reason": run.stop_reason,
        "started_at": started_at.isoformat(timespec="seconds"),
        "finished_at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": round(wall_s, 4),
        "load_duration_s": round((run.load_end_ns - run.start_ns) / 1e9, 4),
        "seed": comp.seed,
        "model": comp.model.to_dict(),
        "requests_completed": len(ok),
        "requests_failed": len(failed),
        "requests_abandoned": run.abandoned_requests,
        "requests_cut_at_stop": len(cut),
        "total_tokens_generated": tokens_generated,
        "summary": summary,
        "tiers": tiers,
        "tier_usage_at_end": comp.store.usage(),
        "errors": {
            "requests_failed": len(failed),
            "tier_operations": {f"{t}.{o}.{c}": n for (t, o, c), n in sorted(rec.errors.items())},
            "first_messages": rec.error_messages[:20] + sorted({r.error for r in failed})[:5],
        },
        "process_io": io_check,
        "memory": {"peak_rss_bytes": peak, "bound_bytes": int(bound), "noise_buffer_bytes": comp.noise.nbytes,
                   "io_slots": comp.io_slots, "io_chunk_bytes": comp.io_chunk_bytes,
                   "cpu_tier_capacity_bytes": int(cpu_cap), "within_bound": peak <= bound},
        "storage": {
            "cache_dir": comp.cache_dir,
            "run_dir": str(ft.directory) if ft else None,
            "direct_io": bool(ft and ft.direct),
            "direct_io_supported": bool(ft and ft.direct_io_supported),
            "capacity_bytes": ft.capacity_bytes if ft else 0,
            "detected_free_bytes": ft.detected_free_bytes if ft else 0,
        },
        "workload_source": _source(comp),
        "setup": run.workload.get("setup", {}),
        "host": host_facts(comp.cache_dir),
        "warnings": all_warnings,
        "config": cfg.model_dump(mode="json"),
    }
