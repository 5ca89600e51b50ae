"""The ladder's measurements: prompts of known size, cells in random order, floods, bracketed requests, TPOT.

Each cell (context C, new tokens N, repeat) gets its own prefix, unique from its first block (a nonce follows the
chat template's few leading tokens), then, at concurrency 1:

    cold      prefix + a fresh suffix of N tokens      nothing cached: the whole prompt is computed
    gpu       prefix + another fresh suffix, at once   the prefix from the GPU's prefix cache
    <tier>    a flood of other prompts (sized to push the prefix out of the GPU and every offload tier above
              this one, but not out of this one), a settle, then prefix + another fresh suffix

Every measured request is bracketed by two scrapes of /metrics; ``verify`` decides from the deltas whether the
point's prompt came from where it was meant to (server.py says which counter shows what).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from kvtier.errors import ConfigError
from kvtier.ladder.server import STORES_PENDING, Reading, Server
from kvtier.modelmaker import WORDS
from kvtier.replay.client import ClientConfig, stream_request
from kvtier.replay.datasets import VirtualUser
from kvtier.replay.scrape import scrape_snapshot as scrape
from kvtier.results.engine_log import EngineLogTail
from kvtier.results.ladder import HANDLING_HIT_SHARE, HandlingPoint, LadderPoint, LoadedPoint, Shown, TpotPoint
from kvtier.tokenizer import Tokenizer

CHUNK_TOKENS = 256
"""The offload tiers' unit of storage in LMCache and the sim: a tier point may miss up to one chunk of the prefix."""
FLOOD_MARGIN = 1.25
"""A flood is this many times the tokens it must push past, so LRU order and partial blocks cannot leave the prefix."""
PROBE_WORDS = (64, 512)
ENGINE_RECORD_WAIT_S = 10.0
"""How long a point waits for its request's record in the engine's log (written a step or two after its reply)."""


class Prompter:
    """Filler text of a given token count: unique words from a seeded generator, sized by the server's own tokens
    per word (two probes) or exactly by ``tokenizer``."""

    def __init__(self, rng: np.random.Generator, tag: str, tokenizer: Tokenizer | None = None) -> None:
        self.rng = rng
        self.tag = tag
        self.tokenizer = tokenizer
        self.tokens_per_word = 1.0
        self.overhead = 0
        self._n = 0

    def words(self, count: int) -> str:
        return " ".join(self.rng.choice(WORDS, size=max(0, count)).tolist())

    def text(self, tokens: int, unique: bool = True) -> str:
        """About ``tokens`` tokens of text (exact with a tokenizer); ``unique`` starts it with a nonce."""
        head = ""
        if unique:
            self._n += 1
            head = f"ladder {self.tag} {self._n}: "
        if self.tokenizer is None:
            return head + self.words(round(max(0, tokens - 6) / self.tokens_per_word))
        return self._fit(head, self.words(int(tokens * 1.3) + 8).split(" "), tokens)

    def dense(self, tokens: int) -> str:
        """About ``tokens`` tokens of single letters apart (far fewer characters per token than words: the
        handling sweep's second kind of text), starting with a nonce; exact with a tokenizer."""
        self._n += 1
        head = f"ladder {self.tag} {self._n}: "
        letters = self.rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(tokens * 1.2) + 8).tolist()
        if self.tokenizer is None:
            return head + " ".join(letters[: max(0, tokens - 6)])
        return self._fit(head, letters, tokens)

    def _fit(self, head: str, items: list[str], tokens: int) -> str:
        """``head`` and the most of ``items`` (space apart) whose text is at most ``tokens`` tokens (a tokenizer)."""
        assert self.tokenizer is not None
        count = self.tokenizer.count
        lo, hi = 0, len(items)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if count(head + " ".join(items[:mid])) <= tokens:
                lo = mid
            else:
                hi = mid - 1
        return head + " ".join(items[:lo])


def first_token_s(rec: dict[str, Any]) -> float | None:
    """A request's first-token time for the ladder: the first event that carries a choice (vLLM and the sim send
    the role delta with token 0), so a token the detokenizer holds back (a partial UTF-8 byte, common with dummy
    weights) counts; the first content delta where a server sends no such event."""
    first: float | None = rec.get("first_event_s", rec["ttft_s"])
    return first


def verify(
    source: str,
    context: int,
    prompt_tokens: int | None,
    r: Reading | None,
    usage_cached: int | None,
    s: Server,
    engine: bool = False,
) -> tuple[bool, str | None, Shown, int | None]:
    """Whether the counters show the intended source; returns (verified, why not, what they showed, cached tokens).

    cold: fewer cached tokens than one block (or 2 % of the prompt); gpu: the GPU's hits cover the prefix (at least
    half of it and all but one block of 80 % of it) and no offload tier served any; a tier: that tier served the
    prefix (the same bound, one 256-token chunk instead of a block) and more than the GPU and every other tier.
    ``engine``: ``r`` is the request's own record from inside the engine (--engine-log), not two scrapes' delta:
    it holds this request alone, so the reading is not disturbed by any other request in flight."""
    block = s.block_tokens or 16
    tiers = dict(r.tiers) if r is not None else {}
    basis = "counters" if r is not None and r.gpu is not None else ("usage" if usage_cached is not None else "none")
    if engine and r is not None:
        basis = "engine"
    shown = Shown(
        gpu_hit_tokens=r.gpu if r else None,
        external_hit_tokens=r.external if r else None,
        tiers=tiers,
        usage_cached_tokens=usage_cached,
        basis=basis,
    )
    if prompt_tokens is None:
        return False, "the response had no usage.prompt_tokens", shown, None
    if basis == "none":
        return False, "neither counters nor usage.cached_tokens: nothing shows where the prompt came from", shown, None
    gpu = (r.gpu or 0) if basis in ("counters", "engine") and r is not None else None
    ext = (r.external or 0) if r is not None and r.external is not None else 0
    cached = (gpu or 0) + ext if gpu is not None else usage_cached
    said = f"{'the engine record' if engine else 'counters'}: gpu {gpu}, external {ext}" + "".join(
        f", {t} {n}" for t, n in tiers.items()
    )
    if basis == "usage":
        said = f"usage.cached_tokens {usage_cached}"
    cached_n = cached or 0
    if source == "cold":
        if cached_n < max(block, 0.02 * prompt_tokens):
            return True, None, shown, cached
        return False, f"{cached_n} of {prompt_tokens} tokens were cached ({said})", shown, cached
    if source == "gpu":
        need = max(0.5 * context, 0.8 * context - block)
        if basis == "usage" and s.tiers:
            return False, "usage.cached_tokens cannot tell the GPU from an offload tier (no counters)", shown, cached
        gpu_hit = gpu if gpu is not None else cached_n
        if gpu_hit >= need and ext == 0 and not any(tiers.values()):
            return True, None, shown, cached
        return False, f"wanted >= {need:.0f} GPU-hit tokens and no offload ({said})", shown, cached
    tier = next((t for t in s.tiers if t.name == source), None)
    if basis == "engine":  # the request's own record names its sources, whether or not a counter does
        named = tier is not None or source in tiers
    else:
        named = tier is not None and basis == "counters" and tier.counter is not None
    if not named:
        return False, f"the server exposes no counter of the tokens tier {source} served ({said})", shown, cached
    got = tiers.get(source, 0)
    need = max(0.5 * context, 0.8 * context - max(block, CHUNK_TOKENS))
    others = max([gpu or 0, *[n for t, n in tiers.items() if t != source]])
    if got >= need and got > others:
        return True, None, shown, cached
    return False, f"wanted >= {need:.0f} tokens from {source}, more than any other source ({said})", shown, cached


def default_contexts(max_len: int, largest_new: int, overhead: int) -> list[int]:
    """Six log-spaced prefix lengths from 256 to what fits under ``max_len`` with the largest suffix."""
    top = max_len - largest_new - overhead - 16
    if top < 256:
        return [max(32, top)]
    return sorted({int(round(x / 16) * 16) for x in np.geomspace(256, top, 6)})


def flood_sizes(
    s: Server, tiers: Sequence[str], overrides: dict[str, int]
) -> dict[str, tuple[int | None, int | None, str | None]]:
    """Per tier: (tokens to flood, tokens it and the tiers above hold, why it cannot be reached). The flood must push
    a prefix out of the GPU and every offload tier above this one: FLOOD_MARGIN x the larger of the GPU's capacity
    and the tiers' above it summed (the offload tiers are one waterfall; the GPU keeps copies beside it)."""
    caps = {t.name: t.capacity_tokens for t in s.tiers}
    gpu = overrides.get("gpu", s.gpu_kv_tokens)
    out: dict[str, tuple[int | None, int | None, str | None]] = {}
    for i, name in enumerate(tiers):
        above = [caps.get(t) for t in tiers[:i]]
        holds = None if any(c is None for c in [*above, caps.get(name)]) else sum(above) + (caps.get(name) or 0)  # type: ignore[arg-type]
        if name in overrides:
            out[name] = (overrides[name], holds, None)
            continue
        if gpu is None or any(c is None for c in above):
            out[name] = (
                None,
                holds,
                f"the server does not report the capacity above {name}: give --flood-tokens {name}=N",
            )
            continue
        need = int(math.ceil(FLOOD_MARGIN * max(gpu, sum(c for c in above if c))))
        if holds is not None and need >= holds:
            past = max(gpu, sum(c for c in above if c))
            why = (
                f"a flood of {need:,} tokens (past the GPU's {gpu:,} and the tiers above) would also push the "
                f"prefix out of {name}, which holds {holds:,} with them: give {name} more than {need:,} tokens of "
                "room, or the server a smaller GPU KV cache (the sim's --gpu-kv-gb, vLLM's "
                "--num-gpu-blocks-override)"
                + (
                    f", or --flood-tokens {name}=N with {past:,} < N < {holds:,} (no margin: the prefix may stay)"
                    if holds > past
                    else ""
                )
            )
            out[name] = (None, holds, why)
            continue
        out[name] = (need, holds, None)
    return out


@dataclass
class LadderSession:
    """The open connection to the server and what every request needs."""

    http: aiohttp.ClientSession
    client: ClientConfig
    metrics_url: str
    server: Server
    prompter: Prompter
    stop: asyncio.Event
    deadline: float | None  # monotonic seconds
    max_requests: int
    sent: int = 0
    lost: bool = False  # a request could not reach the server: nothing more is sent
    failures: list[tuple[str, str, int | None]] = field(default_factory=list)
    user: VirtualUser = field(default_factory=lambda: VirtualUser("ladder", "ladder", 0, ()))
    engine_log: EngineLogTail | None = None  # --engine-log: each point verified by its own record

    def bounded(self) -> str | None:
        """Why no further request may be sent (None: it may)."""
        if self.stop.is_set():
            return "interrupted"
        if self.lost:
            return "server-unavailable"
        if self.deadline is not None and time.monotonic() >= self.deadline:
            return "duration"
        if self.max_requests and self.sent >= self.max_requests:
            return "max-requests"
        return None

    async def send(self, text: str, max_tokens: int = 1) -> dict[str, Any]:
        self.sent += 1
        rec, _ = await stream_request(
            self.http, self.client, self.user, 0, [{"role": "user", "content": text}], max_tokens
        )
        if rec["status"] != "ok":
            self.failures.append((rec["cause"] or "error", rec["error"] or "", rec["http_status"]))
            self.lost = self.lost or rec["cause"] == "connection"
        return dict(rec)

    async def probe(self) -> None:
        """Two requests of known word counts: the server's tokens per word and the template's own tokens."""
        got, texts = [], []
        p = self.prompter
        for n in PROBE_WORDS:
            texts.append(p.words(n))
            rec = await self.send(texts[-1])
            if rec["status"] != "ok" or not rec["prompt_tokens"]:
                why = rec["error"] or "the server sent no usage (kvtier ladder asks for stream_options.include_usage)"
                raise ConfigError(
                    f"--base-url: the probe request failed ({rec['cause'] or 'no usage.prompt_tokens'}: "
                    f"{why}); is it an OpenAI-compatible API?"
                )
            got.append(rec["prompt_tokens"])
        p.tokens_per_word = max(0.1, (got[1] - got[0]) / (PROBE_WORDS[1] - PROBE_WORDS[0]))
        own = p.tokenizer.count(texts[0]) if p.tokenizer is not None else PROBE_WORDS[0] * p.tokens_per_word
        p.overhead = max(0, round(got[0] - own))  # the chat template's tokens around the text

    async def point(
        self,
        text: str,
        source: str,
        context: int,
        new: int,
        rep: int,
        group: int,
        seq: int,
        flood: int,
        held_back: bool,
    ) -> LadderPoint:
        before = await scrape(self.http, self.metrics_url)
        start = time.time()
        rec = await self.send(text)
        after = await scrape(self.http, self.metrics_url)
        reading = self.server.reading(before, after)
        ttft = first_token_s(rec)
        ok = rec["status"] == "ok" and ttft is not None
        own = await self.engine_record(rec.get("request_id")) if ok and self.engine_log is not None else None
        why: str | None
        if ok and self.engine_log is not None and own is None:
            verified, cached = False, None
            why = f"no record of request {rec.get('request_id')} in the engine log within {ENGINE_RECORD_WAIT_S:g} s"
            shown = Shown(gpu_hit_tokens=None, external_hit_tokens=None, usage_cached_tokens=None, basis="none")
        elif ok:
            got = own or reading
            verified, why, shown, cached = verify(
                source, context, rec["prompt_tokens"], got, rec["cached_tokens"], self.server, own is not None
            )
        else:
            why = (
                f"request failed: {rec['cause']}: {rec['error']}"
                if rec["status"] != "ok"
                else "the stream carried no token (no event with a choice)"
            )
            verified, cached = False, None
            shown = Shown(gpu_hit_tokens=None, external_hit_tokens=None, usage_cached_tokens=None, basis="none")
        return LadderPoint(
            seq=seq,
            group=group,
            source=source,
            context_tokens=context,
            new_tokens=new,
            repeat=rep,
            prompt_tokens=rec["prompt_tokens"],
            cached_tokens=cached,
            ttft_s=round(ttft, 6) if ttft is not None else None,
            server_ttft_s=rec["server_ttft_s"],
            verified=verified,
            why=why,
            shown=shown,
            flood_tokens=flood,
            held_back=held_back,
            start_unix_s=round(start, 3),
            status="ok" if ok else "error",
            cause=None if ok else rec["cause"] or "error",
        )

    async def engine_record(self, request_id: str | None) -> Reading | None:
        """The request's own record from the engine's log, as a reading (None: not written within the wait)."""
        if request_id is None or self.engine_log is None:
            return None
        deadline = time.monotonic() + ENGINE_RECORD_WAIT_S
        while True:
            self.engine_log.poll()
            e = self.engine_log.by_id.pop(request_id, None)
            if e is not None:  # the tiers by the names the ladder found them under: vLLM's by-source labels
                known = {t.name for t in self.server.tiers}
                tiers: dict[str, int] = {}
                for name, n in e.tier_tokens.items():
                    label = name if name in known else self.engine_log.sources.get(name, name)
                    tiers[label] = tiers.get(label, 0) + n
                return Reading(gpu=e.tokens.get("gpu", 0), external=e.external_tokens, tiers=tiers)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

    async def flood(self, tokens: int, concurrency: int) -> int:
        """Send unique prompts totalling ``tokens`` (each at most what the server takes), ``concurrency`` at once;
        returns the tokens the server said it received."""
        size = max(256, min((self.server.max_model_len or 8192) - 64, 8192))
        sizes = [size] * (tokens // size) + ([tokens % size] if tokens % size >= 64 else [])
        got = 0
        queue = list(sizes)

        async def worker() -> None:
            nonlocal got
            while queue and self.bounded() is None:
                n = queue.pop()
                rec = await self.send(self.prompter.text(n))
                got += rec["prompt_tokens"] or 0

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return got

    async def drain(self, settle_s: float, limit_s: float = 60.0) -> None:
        """After a flood: wait until the server's stores are done where it says (the sim's
        kvtier_sim:offload_stores_pending reads 0; at most ``limit_s``), then ``settle_s`` more, so the flood's
        writes do not share the measured request's time."""
        t_end = time.monotonic() + limit_s
        while time.monotonic() < t_end:
            snap = await scrape(self.http, self.metrics_url)
            pending = snap.get(STORES_PENDING) if snap is not None else None
            if not pending:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(settle_s)

    async def tpot_round(self, running: int, tokens: int) -> list[dict[str, Any]]:
        """One round of the TPOT sweep at one level: ``running`` requests at once, each decoding ``tokens``."""
        return list(await asyncio.gather(*(self.send(self.prompter.text(64), tokens) for _ in range(running))))

    @staticmethod
    def tpot_point(running: int, recs: Sequence[dict[str, Any]]) -> TpotPoint:
        """A level's rounds: the median over all its requests of their time per token (one request alone is one
        sample: rounds keep a level from resting on it)."""
        # each request's decode time per token after its first, (e2e - first token) / (completion tokens - 1): a
        # server that coalesces tokens into one network chunk (vLLM's API server under load does) shows gaps of 0 and
        # of two tokens, which move a median of gaps but not this mean; an early EOS counts its own tokens. A stream
        # that came in a few bursts (fewer separate arrivals than a quarter of its tokens) times the bursts, not the
        # tokens: it is left out
        per = []
        for r in recs:
            first, n = first_token_s(r), r["completion_tokens"] or 0
            arrivals = 1 + sum(1 for g in r["itl_s"] if g > 0)
            if r["status"] == "ok" and first is not None and r["e2e_s"] and n >= 2 and arrivals >= (n - 1) / 4:
                per.append((r["e2e_s"] - first) / (n - 1))
        return TpotPoint(
            running=running,
            tpot_s=round(float(np.median(per)), 6) if per else None,
            requests=len(recs),
            bursty=sum(r["status"] == "ok" for r in recs) - len(per),
            failed=sum(r["status"] != "ok" for r in recs),
        )

    async def loaded(
        self, running: int, prompts: Sequence[int], decode_tokens: int, cached: int = 0, cached_repeats: int = 0
    ) -> list[LoadedPoint]:
        """The interference sweep at one level: ``running`` streams decode ``decode_tokens`` each while cold prompts
        of ``prompts`` tokens (each a fresh text, one at a time) are timed to their first token; with ``cached``,
        also ``cached_repeats`` prompts of a ``cached``-token prefix cached before the streams start, each timed
        alone first (their median is every such probe's ``alone_s``). A probe counts (``valid``) only when every
        stream was still decoding as its first token came: the streams are started again (up to three times) for
        the probes left when they end first."""
        out: list[LoadedPoint] = []
        left: list[tuple[int, str | None]] = [(n, None) for n in prompts]
        alone = None
        if cached and cached_repeats and not self.bounded():
            prefix = self.prompter.text(cached)
            await self.send(prefix + " end")  # cached from here on
            times = [first_token_s(r) for r in [await self.send(f"{prefix} alone {i}") for i in range(cached_repeats)]]
            ok = [t for t in times if t is not None]
            alone = float(np.median(ok)) if ok else None
            left += [(cached, f"{prefix} among {running} {i}") for i in range(cached_repeats)] if alone else []
        for _ in range(3):
            if not left or self.bounded():
                break
            streams = [asyncio.create_task(self.send(self.prompter.text(64), decode_tokens)) for _ in range(running)]
            try:
                await self._until_running(running, streams)
                await asyncio.sleep(0.1)  # past the streams' own prefills: they decode
                while left and self.bounded() is None and not any(t.done() for t in streams):
                    n, text = left[0]
                    rec = await self.send(text if text is not None else self.prompter.text(n))
                    ended = [t for t in streams if t.done()]
                    ttft = first_token_s(rec)
                    why = None
                    if rec["status"] != "ok" or ttft is None:
                        why = f"request failed: {rec['cause']}: {rec['error']}"
                    elif ended:
                        continue  # a stream ended while it waited: measured again with fresh streams
                    elif text is not None and (rec["cached_tokens"] or 0) < HANDLING_HIT_SHARE * rec["prompt_tokens"]:
                        why = f"the cached prefix was not found: {rec['cached_tokens']} of {rec['prompt_tokens']}"
                    hit = {"cached_tokens": rec["cached_tokens"] or 0, "alone_s": round(alone or 0, 6)} if text else {}
                    out.append(LoadedPoint(running=running, prompt_tokens=rec["prompt_tokens"],
                                           ttft_s=round(ttft, 6) if ttft is not None else None,
                                           valid=why is None, why=why, **hit))  # fmt: skip
                    left.pop(0)
            finally:
                for t in streams:
                    t.cancel()
                await asyncio.gather(*streams, return_exceptions=True)
                await self._until_running(0, [])
        stopped = self.bounded()
        for n, _ in left:
            why = (
                f"not measured: {stopped}" if stopped else f"the {running} streams kept ending before a {n}-token probe"
            )
            out.append(LoadedPoint(running=running, prompt_tokens=None, ttft_s=None, valid=False, why=why))
        return out

    async def handling(self, contexts: Sequence[int], repeats: int) -> list[HandlingPoint]:
        """The handling sweep: for each context and kind of text (words, dense), ``repeats`` times, a fresh
        prefix sent once to be cached, then again with another ending: the second's TTFT is mostly the request's
        handling (its compute is a few tokens), so text with fewer characters per token tells what handling costs
        per token from what it costs per character."""
        out: list[HandlingPoint] = []
        for c in contexts:
            for style in ("words", "dense"):
                for _ in range(repeats):
                    if self.bounded():
                        return out
                    prefix = self.prompter.text(c) if style == "words" else self.prompter.dense(c)
                    await self.send(prefix + " end")
                    text = prefix + " again"
                    rec = await self.send(text)
                    ttft, total, hit = first_token_s(rec), rec["prompt_tokens"], rec["cached_tokens"]
                    valid = rec["status"] == "ok" and ttft is not None and bool(total) and hit is not None
                    valid = valid and (hit or 0) >= HANDLING_HIT_SHARE * (total or 0)
                    t = round(ttft, 6) if ttft is not None else None
                    out.append(HandlingPoint(style=style, prompt_tokens=total, cached_tokens=hit, chars=len(text),
                                             ttft_s=t, valid=valid))  # fmt: skip
        return out

    async def _until_running(self, count: int, streams: Sequence[asyncio.Task[Any]], limit_s: float = 10.0) -> None:
        """Wait until the server's running batch holds ``count`` requests (vllm:num_requests_running; a server
        without it: a fixed 0.5 s), at most ``limit_s``, or one of ``streams`` ended."""
        t_end = time.monotonic() + limit_s
        while time.monotonic() < t_end and not any(t.done() for t in streams):
            snap = await scrape(self.http, self.metrics_url)
            now = snap.get("vllm:num_requests_running") if snap is not None else None
            if now is None:
                await asyncio.sleep(0.5)
                return
            if (now >= count) if count else (now == 0):
                return
            await asyncio.sleep(0.02)


Progress = Callable[[LadderPoint], None]

__all__ = ["Prompter", "LadderSession", "verify", "default_contexts", "flood_sizes", "Progress"]
