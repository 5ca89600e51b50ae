"""Entry point: ``kvtier <subcommand>``; maps kvtier errors to one line and an exit code."""

from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn

from kvtier import __version__
from kvtier.errors import KvtierError, exit_code_for


class KvtierParser(argparse.ArgumentParser):
    """argparse with a suggestion for a misspelt flag or subcommand (the closest known spelling)."""

    def _known(self) -> list[str]:
        out = [o for a in self._actions for o in a.option_strings]
        for a in self._actions:
            if isinstance(a, argparse._SubParsersAction):
                out += list(a.choices)
                for sub in a.choices.values():
                    out += sub._known() if isinstance(sub, KvtierParser) else []
        return out

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        root = self._root()
        if root is not self:  # the deepest subcommand parses last: its flags are the ones a misspelling meant
            root._active = self  # type: ignore[attr-defined]
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        import difflib
        import re

        hints = []
        words = re.findall(r"(?:unrecognized arguments: |invalid choice: ')(.+?)(?:'|$)", message)
        # the command being parsed (a misspelt flag of kvtier plan retention is one of its flags, not another
        # command's), else every command's
        scope = getattr(self._root(), "_active", None) or self._root()
        for token in (t for w in words for t in w.split()):
            close = difflib.get_close_matches(token.split("=")[0], sorted(set(scope._known())), n=1)
            if close:
                hints.append(f"{token}: did you mean {close[0]}?")
        super().error(message + "".join(f"\n  {h}" for h in hints))

    def _root(self) -> KvtierParser:
        return getattr(self, "_kvtier_root", self)


def build_parser() -> argparse.ArgumentParser:
    from kvtier.cli.bench import add_bench_parser
    from kvtier.cli.clean import add_clean_parser
    from kvtier.cli.ladder import add_ladder_parser
    from kvtier.cli.launch import add_launch_parser
    from kvtier.cli.mlperf import add_mlperf_parser
    from kvtier.cli.model import add_model_parser
    from kvtier.cli.plan import add_plan_parser
    from kvtier.cli.replay import add_replay_parser
    from kvtier.cli.report import add_report_parsers
    from kvtier.cli.sim import add_cache_server_parser, add_sim_parser
    from kvtier.cli.trace import add_trace_parser

    p = KvtierParser(prog="kvtier", description="Where should the KV cache live, and what does it cost?")
    p.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_plan_parser(sub)
    add_sim_parser(sub)
    add_cache_server_parser(sub)
    add_replay_parser(sub)
    add_ladder_parser(sub)
    add_launch_parser(sub)
    add_mlperf_parser(sub)
    add_model_parser(sub)
    add_trace_parser(sub)
    add_report_parsers(sub)
    add_clean_parser(sub)
    for child in _all_parsers(p):
        child._kvtier_root = p  # type: ignore[attr-defined]  # suggestions look through every command's flags
        # a flag cut short is an error with a suggestion, not silently another flag; kvtier bench alone keeps
        # argparse's abbreviations: it is a drop-in for the MLPerf reference, whose command lines may use them
        child.allow_abbrev = child.prog == "kvtier bench"
    return p


def _all_parsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    out = [p]
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for sub in a.choices.values():
                out += _all_parsers(sub)
    return out


def _stream_large_copies(args: list[str]) -> None:
    """``kvtier bench`` from the command line: run again, at once, with glibc streaming copies of 1 MiB and more
    (engine/backend.py NT_COPY_BYTES: the CPU tier's page copies then run at memory speed). The same process (its
    PID, its MPI rank, its parent's signals), the same arguments; nothing has been started or printed yet."""
    import os

    from kvtier.engine.backend import nt_copy_environ

    env = nt_copy_environ(os.environ)
    if env is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable, "-m", "kvtier", *args], env)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and args.command == "bench":  # the command line itself, never a caller's own process
        _stream_large_copies(sys.argv[1:])
    try:
        if getattr(args, "plot", None):  # every --plot (plan, ladder): a missing matplotlib stops before any work
            from kvtier.report.plots import require_matplotlib

            require_matplotlib("--plot")
        return int(args.func(args) or 0)
    except KvtierError as e:
        for line in str(e).splitlines() or [type(e).__name__]:
            print(f"kvtier: error: {line}", file=sys.stderr)
        return exit_code_for(e)
    except BrokenPipeError:  # the reader went away (| head): nothing more to say, and no traceback
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python flushes stdout at exit: let that go nowhere
        return 0


def kv_cache(argv: list[str] | None = None) -> int:
    """The ``kv-cache`` console script: exactly ``kvtier bench``, under the name the MLPerf reference's
    wrappers call (``--kvcache-bin-path``, kv-cache-wrapper.sh), so they run kvtier unchanged."""
    if argv is None:  # the console script itself: as `kvtier bench` from the command line
        _stream_large_copies(["bench", *sys.argv[1:]])
    return main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
