"""kvtier sim's own CPU cost per streamed token under 50 concurrent streams.

Starts ``kvtier sim`` (preset cpu-test, tpot 1 ms, no offload) in a child process, runs N concurrent
streaming chat requests with an aiohttp client, and divides the server process's CPU time
(user + system, from /proc/<pid>/stat) spent during the load by the tokens it streamed.
Set SIMPROF="-m cProfile -o FILE" to profile the server process.
Last line: ``sim_overhead streams=50 tokens=... server_cpu_us_per_token=... target_us=30 ok=true|false``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import start_peer, wait_port_file

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


async def one(session: aiohttp.ClientSession, url: str, tokens: int, i: int) -> int:
    body = {
        "model": "tiny-1b",
        "messages": [{"role": "user", "content": f"stream {i} please"}],
        "max_tokens": tokens,
        "stream": True,
    }
    n = 0
    async with session.post(url, json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                d = json.loads(line[6:])
                if d["choices"] and d["choices"][0]["delta"].get("content"):
                    n += 1
    return n


async def load(url: str, streams: int, tokens: int) -> int:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        return sum(await asyncio.gather(*(one(s, url, tokens, i) for i in range(streams))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=2000, help="tokens per stream")
    ap.add_argument("--tpot-ms", type=float, default=1.0)
    ap.add_argument("--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"], help="the server's loop")
    a = ap.parse_args()
    port_file = Path(tempfile.mkdtemp()) / "port"
    proc = start_peer(
        [
            sys.executable,
            *os.environ.get("SIMPROF", "").split(),
            "-m",
            "kvtier",
            "sim",
            "--preset",
            "cpu-test",
            "--gpu-kv-gb",
            "4",
            "--tpot-ms",
            str(a.tpot_ms),
            "--batch-slowdown",
            "0",
            "--port",
            "0",
            "--event-loop",
            a.event_loop,
            "--port-file",
            str(port_file),
        ],
        "kvtier sim",
    )
    try:
        url = f"http://127.0.0.1:{wait_port_file(port_file, proc, 10)}/v1/chat/completions"
        asyncio.run(load(url, 4, 10))  # warm up
        c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
        tokens = asyncio.run(load(url, a.streams, a.tokens))
        c1, t1 = cpu_seconds(proc.pid), time.perf_counter()
    finally:
        proc.stop(grace_s=20)
    us = (c1 - c0) / tokens * 1e6
    print(
        f"{a.streams} streams x {a.tokens} tokens in {t1 - t0:.2f} s: {tokens / (t1 - t0):,.0f} tokens/s streamed, "
        f"server CPU {c1 - c0:.2f} s"
    )
    print(
        f"sim_overhead streams={a.streams} tokens={tokens} server_cpu_us_per_token={us:.1f} target_us=30 "
        f"ok={'true' if us <= 30 else 'false'}"
    )


if __name__ == "__main__":
    main()
