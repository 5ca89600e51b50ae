"""Where progress goes while a command runs (``--progress auto|live|plain|none``): a rich table redrawn in
place on a terminal (live; auto picks it when the stream is a terminal), one plain line per update
otherwise (plain), or nothing (none). Bench and replay say what is in the row; this says how it shows."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, Self, TextIO


class ProgressOutput:
    def __init__(self, mode: str, stream: TextIO = sys.stderr) -> None:
        self.stream = stream
        self.enabled = mode != "none"
        self.live_mode = self.enabled and (mode == "live" or (mode == "auto" and stream.isatty()))
        self._live: Any = None

    def __enter__(self) -> Self:
        if self.live_mode:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(console=Console(file=self.stream), auto_refresh=False, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def show(self, title: str, headers: Sequence[str], values: Sequence[str], line: str) -> None:
        """One update: the table row when live, else ``line``."""
        if not self.enabled:
            return
        if self._live is not None:
            from rich.table import Table
            from rich.text import Text

            table = Table(title=Text(title))
            for h in headers:
                table.add_column(h)
            table.add_row(*(Text(v) for v in values))  # outside text (server names, rates): never markup
            self._live.update(table, refresh=True)
        else:
            print(line, file=self.stream, flush=True)


__all__ = ["ProgressOutput"]
