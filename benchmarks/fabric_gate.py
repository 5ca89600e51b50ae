"""The live gate on a real engine: the link to the shared store degrades mid-run (its rate cut 10x by ``tc``), and
a replica with the gate (kv_connector_extra_config ``gate: true``, kvtier/vllm/gate.py) is set beside one without.

The testbed of benchmarks/fabric.py (benchmarks/_fabric.py, root) with three replica hosts: a computes each prompt
(and stores it to the cache server on s over its own link), b (no gate) and c (gate) each fetch it over their
own link, shaped alike. Each round: a fresh prompt of ``--context`` tokens computed on a, then asked on b and on
c (in turns, b first in odd rounds), each after ``--quiet`` seconds of quiet; ``--before`` rounds at ``--fast``
Mbit/s, then ``--after`` rounds at ``--fast``/10. The no-store baseline is b's and c's TTFT for fresh prompts of
the same length (nothing to fetch), measured before the rounds (which also gives c's gate its prefill rate).

Printed: each round's TTFTs; last: ``fabric_gate recompute_ms=… after_cut_ms_gate=… after_cut_ms_nogate=…
gate_over_recompute=… nogate_over_recompute=… hits_nogate=… gated_blocks=…`` (medians of the rounds after the
cut; the first round after the cut is the one that teaches the gate the new throughput and is counted in).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fabric import Fabric, prepare, start_world, stop_world
from fabric import BLOCK, REPO, Prompts, ask, server_counts, settle


def gate_counts(url: str) -> dict[str, float]:
    from kvtier.replay.scrape import parse_snapshot

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = parse_snapshot(r.read().decode())
    return {o: m.get("kvtier:offload_gate_blocks_total", outcome=o) or 0.0 for o in ("fetched", "gated", "probe")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--fast", type=float, default=500.0, help="the link's rate before the cut, Mbit/s")
    ap.add_argument("--before", type=int, default=3)
    ap.add_argument("--after", type=int, default=6)
    ap.add_argument("--baseline", type=int, default=3, help="fresh prompts per replica for the no-store TTFT")
    ap.add_argument("--quiet", type=float, default=1.5)
    ap.add_argument("--engine-python", default=str(REPO / ".engines-cpu" / "bin" / "python"))
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    ready = prepare("fabric_gate", a.output, a.engine_python)
    if ready is None:
        return 2
    work, model = ready
    max_len = a.context + 1024
    recompute: list[float] = []
    rounds: list[tuple[str, float, float, int, int]] = []  # phase, ttft b, ttft c, cached b, cached c
    with Fabric(["s", "a", "b", "c"]) as fab:
        w = start_world(fab, work, a.engine_python, model, 4 * max_len, max_len, 1.0, settings={"c": {"gate": True}})
        try:
            usage, _ = ask(w.urls["b"], Prompts(0, 1.0).make(1000))
            prompts = Prompts(1, usage["prompt_tokens"] / 1000)
            for host in ("b", "c"):
                for _ in range(a.baseline):
                    stored, _ = server_counts(w)
                    time.sleep(a.quiet)
                    u, dt = ask(w.urls[host], prompts.make(a.context))
                    recompute.append(dt)
                    settle(w, stored + u["prompt_tokens"] // BLOCK)
            for i in range(a.before + a.after):
                phase = "before" if i < a.before else "after"
                rate = a.fast if phase == "before" else a.fast / 10
                for host in ("b", "c"):
                    w.shape(rate, host)
                text = prompts.make(a.context)
                stored, _ = server_counts(w)
                ua, _ = ask(w.urls["a"], text)
                settle(w, stored + ua["prompt_tokens"] // BLOCK)
                got: dict[str, tuple[float, int]] = {}
                for host in ("b", "c") if i % 2 else ("c", "b"):
                    time.sleep(a.quiet)
                    u, dt = ask(w.urls[host], text)
                    got[host] = (dt, u["prompt_tokens_details"]["cached_tokens"])
                rounds.append((phase, got["b"][0], got["c"][0], got["b"][1], got["c"][1]))
                print(f"round {i} {phase} {rate:g} Mbit/s: no gate {got['b'][0] * 1e3:.0f} ms ({got['b'][1]} cached), "
                      f"gate {got['c'][0] * 1e3:.0f} ms ({got['c'][1]} cached)", flush=True)  # fmt: skip
            gates = gate_counts(w.urls["c"])
        finally:
            stop_world(w)
    base = statistics.median(recompute)
    after = [r for r in rounds if r[0] == "after"]
    g = statistics.median(r[2] for r in after)
    n = statistics.median(r[1] for r in after)
    hits = sum(1 for r in after if r[3] > 0) / len(after)
    print(f"no-store TTFT (fresh prompts of {a.context} tokens, b and c): p50 {base * 1e3:.0f} ms; gate outcomes on c: "
          f"{gates}")  # fmt: skip
    print(f"fabric_gate recompute_ms={base * 1e3:.0f} after_cut_ms_gate={g * 1e3:.0f} "
          f"after_cut_ms_nogate={n * 1e3:.0f} gate_over_recompute={g / base:.3f} "
          f"nogate_over_recompute={n / base:.3f} hits_nogate={hits:.2f} "
          f"gated_blocks={gates['gated']:.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
