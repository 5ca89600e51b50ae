"""``--validation-trace``: how realistic was a run? Its request sizes and arrivals against a real trace.

Three distributions are compared, run against trace: input (context) tokens per request, output
(generated) tokens per request, and the seconds between consecutive submissions (the run's, pooled
over users) or arrivals (the trace's). Per distribution the result gives each side's mean, p50 and
p95 and two distances:

* ``ks``: the two-sample Kolmogorov-Smirnov statistic, max |F_run(x) - F_trace(x)|, in [0, 1]: 0 is
  the same distribution; it is scale-free, and tells *whether* the shapes differ;
* ``w1_relative``: the Wasserstein-1 distance (the mean |Q_run(u) - Q_trace(u)| over quantiles u)
  divided by the trace's mean: *how far*, in units of the trace's typical value.

The trace is read with the loaders of ``--trace-path`` (Azure, BurstGPT, Mooncake; format detected).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.stats import percentile
from kvtier.telemetry.recorder import BenchRequest
from kvtier.workload.traces import Trace


def ks_statistic(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    x = np.concatenate([a, b])
    fa = np.searchsorted(a, x, side="right") / a.size
    fb = np.searchsorted(b, x, side="right") / b.size
    return float(np.abs(fa - fb).max())


def w1_relative(a: np.ndarray, b: np.ndarray, points: int = 1001) -> float | None:
    """Wasserstein-1 between a and b, over b's mean (None when b's mean is 0)."""
    u = np.linspace(0.0, 1.0, points)
    w1 = float(np.abs(np.quantile(a, u) - np.quantile(b, u)).mean())
    mean = float(np.mean(b))
    return None if mean == 0 else w1 / mean


def _describe(a: np.ndarray) -> dict[str, float]:
    return {
        "count": int(a.size),
        "mean": round(float(a.mean()), 6),
        "p50": round(percentile(a, 50) or 0.0, 6),
        "p95": round(percentile(a, 95) or 0.0, 6),
    }


def compare(run: np.ndarray, trace: np.ndarray) -> dict[str, Any]:
    if run.size == 0 or trace.size == 0:
        return {"ks": None, "w1_relative": None, "run": None, "trace": None}
    w1 = w1_relative(run, trace)
    return {
        "ks": round(ks_statistic(run, trace), 6),
        "w1_relative": None if w1 is None else round(w1, 6),
        "run": _describe(run),
        "trace": _describe(trace),
    }


def validation_section(trace: Trace, path: str, requests: list[BenchRequest]) -> dict[str, Any]:
    ok = [r for r in requests if r.ok]
    submits = np.sort(np.array([r.submit_ns for r in ok], dtype=np.float64)) / 1e9
    arrivals = np.sort(np.array([r.arrival_s for r in trace.requests], dtype=np.float64))
    dists = {
        "input_tokens": compare(
            np.array([r.context_tokens for r in ok], dtype=np.float64),
            np.array([r.input_tokens for r in trace.requests], dtype=np.float64),
        ),
        "output_tokens": compare(
            np.array([r.generate_tokens for r in ok], dtype=np.float64),
            np.array([r.output_tokens for r in trace.requests], dtype=np.float64),
        ),
        "inter_arrival_s": compare(np.diff(submits), np.diff(arrivals)),
    }
    return {
        "trace": path,
        "format": trace.format,
        "trace_requests": len(trace.requests),
        "run_requests": len(ok),
        "distributions": dists,
        "max_ks": max((d["ks"] for d in dists.values() if d["ks"] is not None), default=None),
    }


__all__ = ["validation_section", "ks_statistic", "w1_relative", "compare"]
