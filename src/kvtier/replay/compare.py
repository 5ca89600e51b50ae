"""What two replay results must share to be compared (``kvtier compare`` / ``kvtier replay compare``,
report/compare.py)."""

from __future__ import annotations

FIXED = (
    "model", "concurrency", "num_rounds", "dataset", "dataset_format", "gap_scale", "history", "user_order",
    "synthetic", "users", "turns", "isl", "osl", "shared_prefix", "synthetic_seed",
)  # fmt: skip
"""Config fields two runs must share to be compared."""


__all__ = ["FIXED"]
