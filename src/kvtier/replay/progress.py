"""Progress while a replay runs (``--progress auto|live|plain|none``): what ``kvtier bench`` shows, for a
serving run. A rich live table on a terminal, a plain line every ``--progress-interval`` seconds
otherwise: elapsed, requests done of the total, in flight, sessions complete / incomplete / error,
TTFT p50/p95 so far, failures, and the server's hit rates from the latest scrapes."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from kvtier.progress import ProgressOutput


def snapshot(records: list[dict[str, Any]], total: int, turns: int, users: int, in_flight: int,
             rates: dict[str, float | None]) -> dict[str, Any]:  # fmt: skip
    """The figures of one progress line, from the records finished so far."""
    recs = records[:]  # appended to by the client meanwhile: one consistent prefix
    ok = [r["ttft_s"] for r in recs if r["status"] == "ok" and r["ttft_s"] is not None]
    per_user: dict[str, list[bool]] = defaultdict(list)
    for r in recs:
        per_user[r["user"]].append(r["status"] == "ok")
    complete = sum(1 for v in per_user.values() if len(v) == turns and all(v))
    error = sum(1 for v in per_user.values() if not all(v))
    return {
        "done": len(recs),
        "total": total,
        "in_flight": in_flight,
        "failed": sum(1 for r in recs if r["status"] != "ok"),
        "sessions_complete": complete,
        "sessions_error": error,
        "sessions_open": users - complete - error,
        "ttft_p50_s": float(np.percentile(ok, 50)) if ok else None,
        "ttft_p95_s": float(np.percentile(ok, 95)) if ok else None,
        "rates": rates,
    }


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


class ReplayProgress(ProgressOutput):
    def tick(self, elapsed_s: float, s: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rates = " ".join(f"{k.replace('_hit_rate', '')}={_f(v, '.2f')}" for k, v in s["rates"].items()) or "—"
        vals = (
            f"{elapsed_s:6.1f}s",
            f"{s['done']}/{s['total']}",
            str(s["in_flight"]),
            f"{s['sessions_complete']}/{s['sessions_open']}/{s['sessions_error']}",
            f"{_f(s['ttft_p50_s'], '.3f')}/{_f(s['ttft_p95_s'], '.3f')}",
            str(s["failed"]),
            rates,
        )
        self.show(
            "kvtier replay",
            (
                "elapsed",
                "requests",
                "in flight",
                "sessions ok/open/error",
                "TTFT p50/p95 s",
                "failed",
                "server hit rates",
            ),
            vals,
            f"[kvtier replay] t={vals[0]} requests={vals[1]} in_flight={vals[2]} sessions ok/open/error={vals[3]} "
            f"ttft_p50/p95={vals[4]} s failed={vals[5]} hit_rates: {vals[6]}",
        )


__all__ = ["ReplayProgress", "snapshot"]
