"""``kvtier launch --fault``: break a part of the launch mid-replay and measure what it costs.

``restart-cache@T``: T seconds after the replay starts, the cache sidecar (the shared CPU/NVMe tier: kvtier's
cache server for the sim, LMCache's MP server for vLLM) is killed (SIGKILL to its process group: a crash, not
a shutdown) and started again with the same command, empty. The replicas keep serving, their loads failing
into misses (the sim counts them and opens its breaker after three), and the run measures the placement
model's "miss storm":

* **baseline**: the requests started in the ``BASELINE_S`` before the fault: their offload hit rate (prompt
  tokens served by an offload tier over all prompt tokens), TTFT p95 and the server's queue time;
* **zero-hit window**: from the kill to the start of the first request an offload tier served again;
  the requests started in it, their TTFT p95, queue time and failures;
* **recovery**: from the kill to the first request after which the last ``RECOVERY_REQUESTS`` requests'
  offload hit rate is back to ``RECOVERED_AT`` of the baseline's (None: not by the end of the run);
* a timeline of the offload hit rate and TTFT p95 in bins over the run, for the plot.

Which tokens an offload tier served comes from the sim's response extension (``prompt_sources``); a server
without it (a real vLLM) says only ``cached_tokens``, GPU and offload hits together, and the outcome says so in
``basis``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.config.launch import Fault, parse_faults
from kvtier.errors import LaunchError
from kvtier.results.envelope import ResultWarning, WarningCode, warning
from kvtier.results.launch import FaultOutcome, StormPoint, StormWindow
from kvtier.results.replay import ReplayRecord, offload_sources
from kvtier.stats import percentile

STOP_JOIN_S = 10.0
"""At most this long for the fault thread to end at teardown (a kill and a start: what is left once its wait for
health is cancelled)."""
BASELINE_S = 30.0
"""The baseline is the requests started in this long before the fault (or since the replay began)."""
RECOVERY_REQUESTS = 8
"""The recovery is judged over this many consecutive requests (by start time)."""
RECOVERED_AT = 0.9
"""Recovered: the trailing requests' offload hit rate at this share of the baseline's."""


@dataclass
class Injected:
    fault: Fault
    down_unix_s: float
    up_unix_s: float | None  # None: it did not come back healthy
    error: str | None = None


class FaultInjector:
    """A thread that, at each fault's time after ``start()``, calls ``restart(fault, stopping)`` (kill, start again,
    wait until healthy — or until ``stopping`` is set, at teardown; it returns the error text or None) and keeps
    what happened and when. ``stop()`` never waits out a restarted part that hangs: it sets ``stopping``."""

    def __init__(self, faults: Sequence[Fault], restart: Callable[[Fault, threading.Event], str | None]) -> None:
        self.faults = list(faults)
        self.restart = restart
        self.done: list[Injected] = []
        self.current: Injected | None = None  # a fault being injected now
        self.started_unix_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-faults", daemon=True)

    def start(self) -> None:
        self.started_unix_s = time.time()
        self._t0 = time.monotonic()
        if self.faults:
            self._thread.start()

    def _run(self) -> None:
        for f in self.faults:
            if self._stop.wait(max(0.0, self._t0 + f.at_s - time.monotonic())):
                return
            self.current = Injected(f, time.time(), None, "the replay ended while it was restarting")
            try:
                err = self.restart(f, self._stop)
            except LaunchError as e:
                err = str(e)
            self.done.append(Injected(f, self.current.down_unix_s, None if err else time.time(), err))
            self.current = None
            if err:
                break  # the part did not come back: later faults have nothing to break
        # the restarted process was started from this thread, and dies with its parent thread (the launch's
        # PR_SET_PDEATHSIG): the thread lives until the launch stops it, at teardown
        self._stop.wait()

    def stop(self) -> None:
        """At teardown, just before the processes are stopped (see ``_run``): a restart still waiting for its part
        to answer gives up at once (``restart``'s event), so a hung part cannot hold the launch's end."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_JOIN_S)


def _tier_tokens(r: ReplayRecord) -> int | None:
    src = r.get("prompt_sources")
    return sum(offload_sources(src).values()) if src else None


def _window(recs: list[ReplayRecord], hit: Callable[[ReplayRecord], int | None]) -> StormWindow:
    ok = [r for r in recs if r["status"] == "ok"]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    queue = [p["queue"] for r in ok if (p := r.get("server_ttft_parts")) and "queue" in p]
    tokens = sum(r["prompt_tokens"] or 0 for r in ok)
    hits = [hit(r) for r in ok]
    known = tokens and all(h is not None for h in hits)
    return StormWindow(
        requests=len(recs),
        failed=sum(1 for r in recs if r["status"] == "error"),
        offload_hit_rate=round(sum(h or 0 for h in hits) / tokens, 6) if known else None,
        ttft_s_p95=percentile(ttft, 95),
        queue_s_mean=round(sum(queue) / len(queue), 6) if queue else None,
        queue_s_p95=percentile(queue, 95),
    )


def storm_outcome(records: Sequence[ReplayRecord], done: Injected, replay_start_unix_s: float) -> FaultOutcome:
    """The miss storm of one injected fault, from the replay's records (module docstring)."""
    recs = sorted((r for r in records if r["start_unix_s"] is not None), key=lambda r: r["start_unix_s"] or 0.0)
    sim = any(r.get("prompt_sources") for r in recs)
    basis = "prompt_sources" if sim else "cached_tokens"

    def hit(r: ReplayRecord) -> int | None:
        return _tier_tokens(r) if sim else r["cached_tokens"]

    down = done.down_unix_s
    before = [r for r in recs if down - BASELINE_S <= (r["start_unix_s"] or 0.0) < down]
    after = [r for r in recs if (r["start_unix_s"] or 0.0) >= down]
    first_hit = next((r for r in after if r["status"] == "ok" and (hit(r) or 0) > 0), None)
    end = first_hit["start_unix_s"] if first_hit is not None else None
    storm = [r for r in after if end is None or (r["start_unix_s"] or 0.0) < end]
    base = _window(before, hit)
    recovered: float | None = None
    if base.offload_hit_rate and first_hit is not None:
        ok_after = [r for r in after if r["status"] == "ok"]
        for i in range(RECOVERY_REQUESTS, len(ok_after) + 1):
            tail = ok_after[i - RECOVERY_REQUESTS : i]
            tokens = sum(r["prompt_tokens"] or 0 for r in tail)
            if tokens and sum(hit(r) or 0 for r in tail) / tokens >= RECOVERED_AT * base.offload_hit_rate:
                recovered = round((tail[-1]["start_unix_s"] or 0.0) - down, 3)
                break
    return FaultOutcome(
        kind=done.fault.kind,
        at_s=done.fault.at_s,
        down_unix_s=down,
        up_unix_s=done.up_unix_s,
        downtime_s=None if done.up_unix_s is None else round(done.up_unix_s - down, 3),
        error=done.error,
        basis=basis,
        baseline=base,
        zero_hit_s=None if end is None else round(end - down, 3),
        storm=_window(storm, hit),
        recovered_after_s=recovered,
        recovered_at=RECOVERED_AT,
        timeline=_timeline(recs, hit, replay_start_unix_s),
        timeline_start_unix_s=replay_start_unix_s,
    )


def _timeline(
    recs: list[ReplayRecord], hit: Callable[[ReplayRecord], int | None], t0: float, bins: int = 60
) -> list[StormPoint]:
    ok = [r for r in recs if r["status"] == "ok"]
    if not ok:
        return []
    span = max((r["start_unix_s"] or 0.0) - t0 for r in ok)
    width = max(1.0, span / bins)
    by_bin: dict[int, list[ReplayRecord]] = {}
    for r in ok:
        by_bin.setdefault(int(max(0.0, (r["start_unix_s"] or 0.0) - t0) // width), []).append(r)
    out = []
    for b, mine in sorted(by_bin.items()):
        tokens = sum(r["prompt_tokens"] or 0 for r in mine)
        hits = [hit(r) for r in mine]
        known = tokens and all(h is not None for h in hits)
        out.append(
            StormPoint(
                t=round(b * width, 3),
                requests=len(mine),
                offload_hit_rate=round(sum(h or 0 for h in hits) / tokens, 6) if known else None,
                ttft_s_p95=percentile([r["ttft_s"] for r in mine if r["ttft_s"] is not None], 95),
            )
        )
    return out


def outcomes(
    injector: FaultInjector, records: Sequence[ReplayRecord]
) -> tuple[list[FaultOutcome], list[ResultWarning]]:
    """At the replay's end: each fault's storm (one still restarting counts, its error saying so), and a warning
    for each that did not come back or was never injected (the replay ended first)."""
    done = list(injector.done) + ([injector.current] if injector.current is not None else [])
    start = min((r["start_unix_s"] for r in records if r["start_unix_s"] is not None), default=injector.started_unix_s)
    out = [storm_outcome(records, d, start) for d in done]
    warnings = [
        warning(
            WarningCode.fault_not_recovered,
            f"--fault {d.fault.kind}@{d.fault.at_s:g}: the part did not come back: {d.error}",
            fault=d.fault.kind,
        )
        for d in done
        if d.error
    ]
    injected = [d.fault for d in done]
    warnings += [
        warning(
            WarningCode.fault_not_injected,
            f"--fault {f.kind}@{f.at_s:g}: the replay ended before it: no storm measured",
            fault=f.kind,
        )
        for f in injector.faults
        if f not in injected
    ]
    return out, warnings


__all__ = ["Fault", "FaultInjector", "Injected", "outcomes", "parse_faults", "storm_outcome", "BASELINE_S"]
