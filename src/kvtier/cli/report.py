"""``kvtier report`` (one self-contained HTML file from results) and ``kvtier compare`` (ratios, refused when
not comparable)."""

from __future__ import annotations

import argparse
import sys

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.report import CompareConfig, ReportConfig


def add_report_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser(
        "report",
        help="one self-contained HTML file (tables, differences in words, plots) from kvtier results",
        description="kvtier report RESULT... --html out.html: bench results, replay folders or summary.json, MPI "
        "aggregates, MLPerf run summaries and launch.json files, side by side; plots need matplotlib (the plot extra)",
    )
    add_config_arguments(p, ReportConfig)
    p.set_defaults(func=run_report)
    c = sub.add_parser(
        "compare",
        help="bench or replay results, or plan answers (--output), side by side as ratios to the first (refused "
        "when not comparable)",
        description="kvtier compare A B ...: each argument one condition, or its trials joined by commas "
        "(a1.json,a2.json): the median over trials and its noise (coefficient of variation) beside each ratio",
    )
    add_config_arguments(c, CompareConfig)
    c.set_defaults(func=run_compare)


def run_report(a: argparse.Namespace) -> int:
    from kvtier.plan.recommend import recommend
    from kvtier.report.html import write_report

    cfg = config_from_args(a, ReportConfig)
    labels = [x.strip() for x in cfg.labels.split(",")] if cfg.labels else None
    info = write_report(cfg.results, cfg.html, cfg.png_dir, labels, read_sweep=lambda p: recommend(p, None, {}))
    plots = f"{len(info['plots'])} plots" if info["matplotlib"] else "no plots (pip install 'kvtier[plot]')"
    print(f"{cfg.html}: {len(info['results'])} results, {plots}, {info['bytes']:,} bytes in {info['seconds']:.2f} s")
    return 0


def compare_results(conditions: list[str], kind: str | None = None, force: bool = False) -> int:
    from kvtier.errors import DatasetError
    from kvtier.report.compare import compare, render
    from kvtier.report.html import load_all

    groups = [[p for p in c.split(",") if p] for c in conditions]
    flat = load_all([p for g in groups for p in g])
    if kind is not None:
        for it in flat:
            if it.kind != kind:
                raise DatasetError(f"{it.path}: a {it.result.benchmark} result, not a kvtier {kind} result")
    loaded, k = [], 0
    for g in groups:
        loaded.append(flat[k : k + len(g)])
        k += len(g)
    c = compare(loaded)
    for p in c.problems:
        print(f"NOT COMPARABLE: {p}", file=sys.stderr)
    if not c.comparable and not force:
        print(
            "kvtier compare: the runs differ in what makes their figures comparable; --force prints the table anyway",
            file=sys.stderr,
        )
        return 2
    print(render(c))
    return 0


def run_compare(a: argparse.Namespace) -> int:
    cfg = config_from_args(a, CompareConfig)
    return compare_results(cfg.conditions, force=cfg.force)
