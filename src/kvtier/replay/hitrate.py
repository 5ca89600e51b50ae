"""A controlled prefix-cache hit rate (``kvtier replay --synthetic --target-hit-rate R``): requests built so that a
share R of each prompt can come from cache, the server primed, the rate checked from its own counters before any
request is measured, and the measured run's rate checked again after it.

Each request is one user message: a shared *document* of round(R x ``--isl``) tokens, then ``--isl`` minus that of
its own. Request t of user u takes document (t x users + u) mod documents; every user is in flight at once
(``--concurrency`` >= ``--users``, checked), so the requests go out turn by turn and cycle through the documents in
that order: a document is reused after every other one was sent, each with its request's own tokens, which the
server caches too. Between two uses of a document the caches take in documents x ``--isl`` tokens: that is the
working set, and ``--working-set`` tokens make ``--working-set`` / ``--isl`` documents (one per virtual user when 0).
Sized above the GPU cache and within an offload tier, the hits come from that tier. Priming sends every document
once; the check sends the first of them again (with new own tokens) and reads the server's counters around it: the
prefix cache's hits (``vllm:prefix_cache_hits``) plus the connector's (``vllm:external_prefix_cache_hits``) over the
prompt tokens it was asked for (``vllm:prefix_cache_queries``). A server caches whole blocks, so a rate is reachable
to about one block over the prompt: with vLLM's 128-token blocks on the CPU build a 0.02 tolerance needs prompts of
~6,400 tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import numpy as np

from kvtier.config.replay import ReplayConfig
from kvtier.replay.datasets import LoadedDataset, Session, Turn
from kvtier.replay.scrape import Snapshot, scrape_snapshot
from kvtier.replay.synthetic import one_token_words
from kvtier.results.envelope import Status, StopCode, StopReason
from kvtier.results.replay import HitRateControl, ScrapeSummary
from kvtier.tokenizer import Tokenizer

CHECK_REQUESTS = 32
"""Documents the check sends again at most (all of them when there are fewer)."""

HITS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total")
QUERIES = "vllm:prefix_cache_queries_total"


@dataclass
class HitPlan:
    """The documents and the sizes a controlled replay sends."""

    documents: list[str]
    prefix_tokens: int
    own_tokens: int
    words: np.ndarray  # one-token words: the requests' own text is drawn from them

    def message(self, doc: int, own: str) -> dict[str, str]:
        return {"role": "user", "content": self.documents[doc] + own}


def controlled_dataset(cfg: ReplayConfig, tok: Tokenizer) -> LoadedDataset:
    """``cfg.users`` sessions of ``cfg.turns`` independent requests (no history: each turn is its own prompt), the
    request sent i-th (turn-major, as the users interleave) on document i mod the documents."""
    rate = cfg.target_hit_rate or 0.0
    vocab = np.array(one_token_words(tok))
    prefix = round(rate * cfg.isl)
    own = cfg.isl - prefix
    n_docs = max(1, cfg.working_set // cfg.isl) if cfg.working_set else cfg.users

    def text(rng: np.random.Generator, n: int) -> str:
        return "".join(vocab[rng.integers(0, len(vocab), n)].tolist()) if n else ""

    docs = [text(np.random.default_rng([cfg.synthetic_seed, 2, d]), prefix) for d in range(n_docs)]
    plan = HitPlan(docs, prefix, own, vocab)
    sessions = []
    for u in range(cfg.users):
        rng = np.random.default_rng([cfg.synthetic_seed, 3, u])
        turns = tuple(
            Turn((plan.message((t * cfg.users + u) % n_docs, text(rng, own)),), cfg.osl, 0.0) for t in range(cfg.turns)
        )
        sessions.append(Session(f"synthetic-{u}", turns, "synthetic"))
    note = (
        f"synthetic, target hit rate {rate:g}: {cfg.users} users x {cfg.turns} independent requests of {cfg.isl} "
        f"tokens ({prefix} of a shared document, {own} their own), {n_docs} documents (working set "
        f"{n_docs * cfg.isl:,} tokens), "
        f"OSL {cfg.osl}; {len(vocab)} one-token words of {tok.name}, seed {cfg.synthetic_seed}"
    )
    return LoadedDataset(sessions, "synthetic", [], [note], plan)


def rate_of(a: Snapshot, b: Snapshot) -> tuple[float | None, float, float]:
    """(hit rate, local hits, external hits) between two scrapes: (prefix-cache + connector hits) / queries."""
    q = (b.get(QUERIES) or 0.0) - (a.get(QUERIES) or 0.0)
    local, ext = ((b.get(n) or 0.0) - (a.get(n) or 0.0) for n in HITS)
    return (round((local + ext) / q, 6) if q > 0 else None), local, ext


async def _send(s: aiohttp.ClientSession, cfg: ReplayConfig, messages: list[dict[str, str]]) -> str | None:
    """One throwaway request (max_tokens 1); its error, or None."""
    body = {"model": cfg.model, "messages": messages, "max_tokens": 1}
    try:
        async with s.post((cfg.base_url or "").rstrip("/") + "/chat/completions", json=body) as r:
            await r.content.read(64 * 1024)
            return None if r.status == 200 else f"HTTP {r.status}"
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return f"{type(e).__name__}: {e}"


async def _pass(s: aiohttp.ClientSession, cfg: ReplayConfig, plan: HitPlan, docs: list[int], seed: int) -> list[str]:
    """Every document of ``docs`` once, each with own tokens of its own, ``cfg.concurrency`` at a time, in order."""
    rng = np.random.default_rng([cfg.synthetic_seed, seed])
    owns = ["".join(plan.words[rng.integers(0, len(plan.words), plan.own_tokens)].tolist()) for _ in docs]
    sem = asyncio.Semaphore(cfg.concurrency)

    async def one(d: int, own: str) -> str | None:
        async with sem:
            return await _send(s, cfg, [plan.message(d, own)])

    got = await asyncio.gather(*(one(d, o) for d, o in zip(docs, owns, strict=True)))
    return [e for e in got if e]


async def prime_and_check(cfg: ReplayConfig, plan: HitPlan, metrics_urls: list[str]) -> HitRateControl:
    """Send every document once (priming), then the first ``CHECK_REQUESTS`` again, and read the rate the server's
    counters give over the second pass (module docstring)."""
    n = len(plan.documents)
    checked = list(range(min(n, CHECK_REQUESTS)))
    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_read=cfg.read_timeout)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        errors = await _pass(s, cfg, plan, list(range(n)), 4)
        before = [await scrape_snapshot(s, u) for u in metrics_urls]
        errors += await _pass(s, cfg, plan, checked, 5)
        after = [await scrape_snapshot(s, u) for u in metrics_urls]
    rate = local = ext = None
    pairs = [(a, b) for a, b in zip(before, after, strict=True) if a is not None and b is not None]
    queried = sum((b.get(QUERIES) or 0.0) - (a.get(QUERIES) or 0.0) for a, b in pairs)
    if pairs and not errors and queried > 0:
        hits = [rate_of(a, b)[1:] for a, b in pairs]
        local, ext = (round(sum(h[k] for h in hits) / queried, 6) for k in (0, 1))
        rate = round(local + ext, 6)
    target = cfg.target_hit_rate or 0.0
    ok = rate is not None and abs(rate - target) <= cfg.hit_rate_tolerance
    if errors:
        why = f"{len(errors)} priming or check requests failed (first: {errors[0]})"
    elif rate is None:
        why = "the server's counters (vllm:prefix_cache_queries/hits) were not read: the rate cannot be checked"
    elif not ok:
        why = (
            f"the server's counters gave a hit rate of {rate:.4f} over the check ({len(checked)} requests), not "
            f"{target:g} +- {cfg.hit_rate_tolerance:g}: the working set ({n * cfg.isl:,} tokens: {n} documents with "
            f"their requests' own tokens) may not fit the server's caches, or its blocks are coarse for "
            f"{cfg.isl}-token prompts (raise --isl)"
        )
    else:
        why = ""
    return HitRateControl(
        target=target,
        tolerance=cfg.hit_rate_tolerance,
        documents=n,
        prefix_tokens=plan.prefix_tokens,
        own_tokens=plan.own_tokens,
        working_set_tokens=n * cfg.isl,
        primed=n,
        checked=len(checked),
        check_rate=rate,
        check_local_rate=local,
        check_external_rate=ext,
        check_ok=ok,
        problem=why,
    )


def measured_rate(c: HitRateControl, metrics: list[ScrapeSummary]) -> HitRateControl:
    """The measured run's rate from its scraped deltas, and whether it stayed within the tolerance."""
    q = sum(m.prefix_cache_queries or 0.0 for m in metrics)
    local = sum(m.prefix_cache_hits or 0.0 for m in metrics)
    ext = sum(m.external_prefix_cache_hits or 0.0 for m in metrics)
    if q <= 0:
        return c.model_copy(update={"within": None})
    rate = round((local + ext) / q, 6)
    return c.model_copy(
        update={
            "rate": rate,
            "local_rate": round(local / q, 6),
            "external_rate": round(ext / q, 6),
            "within": abs(rate - c.target) <= c.tolerance,
        }
    )


def hit_rate_verdict(c: HitRateControl, status: Status, reason: StopReason) -> tuple[Status, StopReason]:
    """A run whose primed rate was not the target measured nothing (failed); one whose measured rate left the
    tolerance is not complete (partial)."""
    if not c.check_ok:
        return Status.failed, StopReason(code=StopCode.hit_rate_off_target, message=c.problem)
    if c.within is False and status == Status.complete:
        return Status.partial, StopReason(
            code=StopCode.hit_rate_drifted,
            message=f"the measured run's hit rate {c.rate:.4f} left {c.target:g} +- {c.tolerance:g} (its check gave "
            f"{c.check_rate:.4f}): the server's caches did not hold the working set throughout",
        )
    return status, reason


__all__ = ["hit_rate_verdict", "HitPlan", "controlled_dataset", "prime_and_check", "measured_rate", "rate_of"]
