"""The one clock kvtier measures with: integer nanoseconds from a monotonic, high-resolution source.

Components take a ``Clock`` rather than calling ``time`` themselves, so tests can drive time by
hand (``ManualClock``) and check accounting exactly, without threads or sleeps.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Protocol


class Clock(Protocol):
    def now_ns(self) -> int:
        """Nanoseconds since an arbitrary, fixed origin; never decreases."""
        ...


class MonotonicClock:
    """time.perf_counter_ns: the highest-resolution monotonic clock of the platform."""

    def now_ns(self) -> int:
        return time.perf_counter_ns()


class ManualClock:
    """A clock that moves only when told to (tests). Thread safe."""

    def __init__(self, start_ns: int = 0) -> None:
        self._t = start_ns
        self._lock = threading.Lock()

    def now_ns(self) -> int:
        with self._lock:
            return self._t

    def set(self, ns: int) -> None:
        with self._lock:
            if ns < self._t:
                raise ValueError("a clock does not go back")
            self._t = ns


MONOTONIC = MonotonicClock()


@dataclass(slots=True)
class IOTiming:
    """Time of one tier operation, integer nanoseconds (the engine measures it; the recorder keeps it).

    device_ns: time inside the calls that move the bytes (write+fsync, pread, memory copy);
    host_ns: everything else the operation did (open, header, bookkeeping, page-cache advice).
    """

    host_ns: int = 0
    device_ns: int = 0

    @property
    def total_ns(self) -> int:
        return self.host_ns + self.device_ns

    def add(self, other: IOTiming) -> None:
        self.host_ns += other.host_ns
        self.device_ns += other.device_ns


__all__ = ["Clock", "IOTiming", "MonotonicClock", "ManualClock", "MONOTONIC"]
