"""``kvtier launch``: parse the launch flags (LaunchConfig) and the replay's after ``--`` (ReplayConfig),
then call ``kvtier.launch.resolved`` (``--dry-run``) or ``kvtier.launch.run``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    replay = parse_replay_args(a.replay_args) if a.replay_args or not values.get("check") else ReplayConfig()
    cfg = validate_config(LaunchConfig, {**values, "replay": replay})
    if cfg.check:
        return run_check(cfg)
    if cfg.dry_run:
        lp = plan(cfg)
        print(
            f"# kvtier launch --dry-run: profile {lp.profile_name} ({lp.profile_source}); ports are examples "
            "chosen free now",
            file=sys.stderr,
        )
        for what in lp.assumed:
            print(f"# assumed: {what}", file=sys.stderr)
        devices = lp.devices()
        if lp.inventory is not None:
            placed = ", ".join(f"{name} -> {','.join(d)}" for name, d in devices["per_replica"].items())
            print(f"# devices {lp.inventory.describe()}: {placed} ({devices['variable']})", file=sys.stderr)
        for w in lp.warnings:
            print(f"# warning {w.code}: {w.message}", file=sys.stderr)
        z = lp.sizes
        l2 = f"; L2 {z['l2_gb']:g} GB ({z['l2_source']})" if z["l2_gb"] is not None else ""
        if lp.sidecar is not None:
            print(f"# cache sidecar L1 {z['l1_gb']:g} GB ({z['l1_source']}){l2}", file=sys.stderr)
        for line in lp.lines():
            print(line)
        if lp.caddyfile:
            print("# Caddyfile:\n" + "\n".join("# " + line for line in lp.caddyfile.splitlines()), file=sys.stderr)
        return 0
    if cfg.arms:
        from kvtier.launch.arms import lines, run_arms

        arms = run_arms(cfg)
        for line in lines(arms):
            print(line)
        print(f"launch --arms: {arms.status.value} ({arms.stop_reason.code.value}); {cfg.output}/arms.json")
        return 0 if arms.status.value == "complete" else 130 if arms.stop_reason.code.value == "interrupted" else 1
    result = run(cfg)
    summary = Path(cfg.replay.output or Path(str(cfg.output)) / "replay") / "summary.json"
    if summary.is_file():  # the launch ends with its replay's result line, as the replay alone would
        from kvtier.cli.replay import print_outcome
        from kvtier.results import load

        replayed = load(summary)
        from kvtier.results.replay import ReplayResult

        if isinstance(replayed, ReplayResult):
            print_outcome(replayed, str(summary.parent))
    for f in result.faults or []:
        print(f.sentence())
    print(f"launch: {result.status.value} ({result.stop_reason.code.value}); {cfg.output}/launch.json")
    return result.exit_status if result.exit_status is not None else 1


def run_check(cfg: LaunchConfig) -> int:
    """``--check``: the engine environment a vLLM launch would run; exit 0 when it may go ahead."""
    if cfg.engine != "vllm":
        print("kvtier launch --check: the simulated engine needs no engine packages: ok")
        return 0
    from kvtier.launch.engines import check_engines

    python = None
    if cfg.build == "cpu":
        from kvtier.launch.orchestrate import cpu_engine_python

        python = cpu_engine_python(cfg)
    from kvtier.config.launch import offload_engine

    needs_lmcache = offload_engine(cfg.engine, cfg.build, cfg.tier, cfg.offload_engine) == "lmcache"
    chk = check_engines(needs_lmcache=needs_lmcache, python=python, cpu_build=cfg.build == "cpu")
    for line in chk.lines():
        print(line)
    fallback_only = bool(chk.problems) and all("compiled module" in p for p in chk.problems)
    if not chk.ok and cfg.allow_fallback and fallback_only:
        print("--allow-fallback: a launch would run, with an engine-fallback warning in launch.json")
        return 0
    return 0 if chk.ok else 1
