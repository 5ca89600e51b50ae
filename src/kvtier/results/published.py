"""A run's MLPerf table beside the published v3.0 KV cache rows (``kvtier mlperf compare``, ``kvtier report``).

A run summary in the MLPerf wrapper's layout — mlpstorage's ``kvcache_run_summary_<time>.json``, a published run's
``summary.json``, or kvtier's ``kvcache_run_summary.json`` (``kvtier mlperf run``) — holds
``options.<o>.aggregated_*`` and ``rank_count`` (``RunOption``). The published rows come from
``published_v3.yaml`` (``Published``; each row names its source). Each published column is one key of the
submitter's ``summary.json`` (mlpstorage's report generator maps them so; published_v3.yaml says which, and
tests/unit/results/test_mlperf_compare.py feeds a published run's own summary and gets x1 against its own row):
tok/s is ``aggregated_avg_throughput_tokens_per_sec``, read GiB/s ``aggregated_read_bandwidth_gbps``, and "P95"
``aggregated_p95_latency_ms`` (the highest rank's ``summary.storage_io_latency_ms.p95``, max over the trials: storage
time per request, queueing included). Per option the run's figures sit beside each row's, as a ratio of the
totals and per rank (the rows differ in scale: 1 to 32 ranks). The storage device p95 is another figure, shown
and never divided. An option the run lacks is named: a CLOSED submission has all three.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvtier.errors import DatasetError
from kvtier.results.mlperf import KvtierOptionFigures


class _Fixed(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PublishedFigure(_Fixed):
    tokens_per_sec: float
    read_gbps: float
    p95_read_latency_ms: float


class PublishedRow(_Fixed):
    submitter: str
    system: str
    division: str
    ranks: int = Field(ge=1)
    hosts: int = Field(ge=1)
    source: str
    options: dict[int, PublishedFigure]


class Published(_Fixed):
    version: str
    rows: list[PublishedRow]


class RunOption(BaseModel):
    """One option of a run summary, mlpstorage's or kvtier's: the figures compared (others are kept, unread)."""

    model_config = ConfigDict(extra="allow")
    aggregated_avg_throughput_tokens_per_sec: float = Field(ge=0, allow_inf_nan=False)
    aggregated_read_bandwidth_gbps: float = Field(ge=0, allow_inf_nan=False)
    rank_count: float = Field(ge=0, le=1_000_000, allow_inf_nan=False)
    aggregated_storage_throughput_tokens_per_sec: float | None = None
    aggregated_write_bandwidth_gbps: float | None = None
    aggregated_p95_latency_ms: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    aggregated_device_read_p95_ms: float | None = None
    partial_failure: bool = False
    missing_files: list[str] = Field(default_factory=list)
    kvtier: KvtierOptionFigures | None = None


class RunFigures(_Fixed):
    tokens_per_sec: float  # aggregated_avg_throughput_tokens_per_sec: the published tok/s
    read_gbps: float
    ranks: int
    tokens_per_sec_per_rank: float
    read_gbps_per_rank: float
    write_gbps: float | None
    device_read_p95_ms: float | None
    p95_latency_ms: float | None  # aggregated_p95_latency_ms: the published "P95" (storage time per request)
    storage_tokens_per_sec: float | None  # aggregated_storage_throughput_tokens_per_sec: shown, not compared


class RowComparison(_Fixed):
    submitter: str
    system: str
    ranks: int
    source: str
    tokens_per_sec: float
    read_gbps: float
    p95_read_latency_ms: float
    run_over_row_tokens: float | None
    run_over_row_read: float | None
    run_over_row_tokens_per_rank: float | None
    run_over_row_read_per_rank: float | None
    run_over_row_p95: float | None


class OptionComparison(_Fixed):
    run: RunFigures
    rows: list[RowComparison]


class PublishedComparison(_Fixed):
    published_version: str
    options: dict[str, OptionComparison]
    missing_options: list[int]
    notes: list[str]


def published() -> Published:
    text = resources.files("kvtier").joinpath("mlperf/published_v3.yaml").read_text()
    return Published.model_validate(yaml.safe_load(text))


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def run_options(options: dict[str, object], where: str = "") -> dict[str, RunOption]:
    """The options of a run summary, typed; an option without a compared figure names it (``where``: the file)."""
    out: dict[str, RunOption] = {}
    for o, s in options.items():
        if not isinstance(s, dict):
            raise DatasetError(f"{where}options.{o}: expected an object")
        for k in ("aggregated_avg_throughput_tokens_per_sec", "aggregated_read_bandwidth_gbps", "rank_count"):
            v = s.get(k)
            if not _number(v) or not 0 <= v < float("inf"):  # type: ignore[operator]  # a number, checked first
                raise DatasetError(f"{where}options.{o}.{k}: expected a number >= 0, got {v!r}")
        try:
            out[str(o)] = RunOption.model_validate(s)
        except ValidationError as e:
            err = e.errors()[0]
            raise DatasetError(f"{where}options.{o}.{'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return out


def comparable(options: dict[str, object]) -> dict[str, RunOption]:
    """The options that carry every compared figure (the others are left out, not refused)."""
    out = {}
    for o, s in options.items():
        try:
            out.update(run_options({o: s}))
        except DatasetError:
            continue
    return out


def load_summary(path: str | Path) -> dict[str, RunOption]:
    """The options of a run summary file, checked: every option has the figures compared (named when not)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e.strerror}") from e
    except (ValueError, RecursionError) as e:
        raise DatasetError(f"{p}: not JSON, or nested too deep: {type(e).__name__}") from None
    options = data.get("options") if isinstance(data, dict) else None
    if not isinstance(options, dict) or not options:
        raise DatasetError(f"{p}: no 'options' (expected a kvcache_run_summary from mlpstorage or kvtier mlperf run)")
    return run_options(options, f"{p}: ")


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def _row(run: RunFigures, row: PublishedRow, fig: PublishedFigure) -> RowComparison:
    tok, read, ranks, n = run.tokens_per_sec, run.read_gbps, run.ranks, row.ranks
    p95 = run.p95_latency_ms
    return RowComparison(
        submitter=row.submitter,
        system=row.system,
        ranks=n,
        source=row.source,
        tokens_per_sec=fig.tokens_per_sec,
        read_gbps=fig.read_gbps,
        p95_read_latency_ms=fig.p95_read_latency_ms,
        run_over_row_tokens=_ratio(tok, fig.tokens_per_sec),
        run_over_row_read=_ratio(read, fig.read_gbps),
        run_over_row_tokens_per_rank=_ratio(tok / ranks, fig.tokens_per_sec / n),
        run_over_row_read_per_rank=_ratio(read / ranks, fig.read_gbps / n),
        run_over_row_p95=None if p95 is None else _ratio(p95, fig.p95_read_latency_ms),
    )


def compare(options: dict[str, RunOption], rows: Published | None = None) -> PublishedComparison:
    pub = rows or published()
    out: dict[str, OptionComparison] = {}
    missing: list[int] = []
    notes: list[str] = []
    for o in ("1", "2", "3"):
        s = options.get(o)
        if s is None:
            missing.append(int(o))
            notes.append(f"option {o} is not in this run: a CLOSED submission has all three options")
            continue
        ranks = int(s.rank_count) or 1
        tok, read = s.aggregated_avg_throughput_tokens_per_sec, s.aggregated_read_bandwidth_gbps
        if s.partial_failure:
            notes.append(
                f"option {o}: partial_failure ({len(s.missing_files)} rank results missing): its sums leave those "
                "ranks out"
            )
        run = RunFigures(
            tokens_per_sec=tok,
            read_gbps=read,
            ranks=ranks,
            tokens_per_sec_per_rank=round(tok / ranks, 3),
            read_gbps_per_rank=round(read / ranks, 6),
            write_gbps=s.aggregated_write_bandwidth_gbps,
            device_read_p95_ms=s.aggregated_device_read_p95_ms,
            p95_latency_ms=s.aggregated_p95_latency_ms,
            storage_tokens_per_sec=s.aggregated_storage_throughput_tokens_per_sec,
        )
        figs = [(row, row.options.get(int(o))) for row in pub.rows]
        out[o] = OptionComparison(run=run, rows=[_row(run, row, fig) for row, fig in figs if fig is not None])
    return PublishedComparison(published_version=pub.version, options=out, missing_options=missing, notes=notes)


def _n(x: float) -> str:
    return f"{int(x):,}" if x == int(x) else f"{x:,}"


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def render(c: PublishedComparison) -> list[str]:
    lines = []
    for o, e in c.options.items():
        r = e.run
        p95, req = r.device_read_p95_ms, r.p95_latency_ms
        lines.append(
            f"option {o}: this run {r.tokens_per_sec:,.1f} tok/s, read {r.read_gbps:.3f} GiB/s over {r.ranks} ranks "
            f"({r.tokens_per_sec_per_rank:,.1f} tok/s, {r.read_gbps_per_rank:.3f} GiB/s per rank); device read p95 "
            f"{'—' if p95 is None else f'{p95:,.1f}'} ms"
            + ("" if req is None else f"; P95 latency {req:,.1f} ms (storage time per request, as published)")
        )
        for w in e.rows:
            lines.append(
                f"  {w.submitter} {w.system} ({w.ranks} rank{'s' if w.ranks != 1 else ''}): {_n(w.tokens_per_sec)} "
                f"tok/s, read {_n(w.read_gbps)} GiB/s, P95 latency {_n(w.p95_read_latency_ms)} ms (per request) | "
                f"this run x{_fmt(w.run_over_row_tokens)} tok/s, x{_fmt(w.run_over_row_read)} read; per rank "
                f"x{_fmt(w.run_over_row_tokens_per_rank)}, x{_fmt(w.run_over_row_read_per_rank)}"
                + ("" if w.run_over_row_p95 is None else f"; P95 x{_fmt(w.run_over_row_p95)}")
            )
    lines += [f"note: {n}" for n in c.notes]
    lines.append(
        "the published rows are CLOSED runs (the options' fixed models, users and 300 s): a run on other parameters "
        "is placed beside them, not ranked among them"
    )
    lines.append(
        "the published tok/s is aggregated_avg_throughput_tokens_per_sec and its P95 aggregated_p95_latency_ms (the "
        "highest rank's storage I/O time per request, queueing included); the device p95 is the drive's own time: "
        "side by side, never divided"
    )
    return lines


__all__ = [
    "PublishedComparison",
    "Published",
    "RunOption",
    "comparable",
    "compare",
    "load_summary",
    "published",
    "render",
]
