"""Live progress while a bench runs: a rich table on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from kvtier.progress import ProgressOutput

if TYPE_CHECKING:
    from kvtier.bench.runner import BenchRunner


class Progress(ProgressOutput):
    def __init__(self, mode: str, stream: TextIO = sys.stderr) -> None:
        super().__init__(mode, stream)
        self._last = (0.0, 0, 0)

    def tick(self, runner: BenchRunner, elapsed_s: float) -> None:
        if not self.enabled:
            return
        rec = runner.rec
        rd, wr = rec.bytes_moved("read"), rec.bytes_moved("write")
        t0, rd0, wr0 = self._last
        dt = max(elapsed_s - t0, 1e-9)
        self._last = (elapsed_s, rd, wr)
        usage = runner.c.store.usage()
        fill = "  ".join(f"{n} {u['used_bytes'] / u['capacity_bytes'] * 100:5.1f}%" for n, u in usage.items())
        done = rec.completed_requests()
        failed = len(rec.requests) - done
        vals = (
            f"{elapsed_s:6.1f}s",
            str(done),
            str(failed),
            f"{(rd - rd0) / dt / 1e9:6.2f}",
            f"{(wr - wr0) / dt / 1e9:6.2f}",
            fill,
        )
        self.show(
            "kvtier bench",
            ("elapsed", "requests ok", "failed", "read GB/s", "write GB/s", "tier fill"),
            vals,
            f"[kvtier] t={vals[0]} requests_ok={vals[1]} failed={vals[2]} read={vals[3]} GB/s "
            f"write={vals[4]} GB/s fill: {fill}",
        )
