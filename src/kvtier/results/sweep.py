"""The typed result of ``kvtier plan sweep`` (sweep.json) and of ``kvtier plan recommend`` (docs/plan.md).

A sweep is a grid of placements (CPU GB x NVMe GB x concurrency), each run ``trials`` times as a replay against a
fresh ``kvtier sim`` whose offload tiers are kvtier's real engine. Every trial is its own replay result folder
(``POINT/trial-N/summary.json``); sweep.json lists them with their status, so a sweep stopped by its budget or
Ctrl+C resumes where it stopped and ``recommend`` reads what ran."""

from __future__ import annotations

from typing import Literal

from kvtier.results.envelope import Envelope, Section


class SweepGrid(Section):
    dataset: str
    dataset_format: str
    cpu_gb: list[float]
    nvme_gb: list[float]
    concurrency: list[int]
    trials: int
    budget_s: float  # 0: no bound
    preset: str
    sim_model: str
    gpu_kv_gb: float
    num_rounds: int
    max_tokens_cap: int | None
    duration_s: float  # per trial (0: the whole dataset)
    nvme_dir: str
    replay_args: list[str]  # passed to every trial's kvtier replay as given
    calibration: str | None = None  # every trial's sim calibrated from this ladder (kvtier sim --calibration)
    accept_unreliable: bool = False


class SweepTrial(Section):
    point: str  # cpu{GB}-nvme{GB}-c{N}
    cpu_gb: float
    nvme_gb: float
    concurrency: int
    trial: int
    path: str  # the trial's replay folder, relative to the sweep's
    status: Literal["complete", "partial", "failed", "not-run"]
    reused: bool  # a complete trial found from an earlier run of the sweep
    wall_s: float | None
    sim_argv: list[str]
    error: str | None = None


class SweepResult(Envelope):
    """One ``kvtier plan sweep`` (sweep.json)."""

    benchmark: Literal["kvtier plan sweep"] = "kvtier plan sweep"
    grid: SweepGrid
    trials: list[SweepTrial]
    wall_s: float


__all__ = ["SweepGrid", "SweepResult", "SweepTrial"]
