"""What sticky routing is worth, measured on real vLLM: the methodology's claim that without stickiness a
session's later rounds miss the replica-local prefix cache.

The same multi-turn trace (LMCache mini-SWE-agent traces from ../shared/data by default) runs through
``kvtier launch --engine vllm --build cpu --tier gpu --replicas 2``: two real vLLM 0.32.0 replicas (the CPU
build, dummy weights, one core each) behind Caddy, once with ``--lb-policy sticky`` (Caddy hashes the
``X-User-Id`` header: every turn of a user reaches one replica) and once with ``--lb-policy least_conn``
(each request to the replica with fewer open connections), alternating over ``--rounds``. Each launch
starts its replicas fresh. No gaps, concurrency 4, ``--max-tokens-cap`` (decode on one core would take the
run's time; the replay sends the recorded history either way). A run may lose no request
(``--max-failure-rate 0``): Caddy used to cut a few streams in every few hundred at their start ("aborting with
incomplete response ... use of closed network connection"; 3 of 48 in one of three least_conn launches), which the
launch's Caddyfile no longer does since it buffers request bodies and drops idle upstream connections before
vLLM's keep-alive does (#41 item 11; benchmarks/caddy_stream_cuts.py measures both Caddyfiles side by side).

Printed per run and pooled per policy: the aggregate prefix hit rate (Σ cached / Σ prompt tokens over every
request, from the servers' usage.prompt_tokens_details), each replica's own hit rate from its counters, and
TTFT p50 / p90 of later turns (every turn after a virtual user's first). Last line:
``routing_real_vllm sticky_hit_rate=… least_conn_hit_rate=… sticky_later_ttft_p50_s=…
least_conn_later_ttft_p50_s=…``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_tool

sys.path.insert(0, str(REPO / "src"))
from kvtier.launch import cpu_engine

SHARED = REPO.parent / "shared" / "data"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1)))] if xs else float("nan")


def one(a: argparse.Namespace, policy: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "kvtier", "launch", "--engine", "vllm", "--build", "cpu", "--tier", "gpu",
           "--replicas", "2", "--lb-policy", policy, "--engine-python", a.engine_python, "--output", str(out),
           "--", "--model", "tiny", "--dataset", str(a.dataset), "--num-rounds", str(a.num_rounds),
           "--concurrency", str(a.concurrency), "--gap-scale", "0", "--warmup", "0", "--skip-too-long",
           "--max-tokens-cap", str(a.max_tokens_cap), "--max-requests", str(a.max_requests),
           "--max-failure-rate", "0", "--progress", "none"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"launch --lb-policy {policy} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    s = json.loads((out / "replay" / "summary.json").read_text())
    recs = [json.loads(x) for x in (out / "replay" / "requests.jsonl").read_text().splitlines()]
    ok = [r for r in recs if r["status"] == "ok"]
    later = [r["ttft_s"] for r in ok if r["turn"] > 0 and r["ttft_s"] is not None]
    return {
        "status": s["status"],
        "requests": len(recs),
        "failed": {c: sum(1 for r in recs if r["cause"] == c) for c in {r["cause"] for r in recs if r["cause"]}},
        "cached": sum(r["cached_tokens"] or 0 for r in ok),
        "prompt": sum(r["prompt_tokens"] or 0 for r in ok),
        "later_ttft": later,
        "replica_hit_rates": [m["prefix_cache_hit_rate_overall"] for m in s["server_metrics"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-python", default=str(REPO / cpu_engine.DEFAULT_PYTHON))
    ap.add_argument("--dataset", type=Path, default=SHARED / "lmcache_agent_trace" / "miniswe")
    ap.add_argument("--num-rounds", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=48)
    ap.add_argument("--max-tokens-cap", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="sticky, least_conn pairs (alternating order)")
    a = ap.parse_args()
    if not Path(a.engine_python).exists():
        raise SystemExit(f"{a.engine_python}: missing (bash scripts/install-engines.sh cpu)")
    if not a.dataset.exists():
        raise SystemExit(f"--dataset {a.dataset}: not found")
    ensure_tool("caddy")
    work = Path(tempfile.mkdtemp(prefix="kvtier-routing-"))
    pooled: dict[str, dict] = {p: {"cached": 0, "prompt": 0, "later_ttft": []} for p in ("sticky", "least_conn")}
    for i in range(a.rounds):
        order = ["sticky", "least_conn"] if i % 2 == 0 else ["least_conn", "sticky"]
        for policy in order:
            r = one(a, policy, work / f"{policy}-{i}")
            hr = r["cached"] / r["prompt"] if r["prompt"] else float("nan")
            reps = ", ".join("—" if x is None else f"{x:.3f}" for x in r["replica_hit_rates"])
            print(f"round {i} {policy:10s} {r['status']:8s} requests {r['requests']:3d} hit_rate {hr:.4f} "
                  f"(replicas {reps}) later-turn TTFT p50 {pct(r['later_ttft'], 0.5):.3f} s "
                  f"p90 {pct(r['later_ttft'], 0.9):.3f} s; failed {r['failed'] or 'none'}", flush=True)  # fmt: skip
            for k in ("cached", "prompt"):
                pooled[policy][k] += r[k]
            pooled[policy]["later_ttft"] += r["later_ttft"]
    h = {p: v["cached"] / v["prompt"] for p, v in pooled.items()}
    t = {p: pct(v["later_ttft"], 0.5) for p, v in pooled.items()}
    print(
        f"routing_real_vllm sticky_hit_rate={h['sticky']:.4f} least_conn_hit_rate={h['least_conn']:.4f} "
        f"sticky_later_ttft_p50_s={t['sticky']:.3f} least_conn_later_ttft_p50_s={t['least_conn']:.3f}"
    )


if __name__ == "__main__":
    main()
