"""How long does ``kvtier report`` take on 100k-request results? (#19 aims under 5 s.)

Two inputs of ``--requests`` requests each, made first (not timed):

* a bench result: a whole ``kvtier bench`` run (tiny-1b, GPU 1 GB > CPU 2 GB > storage 20 GB, no think or
  generation time, 16 users) stopped by ``--max-requests``, in I/O trace mode (every decision made, no
  bytes moved: 100k requests with real I/O take this host's disk over 15 minutes); its JSON carries
  every request's latencies, as a timed run's does;
* a replay result: a real short ``kvtier replay`` against ``kvtier sim`` (offload cpu), whose
  requests.jsonl is then grown to ``--requests`` records by repeating its records with their users,
  turns and times shifted (so the report reads and plots that many), and whose summary.json is
  recomputed from them by the replay's own summarizer.

Then ``kvtier report BENCH REPLAY --html`` runs ``--repeats`` times in a fresh process each (imports
included, as a user runs it); the median wall time counts.

Last line: ``report_speed requests=.. seconds=.. plots=..`` (aim: seconds < 5).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_peer, wait_port_file  # noqa: E402


def kvtier(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], check=True, text=True, capture_output=True,
                          cwd=REPO, **kw)  # type: ignore[call-overload]  # fmt: skip


def bench_result(work: Path, n: int) -> Path:
    cfg = work / "no_think.yaml"
    cfg.write_text("user_templates:\n" + "".join(f"  {p}: {{think_time_range: [0, 0]}}\n" for p in ("chatbot",
                   "coding", "document")))  # fmt: skip
    (work / "cache").mkdir()
    out = work / "bench.json"
    kvtier("bench", "--model", "tiny-1b", "--num-users", "16", "--duration", "900", "--max-requests", str(n),
           "--gpu-mem-gb", "1", "--cpu-mem-gb", "2", "--storage-capacity-gb", "20", "--generation-mode", "none",
           "--config", str(cfg), "--seed", "1", "--progress", "none", "--cache-dir", str(work / "cache"),
           "--io-trace-log", str(work / "trace.csv"), "--output", str(out))  # fmt: skip
    return out


def replay_result(work: Path, n: int) -> Path:
    from kvtier.replay.summary import summarize
    from kvtier.results.replay import ReplayResult
    from tests.integration.test_launch import conversations

    data = conversations(work / "data", users=8, turns=5, max_tokens=16)
    port_file = work / "port"
    argv = [sys.executable, "-m", "kvtier", "sim", "--preset", "cpu-test", "--port", "0", "--port-file",
            str(port_file), "--offload", "cpu", "--cpu-offload-gb", "0.5"]  # fmt: skip
    sim = start_peer(argv, "kvtier sim", cwd=REPO)
    try:
        port = wait_port_file(port_file, sim)
        out = work / "replay"
        kvtier("replay", "--base-url", f"http://127.0.0.1:{port}/v1", "--model", "tiny-1b",
               "--dataset", str(data), "--num-rounds", "5", "--concurrency", "4", "--gap-scale", "0",
               "--output", str(out), "--scrape-interval", "0.5")  # fmt: skip
    finally:
        sim.stop(grace_s=30)
    base = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    span = max(r["start_unix_s"] for r in base) - min(r["start_unix_s"] for r in base) + 1.0
    records = []
    k = 0
    while len(records) < n:
        for r in base:
            records.append({**r, "user": f"{r['user']}#{k}", "start_unix_s": r["start_unix_s"] + k * span})
            if len(records) == n:
                break
        k += 1
    users = len({r["user"] for r in records})
    res = ReplayResult.model_validate_json((out / "summary.json").read_text())
    res.summary = res.summary.model_validate(summarize(records, users, 5, res.wall_s * k))
    with (out / "requests.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    (out / "summary.json").write_text(res.model_dump_json(indent=1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--keep", metavar="DIR", help="make the inputs in DIR and keep them (reused when there)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-report-speed-") as tmp:
        work = Path(a.keep or tmp)
        work.mkdir(parents=True, exist_ok=True)
        have = (work / "bench.json").is_file() and (work / "replay" / "summary.json").is_file()
        bench = work / "bench.json" if have else bench_result(work, a.requests)
        replay = work / "replay" if have else replay_result(work, a.requests)
        print(f"inputs: {bench} ({bench.stat().st_size:,} bytes), {replay}/requests.jsonl "
              f"({(replay / 'requests.jsonl').stat().st_size:,} bytes)", flush=True)  # fmt: skip
        times, line = [], ""
        for i in range(a.repeats):
            t0 = time.perf_counter()
            p = kvtier("report", str(bench), str(replay), "--html", str(work / "r.html"))
            times.append(time.perf_counter() - t0)
            line = p.stdout.strip()
            print(f"repeat {i + 1}: {times[-1]:.2f} s ({line})", flush=True)
    plots = line.split(" results, ")[1].split(" plots")[0] if " plots" in line else "0"
    print(f"report_speed requests={a.requests} seconds={statistics.median(times):.2f} plots={plots}")


if __name__ == "__main__":
    main()
