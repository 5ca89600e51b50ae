"""``kvtier clean DIR``: remove the run folders that killed kvtier runs left in DIR.

Only folders whose marker proves kvtier made them and whose lock no live run holds
(kvtier.engine.runs); a folder without the marker is never touched.

``kvtier clean --remote --remote-namespace shared:NAME --redis-url URL | --s3-bucket B``: empty one shared
namespace of the Redis/S3 tiers (runs leave a shared namespace to its TTL); only keys under it are deleted,
whatever the server lists.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.tiers import RemoteTierFlags

CLEAN_SKIPS = ("redis_mem_gb", "redis_part_mb", "s3_capacity_gb", "s3_part_mb", "remote_ttl")
"""Remote flags that size or age what a run writes: nothing to do with emptying a namespace."""


def add_clean_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser("clean", help="remove the run folders of killed kvtier runs from a cache or NVMe directory")
    p.add_argument("directory", nargs="?", help="the --cache-dir / --nvme-dir to clean")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.add_argument("--remote", action="store_true", help="empty the shared namespace named by --remote-namespace")
    add_config_arguments(p, RemoteTierFlags, skip=CLEAN_SKIPS)  # the servers and the namespace, as bench names them
    p.set_defaults(func=run_clean)


def clean_remote(a: argparse.Namespace) -> int:
    """Empty a shared namespace on the given servers; 0 when every server was emptied."""

    from kvtier.errors import ConfigError
    from kvtier.tiers import KINDS, configured_remote, open_tier, remote_spec

    flags = config_from_args(a, RemoteTierFlags, redis_mem_gb=1 if getattr(a, "redis_url", None) else 0)
    if flags.shared_namespace is None:
        raise ConfigError("--remote: give --remote-namespace shared:NAME (a run's own key space is emptied by the run)")
    kinds = configured_remote(flags)
    if not kinds:
        raise ConfigError("--remote: give --redis-url and/or --s3-bucket")
    problems: list[str] = []
    for kind in kinds:
        try:
            tier: Any = open_tier(kind, remote_spec(kind, flags, connections=2))
        except ConfigError as e:
            problems.append(str(e))
            continue
        where = tier.prefix
        if a.dry_run:
            print(f"would remove {len(tier.purge_preview())} {KINDS[kind].entries} under {where}")
        else:
            print(f"removed {tier.purge()} {KINDS[kind].entries} under {where}")
        problems += tier.cleanup_problems
        tier.close()
    for p in problems:
        print(f"kvtier: warning: {p}", file=sys.stderr)
    return 1 if problems else 0


def run_clean(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.engine.runs import find_stale_runs, remove_stale_run
    from kvtier.errors import ConfigError

    if a.remote:
        return clean_remote(a)
    if a.directory is None:
        raise ConfigError("kvtier clean: give a DIR (or --remote)")
    if not Path(a.directory).is_dir():
        raise ConfigError(f"{a.directory}: not a directory")
    stale = find_stale_runs(a.directory)
    problems: list[str] = []
    for r in stale:
        print(f"{'would remove' if a.dry_run else 'removing'} {r.path} ({r.files} files, {r.bytes / 2**30:.2f} GiB)")
        if not a.dry_run:
            problems += remove_stale_run(r.path)
    for p in problems:
        print(f"kvtier: warning: {p}", file=sys.stderr)
    print(f"{len(stale)} stale run folders in {a.directory}" + ("" if stale or a.dry_run else " (nothing to do)"))
    return 1 if problems else 0
