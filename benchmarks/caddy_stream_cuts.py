"""Streams Caddy cuts at their start in front of real vLLM, with the launch's Caddyfile as it was and as it is (#41
item 11). Two real vLLM 0.32 CPU replicas (a ``kvtier model make`` model) behind Caddy 2.6 (``least_conn``), four
clients on aiohttp (the replay's client) sending short streamed chat completions one after another with idle gaps
drawn from 0, 0.1, 1, 4.9, 5, 5.1 and 6 s (around uvicorn's 5 s keep-alive under vLLM). A stream is cut when its
answer is 200 with no ``[DONE]``; Caddy's log then says "aborting with incomplete response ... use of closed network
connection". ``--variants`` picks the Caddyfiles: ``old`` (the launch's before #41: no request buffering), ``new``
(the launch's: ``buffer_requests``), ``keep`` (old, with idle upstream connections dropped after 2 s: more fresh
connections). Measured here, one run each: old 3 of 320 cut (twice); keep 2 of the first 72; new 0 of 640 (and
0 of 640 with ``keepalive 2s`` added, the first candidate fix). Last line: ``caddy_stream_cuts old=cut/sent
new=cut/sent ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, ensure_tool, start_peer

sys.path.insert(0, str(REPO / "src"))
from kvtier.launch import cpu_engine
from kvtier.launch.caddy import caddyfile
from kvtier.launch.devices import cpu_inventory
from kvtier.launch.procs import free_ports, http_ok
from kvtier.modelmaker import Geometry, make_model

GAPS_S = (0.0, 0.0, 0.1, 1.0, 4.9, 5.0, 5.1, 6.0)
BUFFER = "\t\tbuffer_requests\n"
KEEP = "\t\ttransport http {\n\t\t\tkeepalive 2s\n\t\t}\n"


def variant_text(text: str, variant: str) -> str:
    assert BUFFER in text and text.endswith("\t}\n}\n"), "the launch's Caddyfile, as this benchmark knows it"
    if variant == "new":
        return text
    old = text.replace(BUFFER, "")
    return old if variant == "old" else old[: -len("\t}\n}\n")] + KEEP + "\t}\n}\n"


async def _clients(port: int, n: int, seed: int) -> tuple[int, int]:
    import aiohttp

    rnd = random.Random(seed)
    cut = sent = 0

    async def user(session: aiohttp.ClientSession, u: int) -> None:
        nonlocal cut, sent
        for j in range(n // 4):
            body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {u} {j} " * rnd.randint(5, 60)}],
                    "max_tokens": 4, "stream": True}  # fmt: skip
            sent += 1
            async with session.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body) as r:
                data = b"".join([c async for c in r.content.iter_any()])
                cut += not (r.status == 200 and b"[DONE]" in data)
            await asyncio.sleep(rnd.choice(GAPS_S))

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(*(user(s, u) for u in range(4)))
    return cut, sent


def run(variant: str, n: int, work: Path, engine_python: str) -> tuple[int, int, int]:
    """(streams cut, streams sent, Caddy's "aborting with incomplete response" lines) for one Caddyfile."""
    d = work / variant
    d.mkdir(parents=True)
    model = make_model(d / "tiny", Geometry())
    ports = free_ports(3)
    srvs = []
    for i in range(2):
        (d / f"r{i}").mkdir()
        kv_bytes = 8192 * Geometry().kv_bytes_per_token
        srvs.append(cpu_engine.start(engine_python, str(model), ports[i], d / f"r{i}", kv_bytes, 4096,
                                     cpu_inventory(None).devices))  # fmt: skip
    caddy = None
    try:
        for s in srvs:
            s.wait_healthy(900)
        text = variant_text(caddyfile("cpu", ports[2], [f"127.0.0.1:{p}" for p in ports[:2]]), variant)
        (d / "Caddyfile").write_text(text)
        home = d / "home"
        env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / "c"), "XDG_DATA_HOME": str(home / "d")}
        caddy = start_peer(["caddy", "run", "--config", str(d / "Caddyfile"), "--adapter", "caddyfile"], "caddy",
                           log=d / "caddy.log", env=env)  # fmt: skip
        while not http_ok(f"http://127.0.0.1:{ports[2]}/health"):
            time.sleep(0.2)
        cut, sent = asyncio.run(_clients(ports[2], n, seed=len(variant)))
    finally:
        if caddy is not None:
            caddy.stop(grace_s=30)
        for s in srvs:
            s.stop()
    aborted = sum(
        1 for line in (d / "caddy.log").read_text().splitlines()
        if line.startswith("{") and json.loads(line).get("msg") == "aborting with incomplete response"
    )  # fmt: skip
    return cut, sent, aborted


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-python", default=str(REPO / cpu_engine.DEFAULT_PYTHON))
    ap.add_argument("--requests", type=int, default=320, help="streams per variant")
    ap.add_argument("--variants", default="old,new", help="a comma list of old, new, keep")
    a = ap.parse_args()
    if not Path(a.engine_python).exists():
        raise SystemExit(f"{a.engine_python}: missing (bash scripts/install-engines.sh cpu)")
    ensure_tool("caddy")
    work = Path(tempfile.mkdtemp(prefix="kvtier-caddy-cuts-"))
    got = {}
    try:
        for v in a.variants.split(","):
            cut, sent, aborted = run(v, a.requests, work, a.engine_python)
            print(f"{v}: {cut} of {sent} streams cut; Caddy logged {aborted} incomplete responses", flush=True)
            got[v] = f"{cut}/{sent}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("caddy_stream_cuts " + " ".join(f"{k}={v}" for k, v in got.items()))


if __name__ == "__main__":
    main()
