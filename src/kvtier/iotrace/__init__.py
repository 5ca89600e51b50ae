"""Commands on an I/O trace (``kvtier bench --io-trace-log``, or the MLPerf reference's trace CSV).

Library use::

    from kvtier.config.iotrace import TraceFioConfig, TraceReplayConfig, TraceStatsConfig
    from kvtier import iotrace

    stats = iotrace.run_stats(TraceStatsConfig(trace="t.csv"))            # a dict (kvtier trace stats)
    text, figures = iotrace.run_fio(TraceFioConfig(trace="t.csv", output="j.fio"))  # the job, also written
    result = iotrace.run_replay(TraceReplayConfig(trace="t.csv", cache_dir="/mnt/nvme"))  # a BenchResult

The trace's reading and writing live in ``kvtier.tracefile``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from kvtier import __version__
from kvtier.tracefile import read_trace

if TYPE_CHECKING:
    from kvtier.config.iotrace import TraceFioConfig, TraceReplayConfig, TraceStatsConfig
    from kvtier.results.bench import BenchResult


def run_stats(cfg: TraceStatsConfig) -> dict[str, Any]:
    from kvtier.iotrace.stats import trace_stats
    from kvtier.results.io import check_output_path

    check_output_path("--output", cfg.output)
    out = {
        "kind": "kvtier trace stats",
        "kvtier_version": __version__,
        **trace_stats(read_trace(cfg.trace, cfg.max_bad_rows, cfg.max_rows), cfg.interval),
    }
    if cfg.output:
        from kvtier.results.io import write_text_atomic

        write_text_atomic(cfg.output, json.dumps(out, indent=1))
    return out


def run_fio(cfg: TraceFioConfig) -> tuple[str, dict[str, Any]]:
    from kvtier.iotrace.fio import distil
    from kvtier.results.io import check_output_path, write_text_atomic

    check_output_path("--output", cfg.output)
    if str(cfg.trace).endswith(".json"):  # a latency trace (bench --enable-latency-tracing, trace attach --output)
        import json
        import pathlib

        from kvtier.errors import DatasetError
        from kvtier.iotrace.fio import distil_latency, latency_section

        try:
            data = json.loads(pathlib.Path(cfg.trace).read_text(encoding="utf-8"))
        except (OSError, ValueError) as e:
            raise DatasetError(f"{cfg.trace}: cannot read a latency trace: {e}") from e
        section = latency_section(data, cfg.trace)
        if section is None:
            raise DatasetError(f"{cfg.trace}: no latency trace (a `histograms` map, or a result's latency_tracing)")
        text, figures = distil_latency(section, cfg.trace, cfg)
        write_text_atomic(cfg.output, text)
        return text, figures
    text, figures = distil(read_trace(cfg.trace, cfg.max_bad_rows, cfg.max_rows), cfg)
    write_text_atomic(cfg.output, text)
    return text, figures


def run_replay(cfg: TraceReplayConfig, *, handle_signals: bool = False) -> BenchResult:
    from kvtier.iotrace.replay import run

    return run(cfg, handle_signals=handle_signals)


__all__ = ["run_stats", "run_fio", "run_replay"]
