"""The one status rule of every kvtier command: failed work decides the status.

A run is ``complete`` only if it ran to its stop condition *and* the share of its work that failed
is within ``--max-failure-rate`` (default 0.01). Above it the run is ``failed`` (exit 1) with stop
code ``too-many-failures``; a run that stopped early (a signal, a full device, a lost server) stays
``partial`` with its own stop code. Any failure at all adds the warning ``requests-failed`` with the
counts by cause.

Failures are counted by *cause*, a stable code classified from what happened (never the server's
text copied): ``{cause: {count, first_message, http_status}}``. Causes in ``NOT_COUNTED`` are work the
run's own end cut off (``cut-at-stop`` in a replay, ``cancelled`` in a bench): they are listed, but
they do not count as failed work.

    failed share = failed / (ok + failed)     where failed excludes NOT_COUNTED causes
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvtier.config.base import DEFAULT_MAX_FAILURE_RATE
from kvtier.results.envelope import ResultWarning, Section, Status, StopCode, StopReason, WarningCode, warning

NOT_COUNTED = frozenset({"cut-at-stop", "cancelled"})
"""Causes that are the run's own end (its --duration, its Ctrl+C), not failed work."""


class Failure(Section):
    """One cause of failure: how many, and the first message seen (cut to 300 characters)."""

    count: int
    first_message: str
    http_status: int | None = None  # replay: the HTTP status the cause was seen with (None: no response)


def tally(items: Iterable[tuple[str, str, int | None]]) -> dict[str, Failure]:
    """``(cause, message, http_status)`` per failed unit of work -> ``{cause: Failure}``, sorted by
    count (largest first), the first message and status of each cause kept."""
    out: dict[str, Failure] = {}
    for cause, message, status in items:
        f = out.get(cause)
        if f is None:
            out[cause] = Failure(count=1, first_message=(message or "")[:300], http_status=status)
        else:
            f.count += 1
    return dict(sorted(out.items(), key=lambda kv: (-kv[1].count, kv[0])))


def merge(parts: Iterable[Mapping[str, Failure]]) -> dict[str, Failure]:
    """Several runs' (ranks', trials') failures as one: counts summed, the first message kept."""
    out: dict[str, Failure] = {}
    for part in parts:
        for cause, f in part.items():
            if cause in out:
                out[cause].count += f.count
            else:
                out[cause] = f.model_copy()
    return dict(sorted(out.items(), key=lambda kv: (-kv[1].count, kv[0])))


def failed_count(failures: Mapping[str, Failure]) -> int:
    """Failed units of work: every cause but those the run's own end cut (NOT_COUNTED)."""
    return sum(f.count for c, f in failures.items() if c not in NOT_COUNTED)


def label(cause: str, f: Failure) -> str:
    """``context-length (HTTP 400)``: a cause as the terminal and warnings say it."""
    return f"{cause} (HTTP {f.http_status})" if f.http_status else cause


def in_words(failures: Mapping[str, Failure], ok: int, what: str = "requests") -> str:
    """ "248 of 700 requests failed: context-length (HTTP 400) 248" (empty when nothing failed)."""
    failed = failed_count(failures)
    cut = sum(f.count for c, f in failures.items() if c in NOT_COUNTED)
    text = ""
    if failed:
        causes = ", ".join(f"{label(c, f)} {f.count}" for c, f in failures.items() if c not in NOT_COUNTED)
        text = f"{failed} of {ok + failed} {what} failed: {causes}"
    if cut:
        if text:
            text += f" (and {cut} cut at the run's end, not counted as failed)"
        else:
            text = f"{cut} {what} in flight were cut at the run's end: not counted as failed"
    return text.strip()


def judge(
    status: Status,
    stop: StopReason,
    ok: int,
    failures: Mapping[str, Failure],
    max_failure_rate: float,
    what: str = "requests",
) -> tuple[Status, StopReason, list[ResultWarning]]:
    """The status rule (module docstring) applied to a run's own verdict: returns the status, the stop
    reason and the ``requests-failed`` warning (none when nothing failed)."""
    failed = failed_count(failures)
    attempted = ok + failed
    share = failed / attempted if attempted else 0.0
    out: list[ResultWarning] = []
    if failed:  # work the run's own end cut is listed in failures, but it is not a failure
        out.append(
            warning(
                WarningCode.requests_failed,
                in_words(failures, ok, what),
                failed=failed,
                attempted=attempted,
                failed_share=round(share, 6),
                max_failure_rate=max_failure_rate,
                by_cause={c: f.count for c, f in failures.items()},
            )
        )
    if status != Status.partial and failed and share > max_failure_rate:
        status = Status.failed
        stop = StopReason(
            code=StopCode.too_many_failures,
            message=f"{share:.1%} of {attempted} {what} failed, above --max-failure-rate {max_failure_rate:g} "
            f"(the run itself ended: {stop.code.value})",
        )
    return status, stop, out


def closing_lines(
    status: Status, stop: StopReason, failures: Mapping[str, Failure], ok: int, what: str = "requests"
) -> list[str]:
    """The terminal's last lines about a run's outcome, in words: what failed by cause, and why a run
    that is not complete is not (nothing for a complete run without failures)."""
    out = []
    words = in_words(failures, ok, what)
    if words:
        out.append(words)
    if status != Status.complete:
        out.append(f"run {status.value} ({stop.code.value}): {stop.message}")
    return out


__all__ = [
    "closing_lines",
    "DEFAULT_MAX_FAILURE_RATE",
    "NOT_COUNTED",
    "Failure",
    "tally",
    "merge",
    "failed_count",
    "label",
    "in_words",
    "judge",
]
