"""Two real vLLM replicas behind least_conn routing: per-replica offload tiers against one shared kvtier cache server.

``kvtier launch --engine vllm --build cpu --tier cpu --replicas 2 --lb-policy least_conn --arms
none,kvtier,kvtier-shared``: each arm two fresh vLLM 0.32.0 replicas (dummy weights, ``kvtier model make``'s default
model, ``--kv-cache-tokens`` each) behind Caddy, under the same agent-trace replay (LMCache mini-SWE-agent runs side
by side, each step's prompt extending the run's previous one). least_conn moves a conversation between replicas
from turn to turn, which is what the methodology's shared sidecar is for:

* ``none``: each replica's own GPU prefix cache (vLLM's), nothing offloaded;
* ``kvtier``: kvtier's CPU tier inside each replica (``--l1-gb`` each) — a turn that lands on the other replica
  finds nothing there;
* ``kvtier-shared``: one ``kvtier cache-server`` (``--l1-gb``) that both replicas' specs store to and
  load from — a turn that lands on the other replica loads what the first stored.

Printed: the launch's per-arm lines and verdicts, then, last: ``shared_offload cross_replica_loads=…
external_hit_tokens_kvtier=… external_hit_tokens_shared=… later_ttft_p50_none=… later_ttft_p50_kvtier=…
later_ttft_p50_shared=…`` — cross_replica_loads is the shared server's count of blocks one replica loaded that
the other stored; external_hit_tokens are vLLM's own ``prompt_tokens_by_source{external_kv_transfer}`` summed over
both replicas.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import arms_command, arms_parser, later_p50, launch_arms, trace_folder


def main() -> None:
    a = arms_parser(__doc__, traces=4, concurrency=4, max_requests=32).parse_args()
    work = a.output or Path(tempfile.mkdtemp(prefix="kvtier-shared-offload-"))
    data = trace_folder(a.traces, 4, work)
    out = work / "arms"
    launch = ["--replicas", "2", "--lb-policy", "least_conn"]
    by = launch_arms(arms_command(a, "none,kvtier,kvtier-shared", data, out, launch, ["--skip-too-long"]), out)

    def ext(arm: str) -> str:
        return f"{by[arm]['tokens_by_source'].get('external_kv_transfer', 0):.0f}"

    p50 = {k: later_p50(v) for k, v in by.items()}
    cross = by["kvtier-shared"]["offload"].get("cross_replica_loads")
    print(f"shared_offload cross_replica_loads={'nan' if cross is None else f'{cross:.0f}'} "
          f"external_hit_tokens_kvtier={ext('kvtier')} external_hit_tokens_shared={ext('kvtier-shared')} "
          f"later_ttft_p50_none={p50['none']} later_ttft_p50_kvtier={p50['kvtier']} "
          f"later_ttft_p50_shared={p50['kvtier-shared']}")  # fmt: skip


if __name__ == "__main__":
    main()
