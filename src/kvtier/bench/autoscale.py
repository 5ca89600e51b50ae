"""Autoscaling: change the number of live user workers while the benchmark runs.

Every ``autoscaler.interval_s`` the runner hands the requests completed in the last window to
``Autoscaler.step``, which answers with an action and a new user count; the runner really starts
or stops user threads.

* ``qos``: saturation = max over QoS classes seen in the window of (p95 service latency / the
  class's p95 target). Below target_saturation - 0.1 add users (``step_users``, or 20 % of the
  current count), up to target_saturation + 0.1 hold, above it remove users; after a change wait
  ``cooldown_s`` before the next one.
* ``capacity``: throughput = generated tokens per second in the window. Double the users while
  throughput grows by more than ``growth_fast`` (20 %) per step, grow x1.5 while it still grows,
  and stop the run with "Peak capacity found" when it falls, reporting the peak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvtier.config.bench import AutoscalerTuning, QoSClass, QoSProfile
from kvtier.stats import percentile
from kvtier.telemetry.recorder import RequestRecord


@dataclass
class Autoscaler:
    mode: str
    target_saturation: float
    tuning: AutoscalerTuning
    qos_profiles: Mapping[QoSClass, QoSProfile]
    history: list[dict[str, Any]] = field(default_factory=list)
    last_change_s: float = -1e9
    prev_throughput: float | None = None
    peak: tuple[int, float] = (0, 0.0)
    stop_reason: str | None = None

    def saturation(self, window: Sequence[RequestRecord]) -> float | None:
        worst = None
        for cls, prof in self.qos_profiles.items():
            svc = [r.storage_done_ns - r.submit_ns for r in window if r.ok and r.qos == cls]
            if svc:
                ratio = (percentile(svc, 95) or 0.0) / 1e6 / prof.target_latency_p95_ms
                worst = ratio if worst is None else max(worst, ratio)
        return worst

    def _clamp(self, n: int) -> int:
        return max(self.tuning.min_users, min(self.tuning.max_users, n))

    def step(self, t_s: float, window_s: float, window: Sequence[RequestRecord], users: int) -> tuple[str, int]:
        ok = [r for r in window if r.ok]
        throughput = sum(r.generate_tokens for r in ok) / window_s if window_s > 0 else 0.0
        sat = self.saturation(ok)
        action, target = "hold", users
        if not ok:
            action = "hold (no completed requests in the window)"
        elif self.mode == "qos":
            step = self.tuning.step_users or max(1, users // 5)
            cooling = t_s - self.last_change_s < self.tuning.cooldown_s
            assert sat is not None
            if cooling:
                action = "hold (cooldown)"
            elif sat < self.target_saturation - 0.1:
                action, target = "scale_up", self._clamp(users + step)
            elif sat > self.target_saturation + 0.1:
                action, target = "scale_down", self._clamp(users - step)
            if action.startswith("scale") and target == users:
                action = "hold (at the user limit)"
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
                "action": action,
                "next_users": target,
            }
        )
        return action, target

    def stats(self, final_users: int) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "target_saturation": self.target_saturation,
            "steps": self.history,
            "final_users": final_users,
            "peak_users": self.peak[0] or None,
            "peak_throughput_tokens_per_sec": round(self.peak[1], 3) if self.peak[0] else None,
            "stop_reason": self.stop_reason,
        }
