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
    """One option of a published run: its summary's keys (published_v3.yaml says which is which)."""

    tokens_per_sec: float  # aggregated_avg_throughput_tokens_per_sec: the published tok/s
    read_gbps: float
    storage_tokens_per_sec: float | None = None
    write_gbps: float | None = None
    p95_latency_ms: float | None = None  # aggregated_p95_latency_ms: the published "P95" (storage time per request)
    partial_failure: bool = False
    missing_rank_results: int = 0
    device_read_p95_ms: float | None = None  # from the rank files, where all were read
    device_write_p95_ms: float | None = None


RankFigures = tuple[int, int, int, int, float, float | None, float | None, str]
"""A rank file's figures: option, trial, rank, requests, run length s, device read and write p95 ms, file name."""


class PublishedRun(_Fixed):
    submitter: str
    system: str
    division: str
    model: str
    path: str  # the run folder in mlcommons/storage_results_v3.0
    summary: str
    published: bool  # the run a published row comes from (false: superseded by a later one, or withheld)
    ranks: int = Field(ge=1)
    hosts: int = Field(ge=1)
    trials: int = Field(ge=1)
    options: dict[int, PublishedFigure]
    rank_files: list[RankFigures] = Field(default_factory=list)
    note: str | None = None

    @property
    def source(self) -> str:
        return f"mlcommons/storage_results_v3.0@068d91f:{self.path}{self.summary}"

    @property
    def scale(self) -> str:
        return scale_class(self.ranks)


class Published(_Fixed):
    version: str
    runs: list[PublishedRun]

    @property
    def rows(self) -> list[PublishedRun]:
        """The runs the published rows come from."""
        return [r for r in self.runs if r.published]


def scale_class(ranks: int) -> str:
    """Runs compared as peers: by the number of instances that load the storage."""
    return "1 rank" if ranks <= 1 else "2-8 ranks" if ranks <= 8 else "9-64 ranks" if ranks <= 64 else "65+ ranks"


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
    model: str
    division: str
    ranks: int
    source: str
    tokens_per_sec: float
    read_gbps: float
    write_gbps: float | None
    p95_latency_ms: float | None  # the published "P95" (storage time per request)
    device_read_p95_ms: float | None  # the drive's own, from the rank files where read: never divided by the P95
    partial_failure: bool
    comparable: bool  # same model and scale class as the run
    why_not: str | None  # what differs, when not comparable
    run_over_row_tokens: float | None
    run_over_row_read: float | None
    run_over_row_write: float | None
    run_over_row_tokens_per_rank: float | None
    run_over_row_read_per_rank: float | None
    run_over_row_p95: float | None


class Placement(_Fixed):
    """Where the run's figure falls among the published rows' (1: the highest; ``of``: the rows and the run)."""

    figure: str
    place: int
    of: int
    among_comparable: int | None  # the place among the comparable rows only (None: none is comparable)
    of_comparable: int


class OptionComparison(_Fixed):
    run: RunFigures
    rows: list[RowComparison]
    placements: list[Placement]


class PublishedComparison(_Fixed):
    published_version: str
    model: str
    scale: str
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
    """The options of a run summary file, checked: every option has the figures compared (named when not). Where
    the summary has no device read p95 (every v3.0 summary) and its folder holds the run's rank files, it is taken
    from them (the max over ranks and trials, as mlpstorage's aggregation takes it)."""
    p = Path(path)
    options = _summary_options(p)
    out = run_options(options, f"{p}: ")
    missing = [o for o, s in out.items() if s.aggregated_device_read_p95_ms is None]
    if missing and any(p.parent.glob("option_*/trial_*/rank_*")):
        from kvtier.results.ranks import option_figures, read_run_folder

        run = read_run_folder(p.parent)
        for o in missing:
            fig = option_figures(run.trials(int(o))) if o.isdigit() and int(o) in run.options() else {}
            out[o] = out[o].model_copy(
                update={"aggregated_device_read_p95_ms": fig.get("aggregated_device_read_p95_ms")}
            )
    return out


def _summary_options(p: Path) -> dict[str, object]:
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e.strerror}") from e
    except (ValueError, RecursionError) as e:
        raise DatasetError(f"{p}: not JSON, or nested too deep: {type(e).__name__}") from None
    options = data.get("options") if isinstance(data, dict) else None
    if not isinstance(options, dict) or not options:
        raise DatasetError(f"{p}: no 'options' (expected a kvcache_run_summary from mlpstorage or kvtier mlperf run)")
    return options


def run_model(path: str | Path) -> str:
    """The model a run summary's run used, as mlpstorage names its folder: from the path (``…/kv_cache/MODEL/run/…``,
    as mlpstorage and the published tree lay a run out), else kvtier's summary's ``overrides.model``, else
    llama3.1-8b (every CLOSED run's)."""
    parts = Path(path).resolve().parts
    for i, part in enumerate(parts[:-2]):
        if part == "kv_cache" and parts[i + 2] == "run":
            return parts[i + 1]
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        data = None
    over = data.get("overrides") if isinstance(data, dict) else None
    model = over.get("model") if isinstance(over, dict) else None
    return model if isinstance(model, str) and model else "llama3.1-8b"


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def _row(run: RunFigures, row: PublishedRun, fig: PublishedFigure, model: str) -> RowComparison:
    tok, read, ranks, n = run.tokens_per_sec, run.read_gbps, run.ranks, row.ranks
    differs = [
        what
        for what, mine, theirs in (("model", model, row.model), ("scale", scale_class(ranks), row.scale))
        if mine != theirs
    ]
    return RowComparison(
        submitter=row.submitter,
        system=row.system,
        model=row.model,
        division=row.division,
        ranks=n,
        source=row.source,
        tokens_per_sec=fig.tokens_per_sec,
        read_gbps=fig.read_gbps,
        write_gbps=fig.write_gbps,
        p95_latency_ms=fig.p95_latency_ms,
        device_read_p95_ms=fig.device_read_p95_ms,
        partial_failure=fig.partial_failure,
        comparable=not differs,
        why_not=None
        if not differs
        else "; ".join(
            f"model {row.model}" if d == "model" else f"{row.scale} ({n}), this run {scale_class(ranks)}"
            for d in differs
        ),
        run_over_row_tokens=_ratio(tok, fig.tokens_per_sec),
        run_over_row_read=_ratio(read, fig.read_gbps),
        run_over_row_write=None
        if run.write_gbps is None or fig.write_gbps is None
        else _ratio(run.write_gbps, fig.write_gbps),
        run_over_row_tokens_per_rank=_ratio(tok / ranks, fig.tokens_per_sec / n),
        run_over_row_read_per_rank=_ratio(read / ranks, fig.read_gbps / n),
        run_over_row_p95=None
        if run.p95_latency_ms is None or fig.p95_latency_ms is None
        else _ratio(run.p95_latency_ms, fig.p95_latency_ms),
    )


def _place(figure: str, mine: float, rows: list[tuple[float, bool]]) -> Placement:
    """The run's place by ``figure`` (higher is better) among the rows' values, and among the comparable ones."""
    comp = [v for v, ok in rows if ok]
    return Placement(
        figure=figure,
        place=1 + sum(v > mine for v, _ in rows),
        of=len(rows) + 1,
        among_comparable=1 + sum(v > mine for v in comp) if comp else None,
        of_comparable=len(comp) + 1,
    )


def compare(
    options: dict[str, RunOption], rows: Published | None = None, model: str = "llama3.1-8b"
) -> PublishedComparison:
    """The run (``model``: its folder's model, as mlpstorage names it) beside every published row, per option."""
    pub = rows or published()
    out: dict[str, OptionComparison] = {}
    missing: list[int] = []
    notes: list[str] = []
    scale = "?"
    for o in ("1", "2", "3"):
        s = options.get(o)
        if s is None:
            missing.append(int(o))
            notes.append(f"option {o} is not in this run: a CLOSED submission has all three options")
            continue
        ranks = int(s.rank_count) or 1
        scale = scale_class(ranks)
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
        found = [(row, row.options.get(int(o))) for row in pub.rows]
        compared = [_row(run, row, fig, model) for row, fig in found if fig is not None]
        placements = [
            _place("tok/s", tok, [(w.tokens_per_sec, w.comparable) for w in compared]),
            _place("tok/s per rank", tok / ranks, [(w.tokens_per_sec / w.ranks, w.comparable) for w in compared]),
            _place("read GiB/s", read, [(w.read_gbps, w.comparable) for w in compared]),
            _place("read GiB/s per rank", read / ranks, [(w.read_gbps / w.ranks, w.comparable) for w in compared]),
        ]
        out[o] = OptionComparison(run=run, rows=compared, placements=placements)
    return PublishedComparison(
        published_version=pub.version, model=model, scale=scale, options=out, missing_options=missing, notes=notes
    )


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"


def _ms(x: float | None) -> str:
    return "—" if x is None else f"{x:,.0f}"


def render(c: PublishedComparison) -> list[str]:
    lines = [
        f"this run: {c.model}, {c.scale}; comparable rows (*): the same model and scale class "
        f"({len(published().rows)} published runs read, published_v3.yaml says which rows are missing and why)"
    ]
    for o, e in c.options.items():
        r = e.run
        p95, req = r.device_read_p95_ms, r.p95_latency_ms
        lines.append(
            f"option {o}: this run {r.tokens_per_sec:,.1f} tok/s, read {r.read_gbps:.3f} GiB/s over {r.ranks} ranks "
            f"({r.tokens_per_sec_per_rank:,.1f} tok/s, {r.read_gbps_per_rank:.3f} GiB/s per rank); P95 "
            f"{_ms(req)} ms (storage time per request, as published), device read p95 {_ms(p95)} ms"
        )
        lines.append(
            "  place among the published rows (1 = highest): "
            + ", ".join(
                f"{p.figure} {p.place} of {p.of}"
                + ("" if p.among_comparable is None else f" ({p.among_comparable} of {p.of_comparable} comparable)")
                for p in e.placements
            )
        )
        for w in sorted(e.rows, key=lambda w: (not w.comparable, -w.tokens_per_sec)):
            lines.append(
                f"  {'*' if w.comparable else ' '} {w.submitter} {w.system[:40]} ({w.ranks} rank"
                f"{'s' if w.ranks != 1 else ''}"
                f"{', ' + w.division if w.division != 'closed' else ''}"
                f"{', partial' if w.partial_failure else ''}): {w.tokens_per_sec:,.0f} tok/s, read "
                f"{w.read_gbps:,.2f} GiB/s, P95 {_ms(w.p95_latency_ms)} ms, device read p95 "
                f"{_ms(w.device_read_p95_ms)} ms | this run x{_fmt(w.run_over_row_tokens)} tok/s, "
                f"x{_fmt(w.run_over_row_read)} read; per rank x{_fmt(w.run_over_row_tokens_per_rank)}, "
                f"x{_fmt(w.run_over_row_read_per_rank)}"
                + ("" if w.run_over_row_p95 is None else f"; P95 x{_fmt(w.run_over_row_p95)}")
                + ("" if w.comparable else f" [not comparable: {w.why_not}]")
            )
    lines += [f"note: {n}" for n in c.notes]
    lines.append(
        "the published tok/s is aggregated_avg_throughput_tokens_per_sec and its P95 aggregated_p95_latency_ms (the "
        "highest rank's storage I/O time per request, queueing included); the device p95 is the drive's own time "
        "(from the rank files, where read): side by side, never divided"
    )
    return lines


__all__ = [
    "PublishedComparison",
    "Published",
    "PublishedRun",
    "scale_class",
    "RunOption",
    "comparable",
    "compare",
    "load_summary",
    "published",
    "render",
    "run_model",
]
