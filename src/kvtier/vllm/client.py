"""kvtier's vLLM backend talking to a shared ``kvtier cache-server`` (kvtier/vllm/blockserver.py).

``ServerIndex`` stands where the per-replica ``BlockIndex`` stands in the scheduler's manager (the same calls:
lookup, pin, plan_store, complete_store, forget, usage), each a request on one control connection.
``ServerBlockWorker`` is ``BlockWorker`` with the server as its tiers: each I/O thread maps one page shared with
the server (a memfd sent over its data connection), gathers a block from the engine's KV cache into it and asks the
server to store it, or asks for a block and scatters it back.

The server going away is never an engine failure: a lookup it cannot answer is a miss, a store is not offered, a
load is a failed load (vLLM recomputes those blocks); each is counted (``server_errors``; the workers' failed loads
and stores), and the next call after a second reconnects — after 2, 4, ... up to 30 s while the server stays
unreachable, each attempt bounded by OPEN_S, so a store whose link went silent costs the scheduler one timeout per
wait rather than one per call. Only the first connection, when the engine starts, must succeed: an engine
pointed at no server says so and does not start.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import Future
from typing import Any, Generic, Literal, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from kvtier.engine.backend import round_up
from kvtier.errors import ConfigError
from kvtier.vllm import messages as m
from kvtier.vllm.gate import LiveGate
from kvtier.vllm.index import IndexCounters, StorePlan, TierSlots
from kvtier.vllm.protocol import MAX_KEYS, Conn, ProtocolError, Refused, connect, data_page, page_fds, tcp_address
from kvtier.vllm.worker import BlockLayout, BlockLoad, BlockWorker, pin_host_buffer

log = logging.getLogger("kvtier.vllm")

K = TypeVar("K", bound=Hashable)

RECONNECT_S = 1.0
"""Least time between two attempts to reach a server that went away; doubled for each failure in a row."""
RECONNECT_MAX_S = 30.0
"""Longest wait between two attempts to reach a server that stays unreachable."""
OPEN_S = 3.0
"""Longest a connection's opening (connect, challenge, hello) may take: a live server answers in a round trip."""
CONTROL_TIMEOUT_S = 10.0
AHEAD_S = 1.0
"""How long a prefetched lookup answer is used (vLLM asks for the rest of a request's blocks in the same step)."""
DATA_TIMEOUT_S = 60.0


class ServerDown(Exception):
    """The cache server did not answer (or refused): the caller degrades (a miss, no store, a failed load)."""


R = TypeVar("R", bound=BaseModel)


class ServerLink:
    """One connection that reconnects (hello again) after a failure, at most once per RECONNECT_S. Requests and
    replies are vllm/messages.py's models: a reply that is not its operation's is the server's failure. Over TCP
    (``tcp://`` addresses) ``token`` answers the server's challenge and a block's bytes travel inline."""

    def __init__(
        self,
        path: str,
        hello: m.Hello,
        timeout_s: float,
        fds: Callable[[], list[int]] | None = None,
        token: bytes | None = None,
    ):
        self.path, self.hello, self.timeout_s, self.fds, self.token = path, hello, timeout_s, fds, token
        self.conn: Conn | None = None
        self._owed: list[tuple[type[BaseModel], Callable[[Any], None] | None]] = []  # posted, answer not yet read
        self._tried = 0.0
        self._down = 0  # failures in a row: the wait before the next attempt doubles with each
        self.errors = 0
        self.last_error = ""

    @property
    def inline(self) -> bool:
        """Whether blocks cross this link as bytes (TCP) rather than through a shared page."""
        return tcp_address(self.path) is not None

    def open(self) -> m.TiersReply:
        self._owed = []  # what a closed connection owed is not coming
        c = connect(self.path, min(self.timeout_s, OPEN_S), self.token)
        hello = self.hello.model_dump()
        if c.proof is not None:
            hello["proof"] = c.proof
        try:
            answer = c.call(hello, None if c.inline or not self.fds else self.fds())
            tiers = m.TiersReply.model_validate(answer)
            c.sock.settimeout(self.timeout_s)
        except ValidationError as e:
            c.close()
            raise ProtocolError(f"a hello answer that is not one: {m.refusal(e)}") from None
        except BaseException:
            c.close()
            raise
        self.conn = c
        self._down = 0
        return tiers

    def call(
        self, msg: BaseModel, reply: type[R], payload: memoryview | None = None, into: memoryview | None = None
    ) -> R:
        """The answer to ``msg``, as ``reply``. A connection the server closed (it restarted) is opened again at once
        and the request sent once more; a server that does not answer is tried again only after RECONNECT_S.
        Inline (TCP): ``payload`` is a put's block, sent after the request; a get's hit of ``n`` bytes is read into
        ``into`` (a hit larger than ``into`` is the server's failure, the connection dropped)."""
        try:
            return reply.model_validate(self._call(msg.model_dump(), payload, into))
        except ValidationError as e:
            self.errors += 1
            self.last_error = (
                f"kvtier cache-server {self.path}: a {msg.__class__.__name__.lower()} answer: " + m.refusal(e)
            )
            raise ServerDown(self.last_error) from None

    def _call(
        self, msg: dict[str, Any], payload: memoryview | None = None, into: memoryview | None = None
    ) -> dict[str, Any]:
        if self.conn is not None:
            try:
                return self._send(msg, payload, into)
            except ConnectionError as e:
                if isinstance(e, ProtocolError):
                    raise self._failed(e) from None
                self._tried = 0.0  # closed under us: reconnect now, once
                self.conn = None
        self._connected()
        try:
            return self._send(msg, payload, into)
        except ConnectionError as e:
            raise self._failed(e) from None

    def _send(self, msg: dict[str, Any], payload: memoryview | None, into: memoryview | None) -> dict[str, Any]:
        assert self.conn is not None
        c = self.conn
        try:
            self._drain()
            answer = c.call(msg, payload=payload if c.inline else None)
            if c.inline and into is not None:
                _read_block(c, answer, into)
            self._down = 0
            return answer
        except Refused as e:
            self.errors += 1
            self.last_error = str(e)[:300]
            raise ServerDown(self.last_error) from None
        except OSError as e:
            self.conn.close()
            self.conn = None
            if isinstance(e, ConnectionError):
                raise
            raise self._failed(e) from None  # a timeout: the server may be busy; not sent again

    def _connected(self) -> Conn:
        """The open connection, or a new one (an attempt after RECONNECT_S, doubled for each failure in a row up to
        RECONNECT_MAX_S); ServerDown otherwise."""
        if self.conn is None:
            now = time.monotonic()
            if now - self._tried < self.wait_s:
                raise ServerDown(self.last_error or "the cache server is not connected")
            self._tried = now
            try:
                self.open()
            except (OSError, ProtocolError, Refused) as e:
                raise self._failed(e) from None
        assert self.conn is not None
        return self.conn

    @property
    def wait_s(self) -> float:
        """How long after the last attempt the next may be made."""
        return float(min(RECONNECT_MAX_S, RECONNECT_S * 2.0 ** max(0, self._down - 1)))

    def post(self, msg: BaseModel, reply: type[R], on_reply: Callable[[R], None] | None = None) -> None:
        """Send ``msg`` and go on: its answer is read before the next request's, or by ``settle`` (the server acts on
        it when it arrives, in order with the rest). For what the caller need not wait for — a completed store, an
        unpin — so a link's round trip leaves the engine's scheduling path. A failure raises ServerDown; an answer
        read later that is a refusal or malformed is counted in ``errors``."""
        c = self._connected()
        try:
            self._drain()
            c.send(msg.model_dump())
        except OSError as e:
            c.close()
            self.conn, self._owed = None, []
            raise self._failed(e) from None
        self._owed.append((reply, on_reply))

    def settle(self) -> None:
        """Read every posted answer now."""
        if self.conn is not None:
            try:
                self._drain()
            except OSError as e:
                self.conn.close()
                self.conn = None
                self._failed(e)

    def _drain(self) -> None:
        assert self.conn is not None
        owed, self._owed = self._owed, []
        for reply, on_reply in owed:
            answer = self.conn.recv()
            try:
                if not isinstance(answer, dict) or not answer.get("ok"):
                    raise ValueError(str(answer.get("error") if isinstance(answer, dict) else answer)[:300])
                r = reply.model_validate(answer)
            except (ValueError, ValidationError) as e:  # a refusal of something already done: counted, not raised
                self.errors += 1
                self.last_error = f"kvtier cache-server {self.path}: a posted request: {e}"[:300]
                continue
            if on_reply is not None:
                on_reply(r)

    def pipeline(self, msgs: Sequence[BaseModel], reply: type[R], into: memoryview, each: Callable[[R], None]) -> None:
        """Inline (TCP): send ``msgs`` back to back, then read their answers in order, each hit's bytes into
        ``into`` and ``each(answer)`` called before the next is read — one round trip for them all instead of one
        each. A failure part-way drops the connection and raises ServerDown; the answers not yet read are lost."""
        c = self._connected()
        assert c.inline
        try:
            self._drain()
            for msg in msgs:
                c.send(msg.model_dump())
            for _ in msgs:
                answer = c.recv()
                if not isinstance(answer, dict) or not answer.get("ok"):
                    raise ProtocolError(f"a refused or malformed answer: {str(answer)[:200]}")
                r = reply.model_validate(answer)
                _read_block(c, answer, into)
                each(r)
        except (OSError, ValidationError) as e:
            c.close()
            self.conn = None
            raise self._failed(e) from None

    def _failed(self, e: BaseException) -> ServerDown:
        self.errors += 1
        self._down += 1
        self.last_error = f"kvtier cache-server {self.path}: {e}"[:300]
        return ServerDown(self.last_error)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self._owed = []


class ServerIndex(Generic[K]):
    """The scheduler's view of the shared index (``BlockIndex``'s calls). ``key_of`` scopes vLLM's keys."""

    def __init__(
        self, path: str, key_of: Callable[[K], str], hello: dict[str, Any], token: bytes | None = None
    ) -> None:
        self.key_of = key_of
        self._link = ServerLink(path, m.Hello(role="control", **hello), CONTROL_TIMEOUT_S, token=token)
        self._lock = threading.Lock()
        try:
            answer = self._link.open()
        except (OSError, ProtocolError, Refused) as e:
            raise ConfigError(f"kv_connector_extra_config.cache_server: {path}: {e}") from None
        self.tiers = [TierSlots(n, s, src) for n, s, src in answer.tiers]
        self.counters = IndexCounters()
        self._tier_of: dict[K, int] = {}
        self._ahead: dict[K, Literal["hit", "pending", "miss"]] = {}  # prefetched answers not yet asked for
        self._ahead_at = 0.0
        self.gate: LiveGate | None = None  # the live fetch gate (settings.gate), set by the manager
        self._usage: tuple[float, dict[str, tuple[int, int]]] = (0.0, {})

    @property
    def server_errors(self) -> int:
        return self._link.errors

    def _call(self, msg: BaseModel, reply: type[R]) -> R:
        with self._lock:
            return self._link.call(msg, reply)

    def lookup(self, key: K, following: Callable[[], Sequence[K]] | None = None) -> Literal["hit", "pending", "miss"]:
        """One block's status. vLLM asks one block at a time, in order, until the first miss; ``following`` (this
        block and the request's blocks after it) lets the first ask cover them all in one round trip, the
        answers up to the first miss kept for the asks that follow: over a link with a round trip of r, a
        prefix of n blocks is found in r instead of n × r."""
        if time.monotonic() - self._ahead_at > AHEAD_S:
            self._ahead.clear()
        ahead = self._ahead.pop(key, None)
        if ahead is not None:
            return ahead
        keys = list(following())[:MAX_KEYS] if following is not None else []
        if len(keys) < 2 or keys[0] != key:
            return self.lookup_many([key])[0]
        self._ahead.clear()
        t0 = self._ahead_at = time.monotonic()
        statuses = self.lookup_many(keys)
        if self.gate is not None:
            self.gate.rtt(time.monotonic() - t0)
            run = next((i for i, st in enumerate(statuses) if st == "miss"), len(statuses))
            if not self.gate.allow(run):  # fetching this run is slower than recomputing it: vLLM recomputes
                statuses = ["miss"] * len(statuses)
        for k, status in zip(keys, statuses, strict=True):
            self._ahead[k] = status
            if status == "miss":
                break
        return self._ahead.pop(key)

    def lookup_many(self, keys: Sequence[K]) -> list[Literal["hit", "pending", "miss"]]:
        try:
            found = self._call(m.Lookup(keys=[self.key_of(k) for k in keys]), m.LookupReply).found
        except ServerDown:
            return ["miss"] * len(keys)
        if len(found) != len(keys):
            return ["miss"] * len(keys)
        if len(self._tier_of) > 65536:
            self._tier_of.clear()
        for key, (_, tier) in zip(keys, found, strict=True):
            if tier is not None and tier < len(self.tiers):
                self._tier_of[key] = tier
        return [status for status, _ in found]

    def tier_of(self, key: K) -> TierSlots | None:
        i = self._tier_of.get(key)
        return None if i is None else self.tiers[i]

    def _keys_op(self, op: type[m.Pin | m.Forget], keys: Iterable[K], reply: type[R]) -> R | None:
        ks = [self.key_of(k) for k in keys]
        if not ks:
            return None
        try:
            return self._call(op(keys=ks), reply)
        except ServerDown:
            return None

    def _post(self, msg: BaseModel, reply: type[R], on_reply: Callable[[R], None] | None = None) -> None:
        """Over TCP, a request the scheduler need not wait for is posted (its answer read with the next call's);
        through a Unix socket, where a round trip is microseconds, it is a call."""
        try:
            with self._lock:
                if self._link.inline:
                    self._link.post(msg, reply, on_reply)
                    return
                r = self._link.call(msg, reply)
        except ServerDown:
            return
        if on_reply is not None:
            on_reply(r)

    def pin(self, keys: Iterable[K]) -> None:
        self._keys_op(m.Pin, keys, m.PinReply)

    def unpin(self, keys: Iterable[K]) -> None:
        ks = [self.key_of(k) for k in keys]
        if ks:
            self._post(m.Unpin(keys=ks), m.Done)

    def touch(self, keys: Iterable[K]) -> None:
        ks = [self.key_of(k) for k in keys]
        if ks:
            self._post(m.Touch(keys=ks), m.Done)

    def plan_store(self, keys: Iterable[K]) -> StorePlan[K] | None:
        offered = list(keys)
        by_key = {self.key_of(k): k for k in offered}
        raw = [bytes(k).hex() if isinstance(k, (bytes, bytearray)) else "" for k in by_key.values()]
        try:
            r = self._call(m.PlanStore(keys=list(by_key), raw=raw), m.PlanReply)
        except ServerDown:
            return None
        c = self.counters
        c.rejected += r.rejected
        for name, n in r.demoted.items():
            c.demoted[name] = c.demoted.get(name, 0) + n
        for name, n in r.evicted_by.items():
            c.evicted[name] = c.evicted.get(name, 0) + n
        if r.none:
            return None
        if len(r.store) != len(r.placed):  # an answer that does not hold together: the server's failure
            self._link.errors += 1
            return None
        plan: StorePlan[K] = StorePlan([], {}, [], [])
        for skey, tier in zip(r.store, r.placed, strict=True):
            k = by_key.get(skey)
            if k is None or tier >= len(self.tiers):  # not a key offered, or a tier it does not have: not stored
                continue
            plan.keys_to_store.append(k)
            plan.placed[k] = tier
            name = self.tiers[tier].name
            c.placed[name] = c.placed.get(name, 0) + 1
        plan.evicted = [bytes.fromhex(h) for h in r.evicted if h]  # type: ignore[misc]  # vLLM's keys
        return plan

    def complete_store(self, keys: Iterable[K], success: bool = True) -> list[K]:
        ks = [self.key_of(k) for k in keys]
        if ks:
            self._post(m.Complete(keys=ks, success=success), m.CompleteReply, self._count_failed)
        return []

    def settle(self) -> None:
        """Wait for the answers of what was posted: the server has acted on all of it."""
        with self._lock:
            self._link.settle()

    def _count_failed(self, r: m.CompleteReply) -> None:
        self.counters.failed_stores += r.failed

    def forget(self, keys: Iterable[K]) -> int:
        r = self._keys_op(m.Forget, keys, m.ForgetReply)
        n = r.forgotten if r is not None else 0
        self.counters.lost += n
        return n

    def clear(self) -> list[K]:
        try:
            self._call(m.Reset(), m.ResetReply)
        except ServerDown:
            pass
        self._tier_of.clear()
        return []

    def usage(self) -> dict[str, tuple[int, int]]:
        """tier -> (blocks held, slots), the server's, asked at most once a second."""
        at, last = self._usage
        if time.monotonic() - at >= 1.0 or not last:
            try:
                last = dict(self._call(m.Usage(), m.UsageReply).usage)
            except ServerDown:
                last = last or {t.name: (0, t.slots) for t in self.tiers}
            self._usage = (time.monotonic(), last)
        return last

    def __len__(self) -> int:
        return sum(h for h, _ in self.usage().values())

    def close(self) -> None:
        with self._lock:
            self._link.close()


class ServerBlockWorker(BlockWorker):
    """A worker whose tiers are the shared server's: puts and gets through one page per I/O thread, shared with the
    server over a Unix socket, its bytes sent and received inline over TCP."""

    def __init__(
        self,
        path: str,
        layout: BlockLayout,
        key_of: Callable[[Any], str],
        hello: dict[str, Any],
        io_threads: int = 4,
        token: bytes | None = None,
    ) -> None:
        self.path, self.token = path, token
        self.hello = m.Hello(role="data", **hello)
        self._links: list[ServerLink] = []
        self._pages: list[tuple[int | None, mmap.mmap]] = []
        self._links_lock = threading.Lock()
        probe = ServerLink(path, m.Hello(role="probe", **hello), CONTROL_TIMEOUT_S, token=token)
        try:
            answer = probe.open()  # the geometry is checked now, not at the first store
        except (OSError, ProtocolError, Refused) as e:
            raise ConfigError(f"kv_connector_extra_config.cache_server: {path}: {e}") from None
        finally:
            probe.close()
        self._start(layout, key_of, io_threads, [t[0] for t in answer.tiers])

    def _link(self) -> tuple[ServerLink, memoryview, Any]:
        """This thread's (data link, its page, the page as a uint8 torch tensor)."""
        b = getattr(self._local, "link", None)
        if b is None:
            import torch

            padded = round_up(self.layout.nbytes)
            fd, page = data_page("kvtier-vllm-page", padded, tcp_address(self.path) is not None)
            view = memoryview(page)
            if self.layout.on_device:
                pin_host_buffer(view)  # device copies into the page are DMA
            host = torch.from_numpy(np.frombuffer(page, dtype=np.uint8))
            link = ServerLink(self.path, self.hello, DATA_TIMEOUT_S, None if fd is None else page_fds(fd), self.token)
            with self._links_lock:
                self._links.append(link)
                self._pages.append((fd, page))
            b = self._local.link = (link, view, host)
        return b

    def _load_tasks(self, pairs: list[tuple[Any, int]]) -> list[Future[list[BlockLoad]]]:
        """Over TCP a job's blocks go in at most ``io_threads`` runs, each pipelined on its thread's connection
        (one round trip a run); through a shared page, one block a task."""
        if tcp_address(self.path) is None or len(pairs) < 2:
            return super()._load_tasks(pairs)
        runs = min(self.io_threads, len(pairs))
        size = -(-len(pairs) // runs)
        return [self._pool.submit(self._load_run, pairs[i : i + size]) for i in range(0, len(pairs), size)]

    def _load_run(self, pairs: list[tuple[Any, int]]) -> list[BlockLoad]:
        link, view, host = self._link()
        got: list[BlockLoad] = []
        t0 = time.perf_counter_ns()

        def each(r: m.GetReply) -> None:
            nonlocal t0
            key, block_id = pairs[len(got)]
            io_ns, t0 = time.perf_counter_ns() - t0, time.perf_counter_ns()
            if not r.hit or r.n != self.layout.nbytes:
                self.counters.add("failed_loads", 1, f"load: {r.why or 'wrong size'}")
                got.append(BlockLoad(key, block_id, 0))
                return
            self.layout.scatter(block_id, host)
            self.counters.add(f"loaded:{r.tier or '?'}")
            got.append(BlockLoad(key, block_id, self.layout.nbytes, r.tier or "?", io_ns))

        try:
            link.pipeline([m.Get(key=self.key_of(k)) for k, _ in pairs], m.GetReply, view[: self.layout.nbytes], each)
        except ServerDown as e:
            left = pairs[len(got) :]
            self.counters.add("failed_loads", len(left), f"load: {e}")
            got.extend(BlockLoad(k, b, 0) for k, b in left)
        return got

    def _run_store(self, block_ids: list[int], plan: Any) -> int:
        keys = plan.keys_to_store
        if len(keys) != len(block_ids):
            self.counters.add("failed_stores", len(keys), f"store: {len(keys)} keys for {len(block_ids)} blocks")
            return 0
        futures = [self._pool.submit(self._put, k, b) for k, b in zip(keys, block_ids, strict=True)]
        return sum(f.result() for f in futures)

    def _put(self, key: Any, block_id: int) -> int:
        link, view, host = self._link()
        self.layout.gather(block_id, host)
        try:
            r = link.call(m.Put(key=self.key_of(key)), m.PutReply, payload=view[: self.layout.nbytes])
        except ServerDown as e:
            self.counters.add("failed_stores", 1, f"store: {e}")
            return 0
        self.counters.add(f"stored:{r.tier}")
        return self.layout.nbytes

    def _load(self, key: Any, block_id: int) -> BlockLoad:
        link, view, host = self._link()
        t0 = time.perf_counter_ns()
        try:
            r = link.call(m.Get(key=self.key_of(key)), m.GetReply, into=view[: self.layout.nbytes])
        except ServerDown as e:
            self.counters.add("failed_loads", 1, f"load: {e}")
            return BlockLoad(key, block_id, 0)
        io_ns = time.perf_counter_ns() - t0  # the server's read and the round trip: this worker's wait for the block
        if not r.hit or r.n != self.layout.nbytes:
            self.counters.add("failed_loads", 1, f"load: {r.why or 'wrong size'}")
            return BlockLoad(key, block_id, 0)
        self.layout.scatter(block_id, host)
        tier = r.tier or "?"
        self.counters.add(f"loaded:{tier}")
        return BlockLoad(key, block_id, self.layout.nbytes, tier, io_ns)

    def usage(self) -> dict[str, dict[str, int]]:
        return {}

    def _close_store(self) -> None:
        if self._store_closed:
            return
        self._store_closed = True
        with self._links_lock:
            for link in self._links:
                link.close()
            for fd, page in self._pages:
                try:
                    page.close()
                except BufferError:
                    pass  # a torch tensor still views it; the process's exit unmaps it
                if fd is not None:
                    os.close(fd)
            self._links.clear()
            self._pages.clear()


def _read_block(c: Conn, answer: dict[str, Any], into: memoryview) -> None:
    """Inline (TCP): the bytes of a hit that follow its answer, into the page. More than the page holds cannot be
    skipped safely: ProtocolError, and the caller drops the connection."""
    n = answer.get("n")
    if answer.get("hit") is True and isinstance(n, int) and n > 0:
        if n > len(into):
            raise ProtocolError(f"a block of {n} bytes announced; this page holds {len(into)}")
        c.recv_bytes(into[:n])


__all__ = ["ServerLink", "ServerIndex", "ServerBlockWorker", "ServerDown"]
