"""Closed-loop streaming client: exactly ``concurrency`` virtual users in flight.

Each virtual user sends its turns in order: it waits the recorded gap (``pre_gap`` or the
timestamp difference, times ``--gap-scale``, less the previous request's own latency, never below
0), then streams the request and records TTFT (the first generated token, content *or reasoning*, its text
empty or not), inter-token gaps, e2e latency, usage, status and which replica answered: the sim's own
``x-kvtier-replica`` header, else the ``x-kvtier-upstream`` that kvtier launch's Caddy stamps on each response
(the upstream's host:port, for any engine behind it). Failures are records, not
exceptions: a virtual user whose request failed stops (its session is counted incomplete/error).

The stream is parsed by ``StreamRecorder``, which is given each network chunk with its arrival
time from an injected clock — so its accounting (TTFT, gaps, e2e) is unit-tested without a server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvtier.replay.datasets import VirtualUser
from kvtier.replay.summary import http_cause
from kvtier.results.replay import Decomposition, ReplayRecord, decomposition_problem
from kvtier.telemetry.clock import MONOTONIC, Clock

MAX_EVENT_BYTES = 4 * 1024 * 1024
"""Largest server-sent event: a stream that sends more without a separator is a recorded error."""
MAX_ERROR_BYTES = 64 * 1024
"""Most of an error reply read: enough for any server's message, bounded against a hostile one."""


@dataclass
class ClientConfig:
    base_url: str
    model: str
    concurrency: int
    gap_scale: float = 1.0
    request_timeout_s: float = 64800.0
    read_timeout_s: float = 600.0
    history: str = "recorded"  # recorded | runtime
    cache_salt: str | None = None
    tools: list[dict[str, Any]] | None = None
    ignore_eos: bool = False  # sent as ignore_eos (vLLM, SGLang): every reply runs to its max_tokens
    # each request's X-Request-Id is this prefix and a number: vLLM makes its engine request id of it, so the engine's
    # own per-request record (kvtier/vllm/reqlog.py) joins this run's (kvtier/replay/engine_join.py)
    request_id_prefix: str = field(default_factory=lambda: f"kvt-{secrets.token_hex(4)}-")
    _ids: Iterator[int] = field(default_factory=itertools.count, repr=False)

    def next_request_id(self) -> str:
        return f"{self.request_id_prefix}{next(self._ids)}"


def event_loop_kind(requested: str = "auto") -> str:
    """uvloop when installed (auto) or asked for; else the stock asyncio loop. uvloop kept the client's
    added latency under a same-instant burst of 256 tokens at p50 0.15 ms where the stock loop
    reached 17-19 ms on this host (benchmarks/replay_overhead.py)."""
    if requested == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if requested == "uvloop":
            from kvtier.errors import UnsupportedError

            raise UnsupportedError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def loop_factory(kind: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A loop factory for asyncio.Runner (None = the default loop)."""
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def new_record(user: VirtualUser, turn_index: int, max_tokens: int) -> ReplayRecord:
    """The per-request record (one line of requests.jsonl; fields in docs/metrics.md)."""
    return {
        "user": user.user_id,
        "session": user.session_id,
        "turn": turn_index,
        "session_turn": user.first_turn + turn_index,
        "max_tokens": max_tokens,
        "status": "ok",
        "cause": None,
        "error": None,
        "http_status": None,
        "replica": None,
        "ttft_s": None,
        "itl_s": [],
        "e2e_s": None,
        "prompt_tokens": None,
        "completion_tokens": None,
        "cached_tokens": None,
        "start_unix_s": None,
        "prompt_sources": None,
        "server_ttft_parts": None,
        "server_ttft_s": None,
    }


class StreamRecorder:
    """Server-sent events of one chat completion -> TTFT, inter-token gaps, usage and the reply.

    Feed it each network chunk with the time it arrived (seconds on the request's clock, the
    request sent at ``t0``). Events are split on blank lines; events in one chunk share its arrival
    time (one parse per chunk, not per line, keeps the client's own cost per token low — see
    benchmarks/replay_overhead.py). TTFT is the first generated token's arrival, its text empty or not: a delta
    carrying content or reasoning, or one that carries an empty ``content`` without the ``role`` (a token whose
    text is empty, e.g. half a UTF-8 character), the role-only first delta excepted. A stream whose usage counts
    generated tokens that no delta showed takes its TTFT from the chunk that finished the choice (``settle``); a
    stream with no generated token at all is an error, cause ``no-output``: every request ends ok with a TTFT,
    failed by cause, or cut."""

    def __init__(self, rec: ReplayRecord, t0: float) -> None:
        self.rec = rec
        self.t0 = t0
        self.last: float | None = None
        self.pending = b""
        self.parts: list[str] = []
        self.done = False
        self.first_event = False
        self.finish_s: float | None = None  # when a choice's finish_reason arrived
        self.usage_s: float | None = None  # when the usage arrived
        self.decomposition: Decomposition | None = None  # the server's, checked; into the record by finish()
        self.decomposition_problem: str | None = None  # why the server's was dropped

    def feed(self, data: bytes, now: float) -> bool:
        """Consume one chunk; True once ``data: [DONE]`` arrived. A malformed event (invalid JSON or
        UTF-8, fields of the wrong type) or one over MAX_EVENT_BYTES raises ValueError."""
        self.pending += data
        *events, self.pending = self.pending.replace(b"\r\n", b"\n").split(b"\n\n")
        if len(self.pending) > MAX_EVENT_BYTES:
            raise ValueError(f"an event exceeds {MAX_EVENT_BYTES} bytes without a separator")
        loads, rec = json.loads, self.rec
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                    return True
                ev = loads(payload.decode())
                if not isinstance(ev, dict):
                    raise ValueError(f"event is not a JSON object: {payload[:80]!r}")
                usage = ev.get("usage")
                if usage:
                    if not isinstance(usage, dict):
                        raise ValueError("usage is not an object")
                    self.usage_s = now - self.t0
                    details = usage.get("prompt_tokens_details") or {}
                    rec["prompt_tokens"] = _count(usage.get("prompt_tokens"), "prompt_tokens")
                    rec["completion_tokens"] = _count(usage.get("completion_tokens"), "completion_tokens")
                    rec["cached_tokens"] = _count(
                        details.get("cached_tokens") if isinstance(details, dict) else "?", "cached_tokens"
                    )
                ext = ev.get("kvtier")
                if ext is not None:
                    sim_timing(rec, ext)
                    try:
                        self.decomposition = decomposition(ext) or self.decomposition
                    except DecompositionRejected as e:
                        self.decomposition, self.decomposition_problem = None, str(e)
                    self.transit(ext)
                choices = ev.get("choices") or ()
                if not isinstance(choices, (list, tuple)):
                    raise ValueError("choices is not a list")
                if choices and not self.first_event:  # the role delta: servers send it with token 0
                    self.first_event = True
                    rec["first_event_s"] = now - self.t0
                for ch in choices:
                    d = (ch.get("delta") if isinstance(ch, dict) else None) or {}
                    if not isinstance(d, dict):
                        raise ValueError("a choice's delta is not an object")
                    piece = d.get("content") or d.get("reasoning_content") or d.get("reasoning")
                    if piece is not None and not isinstance(piece, str):
                        raise ValueError("a delta's content is not a string")
                    if self.finish_s is None and ch.get("finish_reason") is not None:
                        self.finish_s = now - self.t0
                    if piece or (d.get("content") == "" and "role" not in d):
                        if self.last is None:
                            rec["ttft_s"] = now - self.t0
                        else:
                            rec["itl_s"].append(now - self.last)
                        self.last = now
                        self.parts.append(d.get("content") or "")
        return False

    def settle(self) -> None:
        """After ``[DONE]``: a stream whose usage counts generated tokens that no delta showed gets its TTFT from the
        chunk that finished the choice (else the usage's); one with no generated token is an error, ``no-output``,
        so an ok record always has a TTFT."""
        rec = self.rec
        if rec["ttft_s"] is not None or rec["status"] != "ok":
            return
        at = self.finish_s if self.finish_s is not None else self.usage_s
        if (rec.get("completion_tokens") or 0) > 0 and at is not None:
            rec["ttft_s"] = at
            self.last = at
            return
        rec["status"], rec["cause"] = "error", "no-output"
        rec["error"] = (
            f"the stream ended without a generated token (usage.completion_tokens: {rec['completion_tokens']})"
        )

    def finish(self, e2e_s: float) -> None:
        """The server's decomposition into the record, once the request's own e2e time bounds it: no part, and not
        their sum, may exceed it (and the tokens by source not the prompt's count); else it is dropped, and
        ``decomposition_dropped`` says why (counted in the summary, with a warning)."""
        rec, d = self.rec, self.decomposition
        problem = self.decomposition_problem
        if d is not None and problem is None:
            bound = e2e_s * (1 + 1e-6) + 1e-3  # the server's clock inside the client's, rounding allowed
            worst = max([d.server_ttft_s, *d.seconds.values()])
            prompt = rec.get("prompt_tokens")
            if worst > bound:
                problem = f"a part of {worst:.6g} s is longer than the request's own {e2e_s:.6g} s"
            elif prompt is not None and sum(d.tokens.values()) > prompt:
                problem = f"{sum(d.tokens.values())} tokens by source, more than the prompt's {prompt}"
        if problem is not None:
            rec["decomposition_dropped"] = problem[:200]
            rec.pop("transit_s", None)  # its stamps came with the dropped decomposition
            return
        if d is not None:
            rec["prompt_sources"] = d.tokens
            rec["server_ttft_parts"] = d.seconds
            rec["server_ttft_s"] = d.server_ttft_s

    def transit(self, ext: Any) -> None:
        """The two legs outside the server, where its ``monotonic_s`` stamps are on this request's clock (the host's
        monotonic clock: the default one, a server on this host): both must come out non-negative and no longer
        than the TTFT, else they are not comparable stamps (another host, an injected clock) and none is kept."""
        stamps = ext.get("monotonic_s") if isinstance(ext, dict) else None
        ttft = self.rec["ttft_s"]
        if not isinstance(stamps, dict) or ttft is None:
            return
        recv, sent = stamps.get("received"), stamps.get("first_sent")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (recv, sent)):
            return
        to_server, to_client = recv - self.t0, self.t0 + ttft - sent  # type: ignore[operator]  # numbers, checked above
        if 0 <= to_server <= ttft and 0 <= to_client <= ttft:
            self.rec["transit_s"] = {"to_server": round(to_server, 7), "to_client": round(to_client, 7)}

    @property
    def reply(self) -> str:
        return "".join(self.parts)


class DecompositionRejected(ValueError):
    """A server's ``kvtier.ttft_decomposition`` that is not the schema's: dropped from the record, not fatal."""


def sim_timing(rec: ReplayRecord, ext: Any) -> None:
    """The sim's ``kvtier.timing`` (assumed, measured or extrapolated) into the record; anything else is a
    malformed event (ValueError)."""
    timing = ext.get("timing") if isinstance(ext, dict) else None
    if timing is not None:
        if timing not in ("assumed", "measured", "extrapolated"):
            raise ValueError(f"kvtier.timing is not assumed, measured or extrapolated: {str(timing)[:40]!r}")
        rec["sim_timing"] = timing


def decomposition(ext: Any) -> Decomposition | None:
    """kvtier's response extension (the sim's ``kvtier`` object): the request's prompt tokens by source and the
    server's TTFT by part, checked against their schema (results/replay.py ``decomposition_problem``). None when
    absent; anything else raises DecompositionRejected (the record keeps no part of it; the request is not failed
    for it). The bound by the request's own time is ``StreamRecorder.finish``'s."""
    d = ext.get("ttft_decomposition") if isinstance(ext, dict) else "?"
    if d is None:
        return None
    if not isinstance(d, dict):
        raise DecompositionRejected("kvtier.ttft_decomposition is not an object")
    tokens: Any = d.get("tokens")
    seconds: Any = d.get("seconds")
    total: Any = d.get("server_ttft_s")
    problem = decomposition_problem(tokens, seconds, total)
    if problem is not None:
        raise DecompositionRejected(f"kvtier.ttft_decomposition.{problem}")
    return Decomposition(dict(tokens), {k: float(v) for k, v in seconds.items()}, float(total))


def _count(v: Any, name: str) -> int | None:
    """A usage count: a non-negative integer or absent; anything else makes the event malformed."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"usage.{name} is not a non-negative integer: {v!r}")
    return v


async def stream_request(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    user: VirtualUser,
    turn_index: int,
    messages: list[dict[str, Any]],
    max_tokens: int,
    clock: Clock = MONOTONIC,
    wall: Callable[[], float] | None = None,
) -> tuple[ReplayRecord, str]:
    """Stream one request; returns its record and the reply text. Never raises for a failed request."""
    import time

    body: dict[str, Any] = {
        "model": cfg.model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.cache_salt:
        body["cache_salt"] = cfg.cache_salt
    if cfg.tools:
        body["tools"] = cfg.tools
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    rec = new_record(user, turn_index, max_tokens)
    rid = rec["request_id"] = cfg.next_request_id()

    def now_s() -> float:  # the one clock read per network chunk
        return clock.now_ns() / 1e9

    t0 = now_s()
    rec["start_unix_s"] = (wall or time.time)()
    rec["start_mono_s"] = round(t0, 7)
    sr = StreamRecorder(rec, t0)
    headers = {"x-user-id": user.user_id, "x-request-id": rid}
    try:
        async with session.post(cfg.base_url.rstrip("/") + "/chat/completions", json=body, headers=headers) as r:
            rec["http_status"] = r.status
            rec["replica"] = r.headers.get("x-kvtier-replica") or r.headers.get("x-kvtier-upstream")
            if r.status != 200:
                text = (await r.content.read(MAX_ERROR_BYTES)).decode("utf-8", "replace")
                rec["status"], rec["cause"], rec["error"] = "error", http_cause(r.status, text), text[:500]
                return rec, ""
            async for data_chunk in r.content.iter_any():
                if sr.feed(data_chunk, now_s()):
                    break
            if not sr.done:  # the server closed the stream early (a dying server does)
                rec["status"], rec["cause"], rec["error"] = "error", "connection", "stream ended without [DONE]"
            else:
                sr.settle()
            sr.finish(now_s() - t0)
    except asyncio.CancelledError:
        # the run is stopping (Ctrl+C, or a bound's grace ran out): recorded as cut, and the worker ends
        rec["status"], rec["cause"] = "cut", "cut-at-stop"
        rec["error"] = "the run stopped while this request was in flight"
    except TimeoutError:
        rec["status"], rec["cause"], rec["error"] = (
            "timeout",
            "timeout",
            (f"no answer within {cfg.request_timeout_s} s, or nothing read for {cfg.read_timeout_s} s"),
        )
    except ValueError as e:  # malformed JSON or fields in an event, an event over MAX_EVENT_BYTES
        rec["status"], rec["cause"], rec["error"] = "error", "stream-malformed", f"{type(e).__name__}: {e}"[:500]
    except (aiohttp.ClientError, OSError) as e:
        rec["status"], rec["cause"], rec["error"] = "error", "connection", f"{type(e).__name__}: {e}"[:500]
    finally:
        rec["e2e_s"] = now_s() - t0
    return rec, sr.reply


@dataclass
class UsersOutcome:
    records: list[ReplayRecord]
    achieved_concurrency: int


@dataclass
class Bounds:
    """Where a replay stops dispatching before its dataset is done (``--max-requests``, ``--duration``).

    Once a bound is hit no new request is sent; requests in flight get ``grace_s`` (``--read-timeout``)
    to finish, then they are cut (recorded as ``cut-at-stop``). ``hit`` names the bound that stopped it."""

    max_requests: int = 0  # requests sent at most (0: no bound)
    duration_s: float = 0.0  # seconds of dispatch (0: no bound)
    grace_s: float = 600.0
    hit: str | None = None  # "max-requests" | "duration"
    sent: int = 0


async def run_users(
    cfg: ClientConfig,
    users: list[VirtualUser],
    stop: asyncio.Event,
    clock: Clock = MONOTONIC,
    records: list[ReplayRecord] | None = None,
    gauge: dict[str, int] | None = None,
    bounds: Bounds | None = None,
    started: dict[int, int] | None = None,
) -> UsersOutcome:
    """Run every virtual user, ``cfg.concurrency`` at a time, until done, until a bound stops dispatch,
    or until ``stop`` is set; then requests in flight are cancelled and recorded as cut (at once for
    ``stop``, after the bound's grace otherwise). Records are appended to ``records`` as they finish, so
    a caller keeps them whatever happens; ``gauge["in_flight"]`` counts the requests under way and ``started``
    holds when each began (``clock`` ns; the progress line's ETA weighs them)."""
    records = [] if records is None else records
    gauge = {} if gauge is None else gauge
    started = {} if started is None else started
    ids = itertools.count()
    bounds = Bounds() if bounds is None else bounds
    gauge["in_flight"] = 0
    queue: asyncio.Queue[VirtualUser] = asyncio.Queue()
    for u in users:
        queue.put_nowait(u)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s, sock_read=cfg.read_timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    peak = {"now": 0, "max": 0}
    halt = asyncio.Event()  # no new request: a bound was hit, or the run stops
    cut = asyncio.Event()  # cancel what is in flight

    def bound(name: str) -> None:
        if bounds.hit is None:
            bounds.hit = name
        halt.set()

    async def watch() -> None:
        async def on_stop() -> None:
            await stop.wait()
            halt.set()
            cut.set()

        async def on_deadline() -> None:
            if bounds.duration_s > 0:
                await asyncio.sleep(bounds.duration_s)
                bound("duration")
            await halt.wait()
            await asyncio.sleep(bounds.grace_s)  # in-flight requests may finish meanwhile
            cut.set()

        await asyncio.gather(on_stop(), on_deadline())

    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:

        async def worker() -> None:
            while not halt.is_set():
                try:
                    user = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                peak["now"] += 1
                peak["max"] = max(peak["max"], peak["now"])
                prev_e2e = 0.0
                live: list[dict[str, Any]] = []
                try:
                    for i, turn in enumerate(user.turns):
                        gap = max(0.0, turn.gap_s * cfg.gap_scale - prev_e2e) if i else 0.0
                        if gap and (await _wait(halt, gap)):
                            return
                        if halt.is_set():
                            return
                        if bounds.max_requests and bounds.sent >= bounds.max_requests:
                            bound("max-requests")
                            return
                        bounds.sent += 1
                        msgs = list(turn.messages)
                        if cfg.history == "runtime" and i:
                            msgs = live + [m for m in turn.messages if m.get("role") != "assistant"][-1:]
                        gauge["in_flight"] += 1
                        key = next(ids)
                        started[key] = clock.now_ns()
                        try:
                            rec, reply = await stream_request(session, cfg, user, i, msgs, turn.max_tokens, clock)
                        finally:
                            gauge["in_flight"] -= 1
                            started.pop(key, None)
                        records.append(rec)
                        prev_e2e = rec["e2e_s"] or 0.0
                        live = msgs + [{"role": "assistant", "content": reply}]
                        if rec["status"] != "ok":
                            break
                finally:
                    peak["now"] -= 1

        workers = [asyncio.create_task(worker()) for _ in range(cfg.concurrency)]
        watcher = asyncio.create_task(watch())
        cutter = asyncio.create_task(cut.wait())
        try:
            pending: set[asyncio.Task[Any]] = {*workers, cutter}
            while cutter in pending and any(not w.done() for w in workers):
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            if cutter not in pending:  # cut what is in flight (each cut request is still recorded)
                for w in workers:
                    w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
            for w in workers:
                err = None if w.cancelled() else w.exception()
                if err is not None:
                    raise err  # a bug in a worker must not pass silently
        finally:
            watcher.cancel()
            cutter.cancel()
    return UsersOutcome(records, peak["max"])


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except TimeoutError:
        return False


__all__ = [
    "ClientConfig",
    "StreamRecorder",
    "stream_request",
    "run_users",
    "UsersOutcome",
    "Bounds",
    "new_record",
    "event_loop_kind",
    "loop_factory",
]
