"""The OpenAI-compatible HTTP front of kvtier sim (aiohttp) over its engine (sim/server.py).

``/v1/chat/completions`` and ``/v1/completions`` (streamed as server-sent events, or one JSON body),
``/v1/models``, ``/health`` and ``/metrics`` (vLLM- and LMCache-named). The wire format is built by the
small functions ``usage``, ``choice`` and ``chunk``; a streamed request's per-token frames are encoded once,
so the decode ticker hands bytes to the transport with no task wake-up per token. Every response carries
``x-kvtier-replica``; an ``ApiError`` anywhere becomes the OpenAI error body with its status.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from kvtier.sim.decomposition import add_send
from kvtier.sim.requests import (
    BODY_TIMEOUT,
    MAX_BODY_BYTES,
    REFUSALS,
    ApiError,
    BadRequest,
    Busy,
    Completion,
    NotFound,
    Refusals,
    error_response,
    parse_completion,
    read_json,
)
from kvtier.sim.server import SimEngine
from kvtier.telemetry.prometheus import CONTENT_TYPE, exposition

WORDS = (
    "the",
    "cache",
    "moves",
    "tokens",
    "to",
    "faster",
    "tiers",
    "when",
    "it",
    "pays",
    "and",
    "recomputes",
    "otherwise",
    "because",
    "bandwidth",
    "matters",
)


def _word(i: int) -> str:
    """Deterministic filler text; periodic in len(WORDS) so per-token chunks can be pre-encoded."""
    return WORDS[(i * 7 + 3) % len(WORDS)] + " "


STALL_LIMIT_S = 60.0
"""A streaming client whose socket buffer stays full this long is treated as gone."""
WRITE_BUFFER_HIGH = 1 << 20
"""Bytes queued for one client above which its stream pauses (backpressure: decoding waits for it)."""


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``, with vLLM's ``prompt_tokens_details.cached_tokens`` (the GPU prefix-cache hit)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def choice(chat: bool, content: str) -> dict[str, Any]:
    """The one choice of a whole (not streamed) response."""
    if chat:
        return {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "length"}
    return {"index": 0, "text": content, "finish_reason": "length", "logprobs": None}


def chunk(head: dict[str, Any], chat: bool, delta: Any, finish: str | None) -> dict[str, Any]:
    """One streamed chunk; ``head`` is the response's id, object, created and model."""
    ch = (
        {"index": 0, "delta": delta, "finish_reason": finish}
        if chat
        else {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
    )
    return {**head, "choices": [ch]}


class TokenFrames:
    """A streamed request's per-token SSE frames, encoded once (with chunked transfer encoding, the chunk
    framing too); ``emit(i)`` writes token i: True sent, False the client is gone, None paused (its
    socket buffer is full: decoding waits for it, up to STALL_LIMIT_S)."""

    def __init__(self, request: web.Request, head: dict[str, Any], chat: bool, chunked: bool) -> None:
        pre, post = (
            json.dumps(chunk(head, chat, {"content": "\x00"} if chat else "\x00", None), separators=(",", ":"))
            .encode()
            .split(b"\\u0000")
        )
        lines = [b"data: " + pre + w.encode() + post + b"\n\n" for w in (_word(i) for i in range(len(WORDS)))]
        self.first = lines[0]
        self.frames = [f"{len(x):x}\r\n".encode() + x + b"\r\n" for x in lines] if chunked else lines
        self.transport = request.transport
        self.stalled_since: float | None = None

    def emit(self, i: int) -> bool | None:
        tr = self.transport
        if tr is None or tr.is_closing():
            return False
        if tr.get_write_buffer_size() > WRITE_BUFFER_HIGH:  # a client that does not read
            now = time.perf_counter()
            if self.stalled_since is None:
                self.stalled_since = now
            return False if now - self.stalled_since > STALL_LIMIT_S else None
        self.stalled_since = None
        tr.write(self.frames[i % len(self.frames)])
        return True


class Handlers:
    """The endpoints over one engine."""

    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.model = engine.s.served_model_name

    @web.middleware
    async def replica_header(self, request: web.Request, handler):  # type: ignore[no-untyped-def]  # aiohttp's type
        try:
            resp = await handler(request)
        except ApiError as e:
            if isinstance(e, Busy):  # work turned away: /health says so for a while (Refusals)
                request.app[REFUSALS].refused(e.cause)
            resp = error_response(e)
        except web.HTTPException as e:
            err = NotFound(e.reason or "not found") if e.status == 404 else ApiError(e.reason or "error")
            err.status = e.status
            resp = error_response(err)
        resp.headers["x-kvtier-replica"] = self.engine.replica_id
        return resp

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._completion(request, False)

    async def _completion(self, request: web.Request, chat: bool) -> web.StreamResponse:
        received = time.perf_counter()  # the TTFT decomposition's start: before the body is read
        engine = self.engine
        s = engine.s
        req = parse_completion(
            await read_json(request), chat, s.served_model_name, s.default_max_tokens, engine.render_chat
        )
        if engine.surely_too_long(req.text, req.max_tokens):  # refused before any tokenization
            raise engine.too_long(engine.fewest_tokens(req.text) + req.max_tokens)
        prompt_ids = await asyncio.to_thread(engine.tokenizer.encode, req.text)  # off the loop
        if not prompt_ids:
            raise BadRequest("the prompt renders to no tokens", "messages" if chat else "prompt")
        gen = engine.generate(prompt_ids, req.max_tokens, received, len(req.text))
        try:  # from here on, every path closes the generator: it holds a slot and KV blocks
            _, info = await gen.__anext__()  # admission and prefill; raises BadRequest/Busy before any byte is sent
            head = {
                "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
            }
            if not req.stream:
                return await self._whole(request, req, head, len(prompt_ids), info, gen)
            return await self._stream(request, req, head, len(prompt_ids), info, gen)
        finally:
            await gen.aclose()

    async def _whole(
        self, request: web.Request, req: Completion, head: dict[str, Any], n_prompt: int, info: dict[str, Any], gen: Any
    ) -> web.Response:
        tr = request.transport

        def still_there(i: int) -> bool | None:  # a client that left stops the decoding
            return not (tr is None or tr.is_closing())

        info = add_send(info, None)  # not streamed: the first token leaves with the last
        _, n = await gen.asend(still_there)
        content = "".join(_word(i) for i in range(n))
        return web.json_response(
            {
                **head,
                "object": "chat.completion" if req.chat else "text_completion",
                "choices": [choice(req.chat, content)],
                "usage": usage(n_prompt, n, info["cached_tokens"]),
                "kvtier": info,
            }
        )

    async def _stream(
        self, request: web.Request, req: Completion, head: dict[str, Any], n_prompt: int, info: dict[str, Any], gen: Any
    ) -> web.StreamResponse:
        chat = req.chat
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-kvtier-replica": self.engine.replica_id,
            }
        )
        await resp.prepare(request)

        async def send(payload: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n")

        frames = TokenFrames(request, head, chat, resp.headers.get("Transfer-Encoding", "").lower() == "chunked")
        if chat:
            await send(chunk(head, chat, {"role": "assistant", "content": ""}, None))
        # the decomposition's end: token 0's frame handed to the socket now, so the client reads it after this stamp
        # (a stamp after the awaited write could come after the client's own: the write may wait on the loop)
        info = add_send(info, time.perf_counter())
        await resp.write(frames.first)  # token 0 leaves with the prefill (and flushes the headers)
        _, n = await gen.asend(frames.emit)
        # the last chunk carries kvtier's extension: the request's TTFT decomposition (docs/serving.md)
        await send({**chunk(head, chat, {} if chat else "", "length"), "kvtier": info})
        if req.include_usage:
            await send({**head, "choices": [], "usage": usage(n_prompt, n, info["cached_tokens"])})
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def models(self, request: web.Request) -> web.Response:
        item = {
            "id": self.model,
            "object": "model",
            "created": 0,
            "owned_by": "kvtier-sim",
            "max_model_len": self.engine.max_model_len,
        }
        st = self.engine.s
        if st.timing_error is not None:  # a calibrated twin says how far its times may stray (a replay records it)
            item["kvtier_timing"] = {"source": st.timing_source, "origin": st.timing_origin, "error": st.timing_error}
        return web.json_response({"object": "list", "data": [item]})

    async def health(self, request: web.Request) -> web.Response:
        """200 always (the server is up); the body says ``degraded`` while its shared offload tier fails, and
        ``busy`` while it is refusing work (429s, or bodies cut for arriving too slowly, in the last
        REFUSING_WINDOW_S; ``refused`` counts them by cause since the start)."""
        o = self.engine.offload
        err = getattr(o, "recent_error", None) if o is not None else None
        refusals = request.app[REFUSALS].health()
        body: dict[str, Any] = {
            "status": "degraded" if err else "busy" if refusals["refusing"] else "ok",
            "offload_errors": o.errors if o is not None else 0,
            **refusals,
        }
        if err:
            body["last_offload_error"] = err
        if o is not None and o.breaker_open:  # the tier is being bypassed: requests recompute
            body["offload_bypassed"] = {"loads": o.bypassed_loads, "stores": o.bypassed_stores}
        return web.json_response(body)

    async def metrics(self, request: web.Request) -> web.Response:
        self.engine.refresh_metrics()
        return web.Response(body=exposition(self.engine.metrics.registry), headers={"Content-Type": CONTENT_TYPE})


def make_app(engine: SimEngine) -> web.Application:
    h = Handlers(engine)
    app = web.Application(middlewares=[h.replica_header], client_max_size=MAX_BODY_BYTES)
    app[REFUSALS] = Refusals()  # body bytes held at once (bounded memory) and the work turned away
    app[BODY_TIMEOUT] = engine.s.body_timeout_s
    app.add_routes(
        [
            web.post("/v1/chat/completions", h.chat_completions),
            web.post("/v1/completions", h.completions),
            web.get("/v1/models", h.models),
            web.get("/health", h.health),
            web.get("/metrics", h.metrics),
        ]
    )
    return app
