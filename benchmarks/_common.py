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


def trace_folder(traces: list[Path] | None, n: int, work: Path) -> Path:
    """``work/traces``: links to agent-trace files, by default the first ``n`` LMCache miniswe runs of
    ../shared/data (a replay's --dataset folder)."""
    traces = traces or sorted((REPO.parent / "shared" / "data" / "lmcache_agent_trace" / "miniswe").glob("*.jsonl"))[:n]
    if len(traces) < 1 or not all(t.is_file() for t in traces):
        raise SystemExit(f"traces not found: {traces} (../shared/data)")
    data = work / "traces"
    data.mkdir(parents=True, exist_ok=True)
    for t in traces:
        link = data / t.name
        if not link.exists():
            link.symlink_to(t.resolve())
    return data


def launch_arms(cmd: list[str], out: Path) -> dict[str, dict]:
    """Run a ``kvtier launch --arms`` command line writing ``out/arms.json``; print its lines; the arms by name."""
    import json
    import subprocess

    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, text=True, capture_output=True, cwd=REPO, timeout=3 * 3600)
    print(p.stdout, end="")
    if not (out / "arms.json").is_file():
        raise SystemExit(f"kvtier launch --arms wrote no arms.json ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads((out / "arms.json").read_text())
    if r["status"] != "complete":
        print(f"arms: {r['status']} ({r['stop_reason']['message']}); figures below are from what ran", flush=True)
    return {s["arm"]: s for s in r["arms"]}
