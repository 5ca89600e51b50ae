"""Request traces: BurstGPT, Azure LLM inference and Mooncake, read strictly.

Every loader validates as it reads: a missing, empty or malformed file is a DatasetError naming the
file and line, never a silent fallback to synthetic load.

* BurstGPT CSV (file or directory of CSVs, columns by name, so both the v1 layout
  ``Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`` and the v2 layout with
  ``Session ID`` and ``Elapsed time`` work). Timestamp in seconds from the trace start. Rows with
  ``Response tokens`` 0 are failed requests in the source and are skipped (counted).
* Azure LLM inference CSV ``TIMESTAMP,ContextTokens,GeneratedTokens`` (wall-clock timestamps).
* Mooncake JSONL ``{timestamp (ms), input_length, output_length, hash_ids}`` with 512-token blocks;
  ``hash_ids`` are prefix-aware block ids, so equal ids at equal positions share KV.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kvtier.errors import DatasetError
from kvtier.workload.formats import classify, elsewhere

TraceFormat = Literal["auto", "burstgpt", "azure", "mooncake"]
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] | None = None
    source: str = ""  # file:line


@dataclass
class Trace:
    format: str
    requests: list[TraceRequest]
    files: list[str]
    skipped_rows: int = 0
    block_tokens: int | None = None


def _files(path: Path, suffixes: tuple[str, ...]) -> list[Path]:
    if not path.exists():
        raise DatasetError(f"{path}: no such file or directory")
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix.lower() in suffixes)
        if not files:
            raise DatasetError(f"{path}: directory holds no {'/'.join(suffixes)} files")
        return files
    return [path]


def _int(value: str | int | None, where: str, field: str, minimum: int = 0) -> int:
    try:
        v = int(float(value)) if isinstance(value, str) else value
    except (TypeError, ValueError):
        v = None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise DatasetError(f"{where}: {field} must be an integer >= {minimum}, got {value!r}")
    return v


def _num(value: str | float | None, where: str, field: str) -> float:
    try:
        v = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DatasetError(f"{where}: {field} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise DatasetError(f"{where}: {field} must be finite and >= 0, got {value!r}")
    return v


def _csv_rows(path: Path, required: Sequence[str]) -> Iterable[tuple[str, dict[str, str]]]:
    try:
        f = path.open(newline="", encoding="utf-8")
    except OSError as e:
        raise DatasetError(f"{path}: cannot read: {e.strerror}") from e
    with f:
        reader = csv.DictReader(f)
        header = [h.strip() for h in (reader.fieldnames or [])]
        if not header:
            raise DatasetError(f"{path}:1: empty file (expected a header with {', '.join(required)})")
        missing = [c for c in required if c not in header]
        if missing:
            raise DatasetError(f"{path}:1: missing column(s) {', '.join(missing)} (header: {', '.join(header)})")
        reader.fieldnames = header
        for row in reader:
            yield f"{path}:{reader.line_num}", row


def load_burstgpt(path: Path) -> Trace:
    reqs, skipped, files = [], 0, _files(path, (".csv",))
    for file in files:
        for where, row in _csv_rows(file, ("Timestamp", "Request tokens", "Response tokens")):
            out = _int(row["Response tokens"], where, "Response tokens")
            if out == 0:
                skipped += 1  # a failed request in the source
                continue
            reqs.append(
                TraceRequest(
                    _num(row["Timestamp"], where, "Timestamp"),
                    _int(row["Request tokens"], where, "Request tokens", 1),
                    out,
                    None,
                    where,
                )
            )
    return _finish("burstgpt", reqs, files, skipped)


def load_azure(path: Path) -> Trace:
    reqs, files = [], _files(path, (".csv",))
    t0: dt.datetime | None = None
    for file in files:
        for where, row in _csv_rows(file, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
            ts = row["TIMESTAMP"].strip()
            try:
                # 7 fractional digits in the source: keep microseconds
                t = dt.datetime.fromisoformat(ts[:26] if "." in ts else ts)
            except ValueError:
                raise DatasetError(f"{where}: TIMESTAMP {ts!r} is not a date-time") from None
            t0 = t0 or t
            reqs.append(
                TraceRequest(
                    (t - t0).total_seconds(),
                    _int(row["ContextTokens"], where, "ContextTokens", 1),
                    _int(row["GeneratedTokens"], where, "GeneratedTokens"),
                    None,
                    where,
                )
            )
    return _finish("azure", reqs, files, 0)


def load_mooncake(path: Path) -> Trace:
    reqs, files = [], _files(path, (".jsonl", ".json"))
    for file in files:
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise DatasetError(f"{file}: cannot read: {e.strerror}") from e
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{file}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DatasetError(f"{where}: expected an object")
            for k in ("timestamp", "input_length", "output_length", "hash_ids"):
                if k not in obj:
                    raise DatasetError(f"{where}: missing field {k!r}")
            inp = _int(obj["input_length"], where, "input_length", 1)
            ids = obj["hash_ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise DatasetError(f"{where}: hash_ids must be a list of integers")
            if len(ids) != math.ceil(inp / MOONCAKE_BLOCK_TOKENS):
                raise DatasetError(
                    f"{where}: {len(ids)} hash_ids for input_length {inp} "
                    f"(expected ceil({inp}/{MOONCAKE_BLOCK_TOKENS}))"
                )
            reqs.append(
                TraceRequest(
                    _num(obj["timestamp"], where, "timestamp") / 1000.0,
                    inp,
                    _int(obj["output_length"], where, "output_length"),
                    tuple(ids),
                    where,
                )
            )
    t = _finish("mooncake", reqs, files, 0)
    t.block_tokens = MOONCAKE_BLOCK_TOKENS
    return t


def _finish(fmt: str, reqs: list[TraceRequest], files: Sequence[Path], skipped: int) -> Trace:
    if not reqs:
        raise DatasetError(f"{', '.join(map(str, files))}: no requests in the trace")
    reqs.sort(key=lambda r: r.arrival_s)
    return Trace(fmt, reqs, [str(f) for f in files], skipped)


def detect_format(path: Path) -> str:
    first = _files(path, (".csv", ".jsonl", ".json"))[0]
    try:
        with first.open(encoding="utf-8") as f:
            head = f.readline().strip()
    except OSError as e:
        raise DatasetError(f"{first}: cannot read: {e.strerror}") from e
    if not head:
        raise DatasetError(f"{first}:1: empty file")
    known = classify(head)
    if known is not None and known.name in TRACE_FORMATS:
        return known.name
    raise DatasetError(
        f"{first}:1: cannot tell the trace format from {head[:80]!r} (BurstGPT or Azure CSV, Mooncake JSONL)"
        + (elsewhere(first, TRACE_FORMATS) or "; kvtier bench --trace-format names it when the header is unusual")
    )


TRACE_FORMATS = ("burstgpt", "azure", "mooncake")
"""The formats of kvtier/workload/formats.py that this module reads."""


LOADERS: dict[str, Callable[[Path], Trace]] = {
    "burstgpt": load_burstgpt,
    "azure": load_azure,
    "mooncake": load_mooncake,
}


def load_trace(path: str | Path, fmt: TraceFormat = "auto") -> Trace:
    p = Path(path)
    name = detect_format(p) if fmt == "auto" else fmt
    return LOADERS[name](p)
