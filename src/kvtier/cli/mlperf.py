"""``kvtier mlperf datasize|run|shim|compare``: the MLPerf Storage v3.0 KV cache submission workflow (mlperf/run.py),
and the shim folder that mlpstorage and the reference's scripts run unchanged (mlperf/shim.py)."""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config.mlperf import MlperfCompareConfig, MlperfConfig, MlperfShimConfig
from kvtier.results.io import write_text_atomic


def add_mlperf_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]  # argparse's private generic
    p = sub.add_parser(
        "mlperf",
        help="the MLPerf Storage KV cache submission workflow: datasize, run (three workloads x trials over MPI)",
        description="kvtier mlperf datasize|run: the three fixed workloads, their trials over MPI ranks, the "
        "MLPerf table and kvtier's figures beside it (kvcache_run_summary.json)",
    )
    actions = p.add_subparsers(dest="mlperf_action", required=True)
    for name, text in (
        ("datasize", "client memory and storage each workload instance needs"),
        ("run", "run the workloads' trials and write kvcache_run_summary.json"),
    ):
        a = actions.add_parser(name, help=text, description=text)
        add_config_arguments(a, MlperfConfig)
        a.set_defaults(func=run_mlperf)
    text = (
        "write DIR/kv-cache.py, DIR/mlperf_wrapper.py and DIR/config.yaml: mlpstorage's `kvcache run "
        "--kvcache-bin-path DIR/kv-cache.py` then runs kvtier bench on every rank, and `python3 kv-cache.py ARGS` "
        "runs `kvtier bench ARGS`"
    )
    s = actions.add_parser("shim", help=text, description=text)
    s.add_argument("dir", metavar="DIR", help=MlperfShimConfig.model_fields["dir"].description)
    add_config_arguments(s, MlperfShimConfig)
    s.set_defaults(func=run_shim)
    text = "a run summary (mlpstorage's or kvtier's kvcache_run_summary) beside the published MLPerf v3.0 KV rows"
    c = actions.add_parser("compare", help=text, description=text)
    c.add_argument("summary", metavar="SUMMARY", help=MlperfCompareConfig.model_fields["summary"].description)
    add_config_arguments(c, MlperfCompareConfig)
    c.set_defaults(func=run_compare)


def run_shim(a: argparse.Namespace) -> int:
    from pathlib import Path

    from kvtier.errors import ConfigError
    from kvtier.mlperf.shim import write_shim

    cfg = config_from_args(a, MlperfShimConfig, dir=a.dir)
    folder = Path(cfg.dir)
    try:
        written = write_shim(folder, force=cfg.force)
    except OSError as e:
        raise ConfigError(f"DIR: cannot write into {folder}: {e.strerror}") from e
    for path in written:
        print(path)
    folder = folder.resolve()  # the hint works from any folder (mlpstorage runs it from its own)
    print(
        f"mlpstorage: `mlpstorage open|closed kvcache run --kvcache-bin-path {folder / 'kv-cache.py'} ...` runs "
        f"{folder / 'mlperf_wrapper.py'} on every rank (one kvtier bench each, {sys.executable} -m kvtier); "
        f"`python3 {folder / 'kv-cache.py'} ARGS` runs `kvtier bench ARGS`"
    )
    return 0


def run_compare(a: argparse.Namespace) -> int:
    from kvtier.results.published import compare, load_summary, render, run_model

    cfg = config_from_args(a, MlperfCompareConfig, summary=a.summary)
    result = compare(load_summary(cfg.summary), model=cfg.model or run_model(cfg.summary))
    for line in render(result):
        print(line)
    if cfg.json_output:
        write_text_atomic(cfg.json_output, json.dumps(result.model_dump(mode="json"), indent=2), "--json")
    return 0


def run_mlperf(a: argparse.Namespace) -> int:
    from kvtier.mlperf import run as submission

    cfg = config_from_args(a, MlperfConfig)
    if a.mlperf_action == "datasize":
        est = submission.datasize(cfg)
        gib = 2**30
        print(f"per instance over {est['duration_s']} s (x{est['num_processes']} instances in all):")
        for o, row in est["options"].items():
            fits = row["working_set_fits_free_space"]
            where = "" if fits is None else (" fits the free space" if fits else " does NOT fit the free space")
            print(
                f"option {o}: {row['model']}, {row['num_users']} users: client memory "
                f"{row['client_memory_bytes'] / gib:.2f} GiB; storage at least "
                f"{row['storage_min_bytes'] / gib:.1f} GiB, "
                f"working set {row['working_set_bytes'] / gib:.1f} GiB (all instances "
                f"{row['all_instances']['working_set_bytes'] / gib:.1f} GiB,{where}"
                f"{'; fits the page cache: use direct I/O' if row['working_set_fits_page_cache'] else ''}); "
                f"largest entry {row['largest_entry_bytes'] / gib:.2f} GiB"
            )
        looked = est["cache_dir_looked_at"]
        free = est["cache_dir_free_bytes"]
        if free is not None:  # what was compared, and what would fit (#58 item 20)

            def fit(need: int) -> int:
                return int(free // need) if need else est["num_processes"]

            fits = "; ".join(
                f"option {o} {fit(row['working_set_bytes'])} (storage minimum: {fit(row['storage_min_bytes'])})"
                for o, row in est["options"].items()
            )
            print(
                f"--cache-dir {looked}: {free / gib:.1f} GiB free, compared with the working sets of all "
                f"{est['num_processes']} instances; instances whose working sets would fit: {fits}"
            )
        if looked is None:
            print("no --cache-dir: whether the working set fits the free space was not checked", file=sys.stderr)
        elif est["cache_dir_free_bytes"] is None:
            print(
                f"--cache-dir: no directory at {looked}: whether the working set fits its free space was not "
                "checked (create it, or name an existing one)",
                file=sys.stderr,
            )
        if cfg.output:
            write_text_atomic(cfg.output, json.dumps(est, indent=2))
        return 0
    summary = submission.run(cfg)
    for o, s in summary.options.items():
        print(
            f"option {o}: read {s.aggregated_read_bandwidth_gbps:.3f} GiB/s, write "
            f"{s.aggregated_write_bandwidth_gbps:.3f} GiB/s, storage throughput "
            f"{s.aggregated_storage_throughput_tokens_per_sec:.1f} tok/s, device read p95 "
            f"{s.aggregated_device_read_p95_ms} ms ({s.trial_count} trials, {s.rank_count} ranks)"
        )
    print(summary.system["submission_table_text"])
    for line in summary.verdict:
        print(f"verdict: {line}", file=sys.stderr)
    print(f"summary: {cfg.results_dir}/kvcache_run_summary.json ({'OK' if not summary.verdict else 'see verdict'})")
    if summary.interrupted:
        return 130
    return 1 if summary.partial_failure else 0
