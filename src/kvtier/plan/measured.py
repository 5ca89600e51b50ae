"""Fetch costs from a kvtier bench result: measured per-tier read latency, not link rates.

Each tier's read operations give a mean size (bytes/op) and end-to-end latency statistics (host +
device, demotion reads included). The fetch time of a prefix of B bytes is modelled as the
measured latency scaled by B / mean size: ``fetch_mean = B / bw_mean`` with ``bw_mean = bytes /
(ops * mean latency)``, and the conservative ``fetch_p95 = B / bw_p95`` with ``bw_p95 = mean size /
p95 latency``. The gate decides on the p95 figure. Prefixes far from the measured size are flagged:
the linear scaling is an extrapolation there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import DatasetError


@dataclass(frozen=True)
class TierReadCost:
    tier: str
    ops: int
    mean_bytes: float
    mean_ms: float
    p95_ms: float
    bw_mean: float  # bytes/s
    bw_p95: float   # bytes/s

    def fetch_s(self, nbytes: float, conservative: bool = True) -> float:
        return nbytes / (self.bw_p95 if conservative else self.bw_mean)

    def extrapolated(self, nbytes: float) -> bool:
        return not (self.mean_bytes / 4 <= nbytes <= self.mean_bytes * 4)


def load_read_costs(path: str | Path) -> tuple[list[TierReadCost], dict[str, Any]]:
    p = Path(path)
    try:
        r = json.loads(p.read_text())
    except OSError as e:
        raise DatasetError(f"--from: cannot read {p}: {e.strerror}") from e
    except json.JSONDecodeError as e:
        raise DatasetError(f"{p}:{e.lineno}: not valid JSON ({e.msg})") from e
    if not isinstance(r, dict) or "tiers" not in r or r.get("benchmark") != "kvtier bench":
        raise DatasetError(f"{p}: not a kvtier bench result (no 'tiers' section)")
    costs = []
    for name, t in r["tiers"].items():
        try:
            rd = t["read"]
            ops, nbytes, lat = int(rd["ops"]), int(rd["bytes"]), rd["latency_ms"]
        except (KeyError, TypeError, ValueError) as e:
            raise DatasetError(f"{p}: tiers.{name}.read is malformed ({e})") from e
        if ops == 0 or not lat.get("mean") or not lat.get("p95"):
            continue
        mean_b = nbytes / ops
        costs.append(TierReadCost(name, ops, mean_b, lat["mean"], lat["p95"],
                                  mean_b / (lat["mean"] / 1e3), mean_b / (lat["p95"] / 1e3)))
    if not costs:
        raise DatasetError(f"{p}: no tier has completed reads to measure")
    meta = {"model": r.get("model", {}).get("key"), "status": r.get("status"), "file": str(p)}
    return costs, meta
