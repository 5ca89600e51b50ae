"""What kvtier's client sends: ``ignore_eos`` only when asked (``kvtier replay --ignore-eos``; the ladder's sweeps by
default), so a reply decodes its max_tokens on vLLM or SGLang while other servers see no unknown field."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp import web

from kvtier.replay.client import ClientConfig, stream_request
from kvtier.replay.datasets import VirtualUser


def _bodies(ignore_eos: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"index": 0, "delta": {"content": "hi"}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
        for event in (chunk, usage):
            await resp.write(f"data: {json.dumps(event)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def main() -> dict[str, Any]:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            cfg = ClientConfig(f"http://127.0.0.1:{port}/v1", "m", 1, ignore_eos=ignore_eos)
            async with aiohttp.ClientSession() as http:
                rec, _ = await stream_request(
                    http, cfg, VirtualUser("u", "s", 0, ()), 0, [{"role": "user", "content": "x"}], 8
                )
            return dict(rec)
        finally:
            await runner.cleanup()

    return seen, asyncio.run(main())


def test_ignore_eos_is_sent_only_when_asked():
    seen, rec = _bodies(True)
    assert rec["status"] == "ok" and seen[0]["ignore_eos"] is True and seen[0]["max_tokens"] == 8
    seen, rec = _bodies(False)
    assert rec["status"] == "ok" and "ignore_eos" not in seen[0]
