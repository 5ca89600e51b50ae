"""The bench runner's request queue (priority by QoS class, then arrival; bounded, closable) and the request-rate
limiter of ``--request-rate``."""

from __future__ import annotations

import heapq
import itertools
import threading
from dataclasses import dataclass, field

from kvtier.telemetry.clock import Clock
from kvtier.workload.users import Request


@dataclass
class _Job:
    request: Request
    submit_ns: int
    done: threading.Event = field(default_factory=threading.Event)


class _PriorityQueue:
    """Highest priority first, FIFO within a priority; closable so waiters wake at stop."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, _Job]] = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self.closed = False

    def put(self, job: _Job) -> bool:
        with self._cv:
            if self.closed:
                return False
            heapq.heappush(self._heap, (-job.request.priority, next(self._seq), job))
            self._cv.notify()
            return True

    def get(self) -> _Job | None:
        with self._cv:
            while not self._heap and not self.closed:
                self._cv.wait()
            if self.closed:
                return None
            return heapq.heappop(self._heap)[2]

    def close(self) -> list[_Job]:
        with self._cv:
            self.closed = True
            left = [j for _, _, j in self._heap]
            self._heap.clear()
            self._cv.notify_all()
            return left

    def __len__(self) -> int:
        with self._cv:
            return len(self._heap)


class _RateLimiter:
    def __init__(self, rate_per_s: float, clock: Clock) -> None:
        self.interval_ns = int(1e9 / rate_per_s) if rate_per_s > 0 else 0
        self.clock = clock
        self._next = 0
        self._lock = threading.Lock()

    def wait(self, stop: threading.Event) -> bool:
        """Block until this caller's slot; False if the run stopped meanwhile."""
        if not self.interval_ns:
            return not stop.is_set()
        with self._lock:
            now = self.clock.now_ns()
            slot = max(now, self._next)
            self._next = slot + self.interval_ns
        delay = (slot - self.clock.now_ns()) / 1e9
        return not stop.wait(delay) if delay > 0 else not stop.is_set()


__all__ = ["_PriorityQueue", "_RateLimiter"]
