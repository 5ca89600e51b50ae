"""``kvtier mlperf compare SUMMARY``: a run's MLPerf table beside the published v3.0 KV cache rows.

SUMMARY is a run summary in the MLPerf wrapper's layout: mlpstorage's ``kvcache_run_summary_<time>.json`` or
kvtier's ``kvcache_run_summary.json`` (``kvtier mlperf run``); both hold ``options.<o>.aggregated_*`` and
``rank_count``. The published rows come from ``published_v3.yaml`` (each names its source). Per option the run's
storage throughput and read bandwidth sit beside each row's, as a ratio of the totals and per rank (the rows differ
in scale: 1 to 32 ranks). The published "P95 read latency" is the total storage time per request (the highest
instance's ``storage_read_p95_ms``): kvtier's summaries carry it (``kvtier.storage_read_p95_ms``) and it is put
beside the row's; mlpstorage's summaries carry only the storage *device* p95, another figure, shown beside it and
never divided by it. An option the run lacks is named: a CLOSED submission has all three.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kvtier.errors import DatasetError

RUN_KEYS = ("aggregated_storage_throughput_tokens_per_sec", "aggregated_read_bandwidth_gbps", "rank_count")


def published() -> dict[str, Any]:
    text = resources.files("kvtier").joinpath("mlperf/published_v3.yaml").read_text()
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def load_summary(path: str | Path) -> dict[str, dict[str, Any]]:
    """The options of a run summary, checked: every option has the figures compared (named when not)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise DatasetError(f"{p}: cannot read: {e.strerror}") from e
    except ValueError as e:
        raise DatasetError(f"{p}: not JSON: {e}") from e
    options = data.get("options") if isinstance(data, dict) else None
    if not isinstance(options, dict) or not options:
        raise DatasetError(f"{p}: no 'options' (expected a kvcache_run_summary from mlpstorage or kvtier mlperf run)")
    out: dict[str, dict[str, Any]] = {}
    for o, s in options.items():
        if not isinstance(s, dict):
            raise DatasetError(f"{p}: options.{o}: expected an object")
        for k in RUN_KEYS:
            v = s.get(k)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise DatasetError(f"{p}: options.{o}.{k}: expected a number >= 0, got {v!r}")
        out[str(o)] = s
    return out


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b > 0 else None


def compare(options: dict[str, dict[str, Any]], rows: dict[str, Any] | None = None) -> dict[str, Any]:
    pub = rows or published()
    out: dict[str, Any] = {"published_version": pub.get("version"), "options": {}, "missing_options": [], "notes": []}
    for o in ("1", "2", "3"):
        s = options.get(o)
        if s is None:
            out["missing_options"].append(int(o))
            out["notes"].append(f"option {o} is not in this run: a CLOSED submission has all three options")
            continue
        ranks = int(s["rank_count"]) or 1
        tok, read = float(s["aggregated_storage_throughput_tokens_per_sec"]), float(s["aggregated_read_bandwidth_gbps"])
        if s.get("partial_failure"):
            out["notes"].append(
                f"option {o}: partial_failure ({len(s.get('missing_files') or [])} rank results missing): its sums "
                "leave those ranks out"
            )
        entry: dict[str, Any] = {
            "run": {
                "tokens_per_sec": tok,
                "read_gbps": read,
                "ranks": ranks,
                "tokens_per_sec_per_rank": round(tok / ranks, 3),
                "read_gbps_per_rank": round(read / ranks, 6),
                "write_gbps": s.get("aggregated_write_bandwidth_gbps"),
                "device_read_p95_ms": s.get("aggregated_device_read_p95_ms"),
                # kvtier mlperf run's summaries carry the published figure too: storage time per request
                "storage_read_p95_ms": (s.get("kvtier") or {}).get("storage_read_p95_ms"),
            },
            "rows": [],
        }
        for row in pub["rows"]:
            fig = (row.get("options") or {}).get(int(o))
            if fig is None:
                continue
            n = int(row["ranks"])
            entry["rows"].append(
                {
                    "submitter": row["submitter"],
                    "system": row["system"],
                    "ranks": n,
                    "source": row["source"],
                    "tokens_per_sec": fig["tokens_per_sec"],
                    "read_gbps": fig["read_gbps"],
                    "p95_read_latency_ms": fig["p95_read_latency_ms"],
                    "run_over_row_tokens": _ratio(tok, fig["tokens_per_sec"]),
                    "run_over_row_read": _ratio(read, fig["read_gbps"]),
                    "run_over_row_tokens_per_rank": _ratio(tok / ranks, fig["tokens_per_sec"] / n),
                    "run_over_row_read_per_rank": _ratio(read / ranks, fig["read_gbps"] / n),
                    "run_over_row_p95": (
                        None
                        if entry["run"]["storage_read_p95_ms"] is None
                        else _ratio(entry["run"]["storage_read_p95_ms"], fig["p95_read_latency_ms"])
                    ),
                }
            )
        out["options"][o] = entry
    return out


def render(c: dict[str, Any]) -> list[str]:
    lines = []
    for o, e in c["options"].items():
        r = e["run"]
        p95, req = r["device_read_p95_ms"], r["storage_read_p95_ms"]
        lines.append(
            f"option {o}: this run {r['tokens_per_sec']:,.1f} tok/s, read {r['read_gbps']:.3f} GiB/s over "
            f"{r['ranks']} ranks ({r['tokens_per_sec_per_rank']:,.1f} tok/s, {r['read_gbps_per_rank']:.3f} GiB/s per "
            f"rank); device read p95 {'—' if p95 is None else f'{p95:,.1f}'} ms"
            + ("" if req is None else f"; P95 read latency {req:,.1f} ms (per request, as published)")
        )
        for row in e["rows"]:
            lines.append(
                f"  {row['submitter']} {row['system']} ({row['ranks']} rank{'s' if row['ranks'] != 1 else ''}): "
                f"{row['tokens_per_sec']:,} tok/s, read "
                f"{row['read_gbps']} GiB/s, P95 read latency {row['p95_read_latency_ms']:,} ms (per request) | "
                f"this run x{_fmt(row['run_over_row_tokens'])} tok/s, x{_fmt(row['run_over_row_read'])} read; per "
                f"rank x{_fmt(row['run_over_row_tokens_per_rank'])}, x{_fmt(row['run_over_row_read_per_rank'])}"
                + ("" if row["run_over_row_p95"] is None else f"; P95 x{_fmt(row['run_over_row_p95'])}")
            )
    lines += [f"note: {n}" for n in c["notes"]]
    lines.append(
        "the published rows are CLOSED runs (the options' fixed models, users and 300 s): a run on other parameters "
        "is placed beside them, not ranked among them"
    )
    lines.append(
        "the published P95 read latency is the total storage time per request (it includes queueing); the device "
        "p95 is the drive's own time: side by side, never divided"
    )
    return lines


def _fmt(x: float | None) -> str:
    return "—" if x is None else f"{x:.3g}"
