"""The storage benchmark: simulated users driving the tiered store.

Library use::

    from kvtier.bench import run
    from kvtier.config import BenchConfig

    result = run(BenchConfig(model="llama3.1-8b", num_users=10, duration=15, gpu_mem_gb=0, cpu_mem_gb=1,
                             cache_dir="/mnt/nvme/kv", output="r.json"))
    print(result.summary.storage_throughput_tokens_per_sec, result.status)

One path: config -> ``derive`` (setup.py) -> ``build_components`` -> ``BenchRunner`` (runner.py,
serving through service.py) -> ``build_result`` (results.py) -> a typed ``BenchResult``.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.bench.plan import Plan
    from kvtier.bench.runner import BenchRunner
    from kvtier.bench.setup import Components
    from kvtier.config.bench import BenchConfig
    from kvtier.mpi import RunEnvironment
    from kvtier.results.aggregate import BenchAggregate
    from kvtier.results.bench import BenchResult
    from kvtier.telemetry.clock import Clock
    from kvtier.telemetry.recorder import Recorder


@contextlib.contextmanager
def stop_on_signals(runner: BenchRunner) -> Iterator[None]:
    """SIGINT/SIGTERM end the run as partial (from the main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    from kvtier.results.envelope import StopCode

    codes = {
        signal.SIGINT: (StopCode.interrupted, "interrupted (SIGINT)"),
        signal.SIGTERM: (StopCode.terminated, "terminated (SIGTERM)"),
    }
    previous = {
        s: signal.signal(s, lambda n, _f: runner.request_stop(*codes[signal.Signals(n)], partial=True)) for s in codes
    }
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def close_timed(comp: Components) -> tuple[dict[str, int], float, list[str]]:
    """Tear the run's components down, timed apart from the load (removing many GB of entry files takes
    a while): (what the storage tier held, seconds, what could not be removed)."""
    held = comp.store.usage().get("storage", {})
    t0 = time.perf_counter()
    problems = comp.close()
    return held, time.perf_counter() - t0, problems


def record_teardown(
    result: BenchResult, closed: tuple[dict[str, int], float, list[str]], kept: bool, removal_pid: int | None = None
) -> None:
    """The result's ``teardown``, and a ``cleanup-failed`` warning for what could not be removed (e.g. the
    folder became read-only mid-run): said in the result, never a traceback."""
    from kvtier.results.bench import TeardownStats
    from kvtier.results.envelope import WarningCode, warning

    held, seconds, problems = closed
    result.teardown = TeardownStats(
        seconds=round(seconds, 4),
        storage_entries=held.get("entries", 0),
        storage_bytes=held.get("used_bytes", 0),
        kept=kept,
        removal="kept" if kept else "background" if removal_pid is not None else "done",
        removal_pid=removal_pid,
    )
    if problems:
        result.warnings.append(
            warning(
                WarningCode.cleanup_failed,
                f"{len(problems)} files or folders of this run could not be removed: {problems[0]}",
                problems=problems[:20],
            )
        )


def run(
    config: BenchConfig,
    *,
    env: RunEnvironment | None = None,
    default_output: str = "kvtier_bench.json",
    on_start: Callable[[Plan, Components], None] | None = None,
    on_tick: Callable[[BenchRunner, float], None] | None = None,
    handle_signals: bool = False,
    clock: Clock | None = None,
    gate: Callable[[], float] | None = None,
    recorder: Recorder | None = None,
    rank: int | None = None,
    before_teardown: Callable[[BenchResult], None] | None = None,
) -> BenchResult | BenchAggregate:
    """Run one benchmark and return its result (also written to ``config.output`` / ``xlsx_output``).

    ``on_start`` is called once the tiers exist, ``on_tick`` every ``progress_interval`` seconds;
    ``handle_signals`` turns SIGINT/SIGTERM into a partial stop (the CLI sets it). Bad input raises
    ConfigError or DatasetError before any load starts; a run that stops early still returns its
    (partial) result. ``gate``, ``recorder`` and ``rank`` serve a rank of an MPI run (bench/mpi.py): the
    gate holds the load until every rank is set up, the recorder's raw samples are pooled by rank 0, and
    the rank is named in ``--request-log``; ``before_teardown`` is called with the result once it is on disk and
    before the tiers are torn down (a rank pools the run there: removing a large run's files takes seconds, and
    mpirun's SIGKILL may come before).

    ``env`` is where the run runs (kvtier/mpi.py ``RunEnvironment``): locally (the default) this process's
    run; as one rank of an MPI launch, this rank's part of one run over a shared window (bench/mpi.py), and
    on rank 0 the aggregate over every rank (``default_output`` names it when ``--output`` is not given)."""
    if env is not None and env.distributed:
        from kvtier.bench.mpi import run_rank

        return run_rank(config, env, default_output, on_start=on_start, on_tick=on_tick, handle_signals=handle_signals)
    from kvtier.bench.results import build_result
    from kvtier.bench.runner import BenchRunner
    from kvtier.bench.setup import build_components, derive
    from kvtier.results.envelope import utc_now
    from kvtier.results.io import check_output_path, write_json
    from kvtier.results.xlsx import write_xlsx
    from kvtier.telemetry.clock import MONOTONIC
    from kvtier.telemetry.recorder import Recorder

    check_output_path("--output", config.output)
    check_output_path("--xlsx-output", config.xlsx_output)
    check_output_path("--request-log", config.request_log)
    if config.io_trace_log:
        from kvtier.tracefile import check_trace_path

        check_trace_path("--io-trace-log", config.io_trace_log)
    started = utc_now()
    clock = clock or MONOTONIC
    plan = derive(config)
    rec = recorder if recorder is not None else Recorder(clock=clock)
    comp = build_components(plan, rec)
    try:
        runner = BenchRunner(plan, comp, rec, clock)
        if on_start is not None:
            on_start(plan, comp)
        with stop_on_signals(runner) if handle_signals else contextlib.nullcontext():
            outcome = runner.run(on_tick=on_tick, tick_s=config.progress_interval, gate=gate)
        comp.close_trace()  # every row on disk before the result names the file's figures
        result = build_result(
            plan, comp, rec, outcome, started, runner.device_resolution, runner.latency_tracing, runner.gpu_telemetry
        )
        # written before the tiers are torn down: a failing cleanup cannot lose a finished result
        if config.output:
            write_json(result, config.output, flag="--output")
        if before_teardown is not None:
            before_teardown(result)
        # the result is safe: a large run's files go in the background, not on the user's wait (engine/runs.py)
        comp.file_tier.remove_in_background = not comp.owns_cache_dir and not comp.trace_mode
    finally:
        closed = close_timed(comp)
    record_teardown(result, closed, config.keep_cache, comp.file_tier.removal_pid)
    if config.output:
        write_json(result, config.output, flag="--output")
    if config.request_log:
        from kvtier.bench.requestlog import write_request_log

        write_request_log(config.request_log, rec, rank)
    if config.xlsx_output:
        write_xlsx(result, config.xlsx_output)
    return result


__all__ = ["run", "stop_on_signals"]
