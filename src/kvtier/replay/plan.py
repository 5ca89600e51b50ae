"""``ReplayPlan``: what a replay will do, checked before anything is sent; ``replay/driver.py`` makes it and
``replay/results.py`` reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.config.replay import ReplayConfig
from kvtier.replay.datasets import LoadedDataset, VirtualUser
from kvtier.results.envelope import (
    ResultWarning,
)
from kvtier.tokenizer import Tokenizer


@dataclass
class ReplayPlan:
    """What a replay will do, checked before anything is sent."""

    config: ReplayConfig  # effective: dataset format, tokenizer and event loop resolved
    dataset: LoadedDataset
    users: list[VirtualUser]
    tokenizer: Tokenizer
    tools: list[dict[str, Any]] | None
    warnings: list[ResultWarning] = field(default_factory=list)
    reuse: dict[str, Any] | None = None  # what the prompts share, computed before the run (replay/reuse.py)
    scrape: bool = True  # False on MPI ranks other than 0: one scraper per server
    prompt_tokens: dict[str, list[int]] = field(default_factory=dict)  # user -> prompt size per turn (tokenizer's)


__all__ = ["ReplayPlan"]
