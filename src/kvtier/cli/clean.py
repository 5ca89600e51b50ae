"""``kvtier clean DIR``: remove the run folders that killed kvtier runs left in DIR.

Only folders whose marker proves kvtier made them and whose lock no live run holds
(kvtier.engine.runs); a folder without the marker is never touched.
"""

from __future__ import annotations

import argparse
import sys


def add_clean_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser("clean", help="remove the run folders of killed kvtier runs from a cache or NVMe directory")
    p.add_argument("directory", help="the --cache-dir / --nvme-dir to clean")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed; remove nothing")
    p.set_defaults(func=run_clean)


def run_clean(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.engine.runs import find_stale_runs, remove_stale_run
    from kvtier.errors import ConfigError

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
