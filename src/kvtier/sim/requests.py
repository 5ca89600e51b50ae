"""What the simulated server accepts: the OpenAI request body, read and validated with bounds.

Every malformed input is a 4xx with OpenAI's error body, never a 500: a body over the size limit
(after decompression too: gzip/deflate bodies are inflated here with a cap, never by the HTTP
layer), an unsupported encoding or charset, JSON that is invalid or nested past the parser's
depth, messages or tool calls of the wrong shape, and parameters kvtier does not model (``n`` > 1)
instead of being silently ignored.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from kvtier.sim.tokens import render_chat

MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body, raw and after decompression."""

ROLES = ("system", "user", "assistant", "tool", "developer")


class ApiError(Exception):
    """An error answered with OpenAI's error body and ``status``."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.headers = headers or {}


class BadRequest(ApiError):
    pass


class NotFound(ApiError):
    status = 404
    kind = "not_found_error"


class TooLarge(ApiError):
    status = 413


class UnsupportedMedia(ApiError):
    status = 415


class RequestTimeout(ApiError):
    """The body did not arrive within the body deadline (a client dribbling its body)."""

    status = 408


MAX_BODIES_IN_FLIGHT = 32
"""Request bodies read at once; the others wait (up to the body deadline) for a slot, then get 429. With
MAX_BODY_BYTES each, the bytes a slow or hostile client can make the server hold are bounded."""
BODY_GATE: web.AppKey[asyncio.Semaphore] = web.AppKey("kvtier_body_gate", asyncio.Semaphore)
BODY_TIMEOUT: web.AppKey[float] = web.AppKey("kvtier_body_timeout_s", float)


class Busy(ApiError):
    """The server is full: the waiting queue is at its bound, or a request waited too long."""

    status = 429
    kind = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, None, {"Retry-After": str(retry_after_s)})


def _inflate(raw: bytes, encoding: str, limit: int) -> bytes:
    """Decompress with an output cap: a small bomb stops at ``limit`` bytes instead of filling RAM."""
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}[encoding]
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(raw, limit + 1)
    except zlib.error as e:
        raise BadRequest(f"request body is not valid {encoding} ({e})") from None
    if len(out) > limit or d.unconsumed_tail:
        raise TooLarge(f"request body exceeds {limit} bytes once decompressed")
    return out


async def read_json(request: web.Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The body as a JSON object. The server runs with auto_decompress off, so ``read()`` returns the
    bytes as sent (bounded by client_max_size); decompression and decoding happen here, bounded."""
    gate, deadline = request.app.get(BODY_GATE), request.app.get(BODY_TIMEOUT, 30.0)
    try:
        if gate is not None:
            try:
                await asyncio.wait_for(gate.acquire(), deadline)
            except TimeoutError:
                raise Busy(f"{MAX_BODIES_IN_FLIGHT} request bodies are being received; try again") from None
        try:
            raw = await asyncio.wait_for(request.read(), deadline)
        finally:
            if gate is not None:
                gate.release()
    except web.HTTPRequestEntityTooLarge:
        raise TooLarge(f"request body exceeds {limit} bytes") from None
    except TimeoutError:
        raise RequestTimeout(f"the request body did not arrive within {deadline:g} s (--body-timeout)") from None
    encoding = request.headers.get("Content-Encoding", "identity").strip().lower()
    if encoding in ("gzip", "x-gzip", "deflate"):
        raw = _inflate(raw, encoding, limit)
    elif encoding not in ("", "identity"):
        raise UnsupportedMedia(f"Content-Encoding {encoding!r} is not supported (gzip, deflate or none)")
    charset = request.charset or "utf-8"
    try:
        codecs.lookup(charset)
    except LookupError:
        raise BadRequest(f"unknown charset {charset!r}") from None
    try:
        body = json.loads(raw.decode(charset))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise BadRequest("request body is not valid JSON") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def _positive_int(body: dict[str, Any], *names: str, default: int) -> int:
    for n in names:
        if n in body and body[n] is not None:
            v = body[n]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise BadRequest(f"'{n}' must be a positive integer", n)
            return v
    return default


def _bool(body: dict[str, Any], name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {v!r}", name)
    return v


@dataclass(frozen=True)
class Completion:
    """A validated completion request: the prompt text and what to generate."""

    chat: bool
    text: str
    max_tokens: int
    stream: bool
    include_usage: bool


def parse_completion(
    body: dict[str, Any],
    chat: bool,
    served_model_name: str,
    default_max_tokens: int,
    render: Callable[[Sequence[dict[str, Any]]], str] = render_chat,
) -> Completion:
    if body.get("model") not in (None, served_model_name):
        raise NotFound(f"model {body.get('model')!r} does not exist", "model")
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or msg.get("role") not in ROLES:
                raise BadRequest(f"messages[{i}] needs a role of {', '.join(ROLES)}", "messages")
        try:
            text = render(msgs)
        except ValueError as e:
            raise BadRequest(f"messages: {e}", "messages") from None
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise BadRequest("'prompt' must be a non-empty string", "prompt")
        text = prompt
    if _positive_int(body, "n", default=1) != 1:
        raise BadRequest("'n' > 1 is not supported by kvtier sim (one choice per request)", "n")
    max_tokens = _positive_int(body, "max_completion_tokens", "max_tokens", default=default_max_tokens)
    stream = _bool(body, "stream")
    so = body.get("stream_options") or {}
    if not isinstance(so, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return Completion(chat, text, max_tokens, stream, bool(so.get("include_usage")))


def error_response(e: ApiError) -> web.Response:
    return web.json_response(
        {"error": {"message": str(e), "type": e.kind, "param": e.param, "code": e.status}},
        status=e.status,
        headers=e.headers,
    )


__all__ = [
    "ApiError",
    "BadRequest",
    "NotFound",
    "TooLarge",
    "UnsupportedMedia",
    "Busy",
    "read_json",
    "parse_completion",
    "Completion",
    "error_response",
    "MAX_BODY_BYTES",
]
