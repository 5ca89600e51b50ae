"""kvtier launch: a tier's processes (cache sidecar, engine replicas, Caddy), a replay through them.

Library use::

    from kvtier.config import LaunchConfig, ReplayConfig
    from kvtier.launch import run

    result = run(LaunchConfig(tier="cpu", engine="sim", replicas=2, output="out",
                              replay=ReplayConfig(model="llama3.1-8b", dataset="sessions.jsonl")))
    print(result.status, result.exit_status)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.config.launch import LaunchConfig
    from kvtier.launch.resolved import LaunchPlan
    from kvtier.results.launch import LaunchResult


def plan(config: LaunchConfig) -> LaunchPlan:
    """Every command, port and URL of the launch, resolved; nothing starts (``--dry-run``)."""
    from kvtier.launch.orchestrate import plan as _plan

    return _plan(config)


def run(config: LaunchConfig) -> LaunchResult:
    """Start the processes, run the replay through them, tear everything down; launch.json and the
    replay's results are written under ``config.output``."""
    from kvtier.launch.orchestrate import execute

    return execute(plan(config))


__all__ = ["plan", "run"]
