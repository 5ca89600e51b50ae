"""An MLPerf KV cache run's rank result files, and mlpstorage's aggregation over them.

A run folder as mlpstorage leaves it — a published one in ``mlcommons/storage_results_v3.0``, or a run of kvtier's
drop-in (``kvtier mlperf shim``) — holds ``summary.json`` (mlpstorage's per-option table) and, per option, trial and
rank, ``option_<o>/trial_<t>/rank_<r>/kvcache_results_<time>.json``: the reference's full result of one instance.
``RankFile`` reads one (typed: the keys the aggregation and kvtier read; the per-request lists and every other key
are kept unread), ``Instance`` is one instance's figures (from a rank file, or from kvtier's own result in
``kvtier mlperf run``), and ``option_figures`` is the one aggregation both use: mlpstorage's
``_aggregate_option_results`` (benchmarks/kvcache.py) — within a trial the sum over ranks of read and write
bandwidth and of both throughputs, the max over ranks of the p95s; across trials the mean (``fmean``), and the max
for the p95s. Its two p95 keys: ``aggregated_p95_latency_ms`` (the max of ``summary.storage_io_latency_ms.p95``,
what the v3.0 results published) and ``aggregated_device_read_p95_ms``/``aggregated_device_write_p95_ms`` (the
device p95s, what mlpstorage writes since it changed on 2026-06-30). Sums run in rank order as mlpstorage's do, so
a published summary is reproduced to the last bit (``parity``; benchmarks/published_parity.py), except where the
submitter's mlpstorage summed a trial's ranks in another order: a float sum depends on its order, and ``parity``
says when another order gives the published double exactly (``order_only``).
"""

from __future__ import annotations

import itertools
import json
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from kvtier.errors import DatasetError

RESULT_GLOB = "kvcache_results_*.json"  # what mlpstorage's aggregation reads, per rank folder
SUMMED = (
    "aggregated_read_bandwidth_gbps",
    "aggregated_write_bandwidth_gbps",
    "aggregated_avg_throughput_tokens_per_sec",
    "aggregated_storage_throughput_tokens_per_sec",
)
MAXED = ("aggregated_p95_latency_ms", "aggregated_device_read_p95_ms", "aggregated_device_write_p95_ms")
FIGURES = SUMMED + MAXED


class _Open(BaseModel):
    """A part of the reference's result: the keys kvtier reads, typed; the others kept, unread."""

    model_config = ConfigDict(extra="allow", frozen=True)


class RankPercentiles(_Open):
    p50: float | None = None
    p95: float | None = None


class RankCacheStats(_Open):
    storage_entries: int | None = None
    tier_storage_read_bandwidth_gbps: float = 0.0  # mlpstorage reads a missing one as 0.0
    tier_storage_write_bandwidth_gbps: float = 0.0
    tier_storage_kv_bytes_read_gb: float | None = None
    tier_storage_kv_bytes_written_gb: float | None = None
    storage_read_device_p95_ms: float | None = None
    storage_write_device_p95_ms: float | None = None
    storage_read_p95_ms: float | None = None
    storage_write_p95_ms: float | None = None


class RankFileSummary(_Open):
    total_requests: int | None = None
    elapsed_time: float | None = None
    avg_throughput_tokens_per_sec: float = 0.0
    storage_throughput_tokens_per_sec: float = 0.0
    end_to_end_latency_ms: RankPercentiles = RankPercentiles()
    storage_io_latency_ms: RankPercentiles = RankPercentiles()
    cache_stats: RankCacheStats = RankCacheStats()


class RankFile(_Open):
    """One instance's ``kvcache_results_*.json`` as the reference (or kvtier's drop-in) writes it."""

    summary: RankFileSummary = RankFileSummary()


@dataclass(frozen=True)
class Instance:
    """One instance's figures, as the aggregation reads them."""

    read_bandwidth_gbps: float
    write_bandwidth_gbps: float
    read_device_p95_ms: float | None
    write_device_p95_ms: float | None
    avg_throughput_tokens_per_sec: float
    storage_throughput_tokens_per_sec: float
    status: str
    decode_bytes_read_gb: float = 0.0
    read_p95_ms: float | None = None  # storage_read_p95_ms: the storage read time per request
    io_p95_ms: float | None = None  # summary.storage_io_latency_ms.p95: the published "P95" is the max of these

    @classmethod
    def of(cls, rank: RankFile) -> Instance:
        s, c = rank.summary, rank.summary.cache_stats
        return cls(
            c.tier_storage_read_bandwidth_gbps,
            c.tier_storage_write_bandwidth_gbps,
            c.storage_read_device_p95_ms,
            c.storage_write_device_p95_ms,
            s.avg_throughput_tokens_per_sec,
            s.storage_throughput_tokens_per_sec,
            "complete",  # mlpstorage reads only a rank's complete result under this name
            c.tier_storage_kv_bytes_read_gb or 0.0,
            c.storage_read_p95_ms,
            s.storage_io_latency_ms.p95,
        )


def trial_sums(inst: Sequence[Instance]) -> dict[str, float]:
    """One trial's summed figures under mlpstorage's keys (SUMMED): its instances' sum, in rank order."""
    sums = (
        sum(x.read_bandwidth_gbps for x in inst),
        sum(x.write_bandwidth_gbps for x in inst),
        sum(x.avg_throughput_tokens_per_sec for x in inst),
        sum(x.storage_throughput_tokens_per_sec for x in inst),
    )
    return dict(zip(SUMMED, sums, strict=True))


def option_figures(trials: Sequence[Sequence[Instance]]) -> dict[str, float | None]:
    """mlpstorage's per-option figures over each trial's instances (in rank order), under its key names: the mean
    over trials of each trial's sum (``trial_sums``), the max over trials of each trial's max p95; a p95 no instance
    has is None."""
    per: dict[str, list[float]] = {k: [] for k in FIGURES}
    for inst in trials:
        for k, v in trial_sums(inst).items():
            per[k].append(v)
        for key, vals in zip(
            MAXED,
            (
                [x.io_p95_ms for x in inst],
                [x.read_device_p95_ms for x in inst],
                [x.write_device_p95_ms for x in inst],
            ),
            strict=True,
        ):
            got = [v for v in vals if v is not None]
            if got:
                per[key].append(max(got))
    out: dict[str, float | None] = {k: statistics.fmean(per[k]) if per[k] else 0.0 for k in SUMMED}
    out.update({k: max(per[k]) if per[k] else None for k in MAXED})
    return out


@dataclass(frozen=True)
class RankRecord:
    option: int
    trial: int
    rank: int
    path: str  # relative to the run folder
    file: RankFile


@dataclass
class RunFolder:
    """A run folder's summary (mlpstorage's ``summary.json`` as written, or None) and its rank results."""

    path: Path
    summary: dict[str, object] | None
    summary_name: str | None = None
    ranks: list[RankRecord] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # rank folders without a result file

    def trials(self, option: int) -> list[list[Instance]]:
        """Each trial's instances in rank order, as mlpstorage aggregates them."""
        by: dict[int, list[RankRecord]] = {}
        for r in self.ranks:
            if r.option == option:
                by.setdefault(r.trial, []).append(r)
        return [[Instance.of(r.file) for r in sorted(by[t], key=lambda r: r.rank)] for t in sorted(by)]

    def options(self) -> list[int]:
        return sorted({r.option for r in self.ranks})


_PART = re.compile(r"(option|trial|rank)_(\d+)$")


def _number(part: str, name: str) -> int | None:
    m = _PART.match(part)
    return int(m.group(2)) if m and m.group(1) == name else None


def read_rank_file(path: Path) -> RankFile:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from e
    except (ValueError, RecursionError) as e:
        raise DatasetError(f"{path}: not JSON ({type(e).__name__})") from None
    if not isinstance(raw, dict):
        raise DatasetError(f"{path}: not a rank result (expected a JSON object)")
    try:
        return RankFile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise DatasetError(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None


def read_run_folder(folder: str | Path) -> RunFolder:
    """A run folder: its summary (``summary.json``, else mlpstorage's ``kvcache_run_summary_<time>.json``) and every
    ``option_<o>/trial_<t>/rank_<r>/kvcache_results_*.json``; a rank folder without one is named in ``missing``, one
    with two is refused (which one mlpstorage read is unknown)."""
    root = Path(folder)
    if not root.is_dir():
        raise DatasetError(f"{root}: not a folder (expected an MLPerf KV cache run folder)")
    named = sorted(root.glob("kvcache_run_summary_*.json"))  # mlpstorage's own name; the published tree renames it
    summary_path = root / "summary.json" if (root / "summary.json").is_file() or not named else named[-1]
    summary = None
    if summary_path.is_file():
        try:
            loaded = json.loads(summary_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DatasetError(f"{summary_path}: cannot read as JSON: {e}") from None
        summary = loaded if isinstance(loaded, dict) else None
    run = RunFolder(root, summary, summary_path.name if summary is not None else None)
    for rank_dir in sorted(root.glob("option_*/trial_*/rank_*")):
        o, t, r = (_number(p, n) for p, n in zip(rank_dir.parts[-3:], ("option", "trial", "rank"), strict=True))
        if o is None or t is None or r is None or not rank_dir.is_dir():
            continue
        files = sorted(rank_dir.glob(RESULT_GLOB))
        if not files:
            run.missing.append(str(rank_dir.relative_to(root)))
            continue
        if len(files) > 1:  # mlpstorage reads whichever the file system lists first: not a figure to trust
            raise DatasetError(
                f"{rank_dir}: {len(files)} result files ({', '.join(f.name for f in files)}); mlpstorage reads one"
            )
        run.ranks.append(RankRecord(o, t, r, str(files[0].relative_to(root)), read_rank_file(files[0])))
    if not run.ranks:
        raise DatasetError(f"{root}: no option_<o>/trial_<t>/rank_<r>/{RESULT_GLOB} (not an MLPerf KV cache run)")
    return run


@dataclass(frozen=True)
class ParityFigure:
    option: int
    key: str
    published: float
    recomputed: float | None
    rel_err: float | None  # |recomputed - published| / |published| (0 when both are 0)
    exact: bool  # the same double
    order_only: bool = False  # not exact, but the same double when some trial's ranks are summed in another order


ORDER_SEARCH_RANKS = 4  # rank orders tried per trial (4! = 24; all trials' orders together: 24^3)


def _in_another_order(trials: list[list[Instance]], key: str, want: float) -> bool:
    """Does summing some trial's ranks in another order give ``want`` exactly? (A sum of floats depends on its
    order; mlpstorage's sums run in the order its version read the rank files, not always rank order.)"""
    if key not in SUMMED or not trials or max(len(t) for t in trials) > ORDER_SEARCH_RANKS:
        return False
    field = {
        SUMMED[0]: "read_bandwidth_gbps",
        SUMMED[1]: "write_bandwidth_gbps",
        SUMMED[2]: "avg_throughput_tokens_per_sec",
        SUMMED[3]: "storage_throughput_tokens_per_sec",
    }[key]
    options = [
        sorted({sum(vals[i] for i in p) for p in itertools.permutations(range(len(vals)))})
        for vals in ([getattr(x, field) for x in t] for t in trials)
    ]
    return any(statistics.fmean(sums) == want for sums in itertools.product(*options))


def parity(run: RunFolder) -> list[ParityFigure]:
    """Each figure of the run's summary that the aggregation makes, beside the aggregation over its rank files."""
    if run.summary is None:
        raise DatasetError(f"{run.path}: no summary.json or kvcache_run_summary_*.json to reproduce")
    options = run.summary.get("options")
    if not isinstance(options, dict):
        raise DatasetError(f"{run.path / str(run.summary_name)}: options: expected an object")
    out = []
    for o in run.options():
        published = options.get(str(o))
        if not isinstance(published, dict):
            where = run.path / str(run.summary_name)
            raise DatasetError(f"{where}: options.{o}: missing, though the run has its ranks")
        mine = option_figures(run.trials(o))
        for key in FIGURES:
            want = published.get(key)
            if not isinstance(want, (int, float)) or isinstance(want, bool):
                continue
            got = mine[key]
            err = None if got is None else (abs(got - want) / abs(want) if want else float(got != 0))
            exact = got is not None and float(got) == float(want)
            order = not exact and _in_another_order(run.trials(o), key, float(want))
            out.append(ParityFigure(o, key, float(want), got, err, exact, order))
    return out


__all__ = [
    "FIGURES",
    "Instance",
    "ParityFigure",
    "RankFile",
    "RunFolder",
    "option_figures",
    "trial_sums",
    "parity",
    "read_rank_file",
    "read_run_folder",
]
