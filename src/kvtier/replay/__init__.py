"""kvtier replay: recorded multi-turn conversations as closed-loop virtual users against a server.

Library use::

    from kvtier.config import ReplayConfig
    from kvtier.replay import run

    result = run(ReplayConfig(base_url="http://127.0.0.1:8000/v1", model="llama3.1-8b",
                              dataset="sessions.jsonl", concurrency=8, output="out/"))
    print(result.summary.ttft_s.p95, result.summary.ttft_degradation.median_pct)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.config.replay import ReplayConfig
    from kvtier.mpi import RunEnvironment
    from kvtier.replay.plan import ReplayPlan
    from kvtier.results.replay import ReplayResult


def run(
    config: ReplayConfig,
    *,
    env: RunEnvironment | None = None,
    on_start: Callable[[ReplayPlan], None] | None = None,
    handle_signals: bool = True,
) -> ReplayResult:
    """Replay ``config.dataset`` against ``config.base_url``; returns the result and, with
    ``config.output``, writes requests.jsonl and summary.json there. Bad flags or data raise before
    any request; SIGINT/SIGTERM (``handle_signals``, main thread) end the run as partial: its result is written,
    then ``kvtier.errors.Interrupted`` (a KeyboardInterrupt carrying the result) is raised, so a calling script
    stops as it would on Ctrl+C.

    ``env`` is where the run runs (kvtier/mpi.py ``RunEnvironment``): locally (the default) every virtual
    user; as one rank of an MPI launch, this rank's share of them over one shared start, and on rank 0 the
    result pooled over every rank (replay/mpi.py)."""
    if env is not None and env.distributed:
        from kvtier.replay.mpi import run_rank

        return run_rank(config, env, handle_signals)
    from pathlib import Path

    from kvtier.errors import ConfigError, Interrupted
    from kvtier.replay.driver import execute, prepare, write_outputs
    from kvtier.results.envelope import StopCode

    fresh = bool(config.output) and not Path(str(config.output)).exists()
    plan = prepare(config)
    if on_start is not None:
        on_start(plan)
    try:
        result, records = execute(plan, handle_signals)
    except ConfigError:  # refused before any request (the server does not answer, serves another model)
        if fresh:  # leave no empty result folder behind (prepare made it to check it can be written)
            try:
                Path(str(config.output)).rmdir()
            except OSError:
                pass  # something was written there after all: kept
        raise
    if config.output:
        write_outputs(result, records, config.output)
    if handle_signals and result.stop_reason.code in (StopCode.interrupted, StopCode.terminated):
        where = f"; its partial result is in {config.output}" if config.output else ""
        raise Interrupted(result, f"replay {result.stop_reason.code.value}{where}")
    return result


__all__ = ["run"]
