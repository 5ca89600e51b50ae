"""Does the hit pay? #30's three checks on the held-in miniswe traces, in one run:

1. **closure**: a replay against ``kvtier sim`` (real CPU offload tier) whose requests each carry the server's
   TTFT decomposition: the share whose parts sum within 5 % of the client's TTFT (aim: >= 99 %);
2. **three views**: ``kvtier plan views`` on that replay, predicting (b) from a ``kvtier bench`` of the same CPU
   tier and the sim's prefill model and (c) from the replay's own KV I/O run through ``kvtier trace replay``:
   the median of the per-turn |prediction error| (aim: <= 20 %);
3. **a 2 x 2 sweep**: ``kvtier plan sweep`` over CPU {0, 2} GB x NVMe {0, 4} GB (``--trials`` each) and
   ``kvtier plan recommend`` at ``--slo-ttft-p95``: the cheapest placement meeting it.

Every figure is measured here, now; each step prints its wall time, and the last line holds all three with the
time ``plan views`` and the whole run took: ``hit_pays closure=… views_b=… views_c=… recommend=… views_s=… wall_s=…``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, start_peer, wait_port_file

MINISWE = REPO.parent / "shared" / "data" / "lmcache_agent_trace" / "miniswe"
MODEL = "gpt-oss-20b"  # 48 KiB/token: miniswe's prompts (up to 11k tokens) fit 0.5 GB of GPU KV, a few at a time
KVTIER = [sys.executable, "-m", "kvtier"]


WALL: dict[str, float] = {}
"""Seconds each step took, by name (the README gives them, so a user knows what a run costs)."""


def run(cmd: list[str], timeout: float, what: str) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    WALL[what] = WALL.get(what, 0.0) + time.monotonic() - t0
    print(f"{what}: {WALL[what]:.0f} s", flush=True)
    if p.returncode not in (0, 1):
        raise SystemExit(f"{what}: exit {p.returncode}:\n{p.stderr[-3000:]}")
    return p


def replay_against_sim(out: Path, args: argparse.Namespace) -> None:
    port_file = out / "sim.port"
    sim = start_peer(
        KVTIER + ["sim", "--model", MODEL, "--gpu-kv-gb", "0.5", "--offload", "cpu", "--cpu-offload-gb", "2",
                  "--port", "0", "--port-file", str(port_file)],
        "kvtier sim",
    )  # fmt: skip
    try:
        port = wait_port_file(port_file, sim, 30)
        run(KVTIER + ["replay", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", MODEL, "--dataset",
                      str(MINISWE), "--concurrency", "4", "--num-rounds", "5", "--max-tokens-cap", "16",
                      "--skip-too-long", "--progress", "none", "--output", str(out / "replay")],
            600, "replay")  # fmt: skip
    finally:
        sim.stop(grace_s=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="work folder (default: a temporary one)")
    ap.add_argument("--trials", type=int, default=2, help="sweep trials per point (2)")
    ap.add_argument("--sweep-duration", type=float, default=15, help="seconds of dispatch per sweep trial (15)")
    ap.add_argument("--slo-ttft-p95", type=float, default=0.5, help="the recommendation's SLO, seconds (0.5)")
    a = ap.parse_args()
    if not MINISWE.exists():
        raise SystemExit(f"{MINISWE}: the held-in traces are not here")
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(dir=a.dir, prefix="kvtier-hit-pays-") as d:
        out = Path(d)
        replay_against_sim(out, a)
        s = json.loads((out / "replay" / "summary.json").read_text())
        dec = s["summary"]["ttft_decomposition"]
        print(
            f"replay: {s['status']}, {dec['requests']} requests with the decomposition; closure within 5 % "
            f"{dec['closure_within_5pct']:.1%}; client overhead p50 {dec['client_overhead_s_p50'] * 1e3:.2f} ms"
        )
        run(KVTIER + ["bench", "--model", MODEL, "--num-users", "4", "--duration", "10", "--gpu-mem-gb", "0",
                      "--cpu-mem-gb", "4", "--cache-dir", str(out / "bench-cache"), "--progress", "none",
                      "--output", str(out / "bench.json")], 300, "bench")  # fmt: skip
        v = run(KVTIER + ["plan", "views", "--from", str(out / "replay"), "--fetch-from", str(out / "bench.json"),
                          "--storage", "--work", str(out / "views"), "--json"], 900, "plan views")  # fmt: skip
        views = json.loads(v.stdout)
        for t in views["turns"]:
            print(f"turn {t['turn']}: measured TTFT {t['measured_ttft_s'] * 1e3:.1f} ms, (b) "
                  f"{t['predicted_ttft_s'] * 1e3:.1f} ms ({t['ttft_error']:+.0%}), (c) "
                  f"{t['storage_ttft_s'] * 1e3:.1f} ms ({t['storage_ttft_error']:+.0%})")  # fmt: skip
        for f in views["findings"]:
            print(f"finding: {f}")
        run(KVTIER + ["plan", "sweep", "--dataset", str(MINISWE), "--cpu-gb", "0,2", "--nvme-gb", "0,4",
                      "--trials", str(a.trials), "--duration", f"{a.sweep_duration:g}", "--max-tokens-cap", "16",
                      "--sim-model", MODEL, "--gpu-kv-gb", "0.5", "--output", str(out / "sweep"),
                      "--replay-args=--skip-too-long"], 3600, "plan sweep")  # fmt: skip
        slo = f"{a.slo_ttft_p95:g}"
        rc = run(KVTIER + ["plan", "recommend", "--from", str(out / "sweep"), "--slo-ttft-p95", slo,
                           "--store-cost", "cpu=3", "--store-cost", "nvme=0.1", "--json"],
                 120, "plan recommend")  # fmt: skip
        rec = json.loads(rc.stdout)
        for p in rec["points"]:
            i = p["ttft_p95_s"]
            print(f"{p['point']}: TTFT p95 {i['mean']:.3f} s [{i['low']}, {i['high']}], offload share "
                  f"{p['offload_hit_share']['mean']:.1%}, meets SLO {p['meets_slo']}")  # fmt: skip
        pick = rec["picks"][0]
        print(f"recommend: {pick['sentence']}")
        print(f"hit_pays closure={dec['closure_within_5pct']:.3f} views_b={views['median_abs_ttft_error']:.3f} "
              f"views_c={views['median_abs_storage_ttft_error']:.3f} recommend={pick['point']} "
              f"slo_ttft_p95={a.slo_ttft_p95:g} views_s={WALL['plan views']:.0f} "
              f"wall_s={time.monotonic() - t0:.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
