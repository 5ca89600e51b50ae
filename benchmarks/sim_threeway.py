"""The same replay against kvtier sim with --offload none, cpu and nvme.

Fixed: dataset (the shared LMCache agent traces), model, concurrency, num_rounds, GPU KV budget
(small, so histories outgrow it). Prints, per offload mode, TTFT p50 and the TTFT degradation of
later turns, and checks that the server's external-hit counter equals the tokens its offload tier
really loaded. Last line: ``sim_threeway none=<median %> cpu=<median %> nvme=<median %> ordered=true|false``
(ordered: cpu reduces the degradation of none, nvme sits between or at cpu), for the median and p95.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "lmcache_agent_trace" / "miniswe"


def metrics(port: int) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode().splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k.split("{")[0]] = out.get(k.split("{")[0], 0.0) + float(v)
    return out


def run(mode: str, a: argparse.Namespace, work: Path) -> dict:
    port_file = work / f"{mode}.port"
    args = [sys.executable, "-m", "kvtier", "sim", "--preset", a.preset, "--model", a.model,
            "--gpu-kv-gb", str(a.gpu_kv_gb),
            "--tpot-ms", str(a.tpot_ms),
            "--port", "0", "--port-file", str(port_file), "--offload", mode]
    if mode == "cpu":
        args += ["--cpu-offload-gb", str(a.offload_gb)]
    if mode == "nvme":
        d = work / "nvme"
        d.mkdir(exist_ok=True)
        args += ["--nvme-dir", str(d), "--nvme-offload-gb", str(a.offload_gb), "--staging-gb", str(a.staging_gb)]
    sim = subprocess.Popen(args, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            if port_file.exists() and port_file.read_text().strip():
                break
            time.sleep(0.05)
        port = int(port_file.read_text())
        out = work / f"replay-{mode}"
        rp = subprocess.run([sys.executable, "-m", "kvtier", "replay", "--base-url", f"http://127.0.0.1:{port}/v1",
                        "--model", a.model, "--dataset", str(a.dataset), "--num-rounds", str(a.num_rounds),
                        "--concurrency", str(a.concurrency), "--gap-scale", "0", "--output", str(out),
                        "--scrape-interval", "2"], capture_output=True, text=True)
        if not (out / "summary.json").exists():
            raise SystemExit(f"replay against --offload {mode} failed:\n{rp.stderr[-3000:]}")
        m = metrics(port)
    finally:
        sim.send_signal(signal.SIGTERM)
        sim.wait(timeout=60)
    s = json.loads((out / "summary.json").read_text())["summary"]
    return {"ttft_p50_s": s["ttft_s"]["p50"], "degradation_median_pct": s["ttft_degradation"]["median_pct"],
            "degradation_p95_pct": s["ttft_degradation"]["p95_pct"], "sessions": s["sessions"],
            "external_hits": m.get("vllm:external_prefix_cache_hits_total"),
            "chunks_loaded": m.get("lmcache_mp_num_chunks_loaded_total"), "gate_recompute":
            m.get("kvtier_sim:fetch_gate_recompute_total")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(DATA))
    ap.add_argument("--preset", default="h100-llama3.1-8b")
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--gpu-kv-gb", type=float, default=4.0)
    ap.add_argument("--tpot-ms", type=float, default=1.0, help="short decode keeps the run short; TTFT is the subject")
    ap.add_argument("--offload-gb", type=float, default=8.0)
    ap.add_argument("--staging-gb", type=float, default=0.25)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--num-rounds", type=int, default=5)
    a = ap.parse_args()
    res = {}
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        for mode in ("none", "cpu", "nvme"):
            res[mode] = r = run(mode, a, Path(tmp))
            print(f"{mode:5} TTFT p50 {r['ttft_p50_s']} s, degradation median {r['degradation_median_pct']} % "
                  f"p95 {r['degradation_p95_pct']} %, external hit tokens {r['external_hits']}, chunks loaded "
                  f"{r['chunks_loaded']} (x256 = {None if r['chunks_loaded'] is None else r['chunks_loaded'] * 256}), "
                  f"gate recomputes {r['gate_recompute']}, sessions {r['sessions']}", flush=True)
    n, c, v = (res[m]["degradation_median_pct"] for m in ("none", "cpu", "nvme"))
    n95, c95, v95 = (res[m]["degradation_p95_pct"] for m in ("none", "cpu", "nvme"))
    ordered = None not in (n, c, v) and c < n and c <= v <= n
    ordered95 = None not in (n95, c95, v95) and c95 < n95 and c95 <= v95 <= n95
    print(f"sim_threeway median none={n} cpu={c} nvme={v} ordered={'true' if ordered else 'false'} "
          f"p95 none={n95} cpu={c95} nvme={v95} ordered_p95={'true' if ordered95 else 'false'}")


if __name__ == "__main__":
    main()
