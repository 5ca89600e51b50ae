"""How much latency does kvtier replay's client itself add, at 256 concurrent streams?

A minimal aiohttp test server (in a child process, on 127.0.0.1) streams every token at a known
schedule: the first after FIRST_MS, then one every ITL_MS, each chunk stamped with the server's send
time. kvtier's replay client (``kvtier.replay.client.stream_request``) consumes 256 streams at once; for
every token the added latency is (client receive time - server send time) on the same clock
(CLOCK_MONOTONIC is shared by processes). The client's CPU time per token is reported too.

Two schedules, each against its own server process (always the stock asyncio loop):
- spread: stream k is offset by k/256 of an ITL, so the server emits 256 tokens per ITL at an even
  rate (the issue's "server that streams at a known rate").
- burst: all 256 streams emit in the same instant (one batch step handed over at once).
Each is measured with the client on the stock asyncio loop and, when installed, on uvloop (what
kvtier replay uses by default). On this 2-vCPU host the stock loop's burst p50 was 17-21 ms and
uvloop's ~0.1 ms, at about the same client CPU per token.
Last line: ``replay_overhead loop=... streams=256 added_latency_p50_ms=... p99_ms=... burst_p50_ms=...
burst_p99_ms=... asyncio_burst_p50_ms=... client_cpu_us_per_token=... ok=true|false`` for the loop
kvtier replay uses (ok: spread and burst p50 both < 1 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def serve(port_q: mp.Queue[int], first_ms: float, itl_ms: float, tokens: int, phases: int) -> None:
    seen = [0]

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = time.monotonic()
        # phases=1: every stream emits at the same instant (a whole batch step at once, the worst
        # case for any single-threaded client); phases=N: stream k is offset by (k mod N)/N of an ITL.
        offset = (seen[0] % phases) / phases * itl_ms
        seen[0] += 1
        for i in range(tokens):
            due = start + (first_ms + offset + i * itl_ms) / 1e3
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            ev = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}], "sent": time.monotonic()}
            await resp.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port_q.put(runner.addresses[0][1])
        await asyncio.Event().wait()

    asyncio.run(main())


async def consume(url: str, streams: int) -> list[float]:
    import kvtier.replay.client as client
    from kvtier.replay.client import ClientConfig

    added: list[float] = []
    real_loads = json.loads

    def stamping_loads(data: str) -> dict:  # note receive time against the server's send stamp
        ev = real_loads(data)
        if "sent" in ev:
            added.append(time.monotonic() - ev["sent"])
        return ev

    client.json.loads = stamping_loads  # type: ignore[assignment]
    cfg = ClientConfig(url, "m", streams)
    from kvtier.replay.datasets import VirtualUser

    user = VirtualUser("u", "s", 0, ())
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        done = await asyncio.gather(
            *(client.stream_request(s, cfg, user, 0, [{"role": "user", "content": "x"}], 8) for _ in range(streams))
        )
    recs = [rec for rec, _ in done]
    client.json.loads = real_loads  # type: ignore[assignment]
    bad = [r for r in recs if r["status"] != "ok"]
    if bad:
        raise SystemExit(f"{len(bad)} streams failed: {bad[0]['error']}")
    return added


def measure(a: argparse.Namespace, phases: int, loop: str) -> tuple[np.ndarray, float]:
    """Added latency (ms) per token and the client's CPU per token (µs) against one server process
    (always the stock asyncio loop); the client runs on ``loop`` (asyncio or uvloop)."""
    q: mp.Queue[int] = mp.Queue()
    proc = mp.Process(target=serve, args=(q, a.first_ms, a.itl_ms, a.tokens, phases), daemon=True)
    proc.start()
    factory = None
    if loop == "uvloop":
        import uvloop

        factory = uvloop.new_event_loop
    try:
        port = q.get(timeout=30)
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(consume(f"http://127.0.0.1:{port}/v1", 8))  # warm up
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            added = np.array(runner.run(consume(f"http://127.0.0.1:{port}/v1", a.streams))) * 1e3
            r1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        proc.terminate()
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return added, cpu / max(1, added.size) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--first-ms", type=float, default=50.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    a = ap.parse_args()
    from kvtier.replay.client import event_loop_kind

    loops = ["asyncio"] + (["uvloop"] if event_loop_kind() == "uvloop" else [])
    res = {}
    for loop in loops:
        for mode, phases in (("burst", 1), ("spread", a.streams)):
            added, cpu_us = measure(a, phases, loop)
            p50, p99 = np.percentile(added, [50, 99])
            res[loop, mode] = (p50, p99, cpu_us)
            print(
                f"{loop:7s} {mode:6s}: {a.streams} streams x {a.tokens} tokens at {a.itl_ms} ms/token: "
                f"{added.size} tokens, client-added latency p50 {p50:.3f} ms p99 {p99:.3f} ms mean "
                f"{added.mean():.3f} ms; client CPU {cpu_us:.1f} us/token",
                flush=True,
            )
    used = loops[-1]  # what kvtier replay runs on here
    p50, p99, cpu_us = res[used, "spread"]
    print(
        f"replay_overhead loop={used} streams={a.streams} added_latency_p50_ms={p50:.3f} p99_ms={p99:.3f} "
        f"burst_p50_ms={res[used, 'burst'][0]:.3f} burst_p99_ms={res[used, 'burst'][1]:.3f} "
        f"asyncio_burst_p50_ms={res['asyncio', 'burst'][0]:.3f} client_cpu_us_per_token={cpu_us:.1f} "
        f"ok={'true' if p50 < 1.0 and res[used, 'burst'][0] < 1.0 else 'false'}"
    )


if __name__ == "__main__":
    main()
