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
and verdicts, then ``real_offload external_hit_tokens=… later_ttft_p50_none=… later_ttft_p50_cpu=…
later_ttft_p50_nvme=…`` — external_hit_tokens is what vLLM's own ``prompt_tokens_by_source{external_kv_transfer}``
counted over the CPU and NVMe arms (cpu+nvme).

``--per-request`` (#53): each kvtier arm's replay joined to its engine's own request log (kvtier launch passes it),
then, last: ``request_truth joined=… sources_exact=… external_match=… closure=… load_io_ratio=… queue_vs_vllm=…
prefill_vs_vllm=…`` over the CPU and NVMe arms — the share of ok requests joined to their engine record; the share of
those whose prompt by source sums exactly to their prompt tokens; the arms whose records' planned offload tokens equal
vLLM's ``external_prefix_cache_hits`` delta exactly (of 2); the share of requests whose parts and transits are within
5 % of the client's TTFT (by construction on one clock: a check of the stamps); the records' tier read time over the
tiers' own counter; and the mean queue + lookup + fetch, and the mean recompute, over vLLM's own histograms of the same
run (``request_queue_time``, ``request_prefill_time``): the independent check of the engine stamps.
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
    ap.add_argument("--per-request", action="store_true", help="print the per-request truth of the kvtier arms, last")
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
    if a.per_request:
        request_truth(sorted((out / "arms").glob("kvtier-*")))


def request_truth(folders: list[Path]) -> None:
    """The per-request join of each kvtier arm (its replay's summary and records), pooled; printed last."""
    import json

    ok = joined = exact = closed = with_parts = matches = 0
    io_ours = io_counter = queue = vq = pre = vp = 0.0
    for f in folders:
        s = json.loads((f / "replay" / "summary.json").read_text())["summary"]
        j, d = s.get("engine_join"), s.get("ttft_decomposition") or {}
        if not j:
            raise SystemExit(f"{f}: no engine_join in its replay summary (the replicas' request logs)")
        ok += j["requests_ok"]
        joined += j["joined_ok"]
        matches += bool(j["external_match"])
        io_ours += sum(j["load_io_s"].values())
        io_counter += j["load_io_s_counter"] or 0.0
        n = d.get("requests") or 0
        with_parts += n
        closed += round((d.get("closure_within_5pct") or 0.0) * n)
        for mine, theirs in (("queue_s_mean", "vllm_queue_s_mean"), ("recompute_s_mean", "vllm_prefill_s_mean")):
            if j[mine] is not None and j[theirs] is not None:
                if mine.startswith("queue"):
                    queue, vq = queue + j[mine] * n, vq + j[theirs] * n
                else:
                    pre, vp = pre + j[mine] * n, vp + j[theirs] * n
        for line in (f / "replay" / "requests.jsonl").read_text().splitlines():
            r = json.loads(line)
            if r["status"] == "ok" and r.get("decomposition") == "measured-in-engine":
                exact += sum(r["prompt_sources"].values()) == r["prompt_tokens"]

    def ratio(x: float, y: float) -> str:
        return f"{x / y:.4f}" if y else "nan"

    print(f"request_truth joined={ratio(joined, ok)} sources_exact={ratio(exact, joined)} "
          f"external_match={matches}/{len(folders)} closure={ratio(closed, with_parts)} "
          f"load_io_ratio={ratio(io_ours, io_counter)} queue_vs_vllm={ratio(queue, vq)} "
          f"prefill_vs_vllm={ratio(pre, vp)}")  # fmt: skip


if __name__ == "__main__":
    main()
