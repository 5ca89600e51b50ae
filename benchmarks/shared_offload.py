"""Two real vLLM replicas behind least_conn routing: per-replica offload tiers against one shared kvtier cache server.

``kvtier launch --engine vllm --build cpu --tier cpu --replicas 2 --lb-policy least_conn --arms
none,kvtier,kvtier-shared``: each arm two fresh vLLM 0.32.0 replicas (dummy weights, ``kvtier model make``'s default
model, ``--kv-cache-tokens`` each) behind Caddy, under the same agent-trace replay (LMCache mini-SWE-agent runs side
by side, each step's prompt extending the run's previous one). least_conn moves a conversation between replicas
from turn to turn, which is what the methodology's shared sidecar is for:

* ``none``: each replica's own GPU prefix cache (vLLM's), nothing offloaded;
* ``kvtier``: kvtier's CPU tier inside each replica (``--l1-gb`` each) — a turn that lands on the other replica
  finds nothing there;
* ``kvtier-shared``: one ``kvtier cache-server --serve vllm`` (``--l1-gb``) that both replicas' specs store to and
  load from — a turn that lands on the other replica loads what the first stored.

Printed: the launch's per-arm lines and verdicts, then, last: ``shared_offload cross_replica_loads=…
external_hit_tokens_kvtier=… external_hit_tokens_shared=… later_ttft_p50_none=… later_ttft_p50_kvtier=…
later_ttft_p50_shared=…`` — cross_replica_loads is the shared server's count of blocks one replica loaded that
the other stored; external_hit_tokens are vLLM's own ``prompt_tokens_by_source{external_kv_transfer}`` summed over
both replicas.
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
                    help="agent-trace files replayed side by side (default: the first four miniswe runs)")  # fmt: skip
    ap.add_argument("--kv-cache-tokens", type=int, default=10368)
    ap.add_argument("--max-model-len", type=int, default=10240)
    ap.add_argument("--l1-gb", type=float, default=1.0, help="the CPU tier: each replica's (kvtier), the server's")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=32)
    ap.add_argument("--max-tokens-cap", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--output", type=Path, default=None)
    a = ap.parse_args()
    if not Path(a.engine_python).exists():
        raise SystemExit(f"{a.engine_python}: missing (bash scripts/install-engines.sh cpu)")
    work = a.output or Path(tempfile.mkdtemp(prefix="kvtier-shared-offload-"))
    data = trace_folder(a.traces, 4, work)
    out = work / "arms"
    cmd = [sys.executable, "-m", "kvtier", "launch", "--engine", "vllm", "--build", "cpu", "--tier", "cpu",
           "--replicas", "2", "--lb-policy", "least_conn", "--arms", "none,kvtier,kvtier-shared",
           "--rounds", str(a.rounds), "--engine-python", a.engine_python, "--kv-cache-tokens", str(a.kv_cache_tokens),
           "--max-model-len", str(a.max_model_len), "--l1-gb", str(a.l1_gb), "--output", str(out),
           "--", "--model", "tiny", "--dataset", str(data), "--num-rounds", "1", "--concurrency", str(a.concurrency),
           "--gap-scale", "0", "--warmup", "0", "--max-tokens-cap", str(a.max_tokens_cap),
           "--max-requests", str(a.max_requests), "--skip-too-long", "--progress", "none"]  # fmt: skip
    by = launch_arms(cmd, out)

    def ext(arm: str) -> str:
        return f"{by[arm]['tokens_by_source'].get('external_kv_transfer', 0):.0f}"

    def p50(arm: str) -> str:
        v = by[arm]["later_ttft"]["p50_s"]
        return "nan" if v is None else f"{v:.3f}"

    cross = by["kvtier-shared"]["offload"].get("cross_replica_loads")
    print(f"shared_offload cross_replica_loads={'nan' if cross is None else f'{cross:.0f}'} "
          f"external_hit_tokens_kvtier={ext('kvtier')} external_hit_tokens_shared={ext('kvtier-shared')} "
          f"later_ttft_p50_none={p50('none')} later_ttft_p50_kvtier={p50('kvtier')} "
          f"later_ttft_p50_shared={p50('kvtier-shared')}")  # fmt: skip


if __name__ == "__main__":
    main()
