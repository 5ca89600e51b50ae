"""kvtier's cache server: one offload tier (the real engine) shared by several sim replicas.

The sim-engine counterpart of an LMCache multiprocess server: it owns the CPU (and, for NVMe, a
small CPU staging tier in front of the file tier) and serves chunk lookups, loads and stores to
every sim replica over a Unix socket, so a conversation stored by one replica is an external hit
on another. Like LMCache in MP mode, KV bytes do not cross the socket: the server performs the
real tier read into its own buffer (standing in for the copy into the engine's GPU memory) and
answers with what it found and how long the I/O took; the replica measures the whole round trip.

Data API (JSON over HTTP on the Unix socket): POST /v1/lookup {keys} -> {found}; POST /v1/load
{keys} -> {found, bytes, seconds}; POST /v1/store {keys, chunk_bytes} -> {stored, bytes, seconds};
GET /v1/info -> geometry and usage. /health and /metrics (lmcache_mp_* names) are served on the
socket and on a TCP port of 127.0.0.1, for health checks and scrapers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import web

from kvtier.sim.metrics import CONTENT_TYPE, CacheMetrics, exposition
from kvtier.sim.model import Offload


def make_cache_app(o: Offload, server_id: str) -> web.Application:
    m = CacheMetrics()
    chunk_bytes = o.cfg.chunk_tokens * o.kvpt

    def refresh() -> dict[str, Any]:
        m.lmcache.update(o)
        return {
            **(o.usage() or {}),
            "loaded_bytes": o.loaded_bytes,
            "load_seconds": o.load_seconds,
            "stored_bytes": o.stored_bytes,
            "store_seconds": o.store_seconds,
        }

    async def keys_of(request: web.Request) -> list[str]:
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="body is not JSON") from None
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise web.HTTPBadRequest(text="'keys' must be a list of non-empty strings")
        if isinstance(body, dict) and body.get("chunk_bytes") not in (None, chunk_bytes):
            raise web.HTTPBadRequest(
                text=f"chunk_bytes {body.get('chunk_bytes')} differs from this server's "
                f"{chunk_bytes}: the replicas and the cache server must serve one model"
            )
        return keys

    async def lookup(request: web.Request) -> web.Response:
        keys = await keys_of(request)
        n = await asyncio.to_thread(o.lookup, keys)
        m.req.inc(len(keys) * o.cfg.chunk_tokens)
        m.hit.inc(n * o.cfg.chunk_tokens)
        return web.json_response({"found": n})

    async def load(request: web.Request) -> web.Response:
        keys = await keys_of(request)
        m.clients.inc()
        try:
            dt, nbytes, found = await asyncio.to_thread(o.load, keys)
        finally:
            m.clients.dec()
        m.loaded.inc(found)
        return web.json_response({"found": found, "bytes": nbytes, "seconds": dt})

    async def store(request: web.Request) -> web.Response:
        keys = await keys_of(request)
        t0 = time.perf_counter()
        stored = await asyncio.to_thread(o.save, keys)
        m.stored.inc(stored // chunk_bytes)
        return web.json_response({"bytes": stored, "seconds": time.perf_counter() - t0})

    async def info(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "server": server_id,
                "kind": o.cfg.kind,
                "chunk_tokens": o.cfg.chunk_tokens,
                "kv_bytes_per_token": o.kvpt,
                "model": o.scope.model_name,
                **refresh(),
            }
        )

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(request: web.Request) -> web.Response:
        refresh()
        return web.Response(body=exposition(m.registry), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.add_routes(
        [
            web.post("/v1/lookup", lookup),
            web.post("/v1/load", load),
            web.post("/v1/store", store),
            web.get("/v1/info", info),
            web.get("/health", health),
            web.get("/metrics", metrics),
        ]
    )
    return app


__all__ = ["make_cache_app"]
