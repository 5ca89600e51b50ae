"""The engine of kvtier sim: admission, scheduling, prefill and decode of the modelled GPU, with
vLLM/LMCache-named metrics (the OpenAI-compatible HTTP front over it: sim/api.py).

Latency model per request:
  TTFT = queue wait (real: waiting for a sequence slot and GPU blocks; vLLM's scheduler rules,
         docs/architecture.md "The simulator against a real vLLM": first come first served, the whole
         sequence must fit to start, no blocks reserved for output, recompute preemption)
       + offload load time                                   (real reads, measured)
       + the engine's steps that compute its prefill         (modelled, slept: see below)
  (with --calibration, the measured fixed cost and handling first: latency before it queues, off the engine)
  then one token per engine step.
The engine runs one step at a time, as vLLM's does: a step decodes one token of every decoding sequence and
computes prefill chunks in what is left of --max-num-batched-tokens (the running requests in the order they
started). A chunk of n new tokens over c held ones costs n / prefill_tps + prefill_pair_s x n x (c + n/2) (a
preset's prefill_overhead with a request's first chunk); a decode batch of k costs tpot_ms x (1 +
batch_slowdown x (k - 1)). A step with chunks lasts their compute plus step_share of the batch's step; a
decode-only step lasts the batch's, the engine busy for step_share of it (a calibration's measured interference,
results/ladder.py StepModel; a preset's is 0). So concurrent prefills queue behind each other (a recompute
delays everyone), a prefill pays for the decode batch it shares its steps with, and decoding sequences stall
while a chunk runs; offload loads of different requests overlap (they are I/O).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvtier.modelspec import ModelSpec
from kvtier.sim.decomposition import first_info, tokens_by_source
from kvtier.sim.metrics import VllmMetrics
from kvtier.sim.model import BLOCK_TOKENS, GpuPrefixCache, Offload, block_hashes
from kvtier.sim.requests import (
    BadRequest,
    Busy,
)
from kvtier.sim.tokens import chat_renderer
from kvtier.tokenizer import Tokenizer, load_tokenizer
from kvtier.units import GiB

if TYPE_CHECKING:
    from kvtier.sim.remote import RemoteOffload

MAX_MODEL_LEN = 131072
"""The modelled model's own context limit, tokens (Llama 3.1's): a prompt + max_tokens past it is refused
even when the simulated GPU could hold it."""


@dataclass(frozen=True)
class SimSettings:
    """The latency model and limits of one sim replica (preset values merged with the flags)."""

    model: ModelSpec
    served_model_name: str
    gpu_kv_gb: float
    prefill_tps: float
    tpot_ms: float
    prefill_overhead_ms: float
    batch_slowdown: float
    max_num_seqs: int
    seed: int
    default_max_tokens: int = 256
    max_waiting: int = 1024
    queue_timeout_s: float = 600.0
    block_tokens: int = BLOCK_TOKENS
    gpu_kv_tokens: int | None = None  # capacity in tokens (as vLLM reports it), instead of gpu_kv_gb
    max_model_len: int | None = None  # at most this (else what the GPU holds, up to MAX_MODEL_LEN)
    tokenizer: str = "auto"  # kvtier.tokenizer kinds; hf:DIR of a kvtier model make folder renders its template
    body_timeout_s: float = 30.0  # a request body must arrive within this (HTTP 408 otherwise)
    max_num_batched_tokens: int = 8192  # a prefill chunk, tokens (vLLM's chunked prefill)
    prefill_pair_s: float = 0.0  # attention: s per new token per token it attends over (0: the linear presets)
    prefill_prompt_s: float = 0.0  # handling per prompt token, cached or not (a calibration's; latency, off the GPU)
    prefill_char_s: float = 0.0  # ... and per character of the prompt's text
    prompt_chars_per_token: float = 0.0  # the calibration text's: characters of a prompt whose text is not known
    step_share: float = 0.0  # the share of the decode batch's step a prefill chunk's step pays (results/ladder.py)
    handling_load: float = 0.0  # handling takes (1 + this) as long while sequences run (results/ladder.py StepModel)
    timing_source: str = "assumed"  # assumed (a preset's figures) | measured (a ladder's fit: --calibration)
    timing_origin: str = ""  # the preset's name or the calibration file
    measured_prompt_tokens: int | None = None  # the calibration's range: longer prompts are extrapolated
    measured_running: int | None = None  # ... and more running sequences
    timing_error: dict[str, Any] | None = None  # the calibration's error (results/ladder.py TwinError), as JSON


class _Req:
    """One request as the scheduler sees it: its block keys (the prompt's full blocks, then one per block it
    fills while decoding), the blocks it holds, how many of its tokens have KV, and how often it was preempted."""

    __slots__ = (
        "keys",
        "prompt_len",
        "generated",
        "held",
        "ready",
        "hit_blocks",
        "computed",
        "preemptions",
        "seq",
        "keys_base",
        "pending",
        "overhead_s",
    )
    _ids = 0

    def __init__(self, keys: list[bytes], prompt_len: int, ready: asyncio.Future[None]) -> None:
        self.keys = keys
        self.prompt_len = prompt_len
        self.generated = 0
        self.held: list[bytes | None] = []
        self.ready = ready
        self.hit_blocks = 0
        self.computed = 0
        self.preemptions = 0
        self.seq: _Seq | None = None
        self.pending: asyncio.Future[bool] | None = None  # its prefill, while the engine's steps compute it
        self.overhead_s = 0.0  # a preset's fixed cost, paid with its first chunk
        _Req._ids += 1
        self.keys_base = _Req._ids

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.generated

    def block_key(self) -> bytes:
        """The key of the next block this request fills while decoding: unique to it (no other prompt can
        match generated tokens the replay never sends back), and kept so a preempted request hits it."""
        key = b"gen:" + self.keys_base.to_bytes(8, "little") + len(self.keys).to_bytes(4, "little")
        self.keys.append(key)
        return key


class _Seq:
    """One decoding sequence in the batch: tokens left, the sink for its tokens, token times, its request."""

    __slots__ = ("left", "emit", "stamps", "done", "req")

    def __init__(self, left: int, emit: Any, t_first: float, req: _Req) -> None:
        self.left = left
        self.emit = emit
        self.stamps = [t_first]
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.req = req


class SimEngine:
    """One replica's modelled GPU: admission, the prefix cache and the engine's steps (prefill chunks, decode batch).

    ``replica_id`` names the replica in the ``x-kvtier-replica`` header; the server sets it once
    it knows the port it listens on."""

    def __init__(
        self,
        s: SimSettings,
        offload: Offload | RemoteOffload | None,
        tokenizer: Tokenizer | None = None,
        replica_id: str = "",
    ) -> None:
        self.s = s
        self.replica_id = replica_id
        self.kvpt = s.model.kv_bytes_per_token
        self.block = s.block_tokens
        by_bytes = int(s.gpu_kv_gb * GiB // (self.kvpt * self.block))
        # vLLM's "KV cache size: N tokens" counts every block; it keeps one as its null block (never cached)
        blocks = s.gpu_kv_tokens // self.block - 1 if s.gpu_kv_tokens else by_bytes
        self.gpu = GpuPrefixCache(blocks, self.block)
        self.offload = offload
        self.tokenizer = tokenizer or load_tokenizer(s.tokenizer)
        self.render_chat = chat_renderer(s.tokenizer)
        self.metrics = VllmMetrics(s.served_model_name)
        self._running: list[_Req] = []  # in the order they started (the last one is preempted first)
        self._waiting: deque[_Req] = deque()  # first come, first served; a preempted request at the front
        self._seqs: set[_Seq] = set()
        self._ticker: asyncio.Task[None] | None = None
        self._arrived = asyncio.Event()  # a prefill joined: it may cut a decode-only step's idle part short
        self._describe_metrics()

    def _describe_metrics(self) -> None:
        """The series that say what this replica is: its KV geometry under vLLM's cache_config_info labels, each
        offload tier's capacity in tokens (what kvtier ladder sizes its floods by) and where its timing comes from."""
        m, s = self.metrics, self.s
        geometry = (str(self.block), str(self.gpu.capacity), str(self.gpu.capacity * self.block), str(self.kvpt))
        m.cache_config.labels(m.model_name, *geometry, "True").set(1)
        m.timing.labels(m.model_name, s.timing_source, s.timing_origin).set(1)
        usage = self.offload.store.usage() if isinstance(self.offload, Offload) else {}
        for tier, u in usage.items():
            m.tier_capacity.labels(m.model_name, tier).set(u["capacity_bytes"] // self.kvpt)

    def handling_s(self, prompt_tokens: int, own_s: float, chars: int | None = None) -> float:
        """A calibrated sim's measured fixed cost and handling per prompt token, as latency before the request queues:
        the ladder measures them one request at a time, where they are mostly the API server's own work (HTTP,
        the chat template, tokenizing, hashing every prompt token, cached or not), which a real engine overlaps
        with other requests' compute. Less what this process already spent for real on the request (parsing,
        tokenizing and hashing it: ``own_s``), so the same work is not counted twice. ``chars``: the prompt's
        characters (None: as many as the calibration's text has for that many tokens). While sequences run, the
        handling takes ``1 + handling_load`` as long (measured: a host-bound engine's API server shares its
        cores). 0 for a preset (its fixed cost is engine time)."""
        s = self.s
        if s.timing_source != "measured":
            return 0.0
        n = prompt_tokens * s.prompt_chars_per_token if chars is None else chars
        slow = 1.0 + (s.handling_load if self.running > 0 else 0.0)
        own = s.prefill_overhead_ms / 1e3 + slow * (s.prefill_prompt_s * prompt_tokens + s.prefill_char_s * n)
        return max(0.0, own - own_s)

    def recompute_tps(self, tokens: int, cached: int) -> float:
        """The rate at which this engine would recompute ``tokens`` after ``cached`` held ones, tokens/s, for the
        fetch gate: its linear rate slowed by attention over the context (the calibration's pair term), which
        makes a long prefix dear to recompute."""
        s = self.s
        return tokens / (tokens / s.prefill_tps + s.prefill_pair_s * tokens * (cached + tokens / 2))

    def timing_of(self, prompt_tokens: int) -> str:
        """How this request is timed: ``assumed`` (a preset), ``measured`` (inside the calibration's range) or
        ``extrapolated`` (a longer prompt, or more running sequences, than the ladder measured)."""
        s = self.s
        if s.timing_source != "measured":
            return "assumed"
        if (s.measured_prompt_tokens is not None and prompt_tokens > s.measured_prompt_tokens) or (
            s.measured_running is not None and self.running > s.measured_running
        ):
            self.metrics.extrapolated.inc()
            return "extrapolated"
        return "measured"

    def refresh_metrics(self) -> None:
        """Set the gauges (running, waiting, KV usage, the offload tier's) from the engine's state."""
        m = self.metrics
        m.running.set(self.running)
        m.waiting.set(self.waiting)
        m.kv_usage.set(self.gpu.used_blocks / self.gpu.capacity)
        if self.offload is not None:
            o = self.offload
            m.lmcache.update(o)
            if o.errors:
                m.offload_errors.set(o.errors)
                m.offload_bypassed.set(o.bypassed_loads)
            m.stores_skipped.set(o.bypassed_stores + getattr(o, "stores_skipped_busy", 0))
            m.stores_pending.set(o.pending_stores)

    # -- the scheduler: vLLM's rules for who runs and who holds which blocks ------------------------------
    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def _schedule(self) -> None:
        """Admit waiting requests first come, first served (a preempted one is at the front): the head starts
        when a slot is free, the running requests' prefills leave some of a step's token budget
        (--max-num-batched-tokens: vLLM schedules running requests first), and its whole sequence fits (vLLM's
        admission gate); while it cannot, no one behind it starts. A started request holds its cached prefix
        and the blocks of its first chunk at once."""
        budget = self.s.max_num_batched_tokens
        while self._waiting and len(self._running) < self.s.max_num_seqs:
            if sum(q.num_tokens - q.computed for q in self._running) >= budget:
                return  # a step's token budget goes to the running prefills first: none is left to start one
            r = self._waiting[0]
            hit = self.gpu.match(r.keys, (r.num_tokens - 1) // self.block)  # the last token is always computed
            total = -(-r.num_tokens // self.block)
            if not self.gpu.admissible(r.keys, hit, total):
                return
            first = min(hit * self.block + budget, r.num_tokens)
            if not self.gpu.grow(r.held, r.keys, -(-first // self.block)):
                return
            self._waiting.popleft()
            r.hit_blocks, r.computed = hit, hit * self.block
            self._running.append(r)
            if not r.ready.done():
                r.ready.set_result(None)

    def _preempt(self, victim: _Req) -> None:
        """vLLM's recompute preemption: the victim's blocks are freed (its cached ones stay cached, tail first),
        it goes back to the front of the queue and, when it starts again, computes its whole sequence anew."""
        self._running.remove(victim)
        self.gpu.free(victim.held)
        victim.preemptions += 1
        victim.ready = asyncio.get_running_loop().create_future()
        self._waiting.appendleft(victim)
        self.metrics.preemptions.inc()
        if victim.pending is not None and not victim.pending.done():
            victim.pending.set_result(False)  # its chunk in flight, if any, is lost
        if victim.seq is not None:
            self._seqs.discard(victim.seq)
            if not victim.seq.done.done():
                victim.seq.done.set_result(None)

    def _grow(self, r: _Req, tokens: int) -> bool:
        """Blocks for ``tokens`` of ``r``'s sequence, preempting the latest-started running request (``r``
        itself last) until they fit: False when ``r`` was the one preempted."""
        need = -(-tokens // self.block)
        while not self.gpu.grow(r.held, r.keys, need):
            victim = self._running[-1]
            self._preempt(victim)
            if victim is r:
                return False
        return True

    def _emitted(self, r: _Req) -> None:
        """A token decoded: its KV is computed (so a decoding request takes none of a step's prefill budget), and
        when it filled a block vLLM caches that block (nothing will match it, but it takes room in the LRU)."""
        r.generated += 1
        r.computed += 1
        i = r.num_tokens // self.block - 1
        if r.num_tokens % self.block == 0 and i < len(r.held) and i == len(r.keys):
            self.gpu.seal(r.held, i, r.block_key())

    def _finish(self, r: _Req) -> None:
        if r in self._running:
            self._running.remove(r)
        elif r in self._waiting:
            self._waiting.remove(r)
        self.gpu.free(r.held)
        self._schedule()
        self.refresh_metrics()

    async def _start(self, r: _Req) -> None:
        """Wait until ``r`` is admitted (``--queue-timeout``; Busy past it)."""
        self._schedule()
        self.refresh_metrics()
        try:
            await asyncio.wait_for(asyncio.shield(r.ready), self.s.queue_timeout_s)
        except TimeoutError:
            raise Busy(f"waited {self.s.queue_timeout_s:g} s for a slot (--queue-timeout)") from None

    async def _prefill(self, r: _Req, loaded: int = 0) -> bool:
        """Compute ``r``'s sequence from what it holds: the engine's steps take it chunk by chunk
        (``--max-num-batched-tokens`` less the step's decode tokens), each chunk's blocks allocated as it is
        scheduled; ``loaded`` tokens past the GPU hit came from the offload tier (blocks, no compute). False when
        ``r`` was preempted meanwhile."""
        s = self.s
        if r not in self._running:
            return False  # preempted between its admission and now: it queues again
        r.computed += loaded
        r.pending = asyncio.get_running_loop().create_future()
        # a preset's fixed cost is GPU time, paid in the request's first chunk; a calibrated sim's is latency
        # (generate: ``handling_s``)
        r.overhead_s = 0.0 if s.timing_source == "measured" else s.prefill_overhead_ms / 1e3
        self._arrived.set()
        self._wake()
        return await r.pending

    async def _compute(self, r: _Req, loaded: int = 0) -> None:
        """Until ``r``'s whole sequence is computed: started again (and computed anew) each time it is preempted."""
        while True:
            if r not in self._running:
                await self._start(r)
                loaded = 0
            if await self._prefill(r, loaded):
                return
            loaded = 0

    def _join(self, seq: _Seq) -> None:
        self._seqs.add(seq)
        self._wake()

    def _wake(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._steps())

    def _prefilling(self) -> list[_Req]:
        return [r for r in self._running if r.pending is not None and not r.pending.done()]

    def _chunks(self, budget: int) -> tuple[list[tuple[_Req, int, int]], float]:
        """This step's prefill chunks, vLLM's way: the running requests in the order they started, each taking
        what is left of the token budget (its blocks allocated now, preempting as decoding does), and the
        chunks' modelled compute, s (linear in their tokens plus attention over what each already holds:
        chunks add up to the whole prompt's cost exactly)."""
        s = self.s
        chunks: list[tuple[_Req, int, int]] = []
        work = 0.0
        for r in self._prefilling():
            if budget <= 0:
                break
            if r.pending is None or r.pending.done():
                continue  # preempted by an earlier chunk's blocks in this step
            n = min(budget, r.num_tokens - r.computed)
            if not self._grow(r, r.computed + n):
                continue
            work += r.overhead_s + n / s.prefill_tps + s.prefill_pair_s * n * (r.computed + n / 2)
            r.overhead_s = 0.0
            chunks.append((r, n, r.preemptions))
            budget -= n
        return chunks, work

    async def _steps(self) -> None:
        """Continuous batching, one timer per engine step (not one per token), timed as the module says: a chunk
        step lasts the chunks' compute plus ``step_share`` of the batch's step; a decode-only step keeps the engine
        busy for that share of it, and a prefill arriving after that part starts the next step at once (the
        batch's tokens ride with it). At a step's end every decoding sequence gets its next token, in the order
        the requests started, each first taking a new block when its sequence fills one (preempting the
        latest-started request when none is free, as vLLM does). Steps run on absolute deadlines."""
        s, clock, sleep = self.s, time.perf_counter, asyncio.sleep
        tpot, slow, share = s.tpot_ms / 1e3, s.batch_slowdown, s.step_share
        due = clock()
        while self._seqs or self._prefilling():
            decoding = [r for r in self._running if r.seq in self._seqs]
            self._arrived.clear()
            budget = s.max_num_batched_tokens - len(decoding)
            chunks, work = self._chunks(budget)
            if not chunks and not decoding:  # nothing the engine can run now: wait for a prefill, never spin
                try:
                    await asyncio.wait_for(self._arrived.wait(), 0.05)
                except TimeoutError:
                    pass
                due = clock()
                continue
            step = tpot * (1 + slow * (len(decoding) - 1)) if decoding else 0.0
            busy_until = due + (work + share * step if chunks else min(1.0, share) * step)
            due = busy_until if chunks else due + step
            now = clock()
            if due <= now:
                due = now  # behind schedule: do not try to catch up with a burst of steps
                await sleep(0)
            elif chunks or budget <= 0:  # no room for a prefill beside this batch: an arrival waits its turn
                await sleep(due - now)
            else:  # a decode-only step: a prefill arriving after its busy part starts the next step at once
                if busy_until > now:
                    await sleep(busy_until - now)
                try:
                    await asyncio.wait_for(self._arrived.wait(), max(0.0, due - clock()))
                    due = clock()
                    continue  # the batch's tokens ride with the prefill's step
                except TimeoutError:
                    pass
            now = clock()
            for r, n, epoch in chunks:
                if r.preemptions != epoch:  # preempted while its chunk ran: that work is lost
                    continue
                r.computed += n
                if r.computed >= r.num_tokens and r.pending is not None and not r.pending.done():
                    r.pending.set_result(True)
            for r in decoding:  # in the order they started
                q = r.seq
                if q is None or q not in self._seqs:
                    continue  # preempted earlier in this step
                if not self._grow(r, r.num_tokens + 1):
                    continue  # preempted: it starts again from the queue
                try:
                    sent = True if q.emit is None else q.emit(len(q.stamps))
                except Exception:  # noqa: BLE001 - one broken stream must not stop the batch
                    sent = False
                if sent is None:  # the client is not reading: this sequence waits for it (backpressure)
                    continue
                if sent:
                    q.stamps.append(now)
                    q.left -= 1
                    self._emitted(r)
                else:
                    q.left = 0  # the client went away: stop decoding this sequence
                if q.left <= 0:
                    self._seqs.discard(q)
                    if not q.done.done():
                        q.done.set_result(None)
            if self._waiting:
                self._schedule()  # what this step left of the budget may start the next request

    @property
    def max_model_len(self) -> int:
        """The longest prompt + max_tokens the simulated GPU can hold, tokens (vLLM's max_model_len is
        bounded the same way by its KV cache: a longer sequence is refused with HTTP 400)."""
        return min(self.s.max_model_len or MAX_MODEL_LEN, self.gpu.capacity * self.block)

    def too_long(self, need_tokens: int) -> BadRequest:
        """vLLM's wording, so clients classify it as they would vLLM's (replay: context-length)."""
        return BadRequest(
            f"This model's maximum context length is {self.max_model_len} tokens (the simulated GPU holds "
            f"{self.gpu.capacity} KV blocks of {self.block}). However, you requested {need_tokens} tokens",
            "max_tokens",
        )

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """BadRequest when prompt + max_tokens need more KV blocks than the simulated GPU holds."""
        need = math.ceil((prompt_tokens + max_tokens) / self.block)
        if need > self.gpu.capacity or prompt_tokens + max_tokens > self.max_model_len:
            raise self.too_long(prompt_tokens + max_tokens)

    def fewest_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can encode to (every token at the tokenizer's longest): no encoding."""
        return len(text.encode("utf-8", "surrogatepass")) // self.tokenizer.max_bytes_per_token

    def surely_too_long(self, text: str, max_tokens: int) -> bool:
        """Whether ``text`` cannot fit even at the tokenizer's longest tokens: checked before encoding,
        so an oversized prompt costs no tokenization."""
        return self.fewest_tokens(text) + max_tokens > self.max_model_len

    async def generate(
        self, prompt_ids: list[int], max_tokens: int, received: float | None = None, chars: int | None = None
    ) -> AsyncGenerator[tuple[str, Any], Any]:
        """Async generator: yields ('first', info) after prefill (the caller sends token 0); is then
        sent a plain function ``emit(i) -> bool | None`` (or None) that the decode ticker calls for
        tokens 1..max_tokens-1 (True sent; False the client is gone: decoding stops; None the client
        is not reading yet: the token waits), and yields ('done', tokens sent) at the end.
        Close it (aclose) to release the request's resources, whatever happened. ``received``: when the
        HTTP handler had the request (perf_counter), so the TTFT decomposition covers parsing and tokenizing.

        The first yield's info is the request's TTFT decomposition (``ttft_decomposition``): the prompt's
        tokens by source and the server's time to the first token by part; docs/serving.md."""
        s, m = self.s, self.metrics
        t_arrive = time.perf_counter()
        t_recv = received if received is not None else t_arrive
        self.check_fits(len(prompt_ids), max_tokens)
        t_hash = time.perf_counter()
        hashes = await asyncio.to_thread(block_hashes, prompt_ids, self.block)  # a long prompt stays off the loop
        own_s = (t_arrive - t_recv) + (time.perf_counter() - t_hash)  # this process's real handling so far
        await asyncio.sleep(self.handling_s(len(prompt_ids), own_s, chars))  # before it queues: no slot held
        t_queued = time.perf_counter()  # the decomposition's "receive" ends here: the handling is in it
        if self.waiting >= s.max_waiting:
            raise Busy(f"{self.waiting} requests are already waiting (--max-waiting {s.max_waiting})")
        r = _Req(hashes, len(prompt_ids), asyncio.get_running_loop().create_future())
        self._waiting.append(r)
        try:
            await self._start(r)
            t_admit = time.perf_counter()
            m.queue.observe(t_admit - t_queued)
            gpu_hit = r.hit_blocks * self.block
            m.pc_queries.inc(len(prompt_ids))
            m.pc_hits.inc(gpu_hit)
            load_s, ext = 0.0, 0
            keys: list[str] = []
            sources: list[str] = []  # the tier of each chunk loaded, in order
            first_chunk = 0
            if self.offload is not None:
                o = self.offload
                keys = await asyncio.to_thread(o.chunk_keys, prompt_ids)
                m.ext_queries.inc(max(0, len(prompt_ids) - gpu_hit))
                m.lm_req.inc(len(prompt_ids))
                # a (remote) tier's count is clamped to the prompt; with its breaker open the tier is not asked
                n = min(await o.alookup(keys), len(keys)) if o.admit("load") else 0
                m.lm_hit.inc(n * o.cfg.chunk_tokens)
                first_chunk = gpu_hit // o.cfg.chunk_tokens
                cand = max(0, n * o.cfg.chunk_tokens - gpu_hit)
                if cand > 0:
                    if o.gate(cand, self.recompute_tps(cand, gpu_hit)):
                        load_s, nbytes, found = await o.aload(keys[first_chunk:n], sources)
                        found = max(0, min(found, n - first_chunk))
                        if found < n - first_chunk:  # the tier promised more than it gave: recomputed
                            m.failed_loads.inc()
                        ext = max(0, (first_chunk + found) * o.cfg.chunk_tokens - gpu_hit)
                        ext = min(ext, len(prompt_ids) - 1 - gpu_hit)  # the last token is computed
                        m.lm_loaded.inc(found)
                    else:
                        m.gate_recompute.inc()
                m.ext_hits.inc(ext)
            t_fetched = time.perf_counter()
            await self._compute(r, ext if r.preemptions == 0 else 0)
            epoch = r.preemptions
            t_first = time.perf_counter()
            m.prefill.observe(t_first - t_admit)
            m.ttft.observe(t_first - t_arrive)
            m.prompt_tokens.inc(len(prompt_ids))
            if self.offload is not None:
                self.offload.store_later(keys)
            ct = self.offload.cfg.chunk_tokens if self.offload is not None else self.block
            by_source = tokens_by_source(len(prompt_ids), gpu_hit, ext, sources, first_chunk, ct)
            self.metrics.count_sources(by_source)
            times = (t_recv, t_queued, t_admit, t_fetched, t_first)
            info = first_info(gpu_hit, ext, load_s, by_source, times)
            info["timing"] = self.timing_of(len(prompt_ids))
            emit = yield "first", info
            self._emitted(r)  # token 0, computed with the prefill
            # Token 0 leaves with the prefill (the caller sends it); tokens 1.. come from the batch
            # step ticker, which hands one token to every running sequence per step.
            seq = _Seq(max_tokens - 1, emit, t_first, r)
            r.seq = seq
            try:
                while seq.left > 0:
                    if r.preemptions != epoch:  # preempted while decoding: queued, prompt + output computed anew
                        await self._compute(r)
                        epoch = r.preemptions
                    seq.done = asyncio.get_running_loop().create_future()
                    self._join(seq)
                    await seq.done
            finally:
                self._seqs.discard(seq)
                stamps = seq.stamps
                m.gen_tokens.inc(len(stamps) if max_tokens else 0)
                for a, b in zip(stamps, stamps[1:]):
                    m.itl.observe(b - a)
            max_tokens = len(stamps)
            t_end = time.perf_counter()
            m.decode.observe(t_end - t_first)
            m.e2e.observe(t_end - t_arrive)
            if max_tokens > 1:
                m.tpot.observe((t_end - t_first) / (max_tokens - 1))
            m.success.inc()
            yield "done", max_tokens
        finally:
            self._finish(r)
