"""How long kvtier takes on the hostile inputs #28 found, measured here (the tests assert what was recorded,
not seconds): a crafted 70 KB requests.jsonl line in ``kvtier report`` (the lazy regular expression it replaced
ran past 30 s on it), ``kvtier trace stats`` on two rows a billion seconds apart (its timeline once had a bin
per second), and a ``kvtier bench`` on a hung Redis stopped by SIGINT (28 s before the tier's connections were
shut down on an interrupt), the memory ``read_trace`` holds per row (about 330 bytes in Python lists before it
kept typed columns), and the worst TTFT of ``kvtier sim --offload redis`` on a hung Redis (55-58 s before the
offload breaker). Last line: ``hostile_inputs report_line_s=… trace_span_s=… ctrl_c_exit_s=…
trace_bytes_per_row=… hung_redis_sim_ttft_max_s=… hung_redis_sim_exit_s=…``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO

sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO))
from kvtier.iotrace.stats import trace_stats
from kvtier.report.figures import ReplayRecords
from kvtier.telemetry.iotrace import HEADER, read_trace


def report_line(d: Path) -> float:
    evil = '{"a": "' + '\\"turn\\": 1, ' * 2000 + '", ' + '"turn": 1, "status": "x", ' * 2000 + '"z": 1}\n'
    p = d / "requests.jsonl"
    p.write_text(evil)
    t0 = time.perf_counter()
    ReplayRecords.read(p)
    return time.perf_counter() - t0


def trace_span(d: Path) -> float:
    p = d / "wide.csv"
    p.write_text(HEADER + "1.0,Write,100,Tier-1,a,Prefill\n1000000001.0,Read,100,Tier-1,a,Decode\n")
    t0 = time.perf_counter()
    trace_stats(read_trace(str(p)), interval_s=1.0)
    return time.perf_counter() - t0


def ctrl_c_exit(d: Path) -> float:
    from tests.conftest import TINY_TEMPLATES
    from tests.unit.engine.test_remote_cleanup_trust import Hung

    srv = Hung()
    cfg = d / "tiny.yaml"
    cfg.write_text(json.dumps({"user_templates": TINY_TEMPLATES}))
    try:
        p = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "bench", "--model", "tiny-1b", "--num-users", "2", "--duration", "60",
             "--gpu-mem-gb", "0", "--cpu-mem-gb", "0.004", "--redis-url", f"redis://127.0.0.1:{srv.port}",
             "--redis-mem-gb", "0.5", "--generation-mode", "none", "--progress", "none", "--cache-dir", str(d),
             "--output", str(d / "r.json"), "--config", str(cfg), "--noise-mb", "16", "--io-chunk-mb", "4"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        )  # fmt: skip
        time.sleep(4)
        t0 = time.perf_counter()
        p.send_signal(signal.SIGINT)
        p.wait(timeout=120)
        return time.perf_counter() - t0
    finally:
        srv.close()


def trace_bytes_per_row(d: Path, rows: int = 1_000_000) -> float:
    """Peak Python memory of read_trace per row, on a trace of ``rows`` operations over 1000 keys."""
    import tracemalloc

    p = d / "long.csv"
    with open(p, "w") as f:
        f.write(HEADER)
        row = "{:.6f},Write,{},Tier-2,u{}/c0,Prefill\n"
        rows_text = (row.format(1764530000 + i * 1e-3, 131072 + i, i % 1000) for i in range(rows))
        f.writelines(rows_text)
    tracemalloc.start()
    trace = read_trace(str(p))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(trace) == rows
    return peak / rows


def hung_sim_ttft(d: Path, requests: int = 40, gap_s: float = 0.5) -> tuple[float, float]:
    """The longest TTFT of ``requests`` sequential requests ``gap_s`` apart (past the default --remote-timeout of
    10 s, so stores fail and the breaker opens) to ``kvtier sim --offload redis`` on a hung Redis: 55-58 s before
    the sim's stores had their own threads and the offload breaker; and the seconds from SIGTERM to its exit."""
    from tests.integration.test_sim import chat, start_sim
    from tests.unit.engine.test_remote_cleanup_trust import Hung

    srv = Hung()
    sim = start_sim(
        d, "--offload", "redis", "--redis-url", f"redis://127.0.0.1:{srv.port}", "--redis-mem-gb", "0.5",
        "--staging-gb", "0.001",
    )  # fmt: skip
    worst = 0.0
    try:
        for i in range(requests):
            t0 = time.perf_counter()
            code, _, _ = sim.post("/v1/chat/completions", chat(" ".join(f"p{i}w{j}" for j in range(300)), max_tokens=1))
            assert code == 200
            worst = max(worst, time.perf_counter() - t0)
            time.sleep(gap_s)
    finally:
        t0 = time.perf_counter()
        sim.proc.send_signal(signal.SIGTERM)
        sim.proc.communicate(timeout=120)
        exit_s = time.perf_counter() - t0
        srv.close()
    return worst, exit_s


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-hostile-") as tmp:
        d = Path(tmp)
        r, t, c = report_line(d), trace_span(d), ctrl_c_exit(d)
        b, (h, x) = trace_bytes_per_row(d), hung_sim_ttft(d)
    print(
        f"hostile_inputs report_line_s={r:.3f} trace_span_s={t:.3f} ctrl_c_exit_s={c:.2f} "
        f"trace_bytes_per_row={b:.0f} hung_redis_sim_ttft_max_s={h:.2f} hung_redis_sim_exit_s={x:.2f}"
    )


if __name__ == "__main__":
    main()
