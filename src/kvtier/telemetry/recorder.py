"""Raw samples of every tier operation and request, recorded on one clock (perf_counter_ns).

Hot path: one tuple append per event (list.append is atomic under the GIL), no formatting and
no per-event logging. Only *completed* operations are recorded as samples; failures go to
error counters and never count as bytes or work.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.errors import TierUnavailable
from kvtier.telemetry.clock import MONOTONIC, Clock, IOTiming


class OpSample(NamedTuple):
    end_ns: int
    host_ns: int
    device_ns: int
    nbytes: int
    cause: str  # request | demotion | promotion


class BenchRequest(NamedTuple):
    """One finished request; times in ns on the recorder's clock."""

    user: int
    qos: str
    phase: str
    context_tokens: int
    generate_tokens: int
    submit_ns: int
    start_ns: int
    storage_done_ns: int
    end_ns: int
    storage_ns: int  # sum of the request's own tier-op times (host + device)
    generation_ns: int  # simulated GPU time slept
    bytes_read: int
    bytes_written: int
    decode_bytes_read: int
    tokens_read: int
    tokens_written: int
    hits: int
    misses: int
    ok: bool
    error: str
    new_tokens: int = 0  # context tokens not in any cache before this request (amplification base)
    turn: int = 1
    rag_ns: int = 0  # storage time of the RAG burst (retrieved chunk reads and re-ingests)
    rag_bytes: int = 0  # bytes of retrieved chunks read
    prefill_ns: int = 0  # storage time of the request's own KV writes before its first token
    decode_ns: int | None = None  # storage time of the decode phase's reads (None: no decode phase)
    key: str = ""  # the request's own KV key (its id in --request-log)
    seq: int = 0  # the user's request number
    tier_ns: tuple[tuple[str, int], ...] = ()  # the request's own operations' time by tier
    stores_dropped: int = 0  # its stores no tier could take (dropped, not failed)
    alloc_wait_ns: int = 0  # waiting for an allocation slot before its writes (--max-concurrent-allocs)
    lookups: tuple[tuple[str, int], ...] = ()  # its lookups by kind and outcome ("lookup_history_hits": 2, ...)


@dataclass
class Recorder:
    """Thread-safe sink for engine events and request records (implements engine EventSink)."""

    ops: dict[tuple[str, str], list[OpSample]] = field(default_factory=lambda: defaultdict(list))
    errors: dict[tuple[str, str, str], int] = field(default_factory=lambda: defaultdict(int))
    error_messages: list[str] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cancelled: dict[tuple[str, str], list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))
    requests: list[BenchRequest] = field(default_factory=list)
    clock: Clock = MONOTONIC
    unavailable: str | None = None  # the first "server unreachable" error of a remote tier (the run stops)
    ok_requests: int = 0  # records with ok
    _lock: threading.Lock = field(default_factory=threading.Lock)

    # EventSink
    def tier_op(self, tier: str, op: str, cause: str, nbytes: int, timing: IOTiming) -> None:
        self.ops[(tier, op)].append(OpSample(self.clock.now_ns(), timing.host_ns, timing.device_ns, nbytes, cause))

    def tier_error(self, tier: str, op: str, cause: str, nbytes: int, error: BaseException) -> None:
        with self._lock:
            self.errors[(tier, op, cause)] += 1
            if self.unavailable is None and isinstance(error, TierUnavailable):
                self.unavailable = str(error)
            if len(self.error_messages) < 20:
                self.error_messages.append(f"{tier} {op} ({cause}): {error}")

    def tier_cancelled(self, tier: str, op: str, cause: str, bytes_done: int) -> None:
        with self._lock:
            self.cancelled[(tier, op)][0] += 1
            self.cancelled[(tier, op)][1] += bytes_done

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def error_total(self) -> tuple[int, str]:
        """(failed tier operations so far, the last one's message), read under the lock."""
        with self._lock:
            return sum(self.errors.values()), (self.error_messages[-1] if self.error_messages else "")

    def request(self, rec: BenchRequest) -> None:
        with self._lock:
            self.requests.append(rec)
            if rec.ok:
                self.ok_requests += 1

    # Progress snapshots (cheap: lengths and running sums over appended lists)
    def bytes_moved(self, op: str) -> int:
        total = 0
        for (_, o), samples in list(self.ops.items()):
            if o == op:
                total += sum(s.nbytes for s in samples[:])
        return total

    def completed_requests(self) -> int:
        """Requests that did their work (``ok``): what --max-requests counts. A failed request is in
        ``requests`` too, counted by cause, but does not bring the run's end nearer."""
        return self.ok_requests
