"""The live fetch gate of kvtier's vLLM backend on a shared cache server: a prefix the server holds is fetched only
when fetching it is expected to be faster than recomputing it, on what this engine measured lately.

A hit is not a win by itself: over a link that slowed down (a congested fabric, a store on another rack), a
fetch of n blocks can take longer than the prefill it replaces, and the engine gets slower while its hit rate
stays high. So the scheduler's lookup asks the gate before it answers "hit" for a run of blocks
(``kvtier.costs.should_fetch``: fetch = round trips × RTT + bytes / throughput against recompute = tokens /
prefill rate), with the three figures measured in this engine (RTT and prefill rate: the median of the last
``WINDOW`` samples):

* **RTT**: the time of the scheduler's lookup requests to the server (small requests: a round trip);
* **throughput**: the last finished load job's bytes over its wall time less one RTT (the workers' runs, as the
  engine waited for them): a link that slowed down closes the gate at the next lookup, not after a window has
  turned over (a job slowed by a hiccup costs at most recomputes until the next probe);
* **prefill rate**: the new tokens of each engine step that computed at least ``MIN_STEP_TOKENS`` over the
  step's time (from the scheduler's hand-over of the step to its output coming back).

Until all three have a sample the gate lets every fetch through (it learns from them). A gated run of blocks is
answered "miss" (vLLM recomputes it); after ``PROBE_EVERY`` gated runs and at least ``PROBE_S`` seconds since the
last probe, one goes through anyway, so the throughput it uses is not frozen at its worst and a link that
recovered is seen (on a slow link a probe is one slow request in ``PROBE_EVERY + 1``, at most one per
``PROBE_S``). Decisions are counted in blocks
by outcome: ``fetched``, ``gated``, ``probe``, ``learning``.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import Counter, deque
from typing import Any

from kvtier.costs import GateDecision, should_fetch

WINDOW = 16
MIN_STEP_TOKENS = 256
PROBE_S = 5.0
PROBE_EVERY = 8


class LiveGate:
    def __init__(self, block_tokens: int, block_bytes: int, round_trips: int = 3, probe_s: float = PROBE_S):
        self.block_tokens, self.block_bytes = block_tokens, block_bytes  # bytes: the whole block, all workers
        self.round_trips, self.probe_s = round_trips, probe_s
        self._rtt: deque[float] = deque(maxlen=WINDOW)
        self._rate: float | None = None  # bytes/s, the last load job's
        self._prefill: deque[float] = deque(maxlen=WINDOW)
        self._lock = threading.Lock()
        self._last_probe = 0.0
        self._gated_since_probe = 0
        self.counts: Counter[str] = Counter()
        self.last: GateDecision | None = None

    # -- what the engine measured ------------------------------------------------------------
    def rtt(self, seconds: float) -> None:
        if seconds > 0:
            with self._lock:
                self._rtt.append(seconds)

    def loaded(self, nbytes: int, seconds: float) -> None:
        """A load job (or a step's jobs): its bytes and wall time."""
        with self._lock:
            rtt = statistics.median(self._rtt) if self._rtt else 0.0
            busy = seconds - rtt
            if nbytes > 0 and busy > 0:
                self._rate = nbytes / busy

    def prefilled(self, tokens: int, seconds: float) -> None:
        """An engine step: the new prompt tokens it computed and its time."""
        if tokens >= MIN_STEP_TOKENS and seconds > 0:
            with self._lock:
                self._prefill.append(tokens / seconds)

    def figures(self) -> tuple[float, float, float] | None:
        """(RTT s, throughput B/s, prefill tokens/s), medians; None until each has a sample."""
        with self._lock:
            if not (self._rtt and self._rate and self._prefill):
                return None
            return statistics.median(self._rtt), self._rate, statistics.median(self._prefill)

    # -- the decision --------------------------------------------------------------------------
    def allow(self, blocks: int, now: float | None = None) -> bool:
        """Whether to fetch a run of ``blocks`` blocks the server holds (False: answer miss, recompute)."""
        if blocks <= 0:
            return True
        figs = self.figures()
        if figs is None:
            self.counts["learning"] += blocks
            return True
        rtt, rate, prefill = figs
        kvpt = self.block_bytes / self.block_tokens
        d = should_fetch(blocks * self.block_tokens, kvpt, rate, self.round_trips * rtt, prefill)
        self.last = d
        if d.fetch:
            self.counts["fetched"] += blocks
            return True
        now = time.monotonic() if now is None else now
        if self._gated_since_probe >= PROBE_EVERY and now - self._last_probe >= self.probe_s:
            self._last_probe, self._gated_since_probe = now, 0
            self.counts["probe"] += blocks
            return True
        self._gated_since_probe += 1
        self.counts["gated"] += blocks
        return False

    def take(self) -> dict[str, int]:
        """Blocks decided since the last call, by outcome."""
        out = {k: v for k, v in self.counts.items() if v}
        self.counts.clear()
        return out


def following(req_context: Any, key: Any) -> list[Any]:
    """``key`` and the request's keys after it, in prompt order (vLLM records each key's end position on the
    request's context, ``ReqContext``; where it does not, ``key`` alone): what the scheduler's first lookup of a
    request asks the server about at once."""
    positions: dict[Any, int] = getattr(req_context, "_offload_key_positions", None) or {}
    at = positions.get(key)
    if at is None:
        return [key]
    return sorted((k for k, p in positions.items() if p >= at), key=positions.__getitem__)


def chain(req_context: Any) -> list[Any]:
    """Every key of the request, in prompt order (empty where vLLM records no positions)."""
    positions: dict[Any, int] = getattr(req_context, "_offload_key_positions", None) or {}
    return sorted(positions, key=positions.__getitem__)


__all__ = ["LiveGate", "PROBE_EVERY", "PROBE_S", "WINDOW", "chain", "following"]
