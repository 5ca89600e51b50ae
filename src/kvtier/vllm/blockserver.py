"""kvtier's one cache server (``kvtier cache-server``): one set of tiers shared by every replica of a run — vLLM
replicas running kvtier's spec, and sim replicas (``--offload remote``, sim/remote.py).

The per-replica backend (kvtier/vllm/spec.py alone) gives each engine its own tiers, so a conversation whose KV
replica A stored is a miss on replica B. This server is the methodology's one cache sidecar per run (as an LMCache
MP server is): it owns the tiers (the CPU arena; a CPU staging tier in front of NVMe files, Redis or S3) and the
block index (kvtier/vllm/index.py's waterfall LRU), and every replica talks to it (kvtier/vllm/client.py) — a
manager over one control connection, each I/O thread over a data connection of its own (vllm/messages.py).

* **Keys** are vLLM's block hashes in the writer's ``KeyScope`` (model, dtype, layout, parallelism, block size):
  replicas of one model meet under one key, another model never does. vLLM's default block hash (SHA-256 with a
  fixed seed) is the same in every process, which is what makes a block stored by A findable by B.
* **Bytes** move through a page both sides map (protocol.py): a put writes the tier from the worker's page, a get
  reads into it; the socket carries only the request. A replica on another host connects over TCP (``--listen``,
  which needs ``--token-file``): it answers the server's challenge with the shared token, and a block's bytes
  travel inline, into and out of a page of the server's own per connection.
* **Order**: a plan's evictions and demotions run on one action thread, in plan order; a put waits until the
  plan that placed its block has made room, so the tiers hold what the index says (the per-replica worker's rule).
* **Leases**: what a manager has pinned or has pending is released when its connection closes, so a replica that
  dies mid-store leaves no block pending forever (another replica's lookup turns from pending to miss).
* **Geometry**: the tiers hold slots of one block (``--block-bytes`` per worker times ``--world-size``, or the first
  engine's). Each replica is checked against the slot on its own: a block that fits is served (a smaller one wastes
  the rest of its slot), a larger one is refused with both named. Other geometries never share keys (vllm/spec.py).
* **Fairness**: a control connection may name ``keys_per_s`` keys a second (listen.py KeyRate); beyond that it is
  slowed, not refused, and the wait counted: one engine's lookup flood cannot starve another's lookups.

Health and metrics (``kvtier_block_server_*``; ``…_cross_replica_loads_total`` counts blocks loaded by an engine
other than the one that stored them) are served on a TCP port of ``--host`` (127.0.0.1 by default), apart from the
data and control API.
"""

from __future__ import annotations

import logging
import mmap
import os
import socket
import threading
import time
from collections import Counter as Tally
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from kvtier.engine.backend import aligned_buffer, round_up
from kvtier.engine.runs import remove_stale_runs
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import ConfigError, StorageError
from kvtier.tiers import open_tiers
from kvtier.vllm import messages as m
from kvtier.vllm.index import BlockIndex
from kvtier.vllm.listen import KEYS_PER_S, KeyRate, Listeners
from kvtier.vllm.protocol import Conn, ProtocolError, is_sealed
from kvtier.vllm.server_http import BoundedHTTPServer, ServerMetrics, http_handler
from kvtier.vllm.settings import VllmOffloadSettings

log = logging.getLogger("kvtier.vllm.server")

PUT_WAIT_S = 60.0
"""Longest a put waits for its plan's evictions and demotions to run before it is refused."""


@dataclass
class Lease:
    """What one manager connection holds: load pins (counted) and blocks it planned and has not completed."""

    engine: str
    scope: str = ""  # the prefix every key of this connection has (its hello's scope; "": any key)
    tokens: int = 0  # tokens per block of its engine
    rate: KeyRate = field(default_factory=lambda: KeyRate(0))  # its allowance of keys a second (0: unbounded)
    pins: Tally[str] = field(default_factory=Tally)
    pending: set[str] = field(default_factory=set)


class BlockServer:
    """The shared tiers and index. ``start()`` listens; ``close()`` stops and releases the tiers."""

    def __init__(
        self,
        settings: VllmOffloadSettings,
        socket_path: str | None,
        host: str = "127.0.0.1",
        port: int = 0,
        listen: tuple[str, int] | None = None,
        token: bytes | None = None,
        slot: m.BlockGeometry | None = None,
        keys_per_s: float = KEYS_PER_S,
    ):
        self.listeners = Listeners(socket_path, listen, token)
        self.settings = settings
        self.path = socket_path
        self.host, self.port = host, port
        self.metrics = ServerMetrics()
        self.geometry = slot  # the slot's geometry: --block-bytes/--world-size, or the first engine's
        self.keys_per_s = keys_per_s
        self.index: BlockIndex[str] | None = None
        self.store: TieredStore | None = None
        self._names: list[str] = []
        self._lock = threading.Lock()  # the index and the bookkeeping below
        self._cv = threading.Condition(self._lock)
        self._seq = 0  # plans made
        self._l1_evicted = 0  # blocks demoted or evicted from the first tier (LMCache's l1_evicted_chunks)
        self._done = 0  # plans whose evictions and demotions have run
        self._actions: deque[tuple[int, list[tuple[str, str, int]]]] = deque()
        self._plan_seq: dict[str, int] = {}  # pending key -> the plan that placed it
        self._placed: dict[str, int] = {}  # pending key -> tier index
        self._put_failed: set[str] = set()
        self._writer: dict[str, str] = {}  # key -> engine that stored it
        self._raw: dict[str, str] = {}  # key -> vLLM's raw key (hex), for the evictions vLLM is told of
        self._closing = False
        self._conns: set[Conn] = set()
        self._threads: list[threading.Thread] = []
        self._http: BoundedHTTPServer | None = None
        self._local = threading.local()

    # -- life ---------------------------------------------------------------------------------
    def start(self) -> int:
        """Listen on the socket, the TCP data port and the health port; returns the health port."""
        self.listeners.open()
        try:
            if self.geometry is not None:  # --block-bytes: the tiers open now (ValueError: no tier holds a block)
                self._open(self.geometry)
        except BaseException as e:
            self.listeners.close()
            if isinstance(e, ValueError):
                raise ConfigError(f"--block-bytes: {e}") from None
            raise
        try:
            self._http = BoundedHTTPServer((self.host, self.port), http_handler(self))
        except OSError as e:
            self.listeners.close()
            raise ConfigError(f"--port: cannot listen on {self.host}:{self.port}: {e.strerror}") from e
        self._threads = [
            *self.listeners.threads(self._serve_conn, lambda why: self.metrics.not_taken.labels(why).inc()),
            threading.Thread(target=self._action_loop, name="kvtier-blocks-actions", daemon=True),
            threading.Thread(target=self._http.serve_forever, name="kvtier-blocks-http", daemon=True),
        ]
        for t in self._threads:
            t.start()
        return int(self._http.server_address[1])

    @property
    def listen_port(self) -> int | None:
        """The bound TCP data port (``--listen``), None without one."""
        return self.listeners.tcp_port

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self.listeners.close()
        for c in list(self._conns):
            try:
                c.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        for t in self._threads:
            t.join(timeout=10)
        if self.store is not None:
            self.store.close()

    # -- connections --------------------------------------------------------------------------
    def _serve_conn(self, s: socket.socket, tcp: bool = False) -> None:
        c = Conn(s, inline=tcp)
        self._conns.add(c)
        fds: list[int] = []
        kind = "?"
        try:
            msg = self.listeners.greet(c, fds, lambda why: self.metrics.refused.labels(why).inc())
            if msg is None:
                return
            if not isinstance(msg, dict) or msg.get("op") != "hello":
                c.send({"ok": False, "error": "the first message must be a hello"})
                return
            try:
                hello = m.Hello.model_validate(msg)
                if hello.role == "admin":
                    kind = "admin"
                    self._control(c, Lease("admin", rate=KeyRate(self.keys_per_s)), admin=True)
                    return
                geometry = self._join(m.BlockGeometry.of(hello))
            except ValueError as e:  # pydantic's ValidationError among them
                c.send({"ok": False, "error": f"hello: {m.refusal(e)}" if isinstance(e, ValidationError) else str(e)})
                return
            kind, engine = hello.role, hello.engine
            self.metrics.clients.labels(kind).inc()
            try:
                if kind == "control":
                    lease = Lease(engine, hello.scope or "", geometry.block_tokens, KeyRate(self.keys_per_s))
                    self._control(c, lease)
                elif kind == "probe":  # a worker checking the geometry and learning the tiers before its first I/O
                    self._reply(c, self._tiers())
                elif kind == "data" and (len(fds) == 1 or c.inline):
                    self._data(c, engine, hello, fds[0] if fds else None, geometry)  # closed below with the rest
                else:
                    c.send({"ok": False, "error": "hello: role control, probe, or data with one page descriptor"})
            finally:
                self.metrics.clients.labels(kind).dec()
        except (ConnectionError, OSError) as e:
            if not self._closing and kind != "?" and not isinstance(e, (BrokenPipeError, ConnectionResetError)):
                log.info("a %s connection ended: %s", kind, e)
        finally:
            for fd in fds:
                os.close(fd)
            self._conns.discard(c)
            c.close()

    def _join(self, g: m.BlockGeometry) -> m.BlockGeometry:
        """A replica's geometry, checked against the slot (the first engine's opens the tiers when no slot was set)."""
        with self._lock:
            if self.geometry is None:
                self._open(g)
            elif g.block_bytes > self.geometry.block_bytes or g.world_size > self.geometry.world_size:
                s = self.geometry
                self.metrics.refused.labels("geometry").inc()
                raise ValueError(
                    f"hello: this server's slots hold blocks of at most {s.block_bytes} bytes per worker and world "
                    f"size {s.world_size}; the engine has {g.block_bytes} bytes, {g.block_tokens} tokens, world size "
                    f"{g.world_size} (start the server with --block-bytes and --world-size of the largest model)"
                )
            return g

    def _open(self, g: m.BlockGeometry) -> None:
        """Cut the tiers in slots of ``g``'s blocks and open them (ValueError when no tier holds one)."""
        index: BlockIndex[str] = BlockIndex(self.settings.slots(g.block_bytes, g.world_size))  # before a tier opens
        if self.settings.offload == "nvme":  # what killed servers left there, before the tier sizes itself
            remove_stale_runs(self.settings.nvme_dir, log.warning)
        tiers = open_tiers(self.settings.plan(g.block_bytes, 1))
        self.store = TieredStore(tiers, StoreConfig(target_usage_ratio=1.0, large_entry_limit_ratio=1.0))
        self._names = [t.name for t in tiers]
        self.index, self.geometry = index, g
        for t in self.index.tiers:
            self.metrics.capacity.labels(t.name).set(t.slots)
            self.metrics.info.labels(t.name, t.source).set(1)
        log.info(
            "kvtier block server: %s (slots of %d bytes per worker, world size %d)",
            ", ".join(f"{t.name} {t.slots} blocks" for t in self.index.tiers),
            g.block_bytes,
            g.world_size,
        )

    @property
    def ix(self) -> BlockIndex[str]:
        assert self.index is not None  # an engine's hello opened the tiers before any request of its connection
        return self.index

    def _reply(self, c: Conn, body: BaseModel) -> None:
        c.send(body.model_dump(mode="json"))

    def _tiers(self) -> m.TiersReply:
        """The tiers (none before the first engine's hello opened them)."""
        tiers = self.index.tiers if self.index is not None else []  # an index is falsy while it holds no block
        return m.TiersReply(tiers=[(t.name, t.slots, t.source) for t in tiers])

    # -- control --------------------------------------------------------------------------------
    def _control(self, c: Conn, lease: Lease, admin: bool = False) -> None:
        """A manager's connection (the tiers, then its requests), or an operator's (``admin``: ``kvtier cache-server
        flush``; flushes and usage only, before any engine's hello too). A request naming a key outside the
        connection's ``scope`` is refused whole, and its reset drops only its scope's blocks; its keys a second are
        held to its ``rate``."""
        self._reply(c, self._tiers())
        adapter, role = (m.ADMIN, "admin") if admin else (m.CONTROL, "control")
        try:
            while True:
                try:
                    req = adapter.validate_python(c.recv())
                except ValidationError as e:
                    c.send({"ok": False, "error": f"{role}: {m.refusal(e)}"})
                    continue
                self.metrics.requests.labels(req.op).inc()
                self.metrics.throttled.inc(lease.rate.take(m.cost(req)))
                outside = m.outside(lease.scope, getattr(req, "keys", ()))
                if outside is not None:
                    self.metrics.requests_refused.labels("scope").inc()
                    c.send({"ok": False, "error": f"{req.op}: {outside}"})
                    continue
                self._reply(c, self._CONTROL[type(req)](self, lease, req))
        finally:
            self._release(lease)

    def _flush(self, prefix: str) -> m.FlushReply:
        """Drop every idle block whose key starts with ``prefix`` (a model's, or one revision's: keys.key_prefix; ""
        for all); blocks being loaded or stored are left and counted (busy)."""
        if self.index is None:
            return m.FlushReply(dropped=0, busy=0)
        with self._lock:
            idle = [str(k) for t in self.index.tiers for k in list(t.lru) if str(k).startswith(prefix)]
            busy = sum(1 for k in self.index.keys() if str(k).startswith(prefix)) - len(idle)
            self.index.forget(idle, lost=False)
            self._drop_shards(idle)
        return m.FlushReply(dropped=len(idle), busy=busy)

    def _lookup(self, lease: Lease, req: m.Lookup) -> m.LookupReply:
        out = []
        with self._lock:
            for k in req.keys:
                r = self.ix.lookup(k)
                t = self.ix.tier_of(k)
                out.append((r, None if t is None else self.ix.tiers.index(t)))
        self.metrics.lookups.inc(len(req.keys))
        self.metrics.lookup_hits.inc(sum(1 for r, _ in out if r != "miss"))
        self.metrics.lm_req.inc(len(req.keys) * lease.tokens)
        self.metrics.lm_hit.inc(sum(1 for r, _ in out if r == "hit") * lease.tokens)
        return m.LookupReply(found=out)

    def _pin(self, lease: Lease, req: m.Pin) -> m.PinReply:
        with self._lock:
            held = [k for k in req.keys if k in self.ix]
            self.ix.pin(held)
            lease.pins.update(held)
        return m.PinReply(pinned=len(held))

    def _unpin(self, lease: Lease, req: m.Unpin) -> m.Done:
        with self._lock:
            asked = Tally(req.keys)  # a key named twice unpins at most what this connection pinned of it
            mine = [k for k, n in asked.items() for _ in range(min(n, lease.pins[k]))]
            self.ix.unpin(mine)
            lease.pins.subtract(mine)
            lease.pins = +lease.pins
        return m.Done()

    def _touch(self, lease: Lease, req: m.Touch) -> m.Done:
        with self._lock:
            self.ix.touch(req.keys)
        return m.Done()

    def _plan(self, lease: Lease, req: m.PlanStore) -> m.PlanReply:
        keys = req.keys
        raw_of = dict(zip(keys, req.raw, strict=False))
        names = [t.name for t in self.ix.tiers]
        with self._lock:
            rejected_before = self.ix.counters.rejected
            plan = self.ix.plan_store(keys)
            rejected = self.ix.counters.rejected - rejected_before
            if plan is None:
                self.metrics.rejected.inc(rejected)
                return m.PlanReply(none=True, rejected=rejected)
            self._seq += 1
            seq = self._seq
            for k, i in plan.placed.items():
                self._plan_seq[k] = seq
                self._placed[k] = i
                self._writer[k] = lease.engine
                self._raw[k] = str(raw_of.get(k, ""))
                lease.pending.add(k)
            gone = [self._raw.pop(k, "") for k in plan.evicted]
            for k in plan.evicted:
                self._writer.pop(k, None)
            self._actions.append((seq, [a for a in plan.actions if a[0] != "place"]))
            self._cv.notify_all()
        demoted, evicted = self.metrics.note_plan(names, plan, rejected)
        self._l1_evicted += demoted.get(names[0], 0) + evicted.get(names[0], 0)
        return m.PlanReply(
            store=plan.keys_to_store,
            placed=[plan.placed[k] for k in plan.keys_to_store],
            evicted=gone,
            demoted=dict(demoted),
            evicted_by=dict(evicted),
            rejected=rejected,
        )

    def _complete(self, lease: Lease, req: m.Complete) -> m.CompleteReply:
        success = req.success
        with self._lock:
            mine = [k for k in req.keys if k in lease.pending]
            ok = [k for k in mine if success and k not in self._put_failed]
            bad = [k for k in mine if k not in ok]
            self.ix.complete_store(ok, True)
            self.ix.complete_store(bad, False)
            self._settle(mine, lease)
            self._drop_shards(bad)
        return m.CompleteReply(failed=len(bad))

    def _forget(self, lease: Lease, req: m.Forget) -> m.ForgetReply:
        with self._lock:
            n = self.ix.forget(req.keys)
            self._drop_shards(req.keys)
        return m.ForgetReply(forgotten=n)

    def _reset(self, lease: Lease, req: m.Reset) -> m.ResetReply:
        """vLLM's reset_prefix_cache: forget every block of the connection's scope (its model's) no one is loading
        or storing (other replicas' loads and stores in flight keep theirs; other models' blocks stay)."""
        return m.ResetReply(dropped=self._flush(lease.scope).dropped)

    def _usage(self, lease: Lease, req: m.Usage) -> m.UsageReply:
        with self._lock:
            return m.UsageReply(usage=dict(self.ix.usage()) if self.index is not None else {})

    _CONTROL: dict[type, Callable[[BlockServer, Lease, Any], BaseModel]] = {
        m.Lookup: _lookup,
        m.Pin: _pin,
        m.Unpin: _unpin,
        m.Touch: _touch,
        m.PlanStore: _plan,
        m.Complete: _complete,
        m.Forget: _forget,
        m.Reset: _reset,
        m.Usage: _usage,
        m.Flush: lambda self, lease, req: self._flush(req.prefix),
    }

    def _settle(self, keys: list[str], lease: Lease | None) -> None:
        """Pending bookkeeping of ``keys`` is over (lock held)."""
        for k in keys:
            self._plan_seq.pop(k, None)
            self._placed.pop(k, None)
            self._put_failed.discard(k)
            if lease is not None:
                lease.pending.discard(k)

    def _drop_shards(self, keys: list[str]) -> None:
        """Delete the shards of blocks that left the index outside a plan (lock held), in order with the plans."""
        gone = [k for k in keys if k not in self.ix]
        for k in gone:
            self._writer.pop(k, None)
            self._raw.pop(k, None)
        if gone:
            self._seq += 1
            self._actions.append((self._seq, [("evict", k, -1) for k in gone]))
            self._cv.notify_all()

    def _release(self, lease: Lease) -> None:
        """A manager's connection closed: its pins end, its pending blocks are dropped."""
        if self.index is None:  # an operator's connection before any engine's
            return
        with self._lock:
            for k, n in lease.pins.items():
                for _ in range(n):
                    self.ix.unpin([k])
            pending = sorted(lease.pending)
            self.ix.complete_store(pending, False)
            self._settle(pending, lease)
            self._drop_shards(pending)
        if pending:
            self.metrics.abandoned.inc(len(pending))
            log.info("engine %s went away with %d blocks pending: dropped", lease.engine, len(pending))

    # -- the action thread: evictions and demotions, in plan order ------------------------------
    def _action_loop(self) -> None:
        while True:
            with self._cv:
                while not self._actions and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                seq, actions = self._actions.popleft()
            try:
                self._run_actions(actions)
            except Exception:  # a bug must not stop the thread: puts would wait for it forever
                log.exception("kvtier block server: actions of plan %d failed", seq)
            with self._cv:
                self._done = seq
                self._cv.notify_all()

    def _run_actions(self, actions: list[tuple[str, str, int]]) -> None:
        assert self.store is not None and self.geometry is not None
        scratch = self._scratch()
        for what, key, tier in actions:
            for rank in range(self.geometry.world_size):
                k = shard_key(key, rank)
                if what == "evict":
                    self.store.delete(k)
                elif not self.store.move(k, self._names[tier], scratch) and self.store.location(k) is not None:
                    log.debug("a demotion of %s did not happen (being read or no room)", k)

    def _scratch(self) -> memoryview:
        b = getattr(self._local, "scratch", None)
        if b is None:
            assert self.geometry is not None
            b = self._local.scratch = aligned_buffer(round_up(self.geometry.block_bytes))
        return b

    # -- data -----------------------------------------------------------------------------------
    def _data(self, c: Conn, engine: str, hello: m.Hello, fd: int | None, g: m.BlockGeometry) -> None:
        """A worker's data connection: puts and gets of one block at a time through its page — the worker's own,
        mapped here (a Unix socket), or this connection's, which the block's bytes are received into and sent from
        (TCP)."""
        assert self.store is not None and self.index is not None
        rank = hello.rank
        padded = round_up(g.block_bytes)
        if rank is None or not 0 <= rank < g.world_size:
            c.send({"ok": False, "error": f"hello: rank must be an integer in [0, {g.world_size})"})
            return
        if fd is None:
            page = mmap.mmap(-1, padded, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
        elif os.fstat(fd).st_size < padded:
            c.send({"ok": False, "error": f"hello: the page is {os.fstat(fd).st_size} bytes; {padded} are needed"})
            return
        elif not is_sealed(fd):  # a page its sender could shrink later would be a SIGBUS here
            c.send({"ok": False, "error": "hello: the page must be a memfd sealed against shrinking and growing"})
            return
        else:
            page = mmap.mmap(fd, padded, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        view = memoryview(page)
        try:
            self._reply(c, m.Done())
            while True:
                try:
                    req = m.DATA.validate_python(c.recv())
                except ValidationError as e:
                    if c.inline:  # a block's bytes may follow what could not be read: no way to stay in step
                        raise ProtocolError(f"data: expected put or get of one key: {m.refusal(e)}") from None
                    c.send({"ok": False, "error": f"data: expected put or get of one key: {m.refusal(e)}"})
                    continue
                self.metrics.requests.labels(req.op).inc()
                outside = m.outside(hello.scope or "", [req.key])
                if outside is not None:
                    self.metrics.requests_refused.labels("scope").inc()
                    if c.inline:  # a put's bytes follow: no way to stay in step
                        raise ProtocolError(f"data: {outside}")
                    c.send({"ok": False, "error": f"{req.op}: {outside}"})
                    continue
                if isinstance(req, m.Put):
                    if c.inline:
                        c.recv_bytes(view[: g.block_bytes])
                    c.send(self._put(req.key, rank, view, g, padded))
                else:
                    reply = self._get(req.key, rank, engine, view, g, padded)
                    c.send(reply)
                    if c.inline and reply.get("hit"):
                        c.send_bytes(view[: g.block_bytes])
        finally:
            view.release()
            try:
                page.close()
            except BufferError:  # a slice of it is still held by the traceback of a connection lost mid-block:
                pass  # the mapping goes when that is collected (closing it here raised and killed the thread's log)

    def _put(self, key: str, rank: int, view: memoryview, g: m.BlockGeometry, padded: int) -> dict[str, Any]:
        assert self.store is not None
        with self._cv:
            tier, seq = self._placed.get(key), self._plan_seq.get(key)
            if tier is None or seq is None:
                return {"ok": False, "error": "this block is not being stored (never planned, completed or dropped)"}
            if not self._cv.wait_for(lambda: self._done >= seq or self._closing, timeout=PUT_WAIT_S):
                self._put_failed.add(key)
                return {"ok": False, "error": f"the room for this block was not made within {PUT_WAIT_S:.0f} s"}
        name = self._names[tier]
        t0 = time.perf_counter()
        try:
            self.store.place(shard_key(key, rank), name, lambda: [view[:padded]], g.block_bytes, self._scratch())
        except StorageError as e:
            with self._lock:
                self._put_failed.add(key)
            self.metrics.failed_stores.inc()
            return {"ok": False, "error": f"store to {name}: {e}"}
        dt = time.perf_counter() - t0
        self.metrics.store_bytes.inc(g.block_bytes)
        self.metrics.store_seconds.inc(dt)
        if rank == 0:
            self.metrics.lm_stored.inc()
        return m.PutReply(tier=name, seconds=dt).model_dump()

    def _get(
        self, key: str, rank: int, engine: str, view: memoryview, g: m.BlockGeometry, padded: int
    ) -> dict[str, Any]:
        assert self.store is not None
        t0 = time.perf_counter()
        try:
            r = self.store.get(shard_key(key, rank), view[:padded])
        except StorageError as e:
            self.metrics.failed_loads.inc()
            return m.GetReply(hit=False, why=str(e)[:300]).model_dump()
        dt = time.perf_counter() - t0
        if not r.hit or r.nbytes != g.block_bytes:
            self.metrics.failed_loads.inc()
            why = "not held" if not r.hit else f"{r.nbytes} bytes, expected {g.block_bytes}"
            return m.GetReply(hit=False, why=why).model_dump()
        self.metrics.loaded.labels(r.tier or "?").inc()
        self.metrics.load_bytes.inc(r.nbytes)
        self.metrics.load_seconds.inc(dt)
        if rank == 0:
            self.metrics.lm_loaded.inc()
            with self._lock:
                writer = self._writer.get(key)
            if writer is not None and writer != engine:
                self.metrics.cross.inc()
        return m.GetReply(hit=True, tier=r.tier, n=r.nbytes, seconds=dt).model_dump()

    def refresh_gauges(self) -> None:
        if self.index is None:
            return
        with self._lock:
            usage, pending = self.index.usage(), self.index.pending
        assert self.geometry is not None
        self.metrics.refresh(usage, pending, self.geometry.block_bytes * self.geometry.world_size, self._l1_evicted)


def shard_key(key: str, rank: int) -> str:
    """The store's key of one worker's share of a block."""
    return f"{key}.r{rank}"


__all__ = ["BlockServer", "shard_key"]
