"""Every key the MLPerf reference writes in its result JSON is in kvtier's, at the same path.

The key sets are the reference's (kv_cache_benchmark/kv_cache/benchmark.py ``results`` and
``_calculate_stats``, cache.py ``get_stats``, monitoring.py ``get_qos_metrics``, prefix_cache.py
``stats``), as written by a default run; pinned here so a rename on either side is noticed.
"""

from __future__ import annotations

import json

import pytest

TOP = {
    "requests_completed",
    "total_tokens_generated",
    "total_storage_io_latency",
    "total_generation_latency",
    "end_to_end_latencies",
    "storage_latencies",
    "generation_latencies",
    "throughput_timeline",
    "prefill_latencies",
    "decode_latencies",
    "multi_turn_cache_hits",
    "multi_turn_cache_misses",
    "seed",
    "summary",
}
SUMMARY = {
    "total_requests",
    "total_tokens",
    "elapsed_time",
    "avg_throughput_tokens_per_sec",
    "total_storage_io_time",
    "storage_throughput_tokens_per_sec",
    "requests_per_second",
    "end_to_end_latency_ms",
    "storage_io_latency_ms",
    "generation_latency_ms",
    "cache_stats",
    "qos_metrics",
    "prefix_cache_stats",
    "autoscaling_stats",
    "autoscaling_summary",
    "multi_turn_stats",
}
LATENCY = {"mean", "p50", "p95", "p99", "p999", "p9999"}
PCTS = ("p50", "p95", "p99", "p999", "p9999")
CACHE_STATS = {
    "cache_hit_rate",
    "cache_hits",
    "cache_misses",
    "gpu_entries",
    "cpu_entries",
    "storage_entries",
    "gpu_memory_used_gb",
    "cpu_memory_used_gb",
    "offloads_cpu",
    "offloads_storage",
    "storage_health",
    "prefill_writes",
    "decode_reads",
    "system_prompt_hits",
    "common_phrase_hits",
    "user_cache_hits",
    "multi_turn_hits",
    "total_read_bytes",
    "total_write_bytes",
    "total_read_gb",
    "total_write_gb",
    "read_write_ratio",
    "read_iops",
    "write_iops",
    "storage_tokens_processed",
    *(f"tier_{t}_kv_bytes_{op}_gb" for t in ("gpu", "cpu", "storage") for op in ("written", "read")),
    *(f"tier_{t}_{op}_bandwidth_gbps" for t in ("gpu", "cpu", "storage") for op in ("read", "write")),
    *(f"{t}_{op}_{p}_ms" for t in ("gpu", "cpu", "storage") for op in ("read", "write") for p in PCTS),
    *(f"storage_{op}_{part}_{p}_ms" for op in ("read", "write") for part in ("device", "host") for p in PCTS),
}
STORAGE_HEALTH = {"overall_status", "criteria", "passed_count", "total_count"}
CRITERION = {"name", "target", "actual", "unit", "passed"}
QOS = {"total_requests", "latency_ms", "sla"}
QOS_LATENCY = {"mean", "p50", "p95", "p99", "max"}
SLA = {"target_p95_ms", "actual_p95_ms", "compliance", "met"}
MULTI_TURN = {"cache_hits", "cache_misses", "hit_rate"}
PREFIX = {"prefix_hits", "prefix_misses", "system_prompt_reuse", "common_phrase_reuse", "bytes_saved"}
TIMELINE = {"timestamp", "throughput_tokens_per_sec"}


def missing(have: dict, want: set[str], where: str) -> list[str]:
    return [f"{where}.{k}" if where else k for k in sorted(want - set(have))]


def test_a_kvtier_result_has_every_key_the_reference_writes(tiny_bench_result):
    _, path = tiny_bench_result
    r = json.loads(path.read_text())
    s = r["summary"]
    cs = s["cache_stats"]
    gaps = missing(r, TOP, "") + missing(s, SUMMARY, "summary") + missing(cs, CACHE_STATS, "summary.cache_stats")
    for key in ("end_to_end_latency_ms", "storage_io_latency_ms", "generation_latency_ms"):
        gaps += missing(s[key], LATENCY, f"summary.{key}")
    gaps += missing(cs["storage_health"], STORAGE_HEALTH, "summary.cache_stats.storage_health")
    for c in cs["storage_health"]["criteria"]:
        gaps += missing(c, CRITERION, "summary.cache_stats.storage_health.criteria[]")
    for level in ("interactive", "responsive", "batch"):
        q = s["qos_metrics"][level]
        if q["no_data"]:  # the reference writes {"no_data": true} alone; kvtier keeps the shape, nulls inside
            continue
        gaps += missing(q, QOS, f"summary.qos_metrics.{level}")
        gaps += missing(q["latency_ms"], QOS_LATENCY, f"summary.qos_metrics.{level}.latency_ms")
        gaps += missing(q["sla"], SLA, f"summary.qos_metrics.{level}.sla")
    gaps += missing(s["multi_turn_stats"], MULTI_TURN, "summary.multi_turn_stats")
    gaps += missing(s["prefix_cache_stats"], PREFIX, "summary.prefix_cache_stats")
    for point in r["throughput_timeline"]:
        gaps += missing(point, TIMELINE, "throughput_timeline[]")
    assert gaps == []
    assert isinstance(s["autoscaling_stats"], list) and s["autoscaling_summary"] is None  # as the reference, off
    assert len(r["end_to_end_latencies"]) == r["requests_completed"] == s["total_requests"]
    assert sum(r["storage_latencies"]) == pytest.approx(r["total_storage_io_latency"], abs=1e-5)
