"""Per-request truth from inside vLLM: where each request's prompt came from and where its time to the first token
went, recorded by kvtier's offloading connector and written as JSONL (``request_log`` in
``kv_connector_extra_config``; off by default).

The scheduler side sees every request: the connector stamps it when the scheduler first gets it, when the lookup
that admitted it started, when it was admitted (its blocks allocated), when its loads were done, when its
prefill was first scheduled and when the step that finished its prefill came back (the first token exists). The
admission's split is vLLM's own: the prompt tokens its prefix cache held (``PrefillStats.num_local_cached_tokens``,
what ``vllm:prefix_cache_hits`` counts), the tokens the connector loads (what ``vllm:external_prefix_cache_hits``
counts), split by the kvtier tier each loaded block came from, and the rest recomputed. The workers report each
request's loads (kvtier/vllm/worker.py ``RequestIO``: when the first was submitted and the last finished, blocks,
bytes and the tier's own read time by tier, blocks that failed) through the connector's worker metadata.

Every stamp is ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process on a Linux host, the client's
too), so ``kvtier replay`` joins a record to the request it sent (``X-Request-Id``) and measures the transits on
either side of the engine (kvtier/replay/engine_join.py).

Hot path: the scheduler thread only updates a dict per request; a finished request's record is handed to a writer
thread through a bounded queue (a full queue drops the record and counts it). The writer appends each record as
one ``write`` of one line to a file opened with O_APPEND (a reader never sees half a line from it), stops at the
size cap (``request_log_mb``) and counts what it dropped, and at close writes a footer with the counts. The file's
first line of each engine start is a header (schema, engine, tiers, cap); an engine restarted onto the same file
appends a new header. No vLLM import here: the connector (kvtier/vllm/spec.py) calls it.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.vllm.worker import RequestIO

log = logging.getLogger("kvtier.vllm")

SCHEMA = "kvtier-engine-requests/1"
MAX_PENDING = 4096
"""Finished records waiting for the writer at most; past it a record is dropped and counted (cause ``queue``)."""


@dataclass
class Stamps:
    """One engine request while the scheduler has it (all stamps ``time.monotonic()`` seconds)."""

    req_id: str
    prompt_tokens: int
    arrived_s: float  # the connector saw it (the engine core's scheduler took it from the API server)
    arrival_unix_s: float | None  # vLLM's own arrival stamp (the API server, wall clock)
    wall_minus_mono_s: float  # time.time() - time.monotonic() when it arrived: converts the stamp above
    lookup_s: float | None = None  # the lookup that admitted it began
    admitted_s: float | None = None  # its blocks allocated (update_state_after_alloc)
    admitted_once: bool = False
    preemptions: int = 0  # vLLM's count for the request (Request.num_preemptions)
    gpu_tokens: int = 0  # vLLM's prefix cache (first admission)
    external_tokens: int = 0  # loaded by the connector (first admission)
    tier_tokens: dict[str, int] = field(default_factory=dict)  # the external tokens by the tier of each block
    key_tiers: dict[Any, str] = field(default_factory=dict)  # the tier each loaded block was planned from
    loads_planned: int = 0  # load jobs the scheduler made for it
    loaded_s: float | None = None  # the scheduler learnt its (first admission's) loads were done
    io: RequestIO = field(default_factory=RequestIO)
    prefill_s: float | None = None  # first step that scheduled prompt tokens of it
    final_step: int | None = None  # the step that finishes its prompt
    first_token_s: float | None = None  # that step's output reached the scheduler
    preempted_before_first_token: bool = False
    store_blocks: dict[str, int] = field(default_factory=dict)  # stores started for it, by tier
    status: str = ""


class RequestLog:
    """The scheduler side's per-request records and their writer (module docstring). Not thread-safe for the
    stamping calls (vLLM's scheduler makes them from one thread); the writer runs on its own thread."""

    def __init__(
        self,
        path: str,
        cap_bytes: int,
        header: Mapping[str, Any],
        block_tokens: int,
        block_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        tier_prefix: str = "",
    ) -> None:
        self.path = path
        self.tier_prefix = tier_prefix  # "shared-" on a shared cache server: the workers name its tiers plainly
        self.cap_bytes = cap_bytes
        self.block_tokens = block_tokens
        self.block_bytes = block_bytes  # one block across every worker of the engine
        self.clock = clock
        self.wall = wall
        self._live: dict[str, Stamps] = {}
        self._by_step: dict[int, list[str]] = {}
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._cv = threading.Condition()
        self._closed = False
        self.written = 0
        self.bytes_written = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self._fd: int | None = _open_log(path)
        start = {"kind": "header", "schema": SCHEMA, **header, "cap_bytes": cap_bytes, "pid": os.getpid()}
        self._emit({**start, "wall_minus_mono_s": round(wall() - clock(), 6)})
        self._thread = threading.Thread(target=self._write_loop, name="kvtier-request-log", daemon=True)
        self._thread.start()

    # -- stamps (the scheduler's thread) ----------------------------------------------------------------
    def seen(self, req_id: str, prompt_tokens: int, arrival_unix_s: float | None) -> None:
        now = self.clock()
        self._live[req_id] = Stamps(req_id, prompt_tokens, now, arrival_unix_s, self.wall() - now)

    def lookup(self, req_id: str, started_s: float) -> None:
        t = self._live.get(req_id)
        if t is not None and t.admitted_s is None:
            t.lookup_s = started_s  # the last lookup before the admission is the one that admitted it

    def admitted(
        self,
        req_id: str,
        gpu_tokens: int,
        external_tokens: int,
        tier_tokens: Mapping[str, int],
        preemptions: int,
        key_tiers: Mapping[Any, str] | None = None,
    ) -> None:
        """Blocks allocated for the request: its first admission's split is the record's, as vLLM counts it (a
        request readmitted after a preemption is counted by vLLM as preempted, not again; a request whose load
        finished is allocated again with nothing to load, which changes nothing here)."""
        t = self._live.get(req_id)
        if t is None:
            return
        if preemptions > t.preemptions:
            t.preemptions = preemptions
            if t.first_token_s is None:
                t.preempted_before_first_token = True
        if t.admitted_once:
            return
        t.admitted_once = True
        t.admitted_s = self.clock()
        t.gpu_tokens = gpu_tokens
        t.external_tokens = external_tokens
        t.tier_tokens = dict(tier_tokens)
        t.key_tiers = dict(key_tiers or {})
        if t.lookup_s is None:
            t.lookup_s = t.admitted_s

    def load_planned(self, req_id: str) -> None:
        t = self._live.get(req_id)
        if t is not None:
            t.loads_planned += 1

    def stores_planned(self, req_id: str, blocks_by_tier: Mapping[str, int]) -> None:
        t = self._live.get(req_id)
        if t is not None:
            for k, n in blocks_by_tier.items():
                t.store_blocks[k] = t.store_blocks.get(k, 0) + n

    def scheduled(self, step: int, scheduled: Mapping[str, tuple[int, int]]) -> None:
        """A step built: ``scheduled`` maps each request scheduled in it to (tokens computed before it, tokens it
        computes). The step that reaches the end of a request's prompt is the one whose output is its first token."""
        now = self.clock()
        for rid, (before, n) in scheduled.items():
            t = self._live.get(rid)
            if t is None or t.final_step is not None or n <= 0:
                continue
            if t.prefill_s is None:
                t.prefill_s = now
            if before + n >= t.prompt_tokens:
                t.final_step = step
                self._by_step.setdefault(step, []).append(rid)

    def step_done(self, step: int | None) -> None:
        """A step's output reached the scheduler (its worker metadata names the step)."""
        if step is None:
            return
        now = self.clock()
        for rid in self._by_step.pop(step, ()):
            t = self._live.get(rid)
            if t is not None and t.first_token_s is None:
                t.first_token_s = now

    def loads_done(self, io: Mapping[str, RequestIO]) -> None:
        now = self.clock()
        for rid, got in io.items():
            t = self._live.get(rid)
            if t is None:
                continue
            if self.tier_prefix:
                got = got.renamed(self.tier_prefix)
            t.io = t.io.merge(got)
            if t.loaded_s is None and not t.preemptions:
                t.loaded_s = now

    def finished(self, req_id: str, status: str) -> None:
        t = self._live.get(req_id)
        if t is not None:
            t.status = status

    def closed(self, req_id: str) -> None:
        """vLLM issues nothing more for the request (its last stores were started): its record is written."""
        t = self._live.pop(req_id, None)
        if t is None:
            return
        waiting = self._by_step.get(t.final_step) if t.final_step is not None else None
        if waiting and req_id in waiting:  # its step never reported back (an aborted request)
            waiting.remove(req_id)
        self._enqueue(self.record(t))

    def record(self, t: Stamps) -> dict[str, Any]:
        """A trace as its line (docs/metrics.md "the engine's request log")."""
        tokens = {"gpu": t.gpu_tokens, **t.tier_tokens}
        failed_tokens = 0
        for key in set(t.io.failed_keys):  # blocks the tiers could not give back: vLLM recomputed them
            tier = t.key_tiers.get(key)
            if tier not in t.tier_tokens:  # not planned from a known tier: taken from the one that served most
                tier = max(t.tier_tokens, key=lambda k: tokens[k], default=None)
            if tier is None:
                break
            take = min(self.block_tokens, tokens[tier])
            tokens[tier] -= take
            failed_tokens += take
        tokens["recomputed"] = t.prompt_tokens - sum(tokens.values())
        stamps = {
            "arrived": t.arrived_s,
            "lookup": t.lookup_s,
            "admitted": t.admitted_s,
            "loaded": t.loaded_s,
            "prefill": t.prefill_s,
            "first_token": t.first_token_s,
            "load_submitted": t.io.submitted_s,
            "load_done": t.io.done_s,
        }
        return {
            "kind": "request",
            "id": t.req_id,
            "status": t.status,
            "prompt_tokens": t.prompt_tokens,
            "tokens": tokens,
            "external_tokens": t.external_tokens,
            "failed_tokens": failed_tokens,
            "preemptions": t.preemptions,
            "preempted_before_first_token": t.preempted_before_first_token,
            "load": {
                "jobs": t.loads_planned,
                "blocks": t.io.blocks,
                "bytes": t.io.nbytes,
                "io_s": {k: round(v, 7) for k, v in t.io.io_s.items()},
                "failed_blocks": t.io.failed_blocks,
            },
            "stores": {"blocks": t.store_blocks, "bytes": {k: n * self.block_bytes for k, n in t.store_blocks.items()}},
            "mono_s": {k: None if v is None else round(v, 7) for k, v in stamps.items()},
            "arrival_unix_s": t.arrival_unix_s,
            "wall_minus_mono_s": round(t.wall_minus_mono_s, 6),
        }

    # -- the writer ------------------------------------------------------------------------------------------
    def _enqueue(self, rec: dict[str, Any]) -> None:
        with self._cv:
            if self._closed:
                self.dropped["closed"] += 1
                return
            if len(self._queue) >= MAX_PENDING:
                self.dropped["queue"] += 1
                return
            self._queue.append(rec)
            self._cv.notify()

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                batch = list(self._queue)
                self._queue.clear()
            for rec in batch:
                self._emit(rec)

    def _emit(self, rec: Mapping[str, Any]) -> None:
        if self._fd is None:
            self.dropped["write-error"] += 1
            return
        line = (json.dumps(rec, separators=(",", ":")) + "\n").encode()
        if rec.get("kind") == "request" and self.bytes_written + len(line) > self.cap_bytes:
            self.dropped["cap"] += 1
            return
        try:
            n = os.write(self._fd, line)  # O_APPEND: one write, one whole line at the end
        except OSError as e:
            self.dropped["write-error"] += 1
            log.warning("kvtier request log %s: %s", self.path, e.strerror)
            return
        self.bytes_written += n
        if rec.get("kind") == "request":
            self.written += 1

    def close(self) -> None:
        """Write what is queued and the footer (the counts), then close the file. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=30)
        footer = {"kind": "footer", "records": self.written, "dropped": dict(self.dropped)}
        self._emit({**footer, "in_flight_at_close": len(self._live)})
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _open_log(path: str) -> int:
    """The log file for appending: created 0600 if absent, never through a link, only a regular file; a ConfigError
    naming the setting otherwise (the engine does not start)."""
    where = f"kv_connector_extra_config.request_log: {path}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise ConfigError(f"{where}: cannot open for appending ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{where}: not a regular file")
    return fd


__all__ = ["RequestLog", "Stamps", "SCHEMA", "MAX_PENDING"]
