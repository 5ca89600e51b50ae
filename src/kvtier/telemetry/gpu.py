"""GPU power, utilisation and memory over a run, from NVML (``nvidia-ml-py``, the ``gpu-telemetry`` extra).

Sampled on a thread every interval, per visible GPU: board power (W), GPU and memory-controller
utilisation (%), memory used and total (bytes). Where NVML cannot be used — the package is not
installed, the driver library is missing, or there is no NVIDIA device — the section says so with a
``code`` and a ``reason`` and carries no samples: absent figures are null, never zero.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


def _nvml() -> tuple[Any, str | None, str | None]:
    """(pynvml module or None, code, reason)."""
    try:
        import pynvml  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None, "nvml-not-installed", "nvidia-ml-py is not installed: pip install 'kvtier[gpu-telemetry]'"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_* of every kind: no driver, no device, no permission
        return None, "nvml-unavailable", f"NVML could not start: {e}"
    return pynvml, None, None


class GpuSampler:
    def __init__(self, interval_s: float = 1.0, nvml: Any = None) -> None:
        self.interval_s = interval_s
        self.code: str | None = None
        self.reason: str | None = None
        self._nvml = nvml
        if nvml is None:
            self._nvml, self.code, self.reason = _nvml()
        self.handles: list[Any] = []
        self.names: list[str] = []
        if self._nvml is not None:
            try:
                n = self._nvml.nvmlDeviceGetCount()
                self.handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
                self.names = [self._name(h) for h in self.handles]
            except Exception as e:  # noqa: BLE001
                self.code, self.reason = "nvml-unavailable", f"NVML could not list devices: {e}"
                self.handles = []
            if not self.handles and self.code is None:
                self.code, self.reason = "no-nvidia-device", "NVML found no NVIDIA device"
        self.samples: list[tuple[float, list[dict[str, float | int | None]]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _name(self, h: Any) -> str:
        name = self._nvml.nvmlDeviceGetName(h)
        return name.decode() if isinstance(name, bytes) else str(name)

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def _one(self, h: Any) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = {}
        nv = self._nvml
        reads: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("utilization_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
            ("memory_utilization_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).memory),
            ("memory_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
            ("memory_total_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).total),
        )
        for key, fn in reads:
            try:
                out[key] = fn()
            except Exception:  # noqa: BLE001 - a figure this device does not report stays null
                out[key] = None
        return out

    def sample(self) -> None:
        self.samples.append((time.monotonic() - self._t0, [self._one(h) for h in self.handles]))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> None:
        self._t0 = time.monotonic()
        if not self.available:
            return
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="kvtier-gpu-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, Any]:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.sample()
        return self.section()

    def section(self) -> dict[str, Any]:
        per_gpu = []
        for i, name in enumerate(self.names):
            rows = [s[1][i] for s in self.samples if i < len(s[1])]

            def vals(k: str, rows: list[dict[str, float | int | None]] = rows) -> list[float]:
                return [float(v) for r in rows if (v := r.get(k)) is not None]

            power, util, mem = vals("power_w"), vals("utilization_pct"), vals("memory_used_bytes")
            per_gpu.append(
                {
                    "index": i,
                    "name": name,
                    "mean_power_w": round(sum(power) / len(power), 3) if power else None,
                    "max_power_w": max(power) if power else None,
                    "mean_utilization_pct": round(sum(util) / len(util), 3) if util else None,
                    "max_memory_used_bytes": int(max(mem)) if mem else None,
                    "memory_total_bytes": rows[0].get("memory_total_bytes") if rows else None,
                }
            )
        return {
            "available": self.available,
            "code": self.code,
            "reason": self.reason,
            "interval_s": self.interval_s,
            "gpus": per_gpu,
            "timeline": [{"t_s": round(t, 3), "gpus": g} for t, g in self.samples],
        }


__all__ = ["GpuSampler"]
