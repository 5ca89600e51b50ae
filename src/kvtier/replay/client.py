"""Closed-loop streaming client: exactly ``concurrency`` virtual users in flight.

Each virtual user sends its turns in order: it waits the recorded gap (``pre_gap`` or the
timestamp difference, times ``--gap-scale``, less the previous request's own latency, never below
0), then streams the request and records TTFT (first content *or reasoning* delta), inter-token
gaps, e2e latency, usage, status and the ``x-kvtier-replica`` header. Failures are records, not
exceptions: a virtual user whose request failed stops (its session is counted incomplete/error).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvtier.replay.datasets import VirtualUser


@dataclass
class ClientConfig:
    base_url: str
    model: str
    concurrency: int
    gap_scale: float = 1.0
    request_timeout_s: float = 64800.0
    history: str = "recorded"  # recorded | runtime
    cache_salt: str | None = None
    tools: list[dict[str, Any]] | None = None


def event_loop_kind(requested: str = "auto") -> str:
    """uvloop when installed (auto) or asked for; else the stock asyncio loop. uvloop kept the client's
    added latency under a same-instant burst of 256 tokens at p50 0.15 ms where the stock loop
    reached 17-19 ms on this host (benchmarks/replay_overhead.py)."""
    if requested == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401, PLC0415
    except ImportError:
        if requested == "uvloop":
            from kvtier.errors import UnsupportedError  # noqa: PLC0415

            raise UnsupportedError("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    return "uvloop"


def loop_factory(kind: str) -> Any:
    """A loop factory for asyncio.Runner (None = the default loop)."""
    if kind == "uvloop":
        import uvloop  # noqa: PLC0415

        return uvloop.new_event_loop
    return None


async def _stream(session: aiohttp.ClientSession, cfg: ClientConfig, user: VirtualUser, turn_index: int,
                  messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "messages": messages, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if cfg.cache_salt:
        body["cache_salt"] = cfg.cache_salt
    if cfg.tools:
        body["tools"] = cfg.tools
    rec: dict[str, Any] = {"user": user.user_id, "session": user.session_id, "turn": turn_index,
                           "session_turn": user.first_turn + turn_index, "max_tokens": max_tokens,
                           "status": "ok", "error": None, "http_status": None, "replica": None,
                           "ttft_s": None, "itl_s": [], "e2e_s": None, "prompt_tokens": None,
                           "completion_tokens": None, "cached_tokens": None, "reply": ""}
    t0 = time.perf_counter()
    rec["start_unix_s"] = time.time()
    last = None
    parts: list[str] = []
    try:
        async with session.post(cfg.base_url.rstrip("/") + "/chat/completions", json=body,
                                headers={"x-user-id": user.user_id}) as r:
            rec["http_status"] = r.status
            rec["replica"] = r.headers.get("x-kvtier-replica")
            if r.status != 200:
                rec["status"], rec["error"] = "error", (await r.text())[:500]
                return rec
            # Read whatever arrived and split SSE events ourselves: one call per network chunk
            # instead of one per line keeps the client's own cost per token low (see
            # benchmarks/replay_overhead.py). Events in one chunk share its arrival time.
            done = False
            pending = b""
            loads, clock, itl = json.loads, time.perf_counter, rec["itl_s"]
            async for data_chunk in r.content.iter_any():
                now = clock()
                pending += data_chunk
                *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            done = True
                            break
                        ev = loads(data.decode())
                        if ev.get("usage"):
                            u = ev["usage"]
                            rec["prompt_tokens"] = u.get("prompt_tokens")
                            rec["completion_tokens"] = u.get("completion_tokens")
                            rec["cached_tokens"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
                        for ch in ev.get("choices") or ():
                            d = ch.get("delta") or {}
                            piece = d.get("content") or d.get("reasoning_content") or d.get("reasoning")
                            if piece:
                                if last is None:
                                    rec["ttft_s"] = now - t0
                                else:
                                    itl.append(now - last)
                                last = now
                                parts.append(d.get("content") or "")
                    if done:
                        break
                if done:
                    break
            if not done:
                rec["status"], rec["error"] = "cut", "stream ended without [DONE]"
    except asyncio.TimeoutError:
        rec["status"], rec["error"] = "timeout", f"no answer within {cfg.request_timeout_s} s"
    except (aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
        rec["status"], rec["error"] = "error", f"{type(e).__name__}: {e}"[:500]
    finally:
        rec["e2e_s"] = time.perf_counter() - t0
        rec["reply"] = "".join(parts)
    return rec


async def run_users(cfg: ClientConfig, users: list[VirtualUser], stop: asyncio.Event) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    queue: asyncio.Queue[VirtualUser] = asyncio.Queue()
    for u in users:
        queue.put_nowait(u)
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout_s)
    conn = aiohttp.TCPConnector(limit=0)
    peak = {"now": 0, "max": 0}

    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        async def worker() -> None:
            while not stop.is_set():
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
                        if gap and (await _wait(stop, gap)):
                            return
                        if stop.is_set():
                            return
                        msgs = list(turn.messages)
                        if cfg.history == "runtime" and i:
                            msgs = live + [m for m in turn.messages if m.get("role") != "assistant"][-1:]
                        rec = await _stream(session, cfg, user, i, msgs, turn.max_tokens)
                        records.append(rec)
                        prev_e2e = rec["e2e_s"] or 0.0
                        live = msgs + [{"role": "assistant", "content": rec["reply"]}]
                        if rec["status"] != "ok":
                            break
                finally:
                    peak["now"] -= 1

        await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    for r in records:
        r.pop("reply", None)
    records.append({"_achieved_concurrency": peak["max"]})
    return records


async def _wait(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
