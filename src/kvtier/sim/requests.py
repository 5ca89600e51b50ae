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
import time
import zlib
from collections import deque
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


MAX_BUFFERED_BODY_BYTES = 256 * 1024 * 1024
"""Bytes of request bodies the server holds at once, over all requests, counted as they arrive (not as declared):
a body that would pass it gets 429. The memory a client can make the server hold is bytes it really sent."""
SMALL_BODY_BYTES = 1024 * 1024
SMALL_POOL_BYTES = 32 * 1024 * 1024
"""Bodies of at most SMALL_BODY_BYTES are counted in a pool of their own, so large bodies holding the shared budget
never turn a small request away (a body that grows past the size moves its bytes to the shared budget)."""
CLIENT_SHARE = 2
"""A client (the peer's address) holds at most 1/CLIENT_SHARE of either budget at once (429 beyond): four bodies of
one client sent fast and held could take the whole budget. Behind a proxy every request is the proxy's."""
BODY_STALL_S = 5.0
"""A body that sends nothing for this long is cut (408) and gives its bytes back: bodies sent fast and then stalled
keep the average rate above the floor, and would hold their bytes until the body deadline. And over any such
window a body must bring MIN_BODY_RATE on average (408 otherwise): sent fast, then a byte a second, it is cut at
the window's end instead of at the deadline."""
MIN_BODY_RATE = 16 * 1024
"""Bytes a second a body must average once BODY_GRACE_S have passed (408 otherwise): a client dribbling a byte
every few seconds is cut within seconds, not at the body deadline."""
BODY_GRACE_S = 2.0
BODY_POLL_S = 0.5
"""How often a body that is not arriving is checked against the rate floor and the deadline."""
REFUSING_WINDOW_S = 10.0
"""/health says the server is refusing work while it has refused some (429, 408 for a slow body) this recently."""


class Refusals:
    """Work the server turned away, by cause, and when it last did (what /health reports); and the body bytes it
    holds now against MAX_BUFFERED_BODY_BYTES. One event loop: no lock."""

    def __init__(self, max_body_bytes: int = MAX_BUFFERED_BODY_BYTES, small_pool: int = SMALL_POOL_BYTES) -> None:
        self.max_body_bytes = max_body_bytes
        self.body_bytes = 0
        self.small_pool = small_pool
        self.small_bytes = 0  # small bodies' bytes, apart
        self.held: dict[tuple[str, bool], int] = {}  # (client, small) -> the bytes that client holds in that pool
        self.by_cause: dict[str, int] = {}
        self.last: float | None = None  # time.monotonic() of the last refusal

    def refused(self, cause: str) -> None:
        self.by_cause[cause] = self.by_cause.get(cause, 0) + 1
        self.last = time.monotonic()

    def take(self, n: int, small: bool = False, client: str = "") -> bool:
        """Whether ``n`` more bytes fit the pool and the client's share of it (then they are counted)."""
        pool = self.small_pool if small else self.max_body_bytes
        used = self.small_bytes if small else self.body_bytes
        mine = self.held.get((client, small), 0)
        if used + n > pool or mine + n > pool // CLIENT_SHARE:
            return False
        self.held[(client, small)] = mine + n
        if small:
            self.small_bytes += n
        else:
            self.body_bytes += n
        return True

    def give(self, n: int, small: bool = False, client: str = "") -> None:
        left = self.held.get((client, small), 0) - n
        if left > 0:
            self.held[(client, small)] = left
        else:
            self.held.pop((client, small), None)
        if small:
            self.small_bytes -= n
        else:
            self.body_bytes -= n

    @property
    def refusing(self) -> bool:
        return self.last is not None and time.monotonic() - self.last < REFUSING_WINDOW_S

    def health(self) -> dict[str, Any]:
        return {
            "refusing": self.refusing,
            "refused": dict(self.by_cause),
            "body_bytes_buffered": self.body_bytes + self.small_bytes,
            "body_bytes_limit": self.max_body_bytes,
        }


REFUSALS: web.AppKey[Refusals] = web.AppKey("kvtier_refusals", Refusals)
BODY_TIMEOUT: web.AppKey[float] = web.AppKey("kvtier_body_timeout_s", float)


class Busy(ApiError):
    """The server is full: the waiting queue is at its bound, or a request waited too long."""

    status = 429
    kind = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int = 1, cause: str = "queue-full") -> None:
        super().__init__(message, None, {"Retry-After": str(retry_after_s)})
        self.cause = cause  # what /health counts it as (Refusals)


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


async def _read_body(
    request: web.Request, limit: int, refusals: Refusals | None, deadline: float
) -> tuple[bytes, int, bool]:
    """The body as sent, read as it arrives: bounded by ``limit`` (413), by the bytes all bodies may hold at once and
    a client's share of them (429; small bodies in a pool of their own), by the deadline (408), after BODY_GRACE_S by
    MIN_BODY_RATE on average and over every BODY_STALL_S (408), and by BODY_STALL_S without a byte (408). Returns
    the body, the bytes it holds of the budget and whether they are in the small pool (the caller gives them back)."""
    loop = asyncio.get_running_loop()
    t0 = last = loop.time()
    parts: list[bytes] = []
    got = 0
    client = request.remote or ""
    marks: deque[tuple[float, int]] = deque([(t0, 0)])  # (when, bytes so far) after each chunk: the recent rate
    small = True  # counted in the small bodies' pool until it grows past SMALL_BODY_BYTES
    declared = request.content_length
    if declared is not None and declared > limit:
        raise TooLarge(f"request body exceeds {limit} bytes")
    try:
        while True:
            now = loop.time()
            elapsed = now - t0
            if elapsed >= deadline:
                _refused(refusals, "body-timeout")
                raise RequestTimeout(f"the request body did not arrive within {deadline:g} s (--body-timeout)")
            if elapsed > BODY_GRACE_S and got < MIN_BODY_RATE * elapsed:
                _refused(refusals, "body-too-slow")
                raise RequestTimeout(
                    f"the request body arrived at {got / elapsed:.0f} bytes/s, under the server's floor of "
                    f"{MIN_BODY_RATE} bytes/s"
                )
            if now - last >= BODY_STALL_S:
                _refused(refusals, "body-stalled")
                raise RequestTimeout(f"the request body stopped arriving for {BODY_STALL_S:g} s")
            while len(marks) > 1 and marks[1][0] <= now - BODY_STALL_S:
                marks.popleft()  # marks[0]: the last mark a window ago or earlier
            if marks[0][0] <= now - BODY_STALL_S and got - marks[0][1] < MIN_BODY_RATE * BODY_STALL_S:
                _refused(refusals, "body-too-slow")
                raise RequestTimeout(
                    f"the request body brought {got - marks[0][1]} bytes in the last {BODY_STALL_S:g} s, under the "
                    f"server's floor of {MIN_BODY_RATE} bytes/s"
                )
            try:
                chunk = await asyncio.wait_for(request.content.readany(), min(BODY_POLL_S, deadline - elapsed))
            except TimeoutError:
                continue
            if not chunk:
                break  # the whole body
            last = loop.time()
            marks.append((last, got + len(chunk)))
            if got + len(chunk) > limit:
                raise TooLarge(f"request body exceeds {limit} bytes")
            if refusals is not None:
                if small and got + len(chunk) > SMALL_BODY_BYTES:  # no longer small: its bytes move to the budget
                    if not refusals.take(got + len(chunk), client=client):
                        raise Busy(
                            f"the server holds as many request body bytes as it can ({refusals.max_body_bytes} in "
                            f"all, half of them for one client); try again",
                            cause="body-bytes",
                        )
                    refusals.give(got, small=True, client=client)
                    small = False
                elif not refusals.take(len(chunk), small, client):
                    raise Busy("the server holds as many request bodies as it can (half of them for one client); "
                               "try again", cause="body-bytes")  # fmt: skip
            got += len(chunk)
            parts.append(chunk)
    except BaseException:
        if refusals is not None:
            refusals.give(got, small, client)
        raise
    return b"".join(parts), got, small


def _refused(refusals: Refusals | None, cause: str) -> None:
    if refusals is not None:
        refusals.refused(cause)


async def read_json(request: web.Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The body as a JSON object. The server runs with auto_decompress off, so the bytes are as sent (read by
    ``_read_body``, bounded); decompression and decoding happen here, bounded."""
    refusals, deadline = request.app.get(REFUSALS), request.app.get(BODY_TIMEOUT, 30.0)
    raw, held, small = await _read_body(request, limit, refusals, deadline)
    try:
        return _decode(request, raw, limit)
    finally:
        if refusals is not None:
            refusals.give(held, small, request.remote or "")


def _decode(request: web.Request, raw: bytes, limit: int) -> dict[str, Any]:
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
