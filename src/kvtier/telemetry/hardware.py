"""The hardware beside a serving run (replay, launch): the host CPU's busy share from /proc/stat and, where
NVML answers, each GPU's power, utilisation and memory — by the samplers ``kvtier bench`` already uses
(telemetry/diskstats.py with no device, telemetry/gpu.py). Absent figures are null with a code, never 0."""

from __future__ import annotations

from typing import Any

from kvtier.telemetry.diskstats import DeviceSampler
from kvtier.telemetry.gpu import GpuSampler


class HardwareSampler:
    """Samples every ``interval_s`` on two threads from ``start`` to ``stop``; ``stop`` returns the section
    (results/replay.py ``Hardware``)."""

    def __init__(self, interval_s: float = 1.0, gpu: GpuSampler | None = None) -> None:
        self.cpu = DeviceSampler([], interval_s)
        self.gpu = gpu if gpu is not None else GpuSampler(interval_s)

    def start(self) -> None:
        self.cpu.start()
        self.gpu.start()

    def stop(self) -> dict[str, Any]:
        self.cpu.stop()
        gpu = self.gpu.stop()
        totals = self.cpu.totals()
        util = totals.get("cpu_utilization")
        return {
            "host_cpu": {
                "code": None if util is not None else "proc-stat-unreadable",
                "utilization": util,
                "timeline": [{"t_s": r["t_s"], "cpu_utilization": r["cpu_utilization"]} for r in self.cpu.timeline()],
            },
            "gpu": gpu,
        }


__all__ = ["HardwareSampler"]
