"""Writers of a result dict: JSON (atomic rename) and XLSX (same data, one sheet per section)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

from kvtier.errors import KvtierError


def write_json(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    try:
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True)
        tmp.write_text(json.dumps(result, indent=2, sort_keys=False) + "\n")
        os.replace(tmp, p)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise KvtierError(f"--output: cannot write {p}: {e.strerror}") from e
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


def write_xlsx(result: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    import xlsxwriter  # noqa: PLC0415

    p = Path(path)
    wb = xlsxwriter.Workbook(str(p))
    bold = wb.add_format({"bold": True})
    sections = {
        "Summary": {k: v for k, v in result.items() if not isinstance(v, dict)} | {
            k: v for k, v in result["summary"].items() if k not in ("cache_stats", "qos_metrics")},
        "Cache": result["summary"]["cache_stats"],
        "QoS": result["summary"]["qos_metrics"],
        "Tiers": result["tiers"],
        "Errors": result["errors"],
        "Memory+IO": {"memory": result["memory"], "process_io": result["process_io"], "storage": result["storage"]},
        "Host": result["host"],
        "Config": result["config"],
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
