"""``kvtier launch``: parse the launch flags (LaunchConfig) and the replay's after ``--`` (ReplayConfig),
then call ``kvtier.launch.plan`` (``--dry-run``) or ``kvtier.launch.run``."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.args import add_config_arguments, config_values
from kvtier.config.base import validate_config
from kvtier.config.launch import LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError


def add_launch_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser(
        "launch",
        help="start a tier's sidecar, replicas and Caddy, run a replay through them, stop",
        description="kvtier launch --tier gpu|cpu|nvme --engine vllm|sim [--build nvidia|amd] "
        "[--replicas N] [--dry-run] --output OUTDIR -- <replay arguments>",
    )
    add_config_arguments(p, LaunchConfig)
    p.add_argument(
        "replay_args",
        nargs=argparse.REMAINDER,
        help="-- [replay] <replay arguments without --base-url/--output/--metrics-url>",
    )
    p.set_defaults(func=run_launch)


def parse_replay_args(raw: list[str]) -> ReplayConfig:
    """The replay arguments after ``--`` (an optional leading ``replay`` is skipped), as a ReplayConfig."""
    from kvtier.cli.replay import add_replay_arguments

    args = list(raw)
    if args and args[0] == "--":
        args = args[1:]
    if args and args[0] == "replay":
        args = args[1:]
    parser = argparse.ArgumentParser(prog="kvtier launch -- replay")
    add_replay_arguments(parser)
    try:
        ns = parser.parse_args(args)
    except SystemExit as e:
        raise ConfigError(f"replay arguments after --: {' '.join(args)!r} do not parse (see the message above)") from e
    return validate_config(ReplayConfig, config_values(ns, ReplayConfig))


def run_launch(a: argparse.Namespace) -> int:
    from kvtier.launch import plan, run

    values = config_values(a, LaunchConfig)
    cfg = validate_config(LaunchConfig, {**values, "replay": parse_replay_args(a.replay_args)})
    if cfg.dry_run:
        lp = plan(cfg)
        print(
            f"# kvtier launch --dry-run: profile {lp.profile_name} ({lp.profile_source}); ports are examples "
            "chosen free now",
            file=sys.stderr,
        )
        for line in lp.lines():
            print(line)
        if lp.caddyfile:
            print("# Caddyfile:\n" + "\n".join("# " + line for line in lp.caddyfile.splitlines()), file=sys.stderr)
        return 0
    result = run(cfg)
    return result.exit_status if result.exit_status is not None else 1
