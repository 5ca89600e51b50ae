"""``kvtier report``: one self-contained HTML file from any mix of kvtier results.

Results are loaded through ``kvtier.results.load`` (bench results, replay folders or summary.json — with
their requests.jsonl when present —, MPI aggregates, MLPerf run summaries, launch.json, ``kvtier plan``
answers written with ``--output``). The page has,
per kind: a side-by-side table of the figures that matter, the differences stated in words against
the first result of that kind, and the plots (``report/plots.py``) as PNGs embedded as data: URIs — no
script, no stylesheet or font from anywhere, so it opens offline and prints as it shows. Without
matplotlib (the ``plot`` extra) the page has the tables and the sentences and says why the plots are
missing. ``--png-dir`` also writes each plot as a PNG file.
"""

from __future__ import annotations

import base64
import functools
import html
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.errors import ConfigError
from kvtier.report.figures import FEW_SAMPLES, Loaded, figures_of, sentences, ttft_sentence
from kvtier.report.plan import PLAN_KINDS, PLAN_PLOTS, PLAN_TITLES, plan_figures, plan_status_rows, sweep_curves
from kvtier.results.aggregate import BenchAggregate
from kvtier.results.arms import ArmsResult
from kvtier.results.bench import BenchResult
from kvtier.results.io import write_bytes_atomic
from kvtier.results.ladder import LadderResult
from kvtier.results.launch import LaunchResult
from kvtier.results.mlperf import MlperfRunSummary, MlpstorageRunSummary
from kvtier.results.outcome import label as cause_label
from kvtier.results.records import ReplayRecords
from kvtier.results.replay import ReplayResult
from kvtier.results.sweep import SweepResult

KINDS = {
    "kvtier bench": "bench",
    "kvtier replay": "replay",
    "kvtier bench mpi": "bench-mpi",
    "kvtier mlperf run": "mlperf",
    "mlpstorage kvcache run": "mlperf",
    "kvtier launch": "launch",
    "kvtier plan sweep": "sweep",
    "kvtier ladder": "ladder",
    "kvtier launch arms": "arms",
    **PLAN_KINDS,
}
TITLES = {
    "bench": "Storage benchmark (kvtier bench)",
    "replay": "Serving benchmark (kvtier replay)",
    "bench-mpi": "MPI bench runs (aggregates)",
    "mlperf": "MLPerf submission runs",
    "launch": "Launches",
    "sweep": "Placement sweeps (kvtier plan sweep)",
    "ladder": "Tier ladders (kvtier ladder)",
    "arms": "Offload engines side by side (kvtier launch --arms)",
    **PLAN_TITLES,
}

CSS = """
body { font-family: sans-serif; margin: 2em; max-width: 75em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.25em; border-bottom: 1px solid #ccc; margin-top: 2em; }
h3 { font-size: 1.05em; margin-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: right; white-space: pre-line; }
th:first-child, td:first-child { text-align: left; }
td.better { background: #e6f4e6; } td.worse { background: #fbe9e9; }
p.answers { color: #555; margin-top: 0; font-style: italic; }
img { max-width: 100%; page-break-inside: avoid; }
ul.findings li { margin: 0.2em 0; }
.meta { color: #666; font-size: 0.85em; }
@media print { body { margin: 0; } h2 { page-break-before: auto; } }
"""


def _published(options: dict[str, Any]) -> str:
    """The run beside the published MLPerf v3.0 KV rows (``kvtier mlperf compare``), or why not."""
    from kvtier.results.published import comparable, compare, render

    ok = comparable(options or {})
    if not ok:
        return "no option with the figures the published rows have"
    return "\n".join(render(compare(ok)))


def _rank_rows(path: Path) -> list[tuple[str, Any]]:
    """A run folder's rank files (mlpstorage's layout), per option: each rank's device p95s, requests and run length
    as the rank files say, with kvtier's aggregation of them beside the summary's (``kvtier.mlperf.ranks``)."""
    from kvtier.errors import DatasetError
    from kvtier.results.ranks import parity, read_run_folder

    folder = path if path.is_dir() else path.parent
    if not any(folder.glob("option_*/trial_*/rank_*")):
        return [("rank files", "none beside the summary (its figures are the summary's alone)")]
    try:
        run = read_run_folder(folder)
        checks = parity(run) if run.summary is not None else []
    except DatasetError as e:
        return [("rank files", f"not read: {e}")]
    rows: list[tuple[str, Any]] = []
    for o in run.options():
        mine = [r for r in run.ranks if r.option == o]
        rd = [x.file.summary.cache_stats.storage_read_device_p95_ms for x in mine]
        wd = [x.file.summary.cache_stats.storage_write_device_p95_ms for x in mine]
        req = [x.file.summary.total_requests for x in mine]
        secs = [x.file.summary.elapsed_time for x in mine]
        rows.append(
            (
                f"option {o}: {len(mine)} rank files",
                f"device read p95 {_span(rd)} ms, write p95 {_span(wd)} ms; requests {_span(req)}; "
                f"run length {_span(secs)} s (lowest to highest rank file)",
            )
        )
    if checks:
        exact = sum(c.exact for c in checks)
        worst = max((c.rel_err or 0.0) for c in checks)
        rows.append(
            (
                "the summary from its rank files",
                f"{exact} of {len(checks)} figures reproduced exactly by kvtier's aggregation (worst relative "
                f"difference {worst:.2g})",
            )
        )
    if run.missing:
        rows.append(("rank folders without a result", ", ".join(run.missing)))
    return rows


def _span(xs: Sequence[float | int | None]) -> str:
    got = [x for x in xs if x is not None]
    if not got:
        return "—"
    lo, hi = min(got), max(got)

    def f(x: float | int) -> str:
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"

    return f(lo) if f(lo) == f(hi) else f"{f(lo)}–{f(hi)}"


def _label_for(path: Path, taken: set[str]) -> str:
    name = path.parent.name if path.name in ("summary.json", "launch.json", "kvcache_run_summary.json") else path.stem
    label, n = name or str(path), 2
    while label in taken:
        label, n = f"{name}-{n}", n + 1
    taken.add(label)
    return label


def load_all(paths: Sequence[str], labels: Sequence[str] | None = None) -> list[Loaded]:
    from kvtier.results import load

    if labels and len(labels) != len(paths):
        raise ConfigError(f"--labels: {len(labels)} labels for {len(paths)} results")
    out: list[Loaded] = []
    taken: set[str] = set()
    given = {Path(q).resolve() for q in paths}  # a launch's replay given on its own is not added twice
    for k, p in enumerate(paths):
        r = load(p)
        path = Path(p)
        file = path / "summary.json" if path.is_dir() and (path / "summary.json").is_file() else path
        kind = KINDS[r.benchmark]
        label = labels[k] if labels else _label_for(file, taken)
        records = ReplayRecords.read(file.parent / "requests.jsonl") if kind == "replay" else None
        item = Loaded(str(p), label, kind, r, records)
        item.figures = plan_figures(r) if kind.startswith("plan-") else figures_of(item)
        out.append(item)
        folder = _launch_replay(item) if kind == "launch" else None
        if folder is not None and not {folder.resolve(), (folder / "summary.json").resolve()} & given:
            replay = load(folder)  # a launch's own replay: its TTFT figures and plots in the serving section
            rec = ReplayRecords.read(folder / "requests.jsonl")
            sub = Loaded(str(folder), f"{label}/replay", "replay", replay, rec)
            sub.figures = figures_of(sub)
            out.append(sub)
    return out


def _fmt(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        if v == 0:
            return "0"
        a = abs(v)
        return f"{v:,.0f}" if a >= 1000 else f"{v:.3g}" if a >= 0.01 else f"{v:.3e}"
    return html.escape(str(v))


def _table(items: Sequence[Loaded]) -> str:
    base = items[0]
    names: list[str] = []
    for it in items:
        names += [f.name for f in it.figures if f.name not in names]
    head = "".join(f"<th>{html.escape(it.label)}</th>" for it in items)
    rows = []
    for n in names:
        cells = []
        b = base.figure(n)
        for it in items:
            f = it.figure(n)
            cls = ""
            if f is not None and b is not None and it is not base and f.better and f.value is not None and b.value:
                diff = (f.value - b.value) / abs(b.value)
                if abs(diff) >= 0.05:
                    cls = " class='better'" if (diff < 0) == (f.better == "lower") else " class='worse'"
            mark = FEW_MARK if f is not None and f.few_samples else ""
            cells.append(f"<td{cls}>{_fmt(None if f is None else f.value)}{mark}</td>")
        rows.append(f"<tr><td>{html.escape(n)}</td>{''.join(cells)}</tr>")
    table = f"<table><tr><th>figure</th>{head}</tr>{''.join(rows)}</table>"
    if any(f.few_samples for it in items for f in it.figures):
        table += f"<p class='meta'>{FEW_MARK} from fewer than {FEW_SAMPLES} samples: a tail of one or two requests.</p>"
    return table


FEW_MARK = " †"


def _causes(failures: dict[str, Any]) -> str:
    return ", ".join(f"{cause_label(c, f)} {f.count}" for c, f in failures.items()) or "none"


def _flags(cfg: Any, names: Sequence[str]) -> str:
    """The run's key flags, as the command line spells them."""
    d = cfg if isinstance(cfg, dict) else cfg.model_dump(mode="json")
    return " ".join(f"--{k.replace('_', '-')} {d[k]}" for k in names if d.get(k) not in (None, "", [], False))


BENCH_FLAGS = (
    "model",
    "num_users",
    "duration",
    "gpu_mem_gb",
    "cpu_mem_gb",
    "storage_capacity_gb",
    "max_concurrent_allocs",
    "generation_mode",
    "tier_order",
)
REPLAY_FLAGS = (
    "model",
    "dataset",
    "concurrency",
    "num_rounds",
    "gap_scale",
    "max_requests",
    "duration",
    "max_failure_rate",
)


def status_rows(it: Loaded) -> list[tuple[str, Any]]:
    """What each kind's verdict is, in rows: status, why it stopped, counts and causes, its key flags."""
    r = it.result
    rows: list[tuple[str, Any]] = [("file", it.path)]
    if not isinstance(r, (MlperfRunSummary, MlpstorageRunSummary)):  # the wrapper's layout has no envelope
        rows += [("status", r.status.value), ("stop", f"{r.stop_reason.code.value}: {r.stop_reason.message}")]
    if isinstance(r, BenchResult):
        h = r.summary.cache_stats.storage_health
        rows += [
            ("requests ok / failed", f"{r.requests_completed:,} / {r.requests_failed:,}"),
            ("failures by cause", _causes(r.errors.failures)),
            (f"storage health ({h.profile})", f"{h.overall_status} ({h.passed_count}/{h.total_count} criteria passed)"),
            ("key flags", _flags(r.config, BENCH_FLAGS)),
        ]
    elif isinstance(r, ReplayResult):
        s = r.summary
        rows += [
            ("requests ok / failed / cut", f"{s.requests_ok:,} / {s.requests_failed:,} / {s.requests_cut_at_stop:,}"),
            ("failures by cause", _causes(s.failures)),
            (
                "dataset",
                f"{r.dataset.path} ({r.dataset.format}, {r.dataset.virtual_users} users; tokenizer "
                f"{r.dataset.tokenizer})",
            ),
            ("key flags", _flags(r.config, REPLAY_FLAGS)),
        ]
        went = ttft_sentence(s)
        if went:
            rows.append(("where TTFT went (the server's decomposition)", went))
    elif isinstance(r, BenchAggregate):
        t = r.totals
        rows += [
            ("ranks reported / launched", f"{r.ranks_reported} / {r.ranks_launched}"),
            ("requests ok / failed", f"{t.requests_completed:,} / {t.requests_failed:,}"),
            ("failures by cause", _causes(t.failures)),
        ]
    elif isinstance(r, MlperfRunSummary):
        rows += [
            ("mode", f"{r.mode}, {r.trials_per_option} trials per option, {r.total_ranks} ranks"),
            ("verdict", "; ".join(r.verdict) if r.verdict else "no submission rule broken"),
            ("partial", "yes: a trial lost a rank, failed or stopped early" if r.partial_failure else "no"),
            ("submission table", r.system.get("submission_table_text")),
            ("beside the published v3.0 KV rows", _published({o: s.model_dump() for o, s in r.options.items()})),
        ]
    elif isinstance(r, MlpstorageRunSummary):
        rows += [
            ("written by", f"mlpstorage (its run summary, schema {r.schema_version}; no kvtier envelope)"),
            (
                "ranks",
                f"{r.total_ranks} ({r.host_count or '?'} hosts x {r.npernode or '?'} per node), "
                f"{r.trials_per_option} trials per option",
            ),
            ("partial", "yes: a rank's result was missing" if r.partial_failure else "no"),
            *_rank_rows(Path(it.path)),
            ("beside the published v3.0 KV rows", _published({o: s.model_dump() for o, s in r.options.items()})),
        ]
    elif isinstance(r, LaunchResult):
        rows += [
            (
                "profile",
                f"{r.profile} ({r.tier} tier, {r.engine}, {r.replicas} replica(s), {r.lb_policy or 'no'} routing)",
            ),
            ("exit status", r.exit_status),
            (
                "replay",
                "below, under the serving benchmark"
                if it.records is not None or _launch_replay(it)
                else "no replay summary beside launch.json",
            ),
        ]
        for f in r.faults or []:
            rows.append((f"fault {f.kind}@{f.at_s:g}", f.sentence()))
    elif isinstance(r, SweepResult):
        ran = [t for t in r.trials if t.status != "not-run"]
        g = r.grid
        rows += [
            ("grid", f"CPU GB {g.cpu_gb} x NVMe GB {g.nvme_gb} x concurrency {g.concurrency}, {g.trials} trials each"),
            (
                "trials ran / complete / all",
                f"{len(ran)} / {sum(t.status == 'complete' for t in ran)} / {len(r.trials)}",
            ),
            ("dataset", f"{g.dataset} (sim {g.sim_model}, {g.gpu_kv_gb:g} GB GPU KV, preset {g.preset})"),
        ]
    elif isinstance(r, LadderResult):
        sv = r.server
        rows += [
            (
                "server",
                f"{sv.model} at {sv.base_url} ({sv.kind}), tiers: {', '.join(t.name for t in sv.tiers) or 'none'}",
            ),
            ("points verified / measured", f"{sum(p.verified for p in r.points)} / {len(r.points)}"),
            (
                "prefill fit",
                "none"
                if r.fit is None
                else f"median |error| {r.fit.prefill_fit_median_abs_rel_err} fitted, "
                f"{r.fit.prefill_holdout_median_abs_rel_err}"
                f" held back ({'superlinear' if r.fit.superlinear else 'linear'})",
            ),
        ]
    elif isinstance(r, ArmsResult):
        rows.append(("rounds", f"{r.rounds}, in the orders {'; '.join(', '.join(o) for o in r.order)}"))
        for arm in r.arms:
            lt = arm.later_ttft
            p50 = "—" if lt.p50_s is None else f"{lt.p50_s:.3f} s [{lt.p50_lo_s:.3f}, {lt.p50_hi_s:.3f}]"
            src = ", ".join(f"{k} {100 * v:.1f} %" for k, v in arm.hit_rate_by_source.items()) or "not counted"
            runs = ", ".join(f"r{x.round} {x.status}" for x in arm.runs)
            rows.append(
                (
                    f"arm {arm.arm} ({arm.offload_engine}, {arm.tier} tier)",
                    f"later-turn TTFT p50 {p50}, p95 {lt.p95_s} s (n={lt.n}); prompt tokens by source: {src}; "
                    + (
                        ""
                        if arm.offload.cross_replica_loads is None
                        else f"blocks loaded that another replica stored: {arm.offload.cross_replica_loads:.0f}; "
                    )
                    + f"failed {_causes(arm.failed)}; runs {runs}",
                )
            )
        for v in r.verdicts:
            rows.append((f"verdict {v.arm} against none", v.why))
    else:
        rows += plan_status_rows(it.plan)
    rows.append(("warnings", ", ".join(w.code for w in getattr(r, "warnings", [])) or "none"))
    return rows


def _launch_replay(it: Loaded) -> Path | None:
    """The replay folder of a launch (its summary.json beside launch.json's replay/), when present."""
    cfg = it.launch.config
    here = Path(it.path) if Path(it.path).is_dir() else Path(it.path).parent
    folder = Path(cfg.replay.output) if cfg.replay.output else here / "replay"
    return folder if (folder / "summary.json").is_file() else None


def _status_table(items: Sequence[Loaded]) -> str:
    head = "".join(f"<th>{html.escape(it.label)}</th>" for it in items)
    per = [dict(status_rows(it)) for it in items]
    keys: list[str] = []
    for d in per:
        keys += [k for k in d if k not in keys]
    body = "".join(
        f"<tr><td>{html.escape(k)}</td>{''.join(f'<td>{_fmt(d.get(k))}</td>' for d in per)}</tr>" for k in keys
    )
    return f"<table><tr><th></th>{head}</tr>{body}</table>"


def _slug(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def build(
    items: Sequence[Loaded], png_dir: str | None = None, read_sweep: Callable[[str], Any] | None = None
) -> tuple[str, dict[str, Any]]:
    """The HTML text, and what went into it (plots drawn, seconds). ``read_sweep``: a sweep folder's recommendation
    (``kvtier plan recommend``), which its plot draws; without it a sweep gets its tables only."""
    t0 = time.perf_counter()
    from kvtier.report import plots, plots_serving  # matplotlib is imported inside each plot

    have_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        have_mpl = False
    out_dir = Path(png_dir) if png_dir else None
    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--png-dir: cannot create {out_dir}: {e.strerror}") from e
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>kvtier report: {html.escape(', '.join(it.label for it in items))}</title>",
        f"<style>{CSS}</style></head><body>",
        "<h1>kvtier report</h1>",
        f"<p class='meta'>kvtier {__version__}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; {len(items)} result(s).</p>",
    ]
    drawn: list[str] = []
    for kind in KINDS.values():
        group = [it for it in items if it.kind == kind]
        if not group:
            continue
        parts.append(f"<h2>{TITLES[kind]}</h2>")
        if kind == "replay" and len({(it.replay.dataset.path, it.replay.dataset.format) for it in group}) > 1:
            used = ", ".join(f"{it.label}: {it.replay.dataset.path}" for it in group)
            parts.append(
                f"<p><b>Note:</b> these replays used different datasets ({html.escape(used)}): their "
                "figures describe different work.</p>"
            )
        if len(group) > 1:
            found = [s for it in group[1:] for s in sentences(group[0], it)]
            parts.append("<h3>What differs</h3>")
            if found:
                parts.append("<ul class='findings'>" + "".join(f"<li>{html.escape(s)}</li>" for s in found) + "</ul>")
            else:
                parts.append(f"<p>No figure differs by 5 % or more from {html.escape(group[0].label)}.</p>")
        parts.append(_status_table(group))
        if group[0].figures:
            parts.append(_table(group))
        makers = {
            "bench": plots.BENCH_PLOTS,
            "replay": plots.REPLAY_PLOTS,
            "sweep": () if read_sweep is None else (functools.partial(sweep_curves, read=read_sweep),),
            "launch": plots_serving.LAUNCH_PLOTS,
            "ladder": plots_serving.LADDER_PLOTS,
            "arms": plots_serving.ARMS_PLOTS,
            **PLAN_PLOTS,
        }.get(kind, ())
        if makers and not have_mpl:
            parts.append("<p>Plots need matplotlib: <code>pip install 'kvtier[plot]'</code>.</p>")
            continue
        for make in makers:
            made = make(group)
            if made is None:
                continue
            title, answers, png = made
            drawn.append(title)
            if out_dir is not None:
                write_bytes_atomic(out_dir / f"{kind}-{_slug(title)}.png", png)
            parts.append(f"<h3>{html.escape(title)}</h3><p class='answers'>{html.escape(answers)}</p>")
            parts.append(
                f"<img alt='{html.escape(title)}' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
            )
    parts.append("</body></html>\n")
    return "\n".join(parts), {"plots": drawn, "seconds": round(time.perf_counter() - t0, 3), "matplotlib": have_mpl}


def write_report(
    paths: Sequence[str],
    out: str,
    png_dir: str | None = None,
    labels: Sequence[str] | None = None,
    read_sweep: Callable[[str], Any] | None = None,
) -> dict[str, Any]:
    """Load, build and write; returns what went in (``plots``, ``seconds``, ``results``)."""
    from kvtier.results.io import check_output_path

    check_output_path("--html", out)
    t0 = time.perf_counter()
    items = load_all(paths, labels)
    text, info = build(items, png_dir, read_sweep)
    from kvtier.results.io import write_text_atomic

    write_text_atomic(out, text, "--html")
    return {
        **info,
        "results": [it.label for it in items],
        "seconds": round(time.perf_counter() - t0, 3),
        "bytes": len(text.encode()),
    }


__all__ = ["write_report", "build", "load_all"]
