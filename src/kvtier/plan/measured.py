"""Fetch costs from a kvtier bench result: measured per-tier read latency, not link rates.

Each tier's read operations give a mean size (bytes/op) and end-to-end latency statistics (host +
device, demotion reads included). The fetch time of a prefix of B bytes is modelled as the
measured latency scaled by B / mean size: ``fetch_mean = B / bw_mean`` with ``bw_mean = bytes /
(ops * mean latency)``, and the conservative ``fetch_p95 = B / bw_p95`` with ``bw_p95 = mean size /
p95 latency``. The gate decides on the p95 figure. Prefixes far from the measured size are flagged:
the linear scaling is an extrapolation there.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import DatasetError
from kvtier.results.bench import BenchResult


@dataclass(frozen=True)
class TierReadCost:
    tier: str
    ops: int
    mean_bytes: float
    mean_ms: float
    p95_ms: float
    bw_mean: float  # bytes/s
    bw_p95: float  # bytes/s

    def fetch_s(self, nbytes: float, conservative: bool = True) -> float:
        return nbytes / (self.bw_p95 if conservative else self.bw_mean)

    def extrapolated(self, nbytes: float) -> bool:
        return not (self.mean_bytes / 4 <= nbytes <= self.mean_bytes * 4)


def read_costs(result: BenchResult) -> list[TierReadCost]:
    """Per-tier read costs of a bench result (tiers without completed reads are left out)."""
    costs = []
    for name, t in result.tiers.items():
        rd = t.read
        mean, p95 = rd.latency_ms.mean, rd.latency_ms.p95
        if rd.ops == 0 or not mean or not p95:
            continue
        mean_b = rd.bytes / rd.ops
        costs.append(TierReadCost(name, rd.ops, mean_b, mean, p95, mean_b / (mean / 1e3), mean_b / (p95 / 1e3)))
    return costs


def load_read_costs(path: str | Path) -> tuple[list[TierReadCost], BenchResult]:
    """Read costs of the bench result in ``path`` (loaded and validated by kvtier.results.load)."""
    from kvtier.results import load

    result = load(path)
    if not isinstance(result, BenchResult):
        raise DatasetError(f"{path}: a {result.benchmark} result, not a kvtier bench result")
    costs = read_costs(result)
    if not costs:
        raise DatasetError(f"{path}: no tier has completed reads to measure")
    return costs, result


__all__ = ["TierReadCost", "read_costs", "load_read_costs"]
