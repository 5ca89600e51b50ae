"""The sim's offload tier on a shared ``kvtier cache-server``: the one cache server (vllm/blockserver.py), over the
same protocol and messages (vllm/protocol.py, vllm/messages.py) kvtier's vLLM spec speaks, as a replica whose block
is one offload chunk (``chunk_tokens`` of the model's KV) and whose world size is one.

* **Lookup**: one ``lookup`` of the prompt's chunk keys on the control connection; the leading hits count.
* **Load**: a ``get`` per chunk on a data connection (the server reads its tier into the page this replica maps)
  until the first miss; each chunk's tier is its source. The whole load has one deadline (``timeout_s``).
* **Store** (after the prefill, off the request's path): a ``plan``; each chunk placed is filled with the replica's
  own noise (``seed``) in the page and ``put``; then ``complete``. The bytes cross the process boundary as an
  engine's do.

A failing server degrades to misses (recompute), counted in ``errors`` (and the breaker of ``_Measured``); it never
fails a request. The first connection, at start, must succeed: a replica pointed at no server, or at one serving
another geometry (another model's KV bytes per chunk), says so and does not start.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from kvtier.engine.backend import round_up
from kvtier.engine.noise import NoiseBuffer
from kvtier.errors import ConfigError
from kvtier.keys import KeyScope, key_prefix
from kvtier.sim.model import OffloadConfig, _Measured
from kvtier.vllm import messages as m
from kvtier.vllm.client import ServerDown, ServerLink
from kvtier.vllm.protocol import ProtocolError, Refused, data_page, page_fds

R = TypeVar("R", bound=BaseModel)
DATA_LINKS = 4
"""Data connections (each with its page): loads and stores of this many requests run at once."""


@dataclass
class _Page:
    link: ServerLink
    fd: int | None  # None over TCP: the page is this process's own, its bytes sent inline
    page: mmap.mmap


class RemoteOffload(_Measured):
    """The cache server's tiers, shared with other replicas. Same calls as Offload's asynchronous view."""

    def __init__(
        self,
        socket_path: str,
        scope: KeyScope,
        kv_bytes_per_token: int,
        chunk_tokens: int = 256,
        timeout_s: float = 10.0,
        engine: str = "sim",
        seed: int = 0,
        token: bytes | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.token = token
        self.scope = scope
        self.kvpt = kv_bytes_per_token
        self.cfg = OffloadConfig("remote", chunk_tokens=chunk_tokens)
        self.timeout_s = timeout_s
        self.chunk_bytes = chunk_tokens * kv_bytes_per_token
        geometry = {"block_bytes": self.chunk_bytes, "block_tokens": chunk_tokens, "world_size": 1, "rank": 0}
        self._hello: dict[str, Any] = {"engine": engine, "scope": key_prefix(scope.model_name), **geometry}
        self._control: ServerLink | None = None
        self._control_lock = threading.Lock()
        self._pages: queue.Queue[_Page] = queue.Queue()
        self._all: list[_Page] = []
        self.noise = NoiseBuffer(64 * 1024 * 1024, seed)
        self._pending: set[asyncio.Task[None]] = set()
        self._init_measured()

    def chunk_keys(self, token_ids: Sequence[int]) -> list[str]:
        return self.scope.keys_for_tokens(token_ids)

    async def connect(self, timeout_s: float = 30.0) -> None:
        """Open the control and data connections (the server checks the geometry), retrying until ``timeout_s``
        while nothing answers; a refusal (another geometry) is a ConfigError at once."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                await asyncio.to_thread(self._open)
                return
            except Refused as e:
                self.close()
                raise ConfigError(f"--cache-server {self.socket_path}: {e}") from None
            except (OSError, ProtocolError) as e:
                self.close()
                if time.monotonic() > deadline:
                    raise ConfigError(f"--cache-server {self.socket_path}: no kvtier cache server answers ({e})") from e
                await asyncio.sleep(0.2)

    def _open(self) -> None:
        hello = m.Hello(role="control", **self._hello)
        self._control = ServerLink(self.socket_path, hello, self.timeout_s, token=self.token)
        self._control.open()
        padded = round_up(self.chunk_bytes)
        for _ in range(DATA_LINKS):
            fd, mapped = data_page("kvtier-sim-page", padded, self._control.inline)
            hello = m.Hello(role="data", **self._hello)
            link = ServerLink(self.socket_path, hello, self.timeout_s, None if fd is None else page_fds(fd), self.token)
            page = _Page(link, fd, mapped)
            self._all.append(page)
            page.link.open()
            self._pages.put(page)

    def _call(self, msg: BaseModel, reply: type[R]) -> R | None:
        """One control request; a failure is counted (the caller degrades)."""
        assert self._control is not None
        try:
            with self._control_lock:
                r = self._control.call(msg, reply)
        except ServerDown as e:
            self._note_error(str(e))
            return None
        self._note_ok()
        return r

    async def alookup(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        r = await asyncio.to_thread(self._call, m.Lookup(keys=list(keys)), m.LookupReply)
        n = 0
        for status, _ in (r.found if r is not None else [])[: len(keys)]:
            if status != "hit":
                break
            n += 1
        return n

    async def aload(self, keys: Sequence[str], sources: list[str] | None = None) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        found, nbytes, tiers = await asyncio.to_thread(self._load, list(keys), t0 + self.timeout_s)
        dt = time.perf_counter() - t0  # the round trips: the server's reads plus the socket
        self._note_load(dt, nbytes, found)
        if sources is not None:
            sources.extend(tiers)
        return dt, nbytes, found

    def _load(self, keys: list[str], deadline: float) -> tuple[int, int, list[str]]:
        found, nbytes, tiers = 0, 0, []
        page = self._pages.get()
        view = memoryview(page.page)
        if page.link.inline:  # over TCP: every get in one round trip, the hits counted up to the first miss
            answers: list[m.GetReply] = []
            try:
                page.link.pipeline([m.Get(key=k) for k in keys], m.GetReply, view[: self.chunk_bytes], answers.append)
                self._note_ok()
            except ServerDown as e:
                self._note_error(str(e))
            finally:
                view.release()
                self._pages.put(page)
            for r in answers:
                if not r.hit or r.n != self.chunk_bytes:
                    break
                found, nbytes = found + 1, nbytes + r.n
                tiers.append((r.tier or "cache-server")[:31])
            return found, nbytes, tiers
        try:
            for k in keys:
                if time.perf_counter() > deadline:
                    self._note_error(f"load: {len(keys) - found} chunks left at the {self.timeout_s:g} s deadline")
                    break
                try:
                    r = page.link.call(m.Get(key=k), m.GetReply, into=view[: self.chunk_bytes])
                except ServerDown as e:
                    self._note_error(str(e))
                    break
                if not r.hit or r.n != self.chunk_bytes:
                    break
                found, nbytes = found + 1, nbytes + r.n
                tiers.append((r.tier or "cache-server")[:31])
            else:
                self._note_ok()
        finally:
            view.release()
            self._pages.put(page)
        return found, nbytes, tiers

    def store_later(self, keys: Sequence[str]) -> None:
        if not keys or not self.admit("store"):
            return

        async def store() -> None:
            t0 = time.perf_counter()
            nbytes = await asyncio.to_thread(self._store, list(keys))
            with self._lock:
                self.stored_bytes += nbytes
                self.store_seconds += time.perf_counter() - t0

        t = asyncio.get_running_loop().create_task(store())
        self._pending.add(t)
        t.add_done_callback(self._pending.discard)

    def _store(self, keys: list[str]) -> int:
        plan = self._call(m.PlanStore(keys=keys), m.PlanReply)
        if plan is None or plan.none:
            return 0
        offered = set(keys)
        todo = [k for k in plan.store if k in offered]
        done: list[str] = []
        page = self._pages.get()
        view = memoryview(page.page)
        try:
            for k in todo:
                self.noise.chunks(k, self.chunk_bytes).fill(view[: round_up(self.chunk_bytes)])
                try:
                    page.link.call(m.Put(key=k), m.PutReply, payload=view[: self.chunk_bytes])
                except ServerDown as e:
                    self._note_error(str(e))
                    break
                done.append(k)
        finally:
            view.release()
            self._pages.put(page)
        if done:
            self._call(m.Complete(keys=done, success=True), m.CompleteReply)
        if len(done) < len(todo):
            self._call(m.Complete(keys=todo[len(done) :], success=False), m.CompleteReply)
        return len(done) * self.chunk_bytes

    @property
    def pending_stores(self) -> int:
        return len(self._pending)

    def usage(self) -> dict[str, Any] | None:
        return None  # the cache server reports its tiers on its own /metrics

    async def aclose(self) -> None:
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=10)
        self.close()

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        for p in self._all:
            p.link.close()
            try:
                p.page.close()
            except BufferError:
                pass
            if p.fd is not None:
                os.close(p.fd)
        self._all.clear()
        self._pages = queue.Queue()


__all__ = ["RemoteOffload", "DATA_LINKS"]
