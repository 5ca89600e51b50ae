"""The one definition of a distribution summary in kvtier: mean, percentiles, max, count.

Percentiles are exact over the raw samples, computed by numpy's default "linear" method
(Hyndman-Fan type 7: the value at rank ``q/100 * (n - 1)``, interpolated between the two nearest
order statistics). Every latency figure kvtier writes — bench (milliseconds, from integer
nanosecond samples), replay (seconds), the autoscaler's saturation and the planner's measured
reads — goes through this module, so a p95 means the same thing in every file.

Names: ``p50 p90 p95 p99 p999 p9999`` for the 50th, 90th, 95th, 99th, 99.9th and 99.99th
percentiles. An empty sample set gives ``count 0`` and nulls, never zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

PERCENTILES: tuple[float, ...] = (50, 90, 95, 99, 99.9, 99.99)
PERCENTILE_NAMES: tuple[str, ...] = ("p50", "p90", "p95", "p99", "p999", "p9999")
SUMMARY_KEYS: tuple[str, ...] = ("count", "mean", *PERCENTILE_NAMES, "max")

Samples = Sequence[float] | Sequence[int] | npt.NDArray[np.generic]
Summary = dict[str, float | int | None]


def percentile(samples: Samples, q: float) -> float | None:
    """The q-th percentile (0-100) of the samples by the method above; None when there are none."""
    a = np.asarray(samples, dtype=np.float64)
    return None if a.size == 0 else float(np.percentile(a, q))


def summarize(samples: Samples, scale: float = 1.0, digits: int = 4) -> Summary:
    """count, mean, p50..p9999 and max of ``samples`` multiplied by ``scale``, rounded to ``digits``.

    ``scale`` converts units once, here: 1e-6 turns nanoseconds into milliseconds."""
    a = np.asarray(samples, dtype=np.float64)
    if a.size == 0:
        return {"count": 0, "mean": None, **dict.fromkeys(PERCENTILE_NAMES), "max": None}
    q = np.percentile(a, PERCENTILES) * scale
    out: Summary = {"count": int(a.size), "mean": round(float(a.mean()) * scale, digits)}
    out.update({n: round(float(v), digits) for n, v in zip(PERCENTILE_NAMES, q, strict=True)})
    out["max"] = round(float(a.max()) * scale, digits)
    return out


def summarize_ns_as_ms(samples_ns: Samples) -> Summary:
    """A summary of integer-nanosecond samples in milliseconds (4 decimals: 100 ns resolution)."""
    return summarize(samples_ns, scale=1e-6, digits=4)


def empty_summary() -> Summary:
    return summarize([])


class Fenwick:
    """Integer sums over positions 0..n-1 with point updates, each O(log n): the LRU stack-distance
    machinery of ``kvtier trace stats`` and ``kvtier plan retention`` (a weight sits at each object's last
    access, so a range sum is the distinct objects, or their bytes, touched in that range)."""

    __slots__ = ("n", "tree")

    def __init__(self, n: int) -> None:
        self.n = n
        self.tree = [0] * (n + 1)

    def add(self, i: int, v: int) -> None:
        i += 1
        tree, n = self.tree, self.n
        while i <= n:
            tree[i] += v
            i += i & -i

    def prefix(self, i: int) -> int:
        """Sum of positions [0, i)."""
        s, tree = 0, self.tree
        while i > 0:
            s += tree[i]
            i -= i & -i
        return s


__all__ = [
    "Fenwick",
    "PERCENTILES",
    "PERCENTILE_NAMES",
    "SUMMARY_KEYS",
    "percentile",
    "summarize",
    "summarize_ns_as_ms",
    "empty_summary",
]
