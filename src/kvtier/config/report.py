"""Configuration of ``kvtier report`` and ``kvtier compare`` (their flags; the results they read are positionals)."""

from __future__ import annotations

from kvtier.config.base import StrictModel, flag


class ReportConfig(StrictModel):
    """``kvtier report RESULT... --html out.html``."""

    results: list[str] = flag(..., "result files or folders", positional=True, metavar="RESULT")
    html: str = flag(..., "the HTML file to write")
    png_dir: str | None = flag(None, "also write each plot as a PNG file here")
    labels: str | None = flag(None, "comma-separated names for the results, in order (default: file or folder names)")


class CompareConfig(StrictModel):
    """``kvtier compare A B ...``: each argument one condition, or its trials joined by commas."""

    conditions: list[str] = flag(
        ..., "results (files or replay folders); trials of one condition: a,b,c", positional=True, metavar="CONDITION"
    )
    force: bool = flag(False, "print the table even when the configs differ (exit 0)")


__all__ = ["CompareConfig", "ReportConfig"]
