"""Progress while a replay runs (``--progress auto|live|plain|none``): what ``kvtier bench`` shows, for a
serving run. A rich live table on a terminal, a plain line every ``--progress-interval`` seconds
otherwise: elapsed, requests done of the total, in flight, sessions complete / incomplete / error,
TTFT p50/p95 so far, failures, and the server's hit rates from the latest scrapes."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from kvtier.progress import ProgressOutput
from kvtier.results.replay import ReplayRecord
from kvtier.stats import percentile


class Tally:
    """Running counts over the records finished so far: each update reads only the new ones (the progress
    task runs on the client's event loop, so its cost must not grow with the run). ``plan``: each virtual user's
    id and number of turns, in the order users start (what the ETA weighs the requests left by)."""

    def __init__(self, plan: list[tuple[str, int]] | None = None) -> None:
        self.seen = 0
        self.failed = 0
        self.ttft_ok: list[float] = []
        self.per_user: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # user -> [records, failed]
        self.plan = plan or []
        self.e2e_by_turn: dict[int, list[float]] = defaultdict(lambda: [0.0, 0])  # turn -> [sum of e2e s, count]
        self.e2e_done = 0.0  # e2e seconds of every request ended so far (a failed one's as far as it got)

    def update(self, records: list[ReplayRecord]) -> None:
        new = records[self.seen :]  # appended to by the client meanwhile: one consistent slice
        self.seen += len(new)
        for r in new:
            u = self.per_user[r["user"]]
            u[0] += 1
            if r["e2e_s"] is not None:
                self.e2e_done += r["e2e_s"]
                if r["status"] == "ok":
                    t = self.e2e_by_turn[r["turn"]]
                    t[0] += r["e2e_s"]
                    t[1] += 1
            if r["status"] == "ok":
                if r["ttft_s"] is not None:
                    self.ttft_ok.append(r["ttft_s"])
            else:
                u[1] += 1
                self.failed += 1

    def work_left(self, total: int, ages: Sequence[float] = ()) -> float | None:
        """Seconds of requests (each at the mean e2e its turn has had so far; a turn not reached yet, as the latest
        turn reached) of the next ``total - seen`` requests, taking each user's turns left in the order users start;
        None without a plan or before a request ended. ``ages``: how long each request in flight has run; it is
        taken to need the rest of a typical request (the mean e2e so far) or, once past half of one, as long again
        as it has run (a request held in a queue tends to stay): the larger, so the estimate never jumps."""
        if not self.plan or not self.e2e_by_turn:
            return None
        reached = sorted(self.e2e_by_turn)
        mean = {t: s / n for t, (s, n) in self.e2e_by_turn.items()}
        left, need = 0.0, total - self.seen
        typical = self.e2e_done / max(1, self.seen)
        for age in ages[:need]:  # in flight: the first of the requests left
            left += max(typical - age, age) - typical  # added to the typical cost counted below
        for user, turns in self.plan:
            if need <= 0:
                break
            done, failed = self.per_user.get(user, (0, 0))
            if failed:
                continue  # a user whose request failed stops
            for turn in range(done, min(turns, done + need)):
                near = next((t for t in reversed(reached) if t <= turn), reached[0])
                left += mean.get(turn, mean[near])
            need -= max(0, min(turns - done, need))
        return left


def snapshot(
    records: list[ReplayRecord],
    total: int,
    turns: int,
    users: int,
    in_flight: int,
    rates: dict[str, float | None],
    tally: Tally | None = None,
    ages: Sequence[float] = (),
) -> dict[str, Any]:
    """The figures of one progress line, from the records finished so far (``tally`` keeps the counts
    between calls; without one they are counted afresh; ``ages``: how long each request in flight has run)."""
    t = tally if tally is not None else Tally()
    t.update(records)
    complete = sum(1 for n, bad in t.per_user.values() if n == turns and not bad)
    error = sum(1 for _, bad in t.per_user.values() if bad)
    left = t.work_left(total, ages)
    return {
        "done": t.seen,
        "total": total,
        "work": None if left is None else (left, t.e2e_done + sum(ages)),
        "in_flight": in_flight,
        "failed": t.failed,
        "sessions_complete": complete,
        "sessions_error": error,
        "sessions_open": users - complete - error,
        "ttft_p50_s": percentile(t.ttft_ok, 50),
        "ttft_p95_s": percentile(t.ttft_ok, 95),
        "rates": rates,
    }


def _f(v: float | None, fmt: str) -> str:
    return "—" if v is None else format(v, fmt)


def eta_s(
    elapsed_s: float, done: int, total: int, duration_s: float = 0.0, work: tuple[float, float] | None = None
) -> float | None:
    """Seconds left: the requests left at the rate so far, or what is left of --duration when sooner;
    None before the first request ends (no rate yet) without a duration. With ``work`` (the e2e seconds of the
    requests left as Tally.work_left weighs them, and of those ended) the rate is of work, not of requests: a
    conversation's later turns, with longer prompts, take longer than its first ones. Neither foresees a server
    whose queue builds late (the README's replay: 13-18 s said for 10-70 s left while long prompts waited for GPU
    room); the closing line's TTFT p95/p99 and queued share show that tail."""
    left = None
    if done and total > done:
        left = (total - done) * elapsed_s / done
        if work is not None and work[1] > 0:
            left = elapsed_s * work[0] / work[1]
    elif total and done >= total:
        left = 0.0
    if duration_s > 0:
        until = max(0.0, duration_s - elapsed_s)
        left = until if left is None else min(left, until)
    return left


class ReplayProgress(ProgressOutput):
    def tick(self, elapsed_s: float, s: dict[str, Any], in_dataset: int | None = None, duration_s: float = 0.0) -> None:
        """One progress update: requests done of the run's total (its --max-requests where that is fewer),
        the share of the dataset's requests done, and the ETA (eta_s)."""
        if not self.enabled:
            return
        of_dataset = f" ({s['done'] / in_dataset:.0%} of dataset)" if in_dataset else ""
        eta = eta_s(elapsed_s, s["done"], s["total"], duration_s, s.get("work"))
        rates = " ".join(f"{k.replace('_hit_rate', '')}={_f(v, '.2f')}" for k, v in s["rates"].items()) or "—"
        vals = (
            f"{elapsed_s:6.1f}s",
            f"{s['done']}/{s['total']}{of_dataset}",
            "—" if eta is None else f"{eta:.0f}s",
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
                "ETA",
                "in flight",
                "sessions ok/open/error",
                "TTFT p50/p95 s",
                "failed",
                "server hit rates",
            ),
            vals,
            f"[kvtier replay] t={vals[0]} requests={vals[1]} eta={vals[2]} in_flight={vals[3]} "
            f"sessions ok/open/error={vals[4]} ttft_p50/p95={vals[5]} s failed={vals[6]} hit_rates: {vals[7]}",
        )


__all__ = ["ReplayProgress", "Tally", "snapshot", "eta_s"]
