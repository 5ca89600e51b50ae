"""The I/O trace: one CSV row per KV operation, in the MLPerf reference's ``--io-trace-log`` format.

    Timestamp,Operation,Object_Size_Bytes,Tier,Key,Phase
    1764530000.123456,Write,131072,Tier-1,u3/c0/t2,Prefill

* Timestamp: Unix epoch seconds, 6 decimals, taken when the operation completed.
* Operation: ``Write`` or ``Read``.
* Object_Size_Bytes: the entry's logical size, one tensor-parallel rank's share (the entry size).
* Tier: ``Tier-0`` (GPU), ``Tier-1`` (CPU RAM), ``Tier-2`` (the storage tier).
* Key: the entry's cache key (links a write to its later reads and demotions).
* Phase: ``Prefill`` (a request's write), ``Decode`` (a request's read), ``Evict`` (both halves of a
  demotion: the read from the upper tier, then the write to the lower one); kvtier adds ``Promote``
  for the write half of a promotion (``--promotion on-read``; its read half is the request's read).

Deletions at the bottom tier are not operations on the medium's data and have no row, as in the
reference. A path ending in ``.zst`` is written through a streaming zstd compressor (the ``zstd``
extra). Writing is off the hot path: rows are formatted under one lock into a batch, and a writer
thread formats nothing, it only compresses and writes whole batches in order.
"""

from __future__ import annotations

import array
import csv
import io
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from kvtier.config.iotrace import MAX_TRACE_ROWS
from kvtier.errors import ConfigError, DatasetError
from kvtier.results.io import open_fresh
from kvtier.tiers import TIER_LABELS  # the reference's Tier-<n> labels, by tier kind

COLUMNS = ("Timestamp", "Operation", "Object_Size_Bytes", "Tier", "Key", "Phase")
HEADER = ",".join(COLUMNS) + "\n"
# The reference's three tiers, then kvtier's remote ones (numbers past the reference's, fixed by kind, not by
# --tier-order, so one label means one medium in every trace).
TIER_NUMBERS = {v: int(v.removeprefix("Tier-")) for v in TIER_LABELS.values()}  # "Tier-2" -> 2
TIER_BY_NUMBER = {TIER_NUMBERS[v]: k for k, v in TIER_LABELS.items()}  # 2 -> "storage"
OPERATIONS = {"read": "Read", "write": "Write"}
PHASES = {
    ("write", "request"): "Prefill",
    ("read", "request"): "Decode",
    ("read", "demotion"): "Evict",
    ("write", "demotion"): "Evict",
    ("write", "promotion"): "Promote",
}
PHASE_NAMES = ("Prefill", "Decode", "Evict", "Promote")
_HEADER_BATCH: list[Any] = []  # a marker: the writer thread writes the header for it


def zstd_module() -> Any:
    """The zstandard module, or a ConfigError saying how to install it."""
    try:
        import zstandard
    except ImportError as e:
        raise ConfigError(
            "--io-trace-log: a path ending in .zst needs the zstandard package: pip install 'kvtier[zstd]'"
        ) from e
    return zstandard


def check_trace_path(flag: str, path: str) -> None:
    """Up front: the folder exists and is writable, and .zst has its compressor."""
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag}: directory {parent} is not writable")
    if path.endswith(".zst"):
        zstd_module()


def rank_trace_path(path: str, rank: int) -> str:
    """``t.csv`` -> ``t.rank_3.csv``; ``t.csv.zst`` -> ``t.rank_3.csv.zst``."""
    p = Path(path)
    name = p.name
    for ext in (".csv.zst", ".zst", ".csv"):
        if name.endswith(ext):
            return str(p.with_name(f"{name[: -len(ext)]}.rank_{rank}{ext}"))
    return str(p.with_name(f"{name}.rank_{rank}"))


class IOTraceWriter:
    """Implements the engine's IOLog: ``store.io_log = IOTraceWriter(path)``; ``close()`` at the end.

    ``on_error`` is called once (from the writer thread) when the file cannot be written, e.g. the
    disk is full; rows after that are counted as dropped, never silently lost."""

    def __init__(
        self,
        path: str,
        batch_rows: int = 8192,
        on_error: Callable[[OSError], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.compressed = path.endswith(".zst")
        self._batch_rows = batch_rows
        self.on_error = on_error
        self._clock = clock
        self._lock = threading.Lock()
        self._rows: list[Any] = []
        self._fmt: dict[tuple[str, str, str], tuple[str, str, str]] = {}
        self.rows = 0
        self.rows_dropped = 0
        self.text_bytes = 0
        self.error: str | None = None
        self._raw: IO[bytes] = open_fresh(path, "--io-trace-log")  # never through a planted file or link
        self._out: Any = self._raw
        if self.compressed:
            self._out = zstd_module().ZstdCompressor(level=3).stream_writer(self._raw, closefd=False)
        self._batches: queue.Queue[list[Any] | None] = queue.Queue(maxsize=64)
        self._thread = threading.Thread(target=self._write_loop, name="kvtier-io-trace", daemon=True)
        self._thread.start()
        self._batches.put(_HEADER_BATCH)
        self._closed = False

    # IOLog
    def io(self, op: str, tier: str, key: str, cause: str, nbytes: int) -> None:
        """One completed operation: a tuple appended under the lock; formatting is the writer thread's."""
        with self._lock:
            if self._closed:
                self.rows_dropped += 1
                return
            rows = self._rows
            rows.append((self._clock(), op, tier, cause, nbytes, key))
            if len(rows) >= self._batch_rows:
                self._rows = []
                self.rows += len(rows)
                self._batches.put(rows)

    def _format(self, batch: list[Any]) -> bytes:
        fmt = self._fmt
        out = []
        for ts, op, tier, cause, nbytes, key in batch:
            mid = fmt.get((op, tier, cause))
            if mid is None:
                mid = fmt[(op, tier, cause)] = (
                    f",{OPERATIONS[op]},",
                    f",{TIER_LABELS.get(tier, tier)},",
                    f",{PHASES.get((op, cause), cause)}\n",
                )
            if '"' in key or "," in key or "\n" in key or "\r" in key:
                key = '"' + key.replace('"', '""') + '"'
            out.append(f"{ts:.6f}{mid[0]}{nbytes}{mid[1]}{key}{mid[2]}")
        return "".join(out).encode()

    def _write_loop(self) -> None:
        while True:
            batch = self._batches.get()
            if batch is None:
                return
            if self.error is not None:
                self.rows_dropped += len(batch)
                continue
            data = HEADER.encode() if batch is _HEADER_BATCH else self._format(batch)
            try:
                self._out.write(data)
                self.text_bytes += len(data)
            except OSError as e:
                self.error = f"{self.path}: {e.strerror or e}"
                self.rows_dropped += len(batch) if batch is not _HEADER_BATCH else 0
                if self.on_error is not None:
                    self.on_error(e)

    def close(self) -> dict[str, Any]:
        """Flush, finish the zstd frame, close; returns the trace's figures."""
        with self._lock:
            if not self._closed:
                self._closed = True
                batch, self._rows = self._rows, []
                self.rows += len(batch)
                if batch:
                    self._batches.put(batch)
                self._batches.put(None)
        self._thread.join()
        try:
            if self.compressed:
                self._out.close()
            self._raw.close()
        except OSError as e:
            self.error = self.error or f"{self.path}: {e.strerror or e}"
        rows = self.rows - (self.rows_dropped if self.error else 0)
        return {
            "path": self.path,
            "rows": max(rows, 0),
            "rows_dropped": self.rows_dropped,
            "compressed": self.compressed,
            "csv_bytes": self.text_bytes,
            "file_bytes": os.path.getsize(self.path) if os.path.exists(self.path) else 0,
            "error": self.error,
        }


# -- reading ---------------------------------------------------------------------------------
@dataclass
class IOTrace:
    """A trace in columns. ``tier`` holds 0/1/2 (Tier-N), ``op`` 1 for Write and 0 for Read,
    ``phase`` an index into ``phases``; keys are interned: ``key`` indexes ``keys``."""

    path: str
    ts: np.ndarray  # float64 Unix seconds
    op: np.ndarray  # int8: 1 write, 0 read
    size: np.ndarray  # int64 bytes
    tier: np.ndarray  # int8 Tier-N
    key: np.ndarray  # int64 index into keys
    phase: np.ndarray  # int8 index into phases
    keys: list[str]
    phases: list[str]
    rows_skipped: int = 0

    def __len__(self) -> int:
        return int(self.ts.size)

    @property
    def duration_s(self) -> float:
        return float(self.ts[-1] - self.ts[0]) if len(self) > 1 else 0.0


def _open_text(path: str) -> IO[str]:
    if path.endswith(".zst"):
        try:
            import zstandard
        except ImportError as e:
            raise DatasetError(
                f"{path}: reading a .zst trace needs the zstandard package: pip install 'kvtier[zstd]'"
            ) from e
        raw = open(path, "rb")
        return io.TextIOWrapper(
            zstandard.ZstdDecompressor().stream_reader(raw, closefd=True), encoding="utf-8", newline=""
        )
    return open(path, encoding="utf-8", newline="")


MAX_OBJECT_BYTES = 1 << 48
"""The largest Object_Size_Bytes read (256 TiB), and less for a longer trace (``size_limit``)."""
INT64_MAX = (1 << 63) - 1


def size_limit(max_rows: int) -> int:
    """The largest Object_Size_Bytes a trace of up to ``max_rows`` rows may hold: MAX_OBJECT_BYTES, or less, so that
    every row's size summed stays inside int64 (2^48 wrapped the totals at 32,768 rows; at the default 50 M rows the
    limit is 184 GB an operation)."""
    return min(MAX_OBJECT_BYTES, INT64_MAX // max(1, max_rows))


MAX_PHASES = 127
"""Distinct Phase values a trace may hold (their index is an int8)."""


def _checked(text: str, column: str, kind: type) -> Any:
    """``kind(text)``, or a ValueError that names the column and the value."""
    try:
        return kind(text)
    except (ValueError, OverflowError):
        raise ValueError(f"{column} {text[:40]!r} is not {'an integer' if kind is int else 'a number'}") from None


def read_trace(path: str, max_bad_rows: int = 0, max_rows: int = MAX_TRACE_ROWS) -> IOTrace:
    """Load a trace written by kvtier or by the reference (same columns, any column order).

    Rows are gathered in typed arrays (8 bytes for the time, size and key, 1 for the rest: no Python object
    a row), and at most ``max_rows`` of them. Raises DatasetError naming the file and line for a missing
    file, a wrong header, a bad row (more than ``max_bad_rows`` of them; fewer are skipped and counted) or
    a row past ``max_rows``."""
    if not os.path.isfile(path):
        raise DatasetError(f"{path}: no such file")
    biggest = size_limit(max_rows)
    ts = array.array("d")
    ops = array.array("b")
    sizes = array.array("q")
    tiers = array.array("b")
    key_ids = array.array("q")
    phase_ids = array.array("b")
    keys: dict[str, int] = {}
    phases: dict[str, int] = {p: i for i, p in enumerate(PHASE_NAMES)}
    skipped = 0
    try:
        with _open_text(path) as f:
            reader = csv.reader(f)
            try:
                header = next(reader)
            except StopIteration:
                raise DatasetError(f"{path}: empty file (expected the header {HEADER.strip()})") from None
            header = [h.strip() for h in header]
            missing = [c for c in COLUMNS if c not in header]
            if missing:
                raise DatasetError(f"{path}:1: not an I/O trace: columns {missing} missing (header {header})")
            idx = [header.index(c) for c in COLUMNS]
            width = len(header)
            op_codes = {"Write": 1, "Read": 0, "write": 1, "read": 0}
            i_ts, i_op, i_size, i_tier, i_key, i_phase = idx
            for line, row in enumerate(reader, start=2):
                if not row:
                    continue
                try:
                    if len(row) != width:
                        raise ValueError(f"{len(row)} fields, header has {width}")
                    t = _checked(row[i_ts], COLUMNS[0], float)
                    if not math.isfinite(t):
                        raise ValueError(f"{COLUMNS[0]} {row[i_ts]!r} is not a finite number")
                    o = op_codes.get(row[i_op], -1)
                    if o < 0:
                        raise ValueError(f"{COLUMNS[1]} {row[i_op][:40]!r} is not Write or Read")
                    n = _checked(row[i_size], COLUMNS[2], int)
                    if not 0 <= n <= biggest:
                        raise ValueError(
                            f"{COLUMNS[2]} {n} is outside 0..{biggest} (the sizes of up to --max-rows {max_rows:,} "
                            "rows must sum within int64)"
                        )
                    if row[i_tier] not in TIER_NUMBERS:
                        raise ValueError(f"{COLUMNS[3]} {row[i_tier][:40]!r} is not one of {', '.join(TIER_NUMBERS)}")
                    tr = TIER_NUMBERS[row[i_tier]]
                    if row[i_phase] not in phases and len(phases) >= MAX_PHASES:
                        raise ValueError(f"more than {MAX_PHASES} distinct {COLUMNS[5]} values")
                except (ValueError, KeyError) as e:
                    skipped += 1
                    if skipped > max_bad_rows:
                        what = f"unknown value {e}" if isinstance(e, KeyError) else str(e)
                        raise DatasetError(f"{path}:{line}: bad row ({what}): {','.join(row)[:200]}") from None
                    continue
                if len(ts) >= max_rows:
                    raise DatasetError(
                        f"{path}:{line}: more than {max_rows:,} operations; give --max-rows to read more "
                        "(about 63 bytes of memory a row while reading, and each distinct key once)"
                    )
                ts.append(t)
                ops.append(o)
                sizes.append(n)
                tiers.append(tr)
                k = row[i_key]
                kid = keys.get(k)
                if kid is None:
                    kid = keys[k] = len(keys)
                key_ids.append(kid)
                ph = row[i_phase]
                pid = phases.get(ph)
                if pid is None:
                    pid = phases[ph] = len(phases)
                phase_ids.append(pid)
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text ({e.reason})") from e
    except csv.Error as e:
        raise DatasetError(f"{path}: malformed CSV: {e}") from e
    except OSError as e:  # includes zstd's "not a zstd frame"
        raise DatasetError(f"{path}: cannot read: {e}") from e
    if not ts:
        raise DatasetError(f"{path}: no operations (only a header)")
    t_col = np.frombuffer(ts, dtype=np.float64)
    order = np.argsort(t_col, kind="stable")  # rows are written per batch; sort by time once
    return IOTrace(
        path,
        t_col[order],
        np.frombuffer(ops, dtype=np.int8)[order],
        np.frombuffer(sizes, dtype=np.int64)[order],
        np.frombuffer(tiers, dtype=np.int8)[order],
        np.frombuffer(key_ids, dtype=np.int64)[order],
        np.frombuffer(phase_ids, dtype=np.int8)[order],
        list(keys),
        list(phases),
        skipped,
    )


__all__ = [
    "COLUMNS",
    "HEADER",
    "TIER_LABELS",
    "PHASES",
    "IOTraceWriter",
    "IOTrace",
    "read_trace",
    "MAX_TRACE_ROWS",
    "TIER_BY_NUMBER",
    "check_trace_path",
    "rank_trace_path",
    "zstd_module",
]
