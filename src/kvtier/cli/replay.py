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

    shown: set[str] = set()

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
            shown.add(w.message)

    from kvtier.errors import Interrupted

    try:
        result = run(cfg, on_start=on_start)
    except Interrupted as e:  # the library raises so scripts stop; the CLI prints the partial result and exits 130
        result = e.result  # type: ignore[assignment]
    print_outcome(result, str(cfg.output), frozenset(shown))
    return exit_code(result.status, result.stop_reason.code)


def queue_share(result: ReplayResult) -> tuple[float, str] | None:
    """The share of TTFT spent queued, and whose figure it is: the server's decomposition (the sim's, or vLLM's
    joined engine log), else a scraped vLLM's queue time over its own TTFT; None when nothing says."""
    d = result.summary.ttft_decomposition
    if d is not None and d.requests:
        ttft = sum(t.requests * t.ttft_s_mean for t in d.by_turn)
        queued = sum(t.requests * t.seconds_mean.get("queue", 0.0) for t in d.by_turn)
        if ttft > 0:
            return queued / ttft, "the server's TTFT decomposition"
    for m in result.server_metrics:
        if m.queue_time_s_mean is not None and m.ttft_server_s_mean:
            return m.queue_time_s_mean / m.ttft_server_s_mean, "the server's queue time over its TTFT"
    return None


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def print_outcome(result: ReplayResult, folder: str, shown: frozenset[str] = frozenset()) -> None:
    """The replay's result line (TTFT p50/p95/p99 and the share queued: the tail, not only the median), every
    coded warning, then what failed by cause and why it is not complete, in words."""
    from pathlib import Path

    from kvtier.results.outcome import closing_lines

    s = result.summary
    t, ss = s.ttft_s, s.sessions
    q = queue_share(result)
    queued = "" if q is None else f"; {q[0]:.0%} of TTFT queued ({q[1]})"
    d = s.ttft_degradation.median_pct
    degradation = "— (no later turn)" if d is None else f"{d:.1f} %"
    print(
        f"replay ({result.status.value}, {result.stop_reason.code.value}): {s.requests_ok}/{s.requests_total} "
        f"requests ok; TTFT p50 {_s(t.p50)} s, p95 {_s(t.p95)} s, p99 {_s(t.p99)} s{queued}; degradation median "
        f"{degradation}; sessions {ss.complete}/{ss.total} complete ({ss.incomplete} "
        f"incomplete, {ss.error} with errors); {Path(folder) / 'summary.json'}"
    )
    if s.twin is not None:  # a calibrated sim's times, as its measured error allows on the real server
        b, e = s.twin.ttft_s, s.twin.error
        quantiles = ", ".join(f"{q} {lo:.4g}-{hi:.4g} s" for q, (lo, hi) in b.items())
        print(f"on the real server (the twin's error, real / predicted x{e.ratio_low:.2f}-x{e.ratio_high:.2f}): "
              f"TTFT {quantiles}")  # fmt: skip
    for w in result.warnings:
        if w.message not in shown:  # the plan's were printed when the run started
            print(f"warning [{w.code}]: {w.message}")
    for line in closing_lines(result.status, result.stop_reason, s.failures, s.requests_ok):
        print(line)


def compare(pa: str, pb: str) -> int:
    """``kvtier replay compare A B``: ``kvtier compare`` for two replay results."""
    from kvtier.cli.report import compare_results

    return compare_results([pa, pb], kind="replay")
