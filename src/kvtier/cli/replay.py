"""``kvtier replay``: replay recorded multi-turn sessions against an OpenAI-compatible server.

The flags are ReplayConfig's fields (config/replay.py); this module parses them, calls
``kvtier.replay.run``, prints, and maps the result to an exit code. ``kvtier replay compare A B``
compares two results.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.replay.plan import ReplayPlan
    from kvtier.results.replay import ReplayResult


def add_replay_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ReplayConfig)


def add_replay_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser("replay", help="replay recorded multi-turn sessions against an OpenAI-compatible server")
    add_replay_arguments(p)
    p.add_argument("compare", nargs="*", help="'compare A B': compare two results (summary.json files or folders)")
    p.set_defaults(func=run_replay)


def run_replay(a: argparse.Namespace) -> int:
    if getattr(a, "compare", None):
        if a.compare[0] != "compare" or len(a.compare) != 3:
            raise ConfigError("usage: kvtier replay compare A/summary.json B/summary.json")
        return compare(a.compare[1], a.compare[2])
    cfg = config_from_args(a, ReplayConfig)
    if cfg.output is None:
        raise ConfigError("--output: required (the result folder)")
    return replay(cfg)


def replay(cfg: ReplayConfig) -> int:
    """Run a replay as the CLI does (announce, run, print the summary line); returns the exit code.
    Under mpirun with two or more ranks, this process replays its share of the users (replay/mpi.py)."""
    from kvtier.mpi import RunEnvironment
    from kvtier.replay import run
    from kvtier.results.envelope import exit_code

    env = RunEnvironment.detect(cfg.mpi_timeout)
    if env.distributed:
        pooled = run(cfg, env=env)
        if env.rank == 0:
            print(f"replay: {env.size} MPI ranks pooled", file=sys.stderr)
            print_outcome(pooled, str(cfg.output))
        return env.exit(exit_code(pooled.status, pooled.stop_reason.code))

    def on_start(plan: ReplayPlan) -> None:
        print(
            f"kvtier replay: {len(plan.dataset.sessions)} sessions in {cfg.dataset or 'synthetic'} "
            f"({plan.dataset.format}) give {len(plan.users)} virtual users of {plan.config.num_rounds} turns",
            file=sys.stderr,
        )
        r = plan.reuse
        if r is not None and r["prompt_tokens"]:
            per = r["kv_bytes_per_session"]
            size = f"; KV per session p50 {per['p50'] / 2**30:.2f} GiB, max {per['max'] / 2**30:.2f} GiB" if per else ""
            print(
                f"kvtier replay: reuse opportunity of {r['prompt_tokens']:,} prompt tokens ({r['block_tokens']}-token "
                f"blocks): history {r['history_reuse_fraction']:.1%}, cross-session "
                f"{r['cross_session_reuse_fraction']:.1%}, new {r['new_fraction']:.1%}{size}",
                file=sys.stderr,
            )
        for w in plan.warnings:
            print(f"kvtier: warning: {w.message}", file=sys.stderr)

    from kvtier.errors import Interrupted

    try:
        result = run(cfg, on_start=on_start)
    except Interrupted as e:  # the library raises so scripts stop; the CLI prints the partial result and exits 130
        result = e.result  # type: ignore[assignment]
    print_outcome(result, str(cfg.output))
    return exit_code(result.status, result.stop_reason.code)


def print_outcome(result: ReplayResult, folder: str) -> None:
    """The replay's result line, then what failed by cause and why it is not complete, in words."""
    from kvtier.results.outcome import closing_lines

    s = result.summary
    sessions = s.sessions.model_dump()
    print(
        f"replay ({result.status.value}, {result.stop_reason.code.value}): {s.requests_ok}/{s.requests_total} "
        f"requests ok, TTFT p50 {s.ttft_s.p50} s, degradation median {s.ttft_degradation.median_pct} %, "
        f"sessions {sessions}; {folder}/summary.json"
    )
    for line in closing_lines(result.status, result.stop_reason, s.failures, s.requests_ok):
        print(line)


def compare(pa: str, pb: str) -> int:
    """``kvtier replay compare A B``: ``kvtier compare`` for two replay results."""
    from kvtier.cli.report import compare_results

    return compare_results([pa, pb], kind="replay")
