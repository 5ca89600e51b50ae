"""The same replay against kvtier sim with --offload none, cpu and nvme (and, with --remote, redis and s3).

Fixed: dataset (the shared LMCache agent traces, miniswe), model, concurrency, num_rounds, GPU KV
budget (small, so histories outgrow it: 0.3 GB holds ~12.7k tokens of tiny-1b, while 8 users in
flight carry ~35k). Timing: the h100-llama3.1-8b preset (prefill 20k tok/s) with tiny-1b geometry
(24 KiB/token), so recompute produces KV at ~0.5 GB/s: on this host CPU RAM (~5-8 GB/s copies)
is ~10x faster than recompute and the file tier (~1-2.5 GB/s O_DIRECT) 2-5x, about the ratios of
an H100 + llama-3.1-8B (2.6 GB/s) to PCIe host memory and NVMe. The NVMe mode keeps a 0.05 GB
CPU staging tier, so nearly all its hits are real file reads.

Runs the three modes ``--repeats`` times, interleaved (none, cpu, nvme, none, ...), on a noisy
2-vCPU host, and reports per mode the mean over repeats of: the median TTFT degradation of later
turns (summary ttft_degradation.median_pct), the median TTFT of later turns (turns 1..), and the
external-hit tokens next to the chunks the engine really loaded.
Last line: ``sim_threeway median_pct none=.. cpu=.. nvme=.. later_ttft_ms none=.. cpu=.. nvme=..
reduced=.. between=.. ordered=true|false``: reduced = none's median degradation is positive and
both offload modes are below it; between = later-turn TTFT cpu < nvme < none. (The degradation ratio
does not order cpu against nvme reliably: an offload tier speeds up the first turns of later
chunks of a conversation as well, so both ratios shrink together; absolute later-turn TTFT shows
the tiers' speeds.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_peer, wait_port_file

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
    port_file = work / "port"
    args = [
        sys.executable,
        "-m",
        "kvtier",
        "sim",
        "--preset",
        a.preset,
        "--model",
        a.model,
        "--gpu-kv-gb",
        str(a.gpu_kv_gb),
        "--tpot-ms",
        str(a.tpot_ms),
        "--port",
        "0",
        "--port-file",
        str(port_file),
        "--offload",
        mode,
    ]
    if mode == "cpu":
        args += ["--cpu-offload-gb", str(a.offload_gb)]
    if mode == "nvme":
        d = work / "nvme"
        d.mkdir(exist_ok=True)
        args += ["--nvme-dir", str(d), "--nvme-offload-gb", str(a.offload_gb), "--staging-gb", str(a.staging_gb)]
    if mode == "redis":
        args += ["--redis-url", a.servers["redis"], "--redis-mem-gb", str(a.offload_gb)]
        args += ["--staging-gb", str(a.staging_gb)]
    if mode == "s3":
        args += ["--s3-endpoint", a.servers["s3"], "--s3-bucket", "kvtier-threeway"]
        args += ["--s3-capacity-gb", str(a.offload_gb), "--staging-gb", str(a.staging_gb)]
    sim = start_peer(args, "kvtier sim")
    try:
        port = wait_port_file(port_file, sim, 15)
        out = work / f"replay-{mode}"
        rp = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier",
                "replay",
                "--base-url",
                f"http://127.0.0.1:{port}/v1",
                "--model",
                a.model,
                "--dataset",
                str(a.dataset),
                "--num-rounds",
                str(a.num_rounds),
                "--concurrency",
                str(a.concurrency),
                "--gap-scale",
                str(a.gap_scale),
                "--output",
                str(out),
                "--scrape-interval",
                "2",
            ],
            capture_output=True,
            text=True,
        )
        if not (out / "summary.json").exists():
            raise SystemExit(f"replay against --offload {mode} failed:\n{rp.stderr[-3000:]}")
        m = metrics(port)
    finally:
        sim.stop(grace_s=60)
    s = json.loads((out / "summary.json").read_text())["summary"]
    return {
        "ttft_p50_s": s["ttft_s"]["p50"],
        "later_ttft_s": later_ttft_s(s),
        "degradation_median_pct": s["ttft_degradation"]["median_pct"],
        "degradation_p95_pct": s["ttft_degradation"]["p95_pct"],
        "sessions": s["sessions"],
        "external_hits": m.get("vllm:external_prefix_cache_hits_total"),
        "chunks_loaded": m.get("lmcache_mp_num_chunks_loaded_total"),
        "gate_recompute": m.get("kvtier_sim:fetch_gate_recompute_total"),
    }


def later_ttft_s(summary: dict) -> float | None:
    by_turn = summary["ttft_degradation"]["ttft_s_by_turn_p50"]
    later = [v for k, v in by_turn.items() if int(k) > 0]
    return sum(later) / len(later) if later else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(DATA))
    ap.add_argument("--preset", default="h100-llama3.1-8b")
    ap.add_argument("--model", default="tiny-1b")
    ap.add_argument("--gpu-kv-gb", type=float, default=0.3)
    ap.add_argument("--tpot-ms", type=float, default=1.0, help="short decode keeps the run short; TTFT is the subject")
    ap.add_argument("--offload-gb", type=float, default=4.0)
    ap.add_argument("--staging-gb", type=float, default=0.05)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--num-rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument(
        "--gap-scale",
        type=float,
        default=1.0,
        help="recorded think/tool gaps (median 1.1 s in miniswe); other users' turns run in them",
    )
    ap.add_argument(
        "--keep",
        metavar="DIR",
        help="keep each replay's result folder as DIR/replay-<mode>-<repeat> (for kvtier report / compare)",
    )
    ap.add_argument(
        "--remote",
        action="store_true",
        help="also --offload redis and s3, against a redis-server and moto's S3 server started here (loopback); "
        "prints one more last line, sim_remote",
    )
    a = ap.parse_args()
    modes: tuple[str, ...] = ("none", "cpu", "nvme") + (("redis", "s3") if a.remote else ())
    res: dict[str, list[dict]] = {m: [] for m in modes}
    with contextlib.ExitStack() as servers, tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        a.servers = {}
        if a.remote:
            sys.path.insert(0, str(REPO / "src"))
            from kvtier.localservers import S3_TEST_CREDENTIALS, redis_server, s3_server

            os.environ.update({k: os.environ.get(k, v) for k, v in S3_TEST_CREDENTIALS.items()})
            a.servers = {
                "redis": servers.enter_context(redis_server()).url,
                "s3": servers.enter_context(s3_server()).url,
            }
        for rep in range(a.repeats):
            for mode in modes:
                work = Path(tmp) / f"{mode}-{rep}"
                work.mkdir()
                r = run(mode, a, work)
                res[mode].append(r)
                if a.keep:
                    Path(a.keep).mkdir(parents=True, exist_ok=True)
                    shutil.copytree(work / f"replay-{mode}", Path(a.keep) / f"replay-{mode}-{rep}", dirs_exist_ok=True)
                print(
                    f"{mode:5} #{rep}: TTFT p50 {r['ttft_p50_s']} s, later turns {r['later_ttft_s']:.4f} s, "
                    f"degradation median {r['degradation_median_pct']} % p95 {r['degradation_p95_pct']} %, "
                    f"external hit tokens {r['external_hits']}, chunks loaded {r['chunks_loaded']} "
                    f"(x256 = {None if r['chunks_loaded'] is None else r['chunks_loaded'] * 256}), "
                    f"gate recomputes {r['gate_recompute']}, sessions {r['sessions']}",
                    flush=True,
                )

    def mean(mode: str, key: str) -> float | None:
        vals = [r[key] for r in res[mode]]
        return None if None in vals else sum(vals) / len(vals)

    med = {m: mean(m, "degradation_median_pct") for m in modes}
    later = {m: mean(m, "later_ttft_s") for m in modes}
    later = {m: v if v is not None else float("nan") for m, v in later.items()}
    # offload reduces the degradation none shows; nvme sits between cpu and none in later-turn TTFT
    reduced = None not in med.values() and med["none"] > 0 and med["cpu"] < med["none"] and med["nvme"] < med["none"]
    between = None not in later.values() and later["cpu"] < later["nvme"] < later["none"]
    print(
        f"sim_threeway median_pct none={med['none']:.1f} cpu={med['cpu']:.1f} nvme={med['nvme']:.1f} "
        f"later_ttft_ms none={later['none'] * 1e3:.1f} cpu={later['cpu'] * 1e3:.1f} nvme={later['nvme'] * 1e3:.1f} "
        f"reduced={'true' if reduced else 'false'} between={'true' if between else 'false'} "
        f"ordered={'true' if reduced and between else 'false'}"
    )
    if a.remote:  # the remote stores in the loop: where their later-turn TTFT falls against none and cpu
        print(
            "sim_remote later_ttft_ms "
            + " ".join(f"{m}={later[m] * 1e3:.1f}" for m in modes)
            + f" external_hit_tokens redis={mean('redis', 'external_hits'):.0f} s3={mean('s3', 'external_hits'):.0f}"
        )


if __name__ == "__main__":
    main()
