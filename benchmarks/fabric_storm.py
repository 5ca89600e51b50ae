"""The miss storm, measured on a real engine: the shared store restarts (a crash: its tiers come back empty)
in the middle of a multi-turn replay, and the replica that leaned on it recomputes. Or (``--fault silent``) the
store's link goes silent for ``--silent-for`` seconds (the store's end of b's link set down: connections stay
open, nothing answers, new ones get no reply) and comes back, the store's blocks intact.

The testbed of benchmarks/fabric.py (benchmarks/_fabric.py, root): ``kvtier cache-server`` on host s, a real
vLLM replica on host b (its own KV cache small, ``--kv-tokens``, so later turns come back from the store over
b's link), ``kvtier replay`` from the root namespace against b with b's own per-request log joined
(``--engine-log``: each request's prompt by source, from inside the engine). At ``--restart-at`` seconds the
cache server is killed and started again (``--fault restart``), or the link falls silent.

Reported, from the replay's records: TTFT p50/p95 and the share of prompt tokens served by the store before the
restart, in the storm (from the restart until the store served a request again, at least ``--storm`` seconds)
and after; the time to recover (from the restart until the store's share over the last ``--window`` requests
is back to half its level before); requests that failed (the recompute policy: none should); the engine's
failed loads and server errors. Last line: ``fabric_storm ttft_p95_before_s=… ttft_p95_storm_s=…
ttft_p95_after_s=… recover_s=… failed_requests=… failed_loads=… server_errors=…``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import trace_folder
from _fabric import Fabric, prepare, start_world, stop_world
from fabric import REPO


def p(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def engine_counts(url: str) -> dict[str, float]:
    from kvtier.replay.scrape import parse_snapshot

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        m = parse_snapshot(r.read().decode())
    return {
        "failed_loads": m.get("kvtier:offload_failed_loads_total") or 0.0,
        "server_errors": m.get("kvtier:offload_server_errors_total") or 0.0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=150.0, help="replay seconds")
    ap.add_argument("--restart-at", type=float, default=60.0, help="seconds into the replay")
    ap.add_argument("--fault", choices=("restart", "silent"), default="restart")
    ap.add_argument("--silent-for", type=float, default=40.0, help="seconds the link is silent (--fault silent)")
    ap.add_argument("--storm", type=float, default=10.0, help="least seconds counted as the storm")
    ap.add_argument("--window", type=int, default=8, help="requests in the rolling store share")
    ap.add_argument("--traces", type=int, default=8, help="LMCache miniswe agent runs replayed side by side")
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=30720, help="b's max_model_len (the runs' prompts grow to 26k)")
    ap.add_argument("--kv-tokens", type=int, default=32768, help="b's own KV cache, tokens (at least --max-len)")
    ap.add_argument("--engine-python", default=str(REPO / ".engines-cpu" / "bin" / "python"))
    ap.add_argument("--output", type=Path)
    a = ap.parse_args()
    ready = prepare("fabric_storm", a.output, a.engine_python)
    if ready is None:
        return 2
    work, model = ready
    data = trace_folder(None, a.traces, work)
    out = work / "replay"
    with Fabric(["s", "b"]) as fab:
        w = start_world(fab, work, a.engine_python, model, a.kv_tokens, a.max_len, 2.0)
        restarted: list[float] = []
        ended = threading.Event()
        try:
            before = engine_counts(w.urls["b"])
            cmd = [sys.executable, "-m", "kvtier", "replay", "--base-url", w.urls["b"] + "/v1", "--model", "tiny",
                   "--dataset", str(data), "--concurrency", str(a.concurrency), "--duration", str(a.duration),
                   "--max-tokens-cap", "16", "--skip-too-long", "--tokenizer", f"hf:{model}",
                   "--engine-log", str(work / "b.requests.jsonl"), "--output", str(out)]  # fmt: skip
            replay = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(work / "replay.log", "wb"))
            t0 = time.time()

            def crash() -> None:
                if ended.wait(a.restart_at):
                    return
                restarted.append(time.time())
                if a.fault == "silent":
                    end = w.links["b"].dev_b  # the store's end: b's packets to s go nowhere, s sends nothing
                    fab.run("s", "ip", "link", "set", end, "down")
                    print(f"b's link silent at {restarted[0] - t0:.1f} s of the replay", flush=True)
                    ended.wait(a.silent_for)
                    fab.run("s", "ip", "link", "set", end, "up")
                    print(f"b's link back at {time.time() - t0:.1f} s", flush=True)
                    return
                took = w.restart_store()
                print(f"store restarted at {restarted[0] - t0:.1f} s of the replay (answering after {took:.2f} s)",
                      flush=True)  # fmt: skip
                ended.wait()  # the new server dies with the thread that started it (PR_SET_PDEATHSIG): live on

            threading.Thread(target=crash, daemon=True).start()
            replay.wait(timeout=a.duration + 600)
            after = engine_counts(w.urls["b"])
            with urllib.request.urlopen(w.urls["s"] + "/metrics", timeout=10) as r:
                text = r.read().decode().splitlines()
            served = [ln for ln in text if ln.startswith("kvtier_block_server_requests_total")]
            print("the restarted store served: " + "; ".join(served), flush=True)
        finally:
            stop_world(w)
            ended.set()
    if not restarted:
        print("fabric_storm: the replay ended before the restart", file=sys.stderr)
        return 1
    recs = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines() if line.strip()]
    t_restart = restarted[0]
    ok = sorted((r for r in recs if r["status"] == "ok" and r.get("start_unix_s")), key=lambda r: r["start_unix_s"])
    failed = sum(1 for r in recs if r["status"] == "error")

    def store_share(r: dict) -> float:
        src = r.get("prompt_sources") or {}
        return sum(v for k, v in src.items() if k.startswith("shared-")) / max(1, r.get("prompt_tokens") or 1)

    pre = [r for r in ok if r["start_unix_s"] < t_restart]
    level = statistics.mean(store_share(r) for r in pre[-4 * a.window :]) if pre else 0.0
    post = [r for r in ok if r["start_unix_s"] >= t_restart]
    first_hit = next((r["start_unix_s"] for r in post if store_share(r) > 0), None)
    storm_end = max(t_restart + max(a.storm, a.silent_for if a.fault == "silent" else 0.0), first_hit or t_restart)
    recover = None
    for i in range(a.window, len(post) + 1):
        win = post[i - a.window : i]
        if statistics.mean(store_share(r) for r in win) >= level / 2:
            recover = win[-1]["start_unix_s"] - t_restart
            break
    storm = [r for r in post if r["start_unix_s"] < storm_end]
    later = [r for r in post if r["start_unix_s"] >= storm_end]

    def line(name: str, rs: list[dict]) -> str:
        tt = [r["ttft_s"] for r in rs if r.get("ttft_s") is not None]
        share = statistics.mean(store_share(r) for r in rs) if rs else float("nan")
        return (f"{name}: {len(rs)} requests, TTFT p50 {p(tt, 0.5):.3f} s p95 {p(tt, 0.95):.3f} s, "
                f"store share of prompt tokens {share:.2f}")  # fmt: skip

    for name, rs in (("before", pre), ("storm", storm), ("after", later)):
        print(line(name, rs))
    d = {k: after[k] - before[k] for k in after}
    rec = "nan" if recover is None else f"{recover:.1f}"
    print(f"fabric_storm ttft_p95_before_s={p([r['ttft_s'] for r in pre], 0.95):.3f} "
          f"ttft_p95_storm_s={p([r['ttft_s'] for r in storm], 0.95):.3f} "
          f"ttft_p95_after_s={p([r['ttft_s'] for r in later], 0.95):.3f} recover_s={rec} failed_requests={failed} "
          f"failed_loads={d['failed_loads']:.0f} server_errors={d['server_errors']:.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
