"""#58 item 11: does one engine's lookup flood still starve another engine's lookups on a shared cache server?

Three arms, each against a fresh ``kvtier cache-server`` (its own process, CPU tier), measured one after the other
in one run: **quiet** (only the honest engine), **flooded, unbounded** (``--keys-per-s 0``: the server as it was)
and **flooded, with the allowance** (the default ``--keys-per-s``). The honest engine is kvtier's scheduler client
(``ServerIndex``) asking about a 64-block prompt every 20 ms; the flood is ``--flooders`` processes, each sending
lookups of MAX_KEYS keys back to back on one connection. The figure is the honest lookup's p50 and p95, flooded
over quiet; the last line holds them all:
``blockserver_flood quiet_p50_ms=… unbounded_p50_ratio=… unbounded_p95_ratio=… allowance_p50_ratio=… …``.
Typical run: ``python benchmarks/blockserver_flood.py`` (about 30 s).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_peer, wait_port_file

GEOMETRY = {"block_bytes": 64 * 1024, "block_tokens": 16, "world_size": 1}


def flooder(path: str, stop, served) -> None:  # type: ignore[no-untyped-def]
    from kvtier.vllm.protocol import MAX_KEYS, connect

    c = connect(path, 30)
    c.call({"op": "hello", "role": "control", "engine": "flood", **GEOMETRY})
    keys = [f"m_{i:016x}" for i in range(MAX_KEYS)]
    while not stop.is_set():
        c.call({"op": "lookup", "keys": keys})
        with served.get_lock():
            served.value += MAX_KEYS
    c.close()


def honest(path: str, n: int) -> list[float]:
    from kvtier.vllm.client import ServerIndex

    ix = ServerIndex(path, lambda k: "m_" + k.hex(), {"engine": "honest", **GEOMETRY})
    prompt = [i.to_bytes(8, "big") for i in range(64)]
    out = []
    for _ in range(n):
        t = time.perf_counter()
        ix.lookup(prompt[0], lambda: prompt)  # the first ask carries the prompt's blocks, as the spec's does
        out.append(time.perf_counter() - t)
        time.sleep(0.02)
    return out


def arm(keys_per_s: float, flooders: int, n: int, work: Path) -> tuple[list[float], float]:
    sock, port_file = work / f"c{keys_per_s:.0f}-{flooders}.sock", work / f"p{keys_per_s:.0f}-{flooders}"
    server = start_peer(
        [sys.executable, "-m", "kvtier", "cache-server", "--socket", str(sock), "--offload", "cpu",
         "--cpu-offload-gb", "0.05", "--keys-per-s", str(keys_per_s), "--port-file", str(port_file)],
        "cache-server",
    )  # fmt: skip
    try:
        wait_port_file(port_file, server)
        stop, served = mp.Event(), mp.Value("q", 0)
        procs = [mp.Process(target=flooder, args=(str(sock), stop, served)) for _ in range(flooders)]
        for p in procs:
            p.start()
        time.sleep(1.5 if flooders else 0.0)  # past the allowance's first second of credit
        t0, base = time.monotonic(), served.value
        lat = honest(str(sock), n)
        rate = (served.value - base) / (time.monotonic() - t0)
        stop.set()
        for p in procs:
            p.join(30)
        return lat, rate
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flooders", type=int, default=1, help="flooding processes (one connection each)")
    ap.add_argument("--lookups", type=int, default=150, help="honest lookups per arm")
    ap.add_argument("--keys-per-s", type=float, default=200_000.0, help="the allowance of the third arm")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-flood-") as d:
        arms = {
            "quiet": arm(a.keys_per_s, 0, a.lookups, Path(d)),
            "unbounded": arm(0, a.flooders, a.lookups, Path(d)),
            "allowance": arm(a.keys_per_s, a.flooders, a.lookups, Path(d)),
        }
    fig = {k: (statistics.median(v), sorted(v)[int(0.95 * len(v))], r) for k, (v, r) in arms.items()}
    for k, (p50, p95, r) in fig.items():
        print(f"{k:>10}: honest lookup p50 {p50 * 1e3:.2f} ms, p95 {p95 * 1e3:.2f} ms; flood {r:,.0f} keys/s")
    q50, q95 = fig["quiet"][0], fig["quiet"][1]
    print(
        f"blockserver_flood flooders={a.flooders} quiet_p50_ms={q50 * 1e3:.2f} quiet_p95_ms={q95 * 1e3:.2f} "
        f"unbounded_p50_ratio={fig['unbounded'][0] / q50:.1f} unbounded_p95_ratio={fig['unbounded'][1] / q95:.1f} "
        f"allowance_p50_ratio={fig['allowance'][0] / q50:.1f} allowance_p95_ratio={fig['allowance'][1] / q95:.1f} "
        f"flood_keys_per_s_unbounded={fig['unbounded'][2]:.0f} flood_keys_per_s_allowance={fig['allowance'][2]:.0f}"
    )


if __name__ == "__main__":
    main()
