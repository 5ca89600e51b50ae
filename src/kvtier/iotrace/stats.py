"""What an I/O trace holds: operations and bytes by tier, operation and phase; object sizes; the rate
over time; and reuse — how many distinct objects (and bytes) were touched between two accesses of
the same object, which is the LRU cache size that would have served the read.

Reuse distance is the LRU stack distance, computed exactly with two Fenwick trees over positions
(one counting objects, one summing their bytes): each object has a marker at its last access; an
access of an object last touched at position p counts the markers after p. Writes and reads are
both accesses; distances are reported for reads. A read of an object never seen before (a trace cut
from a longer run, or a reference trace of a decode-only node) is a *cold* read.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvtier.stats import Fenwick, percentile
from kvtier.tracefile import TIER_BY_NUMBER, IOTrace


def _split(trace: IOTrace, mask: np.ndarray) -> dict[str, int]:
    return {"ops": int(mask.sum()), "bytes": int(trace.size[mask].sum())}


def size_histogram(trace: IOTrace) -> list[dict[str, int]]:
    """Object sizes in power-of-two buckets [low, high), reads and writes counted apart."""
    if len(trace) == 0:
        return []
    exp = np.zeros(len(trace), dtype=np.int64)
    pos = trace.size > 0
    exp[pos] = np.floor(np.log2(trace.size[pos])).astype(np.int64)
    out = []
    for e in range(int(exp.min()), int(exp.max()) + 1):
        m = exp == e
        if not m.any():
            continue
        out.append(
            {
                "low_bytes": 0 if e == 0 and not pos[m].all() else 1 << e,
                "high_bytes": 1 << (e + 1),
                "reads": int((m & (trace.op == 0)).sum()),
                "writes": int((m & (trace.op == 1)).sum()),
            }
        )
    return out


def _sig(x: float) -> float:
    return float(f"{x:.6g}")


MAX_TIMELINE_BINS = 10_000
BINS_PER_ROW, MIN_BINS = 4, 64
"""At most this many rate bins, and at most BINS_PER_ROW per row of the trace (MIN_BINS at least): a trace whose
span would need more is binned coarser (``rate_interval_s`` says the width used), so time and JSON size follow
the rows, never the timestamps' span (two rows far apart gave 1.1 MB of empty bins with the first cap alone)."""


def timeline_bins(trace: IOTrace) -> int:
    """The most rate bins ``trace`` gets."""
    return min(MAX_TIMELINE_BINS, max(MIN_BINS, BINS_PER_ROW * len(trace)))


def timeline_interval(trace: IOTrace, interval_s: float) -> float:
    """``interval_s``, widened so that the trace's span fits in ``timeline_bins`` bins."""
    if not len(trace):
        return interval_s
    span = float(trace.ts.max() - trace.ts.min())
    return max(interval_s, span / (timeline_bins(trace) - 1)) if span > 0 else interval_s


def rate_timeline(trace: IOTrace, interval_s: float) -> list[dict[str, float]]:
    interval_s = timeline_interval(trace, interval_s)
    t = trace.ts - trace.ts[0]
    bins = np.minimum(np.floor(t / interval_s), timeline_bins(trace) - 1).astype(np.int64)
    n = int(bins.max()) + 1 if len(trace) else 0
    ops = np.bincount(bins, minlength=n)
    rb = np.bincount(bins, weights=np.where(trace.op == 0, trace.size, 0), minlength=n)
    wb = np.bincount(bins, weights=np.where(trace.op == 1, trace.size, 0), minlength=n)
    return [
        {
            "t_s": round(i * interval_s, 6),
            "ops_per_s": _sig(float(ops[i]) / interval_s),  # significant digits: wide bins keep small rates
            "read_bytes_per_s": _sig(float(rb[i]) / interval_s),
            "write_bytes_per_s": _sig(float(wb[i]) / interval_s),
        }
        for i in range(n)
    ]


def reuse_distances(trace: IOTrace) -> tuple[np.ndarray, np.ndarray, int]:
    """Per read with an earlier access: (distinct objects between, their bytes); and the cold reads."""
    n = len(trace)
    objs, nbytes = Fenwick(n), Fenwick(n)
    last: dict[int, tuple[int, int]] = {}  # key -> (position of its last access, its size then)
    d_objs: list[int] = []
    d_bytes: list[int] = []
    cold = 0
    keys, sizes, ops = trace.key.tolist(), trace.size.tolist(), trace.op.tolist()
    for pos in range(n):
        k, size = keys[pos], sizes[pos]
        prev = last.get(k)
        if prev is not None:
            p, psize = prev
            if ops[pos] == 0:
                d_objs.append(objs.prefix(pos) - objs.prefix(p + 1))
                d_bytes.append(nbytes.prefix(pos) - nbytes.prefix(p + 1))
            objs.add(p, -1)
            nbytes.add(p, -psize)
        elif ops[pos] == 0:
            cold += 1
        objs.add(pos, 1)
        nbytes.add(pos, size)
        last[k] = (pos, size)
    return np.asarray(d_objs, dtype=np.int64), np.asarray(d_bytes, dtype=np.int64), cold


def _p(a: np.ndarray, q: float) -> float:
    v = percentile(a, q)
    return 0.0 if v is None else v


def _pcts(a: np.ndarray) -> dict[str, float | None]:
    return {f"p{q}": (None if a.size == 0 else _p(a, q)) for q in (50, 90, 95, 99)} | {
        "max": None if a.size == 0 else float(a.max())
    }


def reuse_section(trace: IOTrace, working_set_bytes: int) -> dict[str, Any]:
    d_objs, d_bytes, cold = reuse_distances(trace)
    reads = int((trace.op == 0).sum())
    curve = []
    if d_bytes.size:
        ws = working_set_bytes
        for frac in (0.01, 0.05, 0.1, 0.25, 0.5, 1.0):
            cap = int(ws * frac)
            curve.append({"cache_bytes": cap, "read_hit_fraction": round(float((d_bytes < cap).sum()) / reads, 6)})
    return {
        "reads": reads,
        "reads_with_earlier_access": int(d_objs.size),
        "cold_reads": cold,
        "distance_objects": _pcts(d_objs),
        "distance_bytes": _pcts(d_bytes),
        # an LRU cache of cache_bytes in front of everything would have served this share of the reads
        "lru_hit_curve": curve,
    }


def _last_sizes(trace: IOTrace) -> dict[int, int]:
    return dict(zip(trace.key.tolist(), trace.size.tolist()))


def trace_stats(trace: IOTrace, interval_s: float = 1.0) -> dict[str, Any]:
    """Everything ``kvtier trace stats`` prints and writes (plain JSON types)."""
    reads, writes = trace.op == 0, trace.op == 1
    dur = trace.duration_s
    by_tier: dict[str, Any] = {}
    for t in sorted(set(trace.tier.tolist())):
        m = trace.tier == t
        by_tier[f"Tier-{t}"] = {
            "tier": TIER_BY_NUMBER.get(t, str(t)),
            "read": _split(trace, m & reads),
            "write": _split(trace, m & writes),
        }
    by_phase = {
        name: _split(trace, trace.phase == i) for i, name in enumerate(trace.phases) if (trace.phase == i).any()
    }
    total_bytes = int(trace.size.sum())
    timeline = rate_timeline(trace, interval_s)
    ops_rates = [p["ops_per_s"] for p in timeline]
    sizes = trace.size
    working = _last_sizes(trace)
    ws_bytes = int(sum(working.values()))
    return {
        "path": trace.path,
        "rows": len(trace),
        "rows_skipped": trace.rows_skipped,
        "first_unix_s": float(trace.ts[0]),
        "duration_s": round(dur, 6),
        "read": _split(trace, reads),
        "write": _split(trace, writes),
        "read_fraction_ops": round(float(reads.mean()), 6),
        "read_fraction_bytes": round(float(trace.size[reads].sum()) / total_bytes, 6) if total_bytes else None,
        "ops_per_s": round(len(trace) / dur, 3) if dur > 0 else None,
        "bytes_per_s": round(total_bytes / dur, 1) if dur > 0 else None,
        "peak_ops_per_s": max(ops_rates) if ops_rates else None,
        "by_tier": by_tier,
        "by_phase": by_phase,
        "objects": len(working),
        "working_set_bytes": ws_bytes,
        "object_size_bytes": {
            "mean": round(float(sizes.mean()), 1),
            "p50": _p(sizes, 50),
            "p95": _p(sizes, 95),
            "max": int(sizes.max()),
            "min": int(sizes.min()),
        },
        "size_histogram": size_histogram(trace),
        "rate_interval_s": timeline_interval(trace, interval_s),
        "rate_timeline": timeline,
        "reuse": reuse_section(trace, ws_bytes),
    }


def human_bytes(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    e = min(int(math.log(n, 1024)), 5)
    return f"{n / 1024**e:.2f} {'KMGTP'[e - 1]}iB"


__all__ = ["trace_stats", "reuse_distances", "size_histogram", "rate_timeline", "human_bytes"]
