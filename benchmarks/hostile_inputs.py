"""How long kvtier takes on the hostile inputs #28 found, measured here (the tests assert what was recorded,
not seconds): a crafted 70 KB requests.jsonl line in ``kvtier report`` (the lazy regular expression it replaced
ran past 30 s on it), ``kvtier trace stats`` on two rows a billion seconds apart (its timeline once had a bin
per second), and a ``kvtier bench`` on a hung Redis stopped by SIGINT (28 s before the tier's connections were
shut down on an interrupt), the memory ``read_trace`` holds per row (about 330 bytes in Python lists before it
kept typed columns), and the worst TTFT of ``kvtier sim --offload redis`` on a hung Redis (55-58 s before the
offload breaker); and #41's: a shared-namespace lookup of a forged 4M-part description, a `--duration 2` bench on
a hung Redis, a 2-token request among 64 dribbling clients of the sim, and requests.jsonl after responses with
3 MB of decomposition names. Last line: ``hostile_inputs report_line_s=… trace_span_s=… ctrl_c_exit_s=…
trace_bytes_per_row=… hung_redis_sim_ttft_max_s=… hung_redis_sim_exit_s=… forged_lookup_s=…
forged_lookup_peak_mb=… hung_redis_duration2_exit_s=… dribbled_small_request_s=…
hostile_decomposition_jsonl_bytes=…``.
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
from kvtier.errors import DatasetError
from kvtier.iotrace.stats import trace_stats
from kvtier.results.records import ReplayRecords
from kvtier.tracefile import HEADER, read_trace


def report_line(d: Path) -> float:
    evil = '{"a": "' + '\\"turn\\": 1, ' * 2000 + '", ' + '"turn": 1, "status": "x", ' * 2000 + '"z": 1}\n'
    p = d / "requests.jsonl"
    p.write_text(evil)
    t0 = time.perf_counter()
    try:
        ReplayRecords.read(p)
    except DatasetError:  # refused by its line (not a record): what matters is how long finding that takes
        pass
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


def forged_lookup(d: Path) -> tuple[float, int]:
    """#41 item 2: a shared-namespace lookup of an 8 MiB entry whose description another writer forged to 4M parts
    (12-15 s and 1.47 GB a lookup before): the seconds the lookup takes and its peak Python memory."""
    import tracemalloc

    from kvtier.engine.backend import aligned_buffer
    from kvtier.engine.redis_tier import RedisTier
    from kvtier.engine.resp import RespConnection
    from kvtier.errors import ForeignEntry
    from kvtier.localservers import redis_server

    with redis_server() as srv:
        tier = RedisTier(srv.url, 1 << 30, connections=2, namespace="bench", scope="m")
        c = RespConnection(srv.url, None, 10.0)
        c.call("SET", f"{tier._base('k')}:m", "w" + " 2" * 4_000_000)
        tracemalloc.start()
        t0 = time.perf_counter()
        try:
            tier.read_shared("k", aligned_buffer(1 << 22), 8 << 20)
        except ForeignEntry:
            pass
        took = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        tier.purge()
        tier.close()
        c.close()
    return took, peak


def hung_redis_deadline(d: Path) -> float:
    """#41 item 6: a `--duration 2` bench on a hung Redis with --remote-timeout 120 (a `--duration 5` run took 36 s at
    the default 30 s before): the seconds from start to exit."""
    from tests.unit.engine.test_remote_cleanup_trust import Hung, _bench_argv

    srv = Hung()
    try:
        t0 = time.perf_counter()
        subprocess.run(_bench_argv(srv, d, "--duration", "2", "--remote-timeout", "120"), cwd=REPO, timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        return time.perf_counter() - t0
    finally:
        srv.close()


def dribbled_sim(d: Path, dribblers: int = 64) -> float:
    """#41 item 3: a 2-token request sent among 64 clients dribbling their bodies (it waited 27-30 s and got 429
    before): its seconds."""
    import socket

    from tests.integration.test_sim import chat, start_sim, stop_sim

    sim = start_sim(d, "--body-timeout", "20")
    socks = []
    try:
        for _ in range(dribblers):
            s = socket.create_connection(("127.0.0.1", sim.port), timeout=30)
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
            socks.append(s)
        t0 = time.perf_counter()
        code, _, _ = sim.post("/v1/chat/completions", chat("a small request", max_tokens=2))
        took = time.perf_counter() - t0
        assert code == 200, code
        return took
    finally:
        for s in socks:
            s.close()
        stop_sim(sim)


def hostile_decomposition(d: Path, requests: int = 20) -> int:
    """#41 item 4: bytes of requests.jsonl after `requests` responses each carrying 3 MB of decomposition part names
    (100 such made 368 MB before)."""
    from tests.integration.test_replay_hostile import Hostile, replay_cmd, sessions

    server = Hostile(["decomposition-names"])
    try:
        subprocess.run(replay_cmd(server, sessions(d / "s.jsonl", requests), d / "out"), cwd=REPO, timeout=300,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    finally:
        server.close()
    return (d / "out" / "requests.jsonl").stat().st_size


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="kvtier-hostile-") as tmp:
        d = Path(tmp)
        r, t, c = report_line(d), trace_span(d), ctrl_c_exit(d)
        b, (h, x) = trace_bytes_per_row(d), hung_sim_ttft(d)
        (fl, fm), hd = forged_lookup(d), hung_redis_deadline(d)
        ds, hb = dribbled_sim(d), hostile_decomposition(d)
    print(
        f"hostile_inputs report_line_s={r:.3f} trace_span_s={t:.3f} ctrl_c_exit_s={c:.2f} "
        f"trace_bytes_per_row={b:.0f} hung_redis_sim_ttft_max_s={h:.2f} hung_redis_sim_exit_s={x:.2f} "
        f"forged_lookup_s={fl:.3f} forged_lookup_peak_mb={fm / 1e6:.1f} hung_redis_duration2_exit_s={hd:.1f} "
        f"dribbled_small_request_s={ds:.3f} hostile_decomposition_jsonl_bytes={hb}"
    )


if __name__ == "__main__":
    main()
