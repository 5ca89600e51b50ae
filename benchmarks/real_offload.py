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

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import arms_command, arms_parser, later_p50, launch_arms, trace_folder


def main() -> None:
    ap = arms_parser(__doc__, traces=2, concurrency=2, max_requests=24)
    ap.add_argument("--staging-gb", type=float, default=0.005, help="the NVMe tier's CPU staging")
    ap.add_argument("--l2-gb", type=float, default=4.0, help="the NVMe tier")
    ap.add_argument("--nvme-dir", type=Path, default=None, help="default: a folder under the work folder")
    a = ap.parse_args()
    work = a.output or Path(tempfile.mkdtemp(prefix="kvtier-real-offload-"))
    data = trace_folder(a.traces, 2, work)
    nvme = a.nvme_dir or work / "nvme"
    nvme.mkdir(parents=True, exist_ok=True)
    out = work / "arms"
    launch = ["--staging-gb", str(a.staging_gb), "--l2-gb", str(a.l2_gb), "--nvme-dir", str(nvme)]
    by = launch_arms(arms_command(a, "none,kvtier:cpu,kvtier:nvme", data, out, launch, []), out)
    ext = sum(by[k]["tokens_by_source"].get("external_kv_transfer", 0) for k in ("kvtier:cpu", "kvtier:nvme"))
    p50 = {k: later_p50(v) for k, v in by.items()}
    print(f"real_offload external_hit_tokens={ext:.0f} later_ttft_p50_none={p50['none']} "
          f"later_ttft_p50_cpu={p50['kvtier:cpu']} later_ttft_p50_nvme={p50['kvtier:nvme']}")  # fmt: skip


if __name__ == "__main__":
    main()
