"""Entry point: ``kvtier <subcommand>``; maps kvtier errors to one line and an exit code."""

from __future__ import annotations

import argparse
import sys

from kvtier import __version__
from kvtier.errors import KvtierError, exit_code_for


def build_parser() -> argparse.ArgumentParser:
    from kvtier.cli.bench import add_bench_parser
    from kvtier.cli.clean import add_clean_parser
    from kvtier.cli.launch import add_launch_parser
    from kvtier.cli.mlperf import add_mlperf_parser
    from kvtier.cli.plan import add_plan_parser
    from kvtier.cli.replay import add_replay_parser
    from kvtier.cli.report import add_report_parsers
    from kvtier.cli.sim import add_cache_server_parser, add_sim_parser
    from kvtier.cli.trace import add_trace_parser

    p = argparse.ArgumentParser(prog="kvtier", description="Where should the KV cache live, and what does it cost?")
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_sim_parser(sub)
    add_cache_server_parser(sub)
    add_replay_parser(sub)
    add_launch_parser(sub)
    add_mlperf_parser(sub)
    add_trace_parser(sub)
    add_report_parsers(sub)
    add_clean_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KvtierError as e:
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"kvtier: error: {line}", file=sys.stderr)
        return exit_code_for(e)


def kv_cache(argv: list[str] | None = None) -> int:
    """The ``kv-cache`` console script: exactly ``kvtier bench``, under the name the MLPerf reference's
    wrappers call (``--kvcache-bin-path``, kv-cache-wrapper.sh), so they run kvtier unchanged."""
    return main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
