"""Live progress while a bench runs: a rich table on a terminal, plain periodic lines otherwise."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.live import Live

    from kvtier.bench.runner import BenchRunner


class Progress:
    def __init__(self, mode: str, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.live_mode = mode == "live" or (mode == "auto" and stream.isatty())
        self.enabled = mode != "none"
        self._last = (0.0, 0, 0)
        self._live: Live | None = None

    def __enter__(self) -> Progress:
        if self.enabled and self.live_mode:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.stream), auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

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
        failed = sum(1 for r in rec.requests[:done] if not r.ok)
        vals = (
            f"{elapsed_s:6.1f}s",
            str(done),
            str(failed),
            f"{(rd - rd0) / dt / 1e9:6.2f}",
            f"{(wr - wr0) / dt / 1e9:6.2f}",
            fill,
        )
        if self._live is not None:
            from rich.table import Table

            table = Table(title="kvtier bench")
            for h in ("elapsed", "requests", "failed", "read GB/s", "write GB/s", "tier fill"):
                table.add_column(h)
            table.add_row(*vals)
            self._live.update(table, refresh=True)
        else:
            print(
                f"[kvtier] t={vals[0]} requests={vals[1]} failed={vals[2]} read={vals[3]} GB/s "
                f"write={vals[4]} GB/s fill: {fill}",
                file=self.stream,
                flush=True,
            )
