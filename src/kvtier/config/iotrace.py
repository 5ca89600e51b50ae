"""Configuration of ``kvtier trace stats|fio|replay``: commands on an I/O trace CSV (``--io-trace-log``)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator, model_validator

from kvtier.config.base import StrictModel, flag

MAX_TRACE_ROWS = 50_000_000
"""Rows read at most by default (``--max-rows``): reading peaks at about 63 bytes a row (34 in the columns, the
rest while sorting by time; benchmarks/hostile_inputs.py), plus each distinct key once, so about 3 GB at 50 M
rows; a longer trace is refused at the first row past it, naming the flag."""

TRACE_HELP = "I/O trace CSV (kvtier bench --io-trace-log, or the MLPerf reference's); .zst is read too"


def _tier_list(v: str) -> str:
    parts = [p.strip().removeprefix("Tier-") for p in v.split(",") if p.strip()]
    if not parts or any(p not in ("0", "1", "2") for p in parts):
        raise ValueError(f"expected a comma-separated list of 0, 1, 2 (Tier-N), got {v!r}")
    return ",".join(sorted(set(parts)))


class TraceInput(StrictModel):
    """The trace every ``kvtier trace`` command reads, and how much of it."""

    trace: str = flag(..., TRACE_HELP, cli=False)
    max_bad_rows: int = flag(0, "malformed rows to skip (counted) before the file is refused", ge=0)
    max_rows: int = flag(
        MAX_TRACE_ROWS, "operations read at most; a longer trace is refused (about 63 bytes of memory a row)", ge=1
    )


class TraceStatsConfig(TraceInput):
    """``kvtier trace stats FILE``."""

    interval: float = flag(1.0, "seconds per bin of the rate over time", gt=0)
    output: str | None = flag(None, "also write the statistics as JSON here")


class TraceFioConfig(TraceInput):
    """``kvtier trace fio FILE --output job.fio``."""

    output: str = flag(..., "the fio job file to write")
    tiers: str = flag("2", "tiers whose operations the job reproduces (Tier-N list; 2 = the storage tier)")
    directory: str = flag(".", "fio's directory= (where the job's file lives: the device under test)")
    iodepth: int = flag(16, "fio iodepth (a trace records when operations ended, not how many were in flight)", ge=1)
    max_bs_mb: int = flag(
        64, "largest I/O, MiB: an object is moved in pieces of this size, as kvtier's --io-chunk-mb", ge=1, le=2048
    )
    ioengine: Literal["libaio", "io_uring", "psync"] = flag("libaio", "fio ioengine")
    rate: bool = flag(True, "pace reads and writes at the trace's mean bytes/s (off: --no-rate)", cli=False)
    size_gb: float = flag(0, "fio file size, GB (0 = the trace's working set on those tiers, at least 1 GiB)", ge=0)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: str) -> str:
        return _tier_list(v)


class TraceReplayConfig(TraceInput):
    """``kvtier trace replay FILE``: the trace's operations against kvtier's real tiers."""

    cache_dir: str | None = flag(None, "directory of the storage tier (default: a new temporary directory)")
    speed: float = flag(1.0, "recorded times divided by this (0 = as fast as possible)", ge=0)
    workers: int = flag(8, "operations in flight at once (each key stays on one worker, in trace order)", ge=1, le=512)
    cpu_mem_gb: float = flag(
        0, "CPU tier, GB (0 = the trace's peak of Tier-0 and Tier-1 bytes, plus 5%); Tier-0 runs here too", ge=0
    )
    storage_capacity_gb: float = flag(
        0, "storage tier, GB (0 = the trace's Tier-2 working set, within 95% of the free space)", ge=0
    )
    direct_io: Literal["auto", "on", "off"] = flag("auto", "O_DIRECT for the storage tier")
    io_chunk_mb: int = flag(64, "bytes per I/O call and per-worker buffer, MiB", ge=1, le=4096)
    model: str = flag("llama3.1-8b", "model whose bytes per token turn object sizes into tokens in the result")
    output: str | None = flag(None, "result JSON (a kvtier bench result; default ./kvtier_trace_replay_<time>.json)")
    xlsx_output: str | None = flag(None, "also write the result as XLSX")


__all__ = ["TraceStatsConfig", "TraceFioConfig", "TraceReplayConfig"]


COMM = re.compile(r"[A-Za-z0-9._:+-]{1,15}")


class TraceAttachConfig(StrictModel):
    """``kvtier trace attach --pid PID|--comm NAME --duration S``: another process's latency stack."""

    pid: int | None = flag(None, "the process to trace (its system calls; every thread)", gt=0)
    comm: str | None = flag(None, "the command name to trace (as in /proc/PID/comm, at most 15 characters)")
    duration: float = flag(..., "seconds to trace", gt=0)
    device: list[str] = flag([], "a whole disk (sda, nvme0n1): default all disks")
    output: str | None = flag(None, "also write the trace section as JSON here")

    @field_validator("comm")
    @classmethod
    def _comm(cls, v: str | None) -> str | None:
        # it goes into the bpftrace program: nothing but a command name's own characters
        if v is not None and not COMM.fullmatch(v):  # not match with $: that lets a trailing newline in
            raise ValueError(f"{v!r}: a command name is 1-15 letters, digits or ._:+-")
        return v

    @model_validator(mode="after")
    def _one_process(self) -> TraceAttachConfig:
        if (self.pid is None) == (self.comm is None):
            raise ValueError("give one of --pid and --comm")
        return self

    @property
    def who(self) -> str:
        """The bpftrace predicate that selects the traced process."""
        return f"pid == {self.pid}" if self.pid is not None else f'comm == "{self.comm}"'
