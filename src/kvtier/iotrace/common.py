"""Names shared by the I/O trace commands."""

from __future__ import annotations

TIER_NAMES = {0: "gpu", 1: "cpu", 2: "storage"}


def tier_label(t: int) -> str:
    return f"Tier-{t}"


__all__ = ["TIER_NAMES", "tier_label"]
