"""kvtier bench beside the MLPerf reference with a CPU tier in front of the disk, where the host's CPU is part of the
figure: the same flags and seed one after the other on one disk, alternating which goes first (these machines are
noisy), ``--pairs`` times.

Defaults (#45's): llama3.1-8b, 20 users, ``--cpu-mem-gb 4 --gpu-mem-gb 0 --max-concurrent-allocs 8 --generation-mode
none``, 45 s, the reference's own config.yaml. Each run's figures come from its own result: wall-clock tokens/s
(``avg_throughput_tokens_per_sec``), storage tokens/s (``storage_throughput_tokens_per_sec``, the spec's figure at
--cpu-mem-gb 4), requests completed, and the CPU seconds its process used (from the children's rusage) per GB the
run moved through its tiers. For kvtier, also how its entry bytes were made (``storage.payload``): stamped in place
in a writer's buffer (file-tier writes) or copied from the noise (the CPU tier's one copy into its pages), and the
CPU tier's own write time.

Last line: ``cpu_tier_vs_reference pairs=<n> throughput_ratio=<median kvtier/reference wall-clock tok/s>
storage_throughput_ratio=<median, storage tok/s> cpu_s_per_gb_kvtier=<median> cpu_s_per_gb_reference=<median>
copied_share=<kvtier's bytes copied / bytes made> second_over_first_kvtier=<its median tok/s when second over when
first> second_over_first_reference=<the same> settled=<bool> pairs_lost=<n>`` (#45's aim: throughput >= 1.5). Before
each run the disk is settled (``_common.settle``: writeback, the page cache dropped, the last run's trims done);
``--no-settle`` starts each at once, to measure the order effect that leaves (#59 item 4). A pair one of
whose runs failed (the reference is OOM-killed at 24 GiB now and then) is said, left out and counted in
``pairs_lost``; ``pairs`` counts the pairs the medians are over.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, median, settle
from reference_parity import flags, moved_bytes, run_one


def one(who: str, a: argparse.Namespace, config: Path, work: Path, tag: str) -> dict[str, float]:
    cache, out = work / f"{who}-{tag}", work / f"{who}-{tag}.json"
    waited = settle(work) if a.settle else 0.0  # the last run's writeback, page cache and trims gone first
    cache.mkdir()
    args = flags(a.model, a.users, a.cpu_mem_gb, a.max_concurrent_allocs, a.duration, config, cache, out, a.seed)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        if who == "reference":
            r = run_one([sys.executable, str(a.reference / "kv-cache.py"), *args], a.reference, a.duration * 10 + 300)
        else:
            cmd = [sys.executable, "-m", "kvtier", "bench", "--progress", "none", *args]
            r = run_one(cmd, REPO, a.duration * 10 + 300)
    finally:  # a failed run's files too: the next runs need the disk
        shutil.rmtree(cache, ignore_errors=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    s = r["summary"]
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    gb = moved_bytes(r) / 1e9
    row = {
        "tok_s": float(s["avg_throughput_tokens_per_sec"]),
        "storage_tok_s": float(s["storage_throughput_tokens_per_sec"]),
        "requests": float(r.get("requests_completed") or s.get("total_requests") or 0),
        "gb": gb,
        "cpu_s_per_gb": cpu_s / gb if gb else float("nan"),
        "settled_s": waited,
    }
    if who == "kvtier":
        p = r["storage"]["payload"]
        made = (p.get("bytes_copied") or 0) + (p.get("bytes_stamped_in_place") or 0)
        row["copied_share"] = (p.get("bytes_copied") or 0) / made if made else float("nan")
        lat = ((r["tiers"].get("cpu") or {}).get("write") or {}).get("latency_ms") or {}
        row["cpu_tier_write_s"] = (lat.get("mean") or 0.0) * (lat.get("count") or 0) / 1e3  # its writes' time
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", type=Path, required=True, help="the reference's kv_cache_benchmark folder")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--model", default="llama3.1-8b")
    ap.add_argument("--users", type=int, default=20)
    ap.add_argument("--cpu-mem-gb", type=float, default=4)
    ap.add_argument("--max-concurrent-allocs", type=int, default=8)
    ap.add_argument("--duration", type=int, default=45)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--dir", type=Path, default=None, help="where the cache folders go (default: a temp dir)")
    ap.add_argument(
        "--no-settle",
        dest="settle",
        action="store_false",
        help="start each run at once, not after the disk has gone quiet (to measure the order effect)",
    )
    a = ap.parse_args()
    config = a.reference / "config.yaml"
    if not (a.reference / "kv-cache.py").exists() or not config.exists():
        raise SystemExit(f"--reference {a.reference}: no kv-cache.py and config.yaml there")
    work = Path(tempfile.mkdtemp(prefix="kvtier-cpuref-", dir=a.dir or "/var/tmp"))
    rows: dict[str, list[dict[str, float]]] = {"reference": [], "kvtier": []}
    lost: list[str] = []
    try:
        for i in range(a.pairs):
            pair: dict[str, dict[str, float]] = {}
            for who in ("reference", "kvtier") if i % 2 == 0 else ("kvtier", "reference"):
                try:
                    row = one(who, a, config, work, str(i))
                except SystemExit as e:  # a run that failed (the reference is OOM-killed at 24 GiB now and then)
                    print(f"pair {i} lost: {str(e).splitlines()[0]}", flush=True)
                    lost.append(who)
                    break
                row["second"] = float(len(pair))  # 0: this pair's first run, 1: its second
                pair[who] = row
                extra = ""
                if who == "kvtier":
                    extra = f", bytes copied {row['copied_share']:.2f} of those made, CPU tier writes "
                    extra += f"{row['cpu_tier_write_s']:.1f} s"
                print(f"pair {i} {who:9s}: {row['tok_s']:8.1f} tok/s wall-clock, {row['storage_tok_s']:8.1f} storage "
                      f"tok/s, {row['requests']:.0f} requests, {row['gb']:.1f} GB moved at {row['cpu_s_per_gb']:.3f} "
                      f"CPU s/GB{extra}; settled {row['settled_s']:.0f} s before", flush=True)  # fmt: skip
            if len(pair) == 2:
                for who, row in pair.items():
                    rows[who].append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not rows["kvtier"]:
        raise SystemExit(f"no pair completed ({len(lost)} lost: {', '.join(lost)})")
    ratio = median([k["tok_s"] / r["tok_s"] for k, r in zip(rows["kvtier"], rows["reference"], strict=True)])
    sratio = median(
        [k["storage_tok_s"] / r["storage_tok_s"] for k, r in zip(rows["kvtier"], rows["reference"], strict=True)]
    )

    def order(who: str) -> float:
        """The order effect on one program: its median tok/s when it ran second over when it ran first."""
        firsts = [r["tok_s"] for r in rows[who] if not r["second"]]
        seconds = [r["tok_s"] for r in rows[who] if r["second"]]
        return median(seconds) / median(firsts) if firsts and seconds else float("nan")

    print(
        f"cpu_tier_vs_reference pairs={len(rows['kvtier'])} throughput_ratio={ratio:.2f} "
        f"storage_throughput_ratio={sratio:.2f} "
        f"cpu_s_per_gb_kvtier={median([k['cpu_s_per_gb'] for k in rows['kvtier']]):.3f} "
        f"cpu_s_per_gb_reference={median([r['cpu_s_per_gb'] for r in rows['reference']]):.3f} "
        f"copied_share={median([k['copied_share'] for k in rows['kvtier']]):.2f} "
        f"second_over_first_kvtier={order('kvtier'):.2f} second_over_first_reference={order('reference'):.2f} "
        f"settled={a.settle} pairs_lost={len(lost)}" + (f" ({', '.join(lost)} failed)" if lost else "")
    )


if __name__ == "__main__":
    main()
