"""The same work per request as the MLPerf reference: kvtier bench and the reference's kv-cache.py run
the MLPerf v3.0 workloads side by side, with the reference's own config.yaml, the same flags and the
same seed, and their KV bytes moved per generated token are compared.

Workloads (the reference's three, shortened to ``--duration``, default 30 s): llama3.1-8b with 200
users, --cpu-mem-gb 0, --max-concurrent-allocs 16; llama3.1-8b with 100 users, --cpu-mem-gb 4, 16;
llama3.1-70b-instruct with 70 users, --cpu-mem-gb 0, 4. All: --gpu-mem-gb 0, --generation-mode none,
--seed 42. For each: bytes/token = (Σ over tiers of tier_*_kv_bytes_read_gb + _written_gb) x 2^30 /
total_tokens_generated, read from each result JSON (the same keys in both). Runs alternate the order
(reference first, then kvtier first) because these machines are noisy.

The reference is not shipped with kvtier: point ``--reference`` at a checkout of its
kv_cache_benchmark folder (mlcommons/storage, or the hazemawadalla/storage fork), whose kv-cache.py
runs with this venv's Python (numpy and PyYAML are enough).

Last line: ``reference_parity max_deviation=<max over workloads of |kvtier/reference - 1|>``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

WORKLOADS = [
    ("llama3.1-8b", 200, 0, 16),
    ("llama3.1-8b", 100, 4, 16),
    ("llama3.1-70b-instruct", 70, 0, 4),
]
GiB = 2**30


def flags(
    model: str, users: int, cpu_gb: float, mca: int, duration: int, config: Path, cache: Path, out: Path
) -> list[str]:
    return [
        "--config", str(config), "--model", model, "--num-users", str(users), "--duration", str(duration),
        "--gpu-mem-gb", "0", "--cpu-mem-gb", str(cpu_gb), "--max-concurrent-allocs", str(mca),
        "--generation-mode", "none", "--seed", "42", "--cache-dir", str(cache), "--output", str(out),
    ]  # fmt: skip


def bytes_per_token(result: dict) -> tuple[float, int]:
    s = result["summary"]
    cs = s["cache_stats"]
    moved = sum(cs[f"tier_{t}_kv_bytes_{op}_gb"] for t in ("gpu", "cpu", "storage") for op in ("read", "written"))
    tokens = result["total_tokens_generated"]
    return (moved * GiB / tokens if tokens else float("nan")), tokens


def run_one(cmd: list[str], cwd: Path, timeout: float) -> dict:
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    out = Path(cmd[cmd.index("--output") + 1])
    if p.returncode != 0 or not out.exists():
        raise SystemExit(f"{' '.join(cmd[:4])} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", type=Path, required=True, help="the reference's kv_cache_benchmark folder")
    ap.add_argument("--duration", type=int, default=30)
    ap.add_argument("--workdir", type=Path, default=None, help="where the cache folders go (default: a temp dir)")
    a = ap.parse_args()
    ref_script = a.reference / "kv-cache.py"
    config = a.reference / "config.yaml"
    if not ref_script.exists() or not config.exists():
        raise SystemExit(f"--reference {a.reference}: no kv-cache.py and config.yaml there")
    work = Path(tempfile.mkdtemp(prefix="kvtier-parity-", dir=a.workdir))
    timeout = a.duration * 10 + 300
    deviations = []
    try:
        for i, (model, users, cpu_gb, mca) in enumerate(WORKLOADS):
            got: dict[str, tuple[float, int]] = {}
            order = ["reference", "kvtier"] if i % 2 == 0 else ["kvtier", "reference"]
            for who in order:
                cache = work / f"{who}-{i}"
                cache.mkdir()
                out = work / f"{who}-{i}.json"
                args = flags(model, users, cpu_gb, mca, a.duration, config, cache, out)
                if who == "reference":
                    cmd = [sys.executable, str(ref_script), *args]
                    got[who] = bytes_per_token(run_one(cmd, a.reference, timeout))
                else:
                    cmd = [sys.executable, "-m", "kvtier", "bench", "--progress", "none", *args]
                    got[who] = bytes_per_token(run_one(cmd, REPO, timeout))
                shutil.rmtree(cache, ignore_errors=True)
            (ref, ref_tok), (kv, kv_tok) = got["reference"], got["kvtier"]
            ratio = kv / ref
            deviations.append(abs(ratio - 1))
            print(
                f"{model:24s} users={users:3d} cpu={cpu_gb}GB mca={mca:2d}: "
                f"reference {ref / 1e6:8.2f} MB/token ({ref_tok} tokens)  "
                f"kvtier {kv / 1e6:8.2f} MB/token ({kv_tok} tokens)  ratio {ratio:.3f}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"reference_parity max_deviation={max(deviations):.3f}")


if __name__ == "__main__":
    main()
