"""The methodology's three tiers on a real engine: vLLM (the CPU build) with no offload, with kvtier's CPU tier, and
with kvtier's NVMe tier, under the same agent-trace replay.

``kvtier launch --engine vllm --build cpu --arms none,kvtier:cpu,kvtier:nvme``: each arm a fresh vLLM 0.32.0 (dummy
weights, ``kvtier model make``'s default model) whose KV cache (``--kv-cache-tokens``, 10,368 by default: 81 blocks
of 128 tokens) is too small for the trace's working set — two LMCache mini-SWE-agent runs side by side, each step's
prompt extending the run's previous one (3-9k tokens), so each run's prefix is pushed out of vLLM's cache by the
other's. ``none`` recomputes what vLLM's own cache lost; ``kvtier:cpu`` loads it from kvtier's CPU tier
(``--l1-gb``); ``kvtier:nvme`` from files under ``--nvme-dir`` behind a CPU staging tier of ``--staging-gb``
(small, so the files serve the hits). Arms alternate order over ``--rounds``. Decode is capped
(``--max-tokens-cap``): TTFT is the figure.

Printed: the launch's per-arm lines (later-turn TTFT p50 with its 95 % interval, p95, hit rates by source, failures)
and verdicts, then, last: ``real_offload external_hit_tokens=… later_ttft_p50_none=… later_ttft_p50_cpu=…
later_ttft_p50_nvme=…`` — external_hit_tokens is what vLLM's own ``prompt_tokens_by_source{external_kv_transfer}``
counted over the CPU and NVMe arms (cpu+nvme).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, launch_arms, trace_folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-python", default=str(REPO / ".engines-cpu" / "bin" / "python"))
    ap.add_argument("--traces", type=Path, nargs="+", default=None,
                    help="agent-trace files replayed side by side (default: the first two miniswe runs)")  # fmt: skip
    ap.add_argument("--kv-cache-tokens", type=int, default=10368)
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--l1-gb", type=float, default=1.0, help="kvtier's CPU tier")
    ap.add_argument("--staging-gb", type=float, default=0.005, help="the NVMe tier's CPU staging")
    ap.add_argument("--l2-gb", type=float, default=4.0, help="the NVMe tier")
    ap.add_argument("--nvme-dir", type=Path, default=None, help="default: a folder under the work folder")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-requests", type=int, default=24)
    ap.add_argument("--max-tokens-cap", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--output", type=Path, default=None)
    a = ap.parse_args()
    if not Path(a.engine_python).exists():
        raise SystemExit(f"{a.engine_python}: missing (bash scripts/install-engines.sh cpu)")
    work = a.output or Path(tempfile.mkdtemp(prefix="kvtier-real-offload-"))
    data = trace_folder(a.traces, 2, work)
    nvme = a.nvme_dir or work / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    out = work / "arms"
    cmd = [sys.executable, "-m", "kvtier", "launch", "--engine", "vllm", "--build", "cpu", "--tier", "cpu",
           "--arms", "none,kvtier:cpu,kvtier:nvme", "--rounds", str(a.rounds), "--engine-python", a.engine_python,
           "--kv-cache-tokens", str(a.kv_cache_tokens), "--max-model-len", str(a.max_model_len),
           "--l1-gb", str(a.l1_gb), "--staging-gb", str(a.staging_gb), "--l2-gb", str(a.l2_gb),
           "--nvme-dir", str(nvme), "--output", str(out),
           "--", "--model", "tiny", "--dataset", str(data), "--num-rounds", "1", "--concurrency", str(a.concurrency),
           "--gap-scale", "0", "--warmup", "0", "--max-tokens-cap", str(a.max_tokens_cap),
           "--max-requests", str(a.max_requests), "--progress", "none"]  # fmt: skip
    by = launch_arms(cmd, out)
    ext = sum(by[k]["tokens_by_source"].get("external_kv_transfer", 0) for k in ("kvtier:cpu", "kvtier:nvme"))

    def p50(arm: str) -> str:
        v = by[arm]["later_ttft"]["p50_s"]
        return "nan" if v is None else f"{v:.3f}"

    print(f"real_offload external_hit_tokens={ext:.0f} later_ttft_p50_none={p50('none')} "
          f"later_ttft_p50_cpu={p50('kvtier:cpu')} later_ttft_p50_nvme={p50('kvtier:nvme')}")  # fmt: skip


if __name__ == "__main__":
    main()
