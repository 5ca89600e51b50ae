"""Writers of results: JSON (atomic rename) and XLSX (the bench result, one sheet per section)."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kvtier.errors import KvtierError

if TYPE_CHECKING:
    from kvtier.report.bench import BenchResult


def to_jsonable(result: BaseModel | dict[str, Any]) -> dict[str, Any]:
    return result.model_dump(mode="json") if isinstance(result, BaseModel) else result


def write_json(result: BaseModel | dict[str, Any], path: str | os.PathLike[str], flag: str = "--output") -> Path:
    """Write ``result`` as indented JSON: to a new temporary file beside ``path`` (created exclusively,
    with a random name, so a planted file or symlink is never followed), then renamed over it, so a
    reader never sees half a file. A failure is a KvtierError naming ``flag``."""
    p = Path(path)
    tmp: str | None = None
    try:
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(to_jsonable(result), indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise KvtierError(f"{flag}: cannot write {p}: {e.strerror}") from e
    return p


def flatten(d: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(d, dict):
        for k, v in d.items():
            yield from flatten(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(d, list):
        if all(not isinstance(x, (dict, list)) for x in d):
            yield prefix, "; ".join(str(x) for x in d)
        else:
            for i, v in enumerate(d):
                yield from flatten(v, f"{prefix}[{i}]")
    else:
        yield prefix, d


def write_xlsx(result: BenchResult, path: str | os.PathLike[str]) -> Path:
    import xlsxwriter

    r = result.model_dump(mode="json")
    p = Path(path)
    wb = xlsxwriter.Workbook(str(p))
    bold = wb.add_format({"bold": True})
    sections = {
        "Summary": {k: v for k, v in r.items() if not isinstance(v, (dict, list))}
        | {k: v for k, v in r["summary"].items() if k not in ("cache_stats", "qos_metrics")},
        "Cache": r["summary"]["cache_stats"],
        "QoS": r["summary"]["qos_metrics"],
        "Tiers": r["tiers"],
        "Errors": r["errors"],
        "Memory+IO": {"memory": r["memory"], "process_io": r["process_io"], "storage": r["storage"]},
        "Warnings": {f"{i}.{w['code']}": w["message"] for i, w in enumerate(r["warnings"])}
        | {"stop_reason.code": r["stop_reason"]["code"], "stop_reason.message": r["stop_reason"]["message"]},
        "Host": r["host"],
        "Config": r["config"],
    }
    try:
        for name, data in sections.items():
            ws = wb.add_worksheet(name)
            ws.write_row(0, 0, ["field", "value"], bold)
            ws.set_column(0, 0, 60)
            ws.set_column(1, 1, 40)
            for row, (k, v) in enumerate(flatten(data), start=1):
                ws.write(row, 0, k)
                if v is None:
                    ws.write_blank(row, 1, None)
                elif isinstance(v, bool):
                    ws.write_boolean(row, 1, v)
                elif isinstance(v, (int, float)):
                    ws.write_number(row, 1, v)
                else:
                    ws.write_string(row, 1, str(v))
        wb.close()
    except OSError as e:
        raise KvtierError(f"--xlsx-output: cannot write {p}: {e.strerror}") from e
    return p
