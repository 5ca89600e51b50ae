"""``kvtier compare``: bench or replay results (or ``kvtier plan`` answers of one subcommand) side by side, as
ratios to the first, refused when the runs differ in what makes their figures comparable.

Each condition is one result or several trials of it (``a.json,b.json,c.json``): a figure is then the
median over the trials, and its noise the coefficient of variation across them (stdev / mean), so a
ratio can be read against the spread the same configuration shows by itself. What must be equal:

* replay: ``REPLAY_FIXED`` (model, concurrency, rounds, dataset, gaps, history, user order) and
  the sessions and concurrency actually achieved;
* bench: the workload (``BENCH_FIXED``: model, users, duration, generation mode, tensor parallelism, the
  workload features and inputs, the tuning) — while the tiers, their sizes, the device, direct I/O and
  the I/O settings are what a comparison is for, and may differ.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import DatasetError
from kvtier.report.figures import Loaded

REPLAY_FIXED = (
    "model",
    "concurrency",
    "num_rounds",
    "dataset",
    "dataset_format",
    "gap_scale",
    "history",
    "user_order",
    "synthetic",
    "users",
    "turns",
    "isl",
    "osl",
    "shared_prefix",
    "synthetic_seed",
)
BENCH_FIXED = (
    "model",
    "num_users",
    "duration",
    "generation_mode",
    "tensor_parallel",
    "disable_multi_turn",
    "disable_prefix_caching",
    "enable_rag",
    "rag_num_docs",
    "rag_top_k",
    "enable_autoscaling",
    "use_burst_trace",
    "trace_path",
    "trace_format",
    "dataset_path",
    "prefill_only",
    "decode_only",
    "request_rate",
    "max_requests",
    "kv_layout",
    "performance_profile",
    "tuning",
)


COSMETIC = frozenset(
    {
        "output",
        "seed",
        "progress",
        "progress_interval",
        "log_level",
        "xlsx_output",
        "request_log",
        "base_url",
        "metrics_url",
        "scrape_interval",
        "mpi_timeout",
        "device_interval",
        "io_trace_log",
        "config",
        "cache_dir",
    }
)
"""Config fields that change how a run is watched or where it writes, not what it measures: never listed as
differences (a result's cache folder is a fresh temporary one each run)."""


@dataclass
class Row:
    name: str
    better: str
    unit: str  # "%": the first condition's value is compared by difference (points), not by ratio
    values: list[float | None]  # per condition: the median over its trials
    cv: list[float | None]  # per condition: stdev / mean over its trials (None for one trial)
    ratio: list[float | None]  # per condition: value / the first condition's


@dataclass
class Comparison:
    labels: list[str]
    trials: list[int]
    rows: list[Row]
    problems: list[str]
    differs: list[str]  # config fields that differ and may (what the comparison is about)

    @property
    def comparable(self) -> bool:
        return not self.problems


def _fixed(kind: str) -> tuple[str, ...]:
    """The config fields two runs must share. A plan answer has none: its flags are the question, and two
    answers are set side by side to see what a different question answers (the differing flags are listed)."""
    if kind.startswith("plan-"):
        return ()
    return REPLAY_FIXED if kind == "replay" else BENCH_FIXED


def _config(it: Loaded) -> dict[str, Any]:
    cfg = getattr(it.result, "config", {})  # an MPI aggregate keeps rank 0's config as a dict
    return dict(cfg) if isinstance(cfg, dict) else dict(cfg.model_dump(mode="json"))


def _kind(it: Loaded) -> str:
    """An MPI aggregate compares as a bench run: its figures have the bench's names."""
    return "bench" if it.kind == "bench-mpi" else it.kind


def _problems(conditions: Sequence[Sequence[Loaded]]) -> tuple[list[str], list[str]]:
    kind = _kind(conditions[0][0])
    fixed = _fixed(kind)
    base = _config(conditions[0][0])
    problems, differs = [], set()
    for cond in conditions:
        for it in cond:
            c = _config(it)
            for k in fixed:
                if c.get(k) != base.get(k):
                    shown = "(differs)" if k == "tuning" else f"{base.get(k)!r} vs {c.get(k)!r}"
                    problems.append(f"{it.label}: {k}: {shown}")
            differs |= {k for k in c if k not in fixed and c.get(k) != base.get(k) and k not in COSMETIC}
    if kind == "replay":
        b = conditions[0][0].replay
        for cond in conditions:
            for it in cond:
                r = it.replay
                if r.summary.sessions.complete != b.summary.sessions.complete or (
                    r.concurrency.achieved != b.concurrency.achieved
                ):
                    problems.append(
                        f"{it.label}: achieved sessions/concurrency differ: {b.summary.sessions.model_dump()} / "
                        f"{b.concurrency.achieved} vs {r.summary.sessions.model_dump()} / {r.concurrency.achieved}"
                    )
    return list(dict.fromkeys(problems)), sorted(differs)


def compare(conditions: Sequence[Sequence[Loaded]]) -> Comparison:
    if not conditions or any(not c for c in conditions):
        raise DatasetError("compare: give at least one result per condition")
    kinds = {_kind(it) for c in conditions for it in c}
    if len(kinds) != 1 or not ({"bench", "replay"} & kinds or all(k.startswith("plan-") for k in kinds)):
        raise DatasetError(
            f"compare: bench results (single runs or MPI aggregates), replay results or answers of one kvtier plan "
            f"subcommand (--output), one kind at a time (got {sorted({it.kind for c in conditions for it in c})})"
        )
    problems, differs = _problems(conditions)
    names: list[tuple[str, str, str]] = []
    for c in conditions:
        for it in c:
            names += [(f.name, f.better, f.unit) for f in it.figures if (f.name, f.better, f.unit) not in names]
    rows = []
    for name, better, unit in names:
        vals: list[float | None] = []
        cvs: list[float | None] = []
        for c in conditions:
            xs = [f.value for it in c if (f := it.figure(name)) is not None and f.value is not None]
            vals.append(statistics.median(xs) if xs else None)
            mean = statistics.fmean(xs) if xs else 0.0
            cvs.append(statistics.stdev(xs) / abs(mean) if len(xs) >= 2 and mean else None)
        ratio = [None if v is None or not vals[0] else v / vals[0] for v in vals]
        rows.append(Row(name, better, unit, vals, cvs, ratio))
    labels = [c[0].label if len(c) == 1 else f"{c[0].label} (+{len(c) - 1})" for c in conditions]
    return Comparison(labels, [len(c) for c in conditions], rows, problems, differs)


def render(c: Comparison) -> str:
    """The table as text: value (ratio to the first, ± noise across trials)."""

    def cell(v: float | None, r: float | None, cv: float | None, first: bool, base: float | None, unit: str) -> str:
        if v is None:
            return "—"
        s = f"{v:.4g}"
        if not first and unit == "%" and base is not None:
            s += f" ({v - base:+.1f} pts)"
        elif not first and r is not None:
            s += f" ({r:.2f}x)"
        if cv is not None:
            s += f" ±{cv * 100:.0f}%"
        return s

    width = max([len(r.name) for r in c.rows] + [10]) + 2
    cols = [max(len(lbl), 22) for lbl in c.labels]
    lines = [" " * width + "".join(f"{lbl:>{w + 2}}" for lbl, w in zip(c.labels, cols))]
    for row in c.rows:
        cells = [
            cell(v, r, cv, i == 0, row.values[0], row.unit)
            for i, (v, r, cv) in enumerate(zip(row.values, row.ratio, row.cv))
        ]
        lines.append(f"{row.name:<{width}}" + "".join(f"{x:>{w + 2}}" for x, w in zip(cells, cols)))
    if any(n > 1 for n in c.trials):
        lines.append("(median over trials; ± is the coefficient of variation across a condition's trials)")
    if c.differs:
        lines.append("configs differ in: " + ", ".join(c.differs))
    return "\n".join(lines)


__all__ = ["compare", "render", "Comparison", "Row", "BENCH_FIXED", "REPLAY_FIXED"]
