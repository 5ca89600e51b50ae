"""kvtier's cache server: one offload tier (the real engine) shared by several sim replicas.

The sim-engine counterpart of an LMCache multiprocess server: it owns the CPU (and, for NVMe, a
small CPU staging tier in front of the file tier) and serves chunk lookups, loads and stores to
every sim replica over a Unix socket, so a conversation stored by one replica is an external hit
on another. Like LMCache in MP mode, KV bytes do not cross the socket: the server performs the
real tier read into its own buffer (standing in for the copy into the engine's GPU memory) and
answers with what it found and how long the I/O took; the replica measures the whole round trip.

Data API (JSON over HTTP on the Unix socket): POST /v1/lookup {keys} -> {found}; POST /v1/load
{keys} -> {found, bytes, seconds, sources (the tier of each chunk found)}; POST /v1/store
{keys, chunk_bytes} -> {stored, bytes, seconds};
GET /v1/info -> geometry and usage. /health and /metrics (lmcache_mp_* names) are served on the
socket and, alone, on a TCP port of 127.0.0.1 for health checks and scrapers: the data API is never
on TCP. A request names at most MAX_KEYS keys.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiohttp import ClientPayloadError, web

from kvtier.sim.metrics import CacheMetrics
from kvtier.sim.model import Offload
from kvtier.telemetry.prometheus import CONTENT_TYPE, exposition

MAX_KEYS = 8192
"""Keys one data request may name (2M tokens of 256-token chunks)."""
MAX_DATA_BODY = 2 * 1024 * 1024
"""Largest data request body: MAX_KEYS keys of ~90 characters, with room to spare."""


def make_cache_apps(o: Offload, server_id: str) -> tuple[web.Application, web.Application]:
    """(data app, public app). The data app — lookup/load/store/info, health, metrics — is served on
    the Unix socket only, in a 0700 folder; the public app, on TCP, has /health and /metrics alone,
    so whoever can reach the port cannot read or fill the tier."""
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
        except (ConnectionError, ClientPayloadError, asyncio.IncompleteReadError):
            # the client went away mid-body: nothing to answer, nothing worth a traceback in the log
            raise web.HTTPBadRequest(text="incomplete body") from None
        keys = body.get("keys") if isinstance(body, dict) else None
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise web.HTTPBadRequest(text="'keys' must be a list of non-empty strings")
        if len(keys) > MAX_KEYS:
            raise web.HTTPBadRequest(text=f"{len(keys)} keys in one request; at most {MAX_KEYS}")
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
        sources: list[str] = []
        try:
            dt, nbytes, found = await asyncio.to_thread(o.load, keys, sources)
        finally:
            m.clients.dec()
        m.loaded.inc(found)
        return web.json_response({"found": found, "bytes": nbytes, "seconds": dt, "sources": sources})

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
        return web.json_response({"status": "ok", "server": "kvtier cache-server", "socket": server_id})

    async def metrics(request: web.Request) -> web.Response:
        refresh()
        return web.Response(body=exposition(m.registry), headers={"Content-Type": CONTENT_TYPE})

    data = web.Application(client_max_size=MAX_DATA_BODY)
    data.add_routes(
        [
            web.post("/v1/lookup", lookup),
            web.post("/v1/load", load),
            web.post("/v1/store", store),
            web.get("/v1/info", info),
            web.get("/health", health),
            web.get("/metrics", metrics),
        ]
    )
    public = web.Application(client_max_size=1024)
    public.add_routes([web.get("/health", health), web.get("/metrics", metrics)])
    return data, public


__all__ = ["make_cache_apps", "MAX_KEYS"]
