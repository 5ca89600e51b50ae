"""Compare two replay results: refuse when they differ in what makes the figures comparable."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.report.replay import ReplayResult

FIXED = ("model", "concurrency", "num_rounds", "dataset", "dataset_format", "gap_scale", "history", "user_order")
"""Config fields two runs must share to be compared."""


@dataclass
class Comparison:
    rows: list[tuple[str, float | None, float | None]]
    problems: list[str]

    @property
    def comparable(self) -> bool:
        return not self.problems


def compare(a: ReplayResult, b: ReplayResult) -> Comparison:
    ca, cb = a.config.model_dump(), b.config.model_dump()
    problems = [f"{k}: {ca[k]!r} vs {cb[k]!r}" for k in FIXED if ca[k] != cb[k]]
    sa, sb = a.summary.sessions, b.summary.sessions
    if sa.complete != sb.complete or a.concurrency.achieved != b.concurrency.achieved:
        problems.append(
            f"achieved sessions/concurrency differ: {sa.model_dump()} / {a.concurrency.achieved} vs "
            f"{sb.model_dump()} / {b.concurrency.achieved}"
        )
    rows = [
        ("TTFT p50 s", a.summary.ttft_s.p50, b.summary.ttft_s.p50),
        ("TTFT p95 s", a.summary.ttft_s.p95, b.summary.ttft_s.p95),
        ("degradation median %", a.summary.ttft_degradation.median_pct, b.summary.ttft_degradation.median_pct),
        ("TPOT mean s", a.summary.tpot_s_mean, b.summary.tpot_s_mean),
    ]
    return Comparison(rows, problems)


__all__ = ["compare", "Comparison", "FIXED"]
