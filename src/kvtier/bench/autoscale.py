"""Autoscaling: change the number of live user workers while the benchmark runs.

Every ``autoscaler.interval_s`` the runner hands ``Autoscaler.step`` the requests completed in the
last window and a ``StorageSample`` (the storage tier's read and write p95 over the last
``saturation_detection.history_window_size`` windows, and the queue depth); it answers with an
action and a new user count, and the runner really starts or stops user threads.

* ``qos``: saturation = the worst of (p95 service latency / the class's p95 target) over the QoS
  classes seen in the window and, as the reference's storage monitor does, storage read p95 /
  ``read_latency_p95_threshold_ms``, storage write p95 / ``write_latency_p95_threshold_ms`` and queue
  depth / ``queue_depth_threshold``. Below target_saturation - 0.1 for
  ``consecutive_samples_required`` samples in a row: users x ``scale_up_factor`` (at least +1); above
  target_saturation + 0.1 as long: users x ``scale_down_factor`` (at least -1); in between hold.
  After a change wait ``cooldown_s``. Users stay within [``min_users``, ``max_users``].
* ``capacity``: throughput = generated tokens per second in the window. Double the users while
  throughput grows by more than ``growth_fast`` (20 %) per step, grow x1.5 while it still grows,
  and stop the run with "Peak capacity found" when it falls, reporting the peak.

That is kvtier's own search (``--autoscaler-algorithm kvtier``). The default, ``reference``, is the
MLPerf reference's (kv_cache/monitoring.py ``WorkloadAutoscaler``, benchmark.py's monitor loop), on the
same saturation figure:

* ``qos``: while a cooldown of 3 samples runs, hold. Saturation above target x 1.1 for 2 samples in a
  row: users x ``scale_down_factor`` (0.8), then the cooldown; below target x 0.9: users x
  ``scale_up_factor`` (1.2, rounded down, so fewer than 5 users never grow), no cooldown; in the band:
  hold (and the count of samples above restarts).
* ``capacity``: throughput = generated tokens since the start / seconds since the start. First sample:
  users + max(users x 0.4, 5) (at most +100); a sample more than 1 % above the peak: a new peak, users +
  max(users x 0.2, 5) (at most +100); two samples without that gain: stop, "Peak capacity found".
* Users stay within [1, 500] (the reference's worker cap) and [``min_users``, ``max_users``].
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.config.tuning import AutoscalerTuning, QoSClass, QoSProfile, SaturationDetection
from kvtier.stats import percentile
from kvtier.telemetry.recorder import BenchRequest


@dataclass(frozen=True)
class StorageSample:
    """The storage side of one qos sample (None where there were no such operations)."""

    read_p95_ms: float | None = None
    write_p95_ms: float | None = None
    queue_depth: int = 0


@dataclass
class Autoscaler:
    mode: str
    target_saturation: float
    tuning: AutoscalerTuning
    qos_profiles: Mapping[QoSClass, QoSProfile]
    thresholds: SaturationDetection = field(default_factory=SaturationDetection)
    history: list[dict[str, Any]] = field(default_factory=list)
    last_change_s: float = -1e9
    prev_throughput: float | None = None
    peak: tuple[int, float] = (0, 0.0)
    stop_reason: str | None = None
    _streak: tuple[str, int] = ("", 0)
    algorithm: str = "reference"  # reference | kvtier (module docstring)
    _cooldown: int = 0  # reference qos: samples left to hold
    _above: int = 0  # reference: samples in a row above the band (qos) or without a 1 % gain (capacity)
    _tokens: int = 0  # reference capacity: generated tokens since the start
    _samples: int = 0

    REFERENCE_USER_CAP = 500

    def saturation(self, window: Sequence[BenchRequest], storage: StorageSample | None = None) -> float | None:
        ratios: list[float] = []
        for cls, prof in self.qos_profiles.items():
            svc = [r.storage_done_ns - r.submit_ns for r in window if r.ok and r.qos == cls]
            if svc:
                ratios.append((percentile(svc, 95) or 0.0) / 1e6 / prof.target_latency_p95_ms)
        if storage is not None:
            th = self.thresholds
            if storage.read_p95_ms is not None:
                ratios.append(storage.read_p95_ms / th.read_latency_p95_threshold_ms)
            if storage.write_p95_ms is not None:
                ratios.append(storage.write_p95_ms / th.write_latency_p95_threshold_ms)
            ratios.append(storage.queue_depth / th.queue_depth_threshold)
        return max(ratios) if ratios else None

    def _clamp(self, n: int) -> int:
        return max(self.tuning.min_users, min(self.tuning.max_users, n))

    def _qos(self, t_s: float, sat: float, users: int) -> tuple[str, int]:
        tu = self.tuning
        want = "up" if sat < self.target_saturation - 0.1 else "down" if sat > self.target_saturation + 0.1 else ""
        kind, n = self._streak
        self._streak = (want, n + 1 if want == kind else 1) if want else ("", 0)
        if not want:
            return "hold", users
        if self._streak[1] < tu.consecutive_samples_required:
            return f"hold ({self._streak[1]} of {tu.consecutive_samples_required} samples)", users
        if t_s - self.last_change_s < tu.cooldown_s:
            return "hold (cooldown)", users
        if want == "up":
            target = self._clamp(max(users + 1, int(users * tu.scale_up_factor)))
        else:
            target = self._clamp(min(users - 1, int(users * tu.scale_down_factor)))
        if target == users:
            return "hold (at the user limit)", users
        self._streak = ("", 0)
        return f"scale_{want}", target

    def _ref_clamp(self, n: int) -> int:
        return max(1, self.tuning.min_users, min(self.tuning.max_users, self.REFERENCE_USER_CAP, n))

    def _reference_qos(self, sat: float, users: int) -> tuple[str, int]:
        if self._cooldown > 0:
            self._cooldown -= 1
            return "hold (cooldown)", users
        tu = self.tuning
        if sat > self.target_saturation * 1.1:
            self._above += 1
            if self._above >= tu.consecutive_samples_required:
                target = self._ref_clamp(int(users * tu.scale_down_factor))
                if target < users:
                    self._cooldown = 3
                    return "scale_down", target
            return f"hold ({self._above} of {tu.consecutive_samples_required} samples above)", users
        self._above = 0
        if sat < self.target_saturation * 0.9:
            target = self._ref_clamp(int(users * tu.scale_up_factor))
            if target > users:
                return "scale_up", target
        return "hold", users

    def _reference_capacity(self, t_s: float, users: int) -> tuple[str, int]:
        throughput = self._tokens / max(t_s, 1e-6)
        self._samples += 1

        def step(fraction: float) -> int:
            return min(max(int(users * fraction), 5), 100)

        if self._samples == 1:
            self.peak = (users, throughput)
            target = self._ref_clamp(users + step(0.4))
            return ("scale_up", target) if target > users else ("hold", users)
        if throughput > self.peak[1] * 1.01:
            self.peak = (users, throughput)
            self._above = 0
            target = self._ref_clamp(users + step(0.2))
            return ("scale_up", target) if target > users else ("hold", users)
        self._above += 1
        if self._above >= 2:
            self.stop_reason = "Peak capacity found"
            return "stop", users
        return "hold", users

    def step(
        self,
        t_s: float,
        window_s: float,
        window: Sequence[BenchRequest],
        users: int,
        storage: StorageSample | None = None,
    ) -> tuple[str, int]:
        ok = [r for r in window if r.ok]
        throughput = sum(r.generate_tokens for r in ok) / window_s if window_s > 0 else 0.0
        sat = self.saturation(ok, storage)
        action, target = "hold", users
        self._tokens += sum(r.generate_tokens for r in ok)
        if self.algorithm == "reference":
            if self.mode == "qos":
                action, target = (
                    ("hold (no completed requests in the window)", users)
                    if sat is None
                    else (self._reference_qos(sat, users))
                )
            else:
                action, target = self._reference_capacity(t_s, users)
                throughput = self._tokens / max(t_s, 1e-6)
        elif not ok:
            action = "hold (no completed requests in the window)"
        elif self.mode == "qos":
            assert sat is not None
            action, target = self._qos(t_s, sat, users)
        else:  # capacity
            if throughput > self.peak[1]:
                self.peak = (users, throughput)
            prev = self.prev_throughput
            if prev is None or prev <= 0:
                action, target = "scale_up x2", self._clamp(users * 2)
            else:
                growth = (throughput - prev) / prev
                if growth > self.tuning.growth_fast:
                    action, target = "scale_up x2", self._clamp(users * 2)
                elif growth > 0:
                    action, target = "scale_up x1.5", self._clamp(int(np.ceil(users * 1.5)))
                else:
                    action, self.stop_reason = "stop", "Peak capacity found"
            self.prev_throughput = throughput
            if target == users and action.startswith("scale_up"):
                action, self.stop_reason = "stop", "Peak capacity found (max_users reached)"
        if target != users:
            self.last_change_s = t_s
        self.history.append(
            {
                "t_s": round(t_s, 3),
                "users": users,
                "throughput_tokens_per_sec": round(throughput, 3),
                "saturation": None if sat is None else round(sat, 4),
                "storage_read_p95_ms": None if storage is None else storage.read_p95_ms,
                "storage_write_p95_ms": None if storage is None else storage.write_p95_ms,
                "queue_depth": None if storage is None else storage.queue_depth,
                "action": action,
                "next_users": target,
            }
        )
        return action, target

    def stats(self, initial_users: int, final_users: int) -> dict[str, Any]:
        return {
            "initial_users": initial_users,
            "mode": self.mode,
            "target_saturation": self.target_saturation,
            "algorithm": self.algorithm,
            "steps": self.history,
            "final_users": final_users,
            "peak_users": self.peak[0] or None,
            "peak_throughput_tokens_per_sec": round(self.peak[1], 3) if self.peak[0] else None,
            "stop_reason": self.stop_reason,
        }
