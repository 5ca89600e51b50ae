"""Helpers shared by the benchmark scripts (run them from the repo root with the project's venv)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ensure_tool(name: str) -> str:
    """Path of ``name``, installing it with the project's own script when it is missing."""
    path = shutil.which(name)
    if path is None:
        print(f"{name} not found: installing it with scripts/install-tools.sh", file=sys.stderr)
        subprocess.run(["bash", str(REPO / "scripts" / "install-tools.sh"), name], check=True)
        path = shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} is required and could not be installed")
    return path


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
