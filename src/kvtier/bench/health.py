"""``storage_health``: the reference's pass/fail criteria for a bench run's storage tier (its profiles' latency
and throughput targets), judged from the run's own figures."""

from __future__ import annotations

from typing import Any

from kvtier.results.bench import OPS
from kvtier.stats import summarize_ns_as_ms
from kvtier.telemetry.recorder import Recorder
from kvtier.units import GiB

CPU_P95_TARGET_MS = 150.0
STORAGE_WRITE_P95_TARGET_MS = 500.0
STORAGE_READ_P95_TARGET_MS = 200.0
HIT_RATE_TARGET = 0.3
"""The reference's storage_health criteria for --performance-profile latency."""


def storage_health(
    profile: str, tiers: dict[str, dict[str, Any]], hit_rate: float | None, rec: Recorder, wall_s: float
) -> dict[str, Any]:
    """The reference's pass/fail criteria for --performance-profile (summary.cache_stats.storage_health)."""
    criteria: list[dict[str, Any]] = []
    st = tiers.get("storage")

    def add(name: str, target: float, actual: float, unit: str, passed: bool) -> None:
        criteria.append({"name": name, "target": target, "actual": round(actual, 6), "unit": unit, "passed": passed})

    if profile == "throughput":
        rd = st["read"]["bytes"] if st else 0
        wr = st["write"]["bytes"] if st else 0
        if rd > 0 or wr == 0:
            bw = rd / GiB / wall_s
            add("Storage KV Read Bandwidth", 0, bw, "GiB/s", bw > 0)
        if wr > 0 or rd == 0:
            bw = wr / GiB / wall_s
            add("Storage KV Write Bandwidth", 0, bw, "GiB/s", bw > 0)
    else:
        for op, target in (("write", STORAGE_WRITE_P95_TARGET_MS), ("read", STORAGE_READ_P95_TARGET_MS)):
            p95 = st[op]["device_latency_ms"]["p95"] if st else None
            if p95 is not None:
                add(f"Storage Tier {op.capitalize()} Device P95 < {target:g}ms", target, p95, "ms", p95 < target)
        cpu = [s.host_ns + s.device_ns for op in OPS for s in rec.ops.get(("cpu", op), [])]
        if cpu:
            p95 = float(summarize_ns_as_ms(cpu)["p95"] or 0.0)
            add(f"CPU RAM P95 < {CPU_P95_TARGET_MS:g}ms", CPU_P95_TARGET_MS, p95, "ms", p95 < CPU_P95_TARGET_MS)
        if hit_rate is not None:
            add(
                f"Cache Hit Rate > {HIT_RATE_TARGET:.0%}",
                HIT_RATE_TARGET,
                hit_rate,
                "ratio",
                hit_rate > HIT_RATE_TARGET,
            )
    passed = sum(1 for c in criteria if c["passed"])
    return {
        "profile": profile,
        "overall_status": "PASS" if passed == len(criteria) else "FAIL",
        "criteria": criteria,
        "passed_count": passed,
        "total_count": len(criteria),
    }


__all__ = ["storage_health"]
