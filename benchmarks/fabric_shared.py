"""Which shared store pays, at which link rate: kvtier's cache server over TCP, a Redis Cluster and an S3 server, each
shared by two real vLLM replicas (the CPU build) on the namespace testbed (benchmarks/_fabric.py, root), measured
the same way.

For each store (``--stores``): the world of benchmarks/_fabric.py with that store on host s and replicas a and b.
At each rate of b's link (``--rates``, Mbit/s, shaped by ``tc``): ``--rounds`` rounds of a fresh prompt of
``--context`` tokens computed on a, stored (the store itself says so), then asked on b, which loads it over its
link (verified: b's cached tokens are the prompt's whole blocks; a round that is not counts as unverified); and
``--rounds`` fresh prompts on b with nothing to fetch (the recompute it replaces, at the same rate, the same
load). The round trip is the link's own (the relay of the crossover benchmark fronts one TCP endpoint; a cluster's
masters are three).

Printed: per store and rate, the medians; last: ``fabric_shared rates_mbps=… recompute_ms=… cache-server_ms=…
redis-cluster_ms=… s3_ms=… fetch_over_recompute_max=… unverified=…`` (per store, the fetch TTFT medians in the
order of the rates; recompute the median over every store's baseline).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fabric import STORES, Fabric, prepare, start_world, stop_world
from fabric import BLOCK, REPO, Prompts, ask


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", default=",".join(STORES))
    ap.add_argument("--rates", default="1000,200,100,50", help="b's link, Mbit/s")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quiet", type=float, default=1.0, help="seconds between requests (stores settle)")
    ap.add_argument("--engine-python", default=str(REPO / ".engines-cpu" / "bin" / "python"))
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, _interrupted)  # a kill tears the testbed down as Ctrl+C does
    stores = a.stores.split(",")
    rates = [float(r) for r in a.rates.split(",")]
    unknown = sorted(set(stores) - set(STORES))
    if unknown:
        ap.error(f"--stores: {', '.join(unknown)}: expected {', '.join(STORES)}")
    ready = prepare("fabric_shared", a.output, a.engine_python)
    if ready is None:
        return 2
    work, model = ready
    max_len = a.context + 1024
    fetch: dict[str, dict[float, float]] = {}
    recompute: list[float] = []
    unverified = 0
    for store in stores:
        fetch[store] = {}
        (work / store).mkdir(exist_ok=True)
        with Fabric(["s", "a", "b"]) as fab:
            w = start_world(fab, work / store, a.engine_python, model, 4 * max_len, max_len, 1.0, kind=store)
            try:
                usage, _ = ask(w.urls["b"], Prompts(0, 1.0).make(1000))  # warm-up; the tokenizer's words per token
                prompts = Prompts(hash(store) % 1000 + 1, usage["prompt_tokens"] / 1000)
                for rate in rates:
                    w.shape(rate)
                    got, base = [], []
                    for _ in range(a.rounds):
                        text = prompts.make(a.context)
                        had = w.stored_blocks()
                        ua, _ = ask(w.urls["a"], text)
                        blocks = ua["prompt_tokens"] // BLOCK
                        deadline = time.monotonic() + 120
                        while w.stored_blocks() < had + blocks and time.monotonic() < deadline:
                            time.sleep(0.1)
                        time.sleep(a.quiet)
                        ub, dt = ask(w.urls["b"], text)
                        cached = ub["prompt_tokens_details"]["cached_tokens"]
                        if cached != blocks * BLOCK:
                            unverified += 1
                        got.append(dt)
                        time.sleep(a.quiet)
                        _, dr = ask(w.urls["b"], prompts.make(a.context))  # nothing to fetch: the recompute
                        base.append(dr)
                    fetch[store][rate] = statistics.median(got)
                    recompute += base
                    print(f"{store} at {rate:g} Mbit/s: fetch {statistics.median(got) * 1e3:.0f} ms (cached "
                          f"{cached} of {ub['prompt_tokens']}), recompute {statistics.median(base) * 1e3:.0f} ms",
                          flush=True)  # fmt: skip
            finally:
                stop_world(w)
    rec = statistics.median(recompute)
    worst = max(v / rec for per in fetch.values() for v in per.values())
    parts = [f"rates_mbps={','.join(f'{r:g}' for r in rates)}", f"recompute_ms={rec * 1e3:.0f}"]
    parts += [f"{s}_ms={','.join(f'{fetch[s][r] * 1e3:.0f}' for r in rates)}" for s in stores]
    print("fabric_shared " + " ".join(parts) + f" fetch_over_recompute_max={worst:.2f} unverified={unverified}")
    return 0


def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
