"""Helpers shared by the benchmark scripts (run them from the repo root with the project's venv)."""

from __future__ import annotations

import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvtier.child import Child, start  # noqa: E402 - the checkout's kvtier, as the scripts run it


def start_peer(
    argv: list[str], name: str, log: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Child:
    """A benchmark's peer (a sim, Caddy) through kvtier's one runner (kvtier/child.py): its own process group,
    told SIGTERM if the benchmark dies, its output to ``log`` (appended) or nowhere; ``.stop()`` ends it and its
    children."""
    if log is None:
        return start(argv, name=name, stdout=subprocess.DEVNULL, env=env, cwd=cwd)
    with open(log, "ab") as f:
        return start(argv, name=name, stdout=f, env=env, cwd=cwd, log=log)


def wait_port_file(path: Path, peer: Child, timeout_s: float = 60.0) -> int:
    """The port ``peer`` writes to ``path`` once it listens (kvtier sim --port-file); SystemExit if it exits or
    runs out of time first."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return int(path.read_text())
        if peer.poll() is not None:
            raise SystemExit(f"{peer.name} exited with status {peer.poll()} before it listened")
        time.sleep(0.05)
    peer.stop()
    raise SystemExit(f"{peer.name} did not listen within {timeout_s:.0f} s")


def prior_queries(url: str) -> float:
    """The prompt tokens a server (vLLM, or kvtier sim, which keeps vLLM's names) has looked up in its prefix cache
    so far: 0 on a fresh one. A side-by-side run checks it before each replay, so neither side meets a cache an
    earlier run warmed."""
    import urllib.request

    from kvtier.replay.scrape import parse_snapshot

    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as r:
        m = parse_snapshot(r.read().decode())
    return float(m.get("vllm:prefix_cache_queries_total") or 0.0)


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


def device_of(path: Path) -> str | None:
    """The block device (its name under /sys/block, e.g. ``vda``) holding ``path``; None when not a plain disk."""
    import os

    st = os.stat(path)
    sysdev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    try:
        real = sysdev.resolve(strict=True)
    except OSError:
        return None
    disk = real.parent if (real / "partition").exists() else real  # a partition's disk
    return disk.name if (Path("/sys/block") / disk.name / "stat").exists() else None


def settle(path: Path, quiet_bytes_s: float = 2e6, quiet_s: int = 2, limit_s: float = 120.0) -> float:
    """Between the runs of an A/B pair: write back dirty pages, drop the page cache, and wait until the disk holding
    ``path`` has been quiet (under ``quiet_bytes_s`` read+written a second, nothing in flight, including the trims of
    the run's deleted files a ``discard`` mount issues) for ``quiet_s`` seconds in a row, at most ``limit_s``.
    Returns the seconds waited. Without root the cache drop is skipped; without a device, only the sync is done."""
    import os
    import time

    t0 = time.monotonic()
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        pass
    dev = device_of(path)
    if dev is None:
        return time.monotonic() - t0

    def sample() -> tuple[int, int]:
        f = Path(f"/sys/block/{dev}/stat").read_text().split()
        sectors = int(f[2]) + int(f[6]) + (int(f[13]) if len(f) > 13 else 0)  # read, written, discarded
        return sectors * 512, int(f[8])  # bytes, I/Os in flight

    calm, (last, _) = 0, sample()
    while calm < quiet_s and time.monotonic() - t0 < limit_s:
        time.sleep(1.0)
        now, in_flight = sample()
        calm = calm + 1 if now - last < quiet_bytes_s and in_flight == 0 else 0
        last = now
    return time.monotonic() - t0


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

    print("$ " + " ".join(cmd), flush=True)
    p = subprocess.run(cmd, text=True, capture_output=True, cwd=REPO, timeout=3 * 3600)
    print(p.stdout, end="")
    if not (out / "arms.json").is_file():
        raise SystemExit(f"kvtier launch --arms wrote no arms.json ({p.returncode}):\n{p.stderr[-3000:]}")
    r = json.loads((out / "arms.json").read_text())
    if r["status"] != "complete":
        print(f"arms: {r['status']} ({r['stop_reason']['message']}); figures below are from what ran", flush=True)
    return {s["arm"]: s for s in r["arms"]}


def arms_parser(doc: str, traces: int, concurrency: int, max_requests: int) -> Any:
    """The flags the real-vLLM ``kvtier launch --arms`` benchmarks share (real_offload, shared_offload)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--engine-python", default=str(REPO / ".engines-cpu" / "bin" / "python"))
    ap.add_argument(
        "--traces",
        type=Path,
        nargs="+",
        default=None,
        help=f"agent-trace files replayed side by side (default: the first {traces} miniswe runs)",
    )
    ap.add_argument("--kv-cache-tokens", type=int, default=10368)
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--l1-gb", type=float, default=1.0, help="kvtier's CPU tier")
    ap.add_argument("--concurrency", type=int, default=concurrency)
    ap.add_argument("--max-requests", type=int, default=max_requests)
    ap.add_argument("--max-tokens-cap", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--output", type=Path, default=None)
    return ap


def arms_command(a: Any, arms: str, data: Path, out: Path, launch: list[str], replay: list[str]) -> list[str]:
    """``kvtier launch --engine vllm --build cpu --tier cpu --arms ARMS`` with the shared flags, ``launch`` (more
    launch flags) and, after ``--``, the agent-trace replay with ``replay`` (more replay flags)."""
    if not Path(a.engine_python).exists():
        raise SystemExit(f"{a.engine_python}: missing (bash scripts/install-engines.sh cpu)")
    return [sys.executable, "-m", "kvtier", "launch", "--engine", "vllm", "--build", "cpu", "--tier", "cpu",
            *launch, "--arms", arms, "--rounds", str(a.rounds), "--engine-python", a.engine_python,
            "--kv-cache-tokens", str(a.kv_cache_tokens), "--max-model-len", str(a.max_model_len),
            "--l1-gb", str(a.l1_gb), "--output", str(out),
            "--", "--model", "tiny", "--dataset", str(data), "--num-rounds", "1", "--concurrency", str(a.concurrency),
            "--gap-scale", "0", "--warmup", "0", "--max-tokens-cap", str(a.max_tokens_cap),
            "--max-requests", str(a.max_requests), *replay, "--progress", "none"]  # fmt: skip


def later_p50(arm: dict) -> str:
    """An arm's later-turn TTFT p50 (arms.json), for a benchmark's last line."""
    v = arm["later_ttft"]["p50_s"]
    return "nan" if v is None else f"{v:.3f}"
