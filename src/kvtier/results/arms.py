"""The typed result of ``kvtier launch --arms`` (arms.json): the same replay against offload engines side by side.

Each arm is a stack launched fresh (an offload engine on a tier, or ``none``: vLLM's own GPU prefix cache alone);
the arms run in turn, their order reversed every other round (``--rounds``), so a slow drift of the host does not
favour one. Per arm, pooled over its rounds:

* **later-turn TTFT** — requests whose prompt extends an earlier one of its session (``turn > 0`` or, for agent
  traces whose every step is its own session, ``session_turn > 0``): p50 and p95, each with a 95 % bootstrap
  interval (seeded), and the p50 by turn;
* **prompt tokens by source** — what vLLM's own counters say served them (``local_compute``, ``local_cache_hit``,
  ``external_kv_transfer``; the cached ones by tier: ``device``, ``host``, ``disk``), summed over replicas and rounds;
* **offload traffic** — vLLM's ``kv_offload_*`` bytes and seconds; kvtier's failed loads;
* **failures** by cause, and requests cut at the stop.

The verdict of an arm against ``none``: it **pays** when its later-turn p50's interval lies wholly below none's, it
**costs** when wholly above; otherwise the intervals overlap and the run cannot tell (``pays: null``, with the
ratio). Per turn, the ratio of p50s.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvtier.config.launch import LaunchConfig
from kvtier.results.envelope import Envelope, Section


class ArmRun(Section):
    round: int
    folder: str
    status: str  # the launch's: complete | partial | failed
    stop: str
    requests: int
    ok: int
    failed: dict[str, int] = Field(default_factory=dict)  # by cause
    cut: int = 0
    error: str | None = None  # a launch that did not start (its message)


class Spread(Section):
    """A TTFT percentile with its 95 % bootstrap interval, seconds."""

    n: int
    p50_s: float | None
    p50_lo_s: float | None
    p50_hi_s: float | None
    p95_s: float | None
    p95_lo_s: float | None
    p95_hi_s: float | None


class ArmOffload(Section):
    load_bytes: float | None = None
    load_s: float | None = None
    store_bytes: float | None = None
    store_s: float | None = None
    load_gb_per_s: float | None = None
    kvtier_failed_loads: float | None = None
    cross_replica_loads: float | None = None  # kvtier-shared: blocks one replica loaded that another stored


class ArmStats(Section):
    arm: str  # as given: none, kvtier, kvtier:nvme, ...
    offload_engine: str
    tier: str
    profile: str | None
    runs: list[ArmRun]
    later_ttft: Spread
    all_ttft: Spread
    later_ttft_p50_by_turn_s: dict[str, float]
    prompt_tokens: int  # of the ok requests, as the servers counted them
    tokens_by_source: dict[str, float]
    hit_rate_by_source: dict[str, float]  # tokens by source over prompt tokens
    cached_by_source: dict[str, float]
    offload: ArmOffload
    failed: dict[str, int]


class Verdict(Section):
    arm: str
    against: Literal["none"] = "none"
    later_ttft_p50_ratio: float | None  # the arm's p50 over none's
    pays: bool | None  # True: faster beyond both intervals; False: slower beyond them; None: cannot tell
    why: str
    by_turn_ratio: dict[str, float]


class ArmsResult(Envelope):
    benchmark: Literal["kvtier launch arms"] = "kvtier launch arms"
    rounds: int
    order: list[list[str]]  # the arms in the order each round ran them
    arms: list[ArmStats]
    verdicts: list[Verdict]
    config: LaunchConfig


__all__ = ["ArmRun", "ArmStats", "ArmsResult", "ArmOffload", "Spread", "Verdict"]
