"""The envelope every kvtier result file shares, whatever command wrote it.

    result_schema_version  int; bumped when a key changes meaning or shape
    kvtier_version         the kvtier that wrote the file
    benchmark              the command: "kvtier bench" | "kvtier replay" | "kvtier launch"
    status                 complete | partial | failed
    stop_reason            {code, message}: why the run ended, as a stable code and a sentence
    started_at/finished_at ISO 8601, UTC
    config                 the effective config (each command's own model; autos resolved)
    host                   CPU, memory, kernel, Python and library versions, and the filesystem
                           and block device of every directory the run used
    warnings               [{code, message, ...observed values}] with stable codes

A command's result model extends ``Envelope`` with its own sections. Exit codes come from the
status and the stop code (``exit_code``), never from searching text.
"""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvtier import __version__

SCHEMA_VERSION = 3
"""3: failures by cause ({cause: {count, first_message, http_status}}) replaced failures_by_status, and the
status follows the one rule of results/outcome.py. 2: warnings became coded objects, stop_reason became
{code, message}, host gained versions and directories, replay and launch files gained the envelope."""


class Status(enum.StrEnum):
    complete = "complete"  # ran to its stop condition with failed work within --max-failure-rate
    partial = "partial"  # stopped early (signal, device full, internal error): what it has is kept
    failed = "failed"  # nothing usable was measured, or more than --max-failure-rate of the work failed


class StopCode(enum.StrEnum):
    """Why a run ended. Stable: scripts may switch on these."""

    duration = "duration"  # --duration elapsed
    max_requests = "max-requests"  # --max-requests completed
    trace_finished = "trace-finished"  # every trace request was served
    dataset_finished = "dataset-finished"  # every dataset turn was served (bench) / every virtual user ran (replay)
    peak_capacity = "peak-capacity"  # the capacity autoscaler found its peak
    interrupted = "interrupted"  # SIGINT (Ctrl+C)
    terminated = "terminated"  # SIGTERM
    device_full = "device-full"  # ENOSPC / EDQUOT on the storage tier
    tier_unavailable = "tier-unavailable"  # a remote tier's server (Redis, S3) could not be reached
    internal_error = "internal-error"  # a bug stopped the run; the message names it
    startup_failed = "startup-failed"  # launch: a process did not start or become healthy
    running = "running"  # launch.json written while the replay was still running
    too_many_failures = "too-many-failures"  # it ran to its end, but more than --max-failure-rate of its work failed
    grid_finished = "grid-finished"  # plan sweep: every trial of the grid ran; ladder: every point was measured
    budget = "budget"  # plan sweep: its --budget ran out before every trial ran
    server_unavailable = "server-unavailable"  # ladder: the server stopped answering
    answered = "answered"  # plan: the planner answered the question its flags asked
    hit_rate_off_target = "hit-rate-off-target"  # replay --target-hit-rate: the primed server's rate was not it
    hit_rate_drifted = "hit-rate-drifted"  # replay --target-hit-rate: the measured run's rate left the tolerance


class Section(BaseModel):
    """A part of a result: unknown keys are errors when a file is loaded back."""

    model_config = ConfigDict(extra="forbid")


class Distribution(Section):
    """A distribution summary (kvtier.stats) in the unit its key names (``_ms``, ``_s``)."""

    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p95: float | None
    p99: float | None
    p999: float | None
    p9999: float | None
    max: float | None


class StopReason(Section):
    code: StopCode
    message: str


class WarningCode(enum.StrEnum):
    """Stable codes of result warnings (docs/metrics.md describes each)."""

    gpu_tier_off = "gpu-tier-off"
    gpu_tier_capped = "gpu-tier-capped"
    io_chunk_reduced = "io-chunk-reduced"
    cpu_tier_exceeds_host = "cpu-tier-exceeds-host"  # bench: --cpu-mem-gb is more than the host has available now
    host_memory_short = "host-memory-short"  # a RAM tier stopped growing: the host ran short of memory
    direct_io_off = "direct-io-off"
    cache_dir_exposed = "cache-dir-exposed"
    working_set_fits_page_cache = "working-set-fits-page-cache"
    entry_exceeds_tier = "entry-exceeds-tier"
    tp_sharding_differs = "tp-sharding-differs-from-reference"
    dataset_records_skipped = "dataset-records-skipped"
    dataset_file_skipped = "dataset-file-skipped"
    trace_rows_skipped = "trace-rows-skipped"
    rag_ingest_excluded = "rag-ingest-excluded"
    prepopulation_excluded = "prepopulation-excluded"
    errors_seen = "errors-seen"  # tier operations failed (a failed request is requests-failed)
    requests_dropped = "requests-dropped"  # bench --arrival open: requests found the queue full (never served)
    discard_mount = "discard-mount"  # bench: the cache dir's filesystem trims every delete (mounted -o discard)
    precondition_short = "precondition-short"  # bench: --precondition wrote less than it was asked to
    stores_dropped = "stores-dropped"  # bench: stores no tier could take (dropped, not failed)
    requests_failed = "requests-failed"  # some requests failed: counts by cause (results/outcome.py)
    prompts_exceed_context = "prompts-exceed-context"  # replay: prompts longer than the server's max_model_len
    run_not_complete = "run-not-complete"
    nothing_completed = "nothing-completed"
    concurrency_capped = "concurrency-capped"
    concurrency_not_reached = "concurrency-not-reached"
    offload_never_exercised = "offload-never-exercised"
    offload_never_used = "offload-never-used"
    tokenizer_estimated = "tokenizer-estimated"
    scrape_failed = "scrape-failed"
    stale_runs_removed = "stale-runs-removed"
    stale_runs_found = "stale-runs-found"
    cleanup_failed = "cleanup-failed"
    engine_fallback = "engine-fallback"
    ranks_lost = "ranks-lost"
    device_shared = "device-shared"
    rank_not_complete = "rank-not-complete"
    gpu_env_conflict = "gpu-env-conflict"
    trace_mode = "trace-mode"
    latency_tracing_unavailable = "latency-tracing-unavailable"
    io_trace_incomplete = "io-trace-incomplete"
    remote_tier_limit = "remote-tier-limit"  # the server's own memory limit or eviction policy can undercut kvtier's
    offload_degraded = "offload-degraded"  # replay: KV an offload tier held was recomputed (gate, failed, bypassed)
    offload_decode_dependency = "offload-decode-dependency"  # replay: loads past each request's prefix
    remote_foreign_entries = "remote-foreign-entries"  # a shared namespace held what its keys do not name: misses
    fault_not_recovered = "fault-not-recovered"  # launch --fault: the restarted part did not answer again
    fault_not_injected = "fault-not-injected"  # launch --fault: the replay ended before the fault's time
    ladder_unverified = "ladder-unverified"  # ladder: points whose counters did not show the intended source
    ladder_source_unverified = "ladder-source-unverified"  # ladder: a source asked for has no verified point
    ladder_noisy_cells = "ladder-noisy-cells"  # ladder: cells whose repeats spread past the bound, measured again
    ladder_fit_unreliable = "ladder-fit-unreliable"  # ladder: the fit's errors past their bounds (status partial)
    ladder_tier_unreachable = "ladder-tier-unreachable"  # ladder: no flood size pushes a prefix down to the tier
    decomposition_dropped = "decomposition-dropped"  # replay: a server's TTFT decomposition failed its schema/bounds
    sim_timing_assumed = "sim-timing-assumed"  # replay: the sim's latency model is a preset's assumed figures
    sim_timing_extrapolated = "sim-timing-extrapolated"  # replay: requests timed outside the calibration's range
    offload_hits_not_paying = "offload-hits-not-paying"  # replay: hits whose fetch took longer than the recompute
    engine_join_incomplete = "engine-join-incomplete"  # replay --engine-log: ok requests the engine's log lacks
    engine_counts_differ = "engine-counts-differ"  # replay --engine-log: the records do not add up to the counters
    gds_off = (
        "gds-off"  # --gds auto found no cuFile path (the file tier used O_DIRECT), or kvikio moved the bytes by POSIX
    )


class ResultWarning(BaseModel):
    """A coded warning; extra keys carry the observed values it is about."""

    model_config = ConfigDict(extra="allow")
    code: str = Field(pattern=r"^[a-z0-9]+(-[a-z0-9]+)*$")
    message: str


def warning(code: WarningCode, message: str, **observed: Any) -> ResultWarning:
    return ResultWarning(code=code.value, message=message, **observed)


class DirectoryFacts(Section):
    """Where a directory the run used lives: its filesystem and the block device under it."""

    path: str
    mount_point: str
    fs_type: str
    device: str
    block_device: str | None = None


class HostFacts(Section):
    hostname: str
    os: str
    kernel: str
    python: str
    cpu_model: str
    cpu_count: int | None
    mem_total_bytes: int
    libraries: dict[str, str | None]
    directories: dict[str, DirectoryFacts] = Field(default_factory=dict)


def collect_host(directories: dict[str, str | None] | None = None) -> HostFacts:
    """Facts about this host, and about each named directory (role -> path; None entries skipped)."""
    from kvtier.telemetry.host import describe_directory, host_basics

    dirs = {role: DirectoryFacts(**describe_directory(path)) for role, path in (directories or {}).items() if path}
    return HostFacts(**host_basics(), directories=dirs)


class Envelope(BaseModel):
    """Fields every result file has (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    result_schema_version: int = SCHEMA_VERSION
    kvtier_version: str = __version__
    benchmark: str
    status: Status
    stop_reason: StopReason
    started_at: str
    finished_at: str
    host: HostFacts
    warnings: list[ResultWarning] = Field(default_factory=list)


def utc_now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def iso(t: dt.datetime) -> str:
    return t.isoformat(timespec="seconds")


EXIT_BY_STOP = {
    StopCode.interrupted: 130,
    StopCode.terminated: 143,
    StopCode.device_full: 5,
    StopCode.startup_failed: 6,
    StopCode.tier_unavailable: 7,
}


def exit_code(status: Status, stop: StopCode) -> int:
    """The process exit status of a run: 0 complete; 130/143 for SIGINT/SIGTERM, 5 device full,
    6 a launch whose processes did not start, 7 a remote tier's server unreachable; 1 for any other
    partial or failed run."""
    if status == Status.complete:
        return 0
    return EXIT_BY_STOP.get(stop, 1)


__all__ = [
    "SCHEMA_VERSION",
    "Section",
    "Distribution",
    "Status",
    "StopCode",
    "StopReason",
    "WarningCode",
    "ResultWarning",
    "warning",
    "DirectoryFacts",
    "HostFacts",
    "collect_host",
    "Envelope",
    "exit_code",
    "utc_now",
    "iso",
]
