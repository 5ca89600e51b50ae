"""``kvtier mlperf datasize|run``: the MLPerf Storage v3.0 KV cache submission workflow (what the
``mlpstorage`` wrapper does around the reference), on kvtier.

The three fixed workloads (options): 1 = llama3.1-8b, 200 users, --cpu-mem-gb 0, --max-concurrent-allocs
16; 2 = llama3.1-8b, 100 users, 4 GB, 16; 3 = llama3.1-70b-instruct, 70 users, 0 GB, 4; all 300 s,
--gpu-mem-gb 0, --generation-mode none. A CLOSED run fixes seed 42, 3 trials per option and 20 s
between options, and takes no overrides; ``--open`` allows them and says so.

``run`` starts each option's trials as one MPI run (``mpirun -np N``, or ``--hosts``; one process
without MPI when N is 1 on this host), each rank an instance with ``rank_<r>/`` under the cache dir,
and writes ``kvcache_run_summary.json``: per option the wrapper's table under the wrapper's names
(per trial the sums over ranks of read/write bandwidth and of both throughputs, the max over ranks of
the storage device read/write p95; across trials the mean, and the max for latency), and beside it
kvtier's figures: per trial the pooled percentiles of the MPI aggregate, the spread across trials
(median, min, max, coefficient of variation) and a verdict naming every rule the run broke.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.child import start
from kvtier.config.bench import BenchConfig
from kvtier.config.mlperf import MlperfConfig
from kvtier.errors import ConfigError, DatasetError
from kvtier.mpi import mpirun_argv, require_mpi
from kvtier.results import load
from kvtier.results.aggregate import BenchAggregate
from kvtier.results.bench import BenchResult
from kvtier.results.envelope import WarningCode, iso, utc_now
from kvtier.results.mlperf import (
    ClosedRules,
    KvtierOptionFigures,
    MlperfRunSummary,
    MlperfWorkload,
    OptionSummary,
    TrialFigures,
    TrialSpread,
)
from kvtier.results.ranks import SUMMED, Instance, option_figures, trial_sums
from kvtier.telemetry.host import mem_limit_bytes
from kvtier.units import GiB

WORKLOADS: dict[int, MlperfWorkload] = {
    1: MlperfWorkload(model="llama3.1-8b", num_users=200, cpu_mem_gb=0, max_concurrent_allocs=16),
    2: MlperfWorkload(model="llama3.1-8b", num_users=100, cpu_mem_gb=4, max_concurrent_allocs=16),
    3: MlperfWorkload(model="llama3.1-70b-instruct", num_users=70, cpu_mem_gb=0, max_concurrent_allocs=4),
}
CLOSED = ClosedRules()
CV_BOUND = 0.10  # coefficient of variation across trials above which the verdict flags a figure


def options(cfg: MlperfConfig) -> list[int]:
    try:
        chosen = [int(x) for x in cfg.workloads.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--workloads: {cfg.workloads!r} is not a list of options 1, 2, 3") from None
    bad = [o for o in chosen if o not in WORKLOADS]
    if bad or not chosen:
        raise ConfigError(f"--workloads: options are 1, 2 and 3 (got {cfg.workloads!r})")
    return chosen


def overrides(cfg: MlperfConfig) -> dict[str, Any]:
    """The parameters this run changes from the CLOSED rules (refused unless --open)."""
    given = {
        "duration": cfg.duration,
        "trials": cfg.trials,
        "inter_option_delay": cfg.inter_option_delay,
        "seed": cfg.seed,
        "num_users": cfg.num_users,
        "model": cfg.model,
        "config": cfg.config,
    }
    return {k: v for k, v in given.items() if v is not None and getattr(CLOSED, k, object()) != v}


def effective(cfg: MlperfConfig) -> ClosedRules:
    changed = overrides(cfg)
    if changed and not cfg.open:
        flags = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in changed.items())
        raise ConfigError(f"a CLOSED run takes no overrides ({flags}): drop them, or pass --open")
    given = {k: getattr(cfg, k) for k in ClosedRules.model_fields if getattr(cfg, k) is not None}
    return CLOSED.model_copy(update=given)


def bench_config(cfg: MlperfConfig, option: int, eff: ClosedRules, out: str | None) -> BenchConfig:
    base = WORKLOADS[option]
    w = base.model_copy(update={"model": cfg.model or base.model, "num_users": cfg.num_users or base.num_users})
    return BenchConfig(
        **w.model_dump(),
        duration=eff.duration,
        gpu_mem_gb=0,
        generation_mode="none",
        seed=eff.seed,
        cache_dir=cfg.cache_dir,
        output=out,
        config=cfg.config,
        progress="none",
        mpi_timeout=cfg.mpi_timeout,
    )


# -- datasize ---------------------------------------------------------------------------------
def datasize(cfg: MlperfConfig) -> dict[str, Any]:
    """Per option and instance, from kvtier's own request stream over the run (think times only, no
    service time: an upper bound, since real users also wait for the device):

    * ``client_memory_bytes``: kvtier's memory bound (noise buffer + I/O buffers + CPU tier + 256 MiB);
    * ``storage_min_bytes``: the largest entry x --max-concurrent-allocs (below it, writes fail);
    * ``working_set_bytes``: every user's largest conversation (its turns' entries, all re-read by
      later turns) plus the shared system prompts: the storage that holds the workload without
      evicting anything that will be read again;
    * ``stream_written_bytes``: every write of the stream, the most a run could write.

    With --cache-dir, whether the working set of all instances fits the free space there; and whether
    it would fit the page cache (host memory), where a run without direct I/O would measure RAM."""
    from kvtier.bench.setup import derive
    from kvtier.bench.sources import user_requests

    eff = effective(cfg)
    out: dict[str, Any] = {"num_processes": cfg.num_processes, "duration_s": eff.duration, "options": {}}
    free = shutil.disk_usage(cfg.cache_dir).free if cfg.cache_dir and Path(cfg.cache_dir).is_dir() else None
    out["cache_dir_looked_at"] = str(Path(cfg.cache_dir).resolve()) if cfg.cache_dir else None
    host_mem, _ = mem_limit_bytes()  # a container's page cache is its limit's, not the host's MemTotal
    for option in options(cfg):
        bc = bench_config(cfg, option, eff, None).model_copy(update={"cache_dir": None})
        plan = derive(bc)
        memory = (bc.noise_mb << 20) + plan.io_slots * plan.io_chunk_bytes + int(bc.cpu_mem_gb * GiB) + (256 << 20)
        written = largest = working = 0
        prefixes: dict[str, int] = {}
        for user in plan.workload.users:
            t = 0.0
            conv, conv_bytes, user_max = None, 0, 0
            for req in user_requests(plan, user):
                t += req.think_before_s
                if t > bc.duration:
                    break
                if req.conversation != conv:
                    conv, conv_bytes = req.conversation, 0
                for r in req.reads:
                    if r.kind == "prefix":
                        prefixes[r.key] = plan.entry_bytes(r.tokens)
                for w in req.writes:
                    n = plan.entry_bytes(w.tokens)
                    written += n
                    conv_bytes += n
                    largest = max(largest, n)
                user_max = max(user_max, conv_bytes)
            working += user_max
        working += sum(prefixes.values())
        n = cfg.num_processes
        out["options"][str(option)] = {
            "model": bc.model,
            "num_users": bc.num_users,
            "kv_bytes_per_token": plan.model.kv_bytes_per_token_per_rank(1),
            "client_memory_bytes": memory,
            "storage_min_bytes": largest * bc.max_concurrent_allocs if bc.max_concurrent_allocs else largest,
            "working_set_bytes": working,
            "stream_written_bytes": written,
            "largest_entry_bytes": largest,
            "all_instances": {"client_memory_bytes": memory * n, "working_set_bytes": working * n},
            "working_set_fits_free_space": None if free is None else working * n <= free,
            "working_set_fits_page_cache": working * n <= host_mem,
        }
    out["cache_dir_free_bytes"] = free
    out["host_memory_bytes"] = host_mem
    return out


# -- run ----------------------------------------------------------------------------------------
def bench_argv(cfg: MlperfConfig, command: list[str]) -> list[str]:
    """``command`` (``kvtier bench …``) on --num-processes ranks over --hosts (mpi.py ``mpirun_argv``), mpirun and
    mpi4py checked first; the command alone for one instance on no named host."""
    hosts = [h.strip() for h in (cfg.hosts or "").split(",") if h.strip()]
    n = cfg.num_processes
    mpirun = require_mpi(f"--num-processes {n}") if n > 1 or hosts else "mpirun"
    try:
        return mpirun_argv(command, n, hosts=hosts, mpirun=mpirun, interface=cfg.mpi_interface or "")
    except ConfigError as e:
        raise ConfigError(f"--num-processes {n}, --hosts {cfg.hosts}: {e}") from None


@dataclass
class Trial:
    """One trial of an option: its folder, what its processes returned, and the results it left."""

    folder: str
    seconds: float
    returncode: int | None
    results: list[BenchResult]  # the instances' results readable here
    aggregate: BenchAggregate | None  # rank 0's MPI aggregate (None for one process)
    missing: list[str]


def _instance_results(out: Path, n: int) -> tuple[list[BenchResult], BenchAggregate | None, list[str]]:
    """The trial's result files readable here (per rank on other hosts need a shared filesystem; the
    table does not), its MPI aggregate (None for one process), and what is missing: the result of a
    single process, or the aggregate and the ranks it lost. Each is validated into its model; a file
    that is absent or does not validate counts as missing."""
    files = [out] if n == 1 else [out.with_name(f"{out.stem}.rank_{r}{out.suffix}") for r in range(n)]
    results = [r for f in files if isinstance(r := _load_or_none(f), BenchResult)]
    if n == 1:
        return results, None, [] if results else [str(out)]
    agg = _load_or_none(out)
    if not isinstance(agg, BenchAggregate):
        return results, None, [str(out)]
    return results, agg, [f"rank {r} (lost)" for r in agg.lost_ranks]


def _load_or_none(path: Path) -> object | None:
    try:
        return load(path)
    except DatasetError:
        return None


def _spread(xs: list[float]) -> TrialSpread:
    if not xs:
        return TrialSpread()
    mean = statistics.fmean(xs)
    cv = statistics.pstdev(xs) / mean if len(xs) > 1 and mean else 0.0
    return TrialSpread(median=statistics.median(xs), min=min(xs), max=max(xs), cv=round(cv, 4))


def _instances(t: Trial) -> list[Instance]:
    """Each instance's figures: from rank 0's aggregate (every rank's, as sent to rank 0: no file of
    another host needed), else from the result files."""
    if t.aggregate is not None:
        return [
            Instance(
                r.tier_storage_read_bandwidth_gbps or 0.0,
                r.tier_storage_write_bandwidth_gbps or 0.0,
                r.storage_read_device_p95_ms,
                r.storage_write_device_p95_ms,
                r.avg_throughput_tokens_per_sec or 0.0,
                r.storage_throughput_tokens_per_sec,
                r.status,
                r.decode_bytes_read_gb or 0.0,
                r.storage_read_p95_ms,
                r.storage_io_p95_ms,
            )
            for r in t.aggregate.ranks
        ]
    out = []
    for r in t.results:
        c = r.summary.cache_stats
        out.append(
            Instance(
                c.tier_storage_read_bandwidth_gbps,
                c.tier_storage_write_bandwidth_gbps,
                c.percentile_ms("storage_read_device", "p95"),
                c.percentile_ms("storage_write_device", "p95"),
                r.summary.avg_throughput_tokens_per_sec,
                r.summary.storage_throughput_tokens_per_sec,
                r.status.value,
                c.decode_bytes_read_gb,
                c.percentile_ms("storage_read", "p95"),
                r.summary.storage_io_latency_ms.p95,
            )
        )
    return out


def summarize_option(option: int, trials: list[Trial], n: int) -> OptionSummary:
    """The wrapper's table (its key names and formulas) and kvtier's figures for one option."""
    per: dict[str, list[float]] = {"decode": [], "req95": []}
    missing: list[str] = []
    partial: list[str] = []
    per_trial = []
    for i, t in enumerate(trials):
        inst = _instances(t)
        per_trial.append(inst)
        missing += t.missing
        per["decode"].append(sum(x.decode_bytes_read_gb for x in inst))
        req = [x.read_p95_ms for x in inst if x.read_p95_ms is not None]
        if req:
            per["req95"].append(max(req))
        states = [x.status for x in inst] + ([t.aggregate.status.value] if t.aggregate is not None else [])
        if t.missing or any(s != "complete" for s in states) or t.returncode not in (0, None):
            partial.append(f"trial {i}")
    table = option_figures(per_trial)  # mlpstorage's keys and formulas, as over the rank files
    read, write = table["aggregated_read_bandwidth_gbps"] or 0.0, table["aggregated_write_bandwidth_gbps"] or 0.0

    def avg(k: str) -> float:
        return statistics.fmean(per[k]) if per[k] else 0.0

    return OptionSummary(
        option=option,
        aggregated_read_bandwidth_gbps=read,
        aggregated_write_bandwidth_gbps=write,
        aggregated_avg_throughput_tokens_per_sec=table["aggregated_avg_throughput_tokens_per_sec"] or 0.0,
        aggregated_storage_throughput_tokens_per_sec=table["aggregated_storage_throughput_tokens_per_sec"] or 0.0,
        aggregated_device_read_p95_ms=table["aggregated_device_read_p95_ms"],
        aggregated_device_write_p95_ms=table["aggregated_device_write_p95_ms"],
        aggregated_p95_latency_ms=table["aggregated_p95_latency_ms"],
        rank_count=n,
        trial_count=len(trials),
        partial_failure=bool(missing or partial),
        missing_files=missing,
        kvtier=KvtierOptionFigures(
            partial_trials=partial,
            decode_bytes_read_gb=avg("decode"),
            storage_read_p95_ms=max(per["req95"]) if per["req95"] else None,
            read_bandwidth_gbps_per_rank=read / n if n else 0.0,
            write_bandwidth_gbps_per_rank=write / n if n else 0.0,
            spread={  # each trial's sum under mlpstorage's key, named without its "aggregated_"
                **{k.removeprefix("aggregated_"): _spread([trial_sums(i)[k] for i in per_trial]) for k in SUMMED},
                "decode_bytes_read_gb": _spread(per["decode"]),
            },
            trials=[
                TrialFigures(
                    folder=t.folder,
                    seconds=t.seconds,
                    returncode=t.returncode,
                    pooled_storage_read_device_p95_ms=_pooled_device_p95(t, "read"),
                    pooled_storage_write_device_p95_ms=_pooled_device_p95(t, "write"),
                    pooled_end_to_end_p95_ms=_pooled_e2e_p95(t),
                )
                for t in trials
            ],
        ),
    )


def _pooled_device_p95(t: Trial, op: str) -> float | None:
    """The storage tier's device p95 over every rank's samples (the aggregate's), else the one instance's."""
    if t.aggregate is not None:
        v = t.aggregate.latency.tiers_device.get("storage", {}).get(op, {}).get("p95")
        return float(v) if v is not None else None
    if t.results:
        return t.results[0].summary.cache_stats.percentile_ms(f"storage_{op}_device", "p95")
    return None


def _pooled_e2e_p95(t: Trial) -> float | None:
    if t.aggregate is not None:
        v = t.aggregate.latency.end_to_end_latency_ms.get("p95")
        return float(v) if v is not None else None
    return t.results[0].summary.end_to_end_latency_ms.p95 if t.results else None


def verdict(cfg: MlperfConfig, opts: dict[str, OptionSummary], all_results: list[BenchResult]) -> list[str]:
    """Every submission rule the run broke (empty: none)."""
    broken = []
    changed = overrides(cfg)
    if changed:
        broken.append("open: CLOSED parameters changed: " + ", ".join(f"{k}={v}" for k, v in changed.items()))
    for o, s in opts.items():
        for trial in s.kvtier.partial_trials:
            broken.append(f"option {o}: {trial} partial (a rank lost, failed or stopped early)")
        for name, sp in s.kvtier.spread.items():
            if sp.cv is not None and sp.cv > CV_BOUND:
                broken.append(f"option {o}: {name} varies {sp.cv:.1%} across trials (bound {CV_BOUND:.0%})")
    absent = [o for o in WORKLOADS if str(o) not in opts]
    if not cfg.open and absent:
        broken.append(
            "closed: option(s) " + ", ".join(str(o) for o in absent) + " not run: a CLOSED submission reports all "
            "three options" + (" (the 70B result is missing)" if 3 in absent else "")
        )
    codes = {w.code for r in all_results for w in r.warnings}
    if WarningCode.working_set_fits_page_cache in codes:
        broken.append("a working set fits the page cache: reads may come from RAM, not the device")
    if WarningCode.direct_io_off in codes:
        broken.append("direct I/O was off on the storage tier")
    return broken


OPTION_NAMES = {1: "Max Storage Stress", 2: "Storage Throughput", 3: "Large Model (70B)"}


def metric_rule(cpu_mem_gb: float) -> str:
    """What an option's storage figures mean, by its CPU tier (Rules 6.3.1: options 1 and 3 have none)."""
    if cpu_mem_gb <= 0:
        return (
            "cpu-mem-gb 0: every KV object goes to the storage tier under test, so the storage figures are the "
            "storage system's alone"
        )
    return (
        f"cpu-mem-gb {cpu_mem_gb:g}: a {cpu_mem_gb:g} GiB CPU tier takes the hottest objects first, so the storage "
        "figures are the traffic that reaches the storage tier past it (fewer, larger misses)"
    )


def peak_device_bandwidth(results: list[BenchResult]) -> float | None:
    """The highest one-interval bytes/s (read + written) any instance's device timeline shows."""
    best: float | None = None
    for r in results:
        for p in r.device.timeline if r.device is not None else []:
            span = float(p.get("interval_s") or 0)
            if span > 0:
                moved = sum(
                    float((d.get("read_bytes") or 0) + (d.get("write_bytes") or 0))
                    for d in (p.get("devices") or {}).values()
                )
                best = moved / span if best is None else max(best, moved / span)
    return best


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"


def submission_line(o: str, s: OptionSummary) -> str:
    """One option of the submission text, led by the figure the spec says to use at its CPU tier (at --cpu-mem-gb 0
    storage throughput does not tell systems apart: decode bytes and wall-clock throughput do), with kvtier's
    truth beside the published columns: per rank, both device p95s, the median across trials."""
    cpu = float(WORKLOADS[int(o)].cpu_mem_gb)
    k = s.kvtier
    sp = k.spread
    decode, wall = k.decode_bytes_read_gb, s.aggregated_avg_throughput_tokens_per_sec
    storage = s.aggregated_storage_throughput_tokens_per_sec
    if cpu <= 0:
        lead = (
            f"decode bytes read {decode:,.1f} GB, wall-clock throughput {wall:,.1f} tok/s (storage throughput "
            f"{storage:,.1f} tok/s is not the figure at cpu-mem-gb 0)"
        )
        median = ("decode bytes read", sp["decode_bytes_read_gb"].median)
    else:
        lead = (
            f"storage throughput {storage:,.1f} tok/s, decode bytes read {decode:,.1f} GB, wall-clock "
            f"throughput {wall:,.1f} tok/s"
        )
        median = ("storage throughput", sp["storage_throughput_tokens_per_sec"].median)
    n = max(s.rank_count, 1)
    return (
        f"Option {o} ({OPTION_NAMES.get(int(o), o)}, cpu-mem-gb {cpu:g}): {lead}; read "
        f"{s.aggregated_read_bandwidth_gbps:.3f} GiB/s ({k.read_bandwidth_gbps_per_rank:.3f} per rank), write "
        f"{s.aggregated_write_bandwidth_gbps:.3f} GiB/s ({k.write_bandwidth_gbps_per_rank:.3f} per rank); "
        f"device p95 read {_ms(s.aggregated_device_read_p95_ms)} ms, write "
        f"{_ms(s.aggregated_device_write_p95_ms)} ms; P95 {_ms(s.aggregated_p95_latency_ms)} ms (storage I/O time "
        f"per request, as published), storage read p95 {_ms(k.storage_read_p95_ms)} ms; median of the trials' "
        f"{median[0]}: "
        f"{'—' if median[1] is None else f'{median[1]:,.1f}'} ({s.trial_count} trials, {n} ranks)"
    )


def system_section(cfg: MlperfConfig, opts: dict[str, OptionSummary], results: list[BenchResult]) -> dict[str, Any]:
    """What a submission records beside its figures: the drives under --cache-dir (sysfs: model, firmware, link),
    the peak device bandwidth the trials reached beside the links' theoretical one, the metric rule of each
    option by its CPU tier, and the submission table as text."""
    from kvtier.telemetry.drives import drives_under

    drives = drives_under(cfg.cache_dir or ".")
    links = [d["link_bandwidth_bytes_per_s"] for d in drives["drives"]]
    theoretical = sum(links) if links and all(x is not None for x in links) else None
    peak = peak_device_bandwidth(results)
    table = [submission_line(o, s) for o, s in opts.items()]
    if peak is not None:
        link = "" if not theoretical else f" ({peak / theoretical:.0%} of the links' {theoretical / 1e9:.1f} GB/s)"
        table.append(f"Peak device bandwidth (one interval of the device timeline): {peak / 1e9:.2f} GB/s{link}")
    for d in drives["drives"]:
        table.append(
            f"Drive {d['device']}: {d.get('model') or 'model unknown'}, firmware {d.get('firmware') or 'unknown'}"
            + (f", link {d['link_speed']} x{d['link_width']}" if d.get("link_speed") else "")
        )
    return {
        "drives": drives["drives"],
        "drive_resolution": drives["resolution"],
        "peak_device_bytes_per_s": None if peak is None else round(peak, 1),
        "theoretical_link_bytes_per_s": None if theoretical is None else round(theoretical, 1),
        "peak_share_of_link": None if peak is None or not theoretical else round(peak / theoretical, 4),
        "metric_rule": {o: metric_rule(float(WORKLOADS[int(o)].cpu_mem_gb)) for o in opts},
        "submission_table_text": "\n".join(table),
    }


def run(cfg: MlperfConfig) -> MlperfRunSummary:
    """Every option x trial as one MPI run; returns (and writes) the run summary."""
    if not cfg.cache_dir or not cfg.results_dir:
        raise ConfigError("--cache-dir and --results-dir: required for kvtier mlperf run")
    eff = effective(cfg)
    chosen = options(cfg)
    bench_argv(cfg, ["kvtier", "bench"])  # mpirun and mpi4py checked (and --hosts) before anything is written
    results_dir = Path(cfg.results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    started = utc_now()
    interrupted = False
    per_option: dict[str, OptionSummary] = {}
    everything: list[BenchResult] = []
    for k, option in enumerate(chosen):
        trials = []
        for trial in range(eff.trials):
            folder = results_dir / f"option_{option}" / f"trial_{trial}"
            folder.mkdir(parents=True, exist_ok=True)
            out = folder / "result.json"
            bc = bench_config(cfg, option, eff, str(out))
            from kvtier.config.base import config_argv

            cmd = bench_argv(cfg, ["kvtier", "bench", *config_argv(bc)])
            print(f"kvtier mlperf: option {option} trial {trial + 1}/{eff.trials}: {' '.join(cmd)}", file=sys.stderr)
            t0 = time.monotonic()
            ranks = start(cmd, name="mpirun", stdout=None, group=False)
            try:
                rc: int | None = ranks.finish(cfg.mpi_timeout + 60)
            except KeyboardInterrupt:  # the ranks got SIGINT too and had the time to write their partial results
                interrupted = True
                rc = ranks.poll()
            results, agg, missing = _instance_results(out, cfg.num_processes)
            everything += results
            trials.append(Trial(str(folder), round(time.monotonic() - t0, 3), rc, results, agg, missing))
            if interrupted:
                break
        per_option[str(option)] = summarize_option(option, trials, cfg.num_processes)
        if interrupted:
            break
        if k < len(chosen) - 1 and eff.inter_option_delay > 0:
            time.sleep(eff.inter_option_delay)
    hosts = max(1, len([h for h in (cfg.hosts or "").split(",") if h.strip()]))
    summary = MlperfRunSummary(
        schema_version="1.0",
        run_datetime=iso(started),
        finished_at=iso(utc_now()),
        mode="open" if cfg.open else "closed",
        interrupted=interrupted,
        npernode=cfg.num_processes // hosts,
        host_count=hosts,
        total_ranks=cfg.num_processes,
        trials_per_option=eff.trials,
        effective=eff,
        overrides=overrides(cfg),
        options=per_option,
        partial_failure=interrupted or any(o.partial_failure for o in per_option.values()),
        verdict=verdict(cfg, per_option, everything),
        system=system_section(cfg, per_option, everything),
        config=cfg.model_dump(mode="json"),
    )
    from kvtier.results.io import write_json

    # a random, exclusively created temporary name: a planted kvcache_run_summary.tmp symlink is never followed
    write_json(summary, results_dir / "kvcache_run_summary.json", "--results-dir")
    return summary


__all__ = ["WORKLOADS", "CLOSED", "datasize", "run", "summarize_option", "verdict"]
