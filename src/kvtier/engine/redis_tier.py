"""Redis / Valkey tier: entries as binary values on a Redis-protocol server (no extra needed: kvtier
speaks the protocol itself, engine/resp.py, so values go from and into the aligned buffers without
a copy).

An entry is stored as parts under ``kvtier:<run>:{<digest>}:<i>``, each at most ``part_bytes`` (the
aligned chunks the store passes, cut without copying), so no value comes near the server's
``proto-max-bulk-len`` and no single command holds the single-threaded server for long. A write
pipelines one SET per part, chunk by chunk (a chunk may be a view of a reused buffer: its parts are
on the server before the next chunk is pulled); a read pipelines GETs in groups that fit the
caller's buffer and receives each value straight into it, so export yields aligned chunks the next
tier can write with O_DIRECT. A part larger than the buffer is read in GETRANGE pieces.

A Redis Cluster is found by itself (the seed URL's INFO says ``cluster_enabled:1``): the ``{digest}`` hash tag
puts an entry's parts and description in one slot, so they travel as one pipeline to one master, while entries
spread over every master's slots (engine/resp.py ``RespNodes`` routes each by the cluster's own slot map). A
master lost is that master's operations failing (``TierUnavailable``, counted), never another master's bytes.

Capacity is kvtier's: the store reserves before writing, as for every tier. The server's own
``maxmemory`` and policy are reported (bench warns when they can undercut the tier); a write the
server refuses for memory (OOM) is a full tier, a key gone from the server an unreadable entry, and
a server that cannot be reached ``TierUnavailable`` — the bench then stops the run as partial.

Timing: device_ns is the time in the socket calls of the pipeline (send, server work, reply);
host_ns the rest (key naming, cutting chunks into parts).

Credentials never come from argv: the password is read from ``KVTIER_REDIS_PASSWORD`` (or
``REDISCLI_AUTH``, as redis-cli does); a URL carrying one is refused. ``rediss://`` turns TLS on;
``KVTIER_REDIS_CA_CERT`` names a CA bundle for it.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from urllib.parse import urlsplit

from kvtier.engine.backend import (
    OwnKeys,
    check_cancel,
    description_limit,
    expected_size_problem,
    read_through_export,
    round_up,
    shared_digest,
)
from kvtier.engine.resp import RespConnection, RespConnectionError, RespError, RespNodes, RespPool, key_slot
from kvtier.errors import ConfigError, EntryNotFound, ForeignEntry, StorageError, TierFullError, TierUnavailable
from kvtier.telemetry.clock import IOTiming

PASSWORD_ENV = ("KVTIER_REDIS_PASSWORD", "REDISCLI_AUTH")
CA_ENV = "KVTIER_REDIS_CA_CERT"
KEY_PREFIX = "kvtier"
DEFAULT_PART_BYTES = 4 * 1024 * 1024


def url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL (redis://, rediss:// or unix://, no password in it), or None.
    Names no flag: the config's validator says which flag it came from."""
    try:
        parts = urlsplit(url)
        has_password = parts.password is not None
    except ValueError:
        return "not a URL: expected redis://host:port/db, rediss://... (TLS) or unix:///path"
    shown = redact_url(url)  # a message never carries a password, whatever else is wrong
    if has_password:
        return f"a password in the URL would be visible in the process list; give it in {PASSWORD_ENV[0]} instead"
    if parts.scheme not in ("redis", "rediss", "unix"):
        return f"{shown!r}: expected redis://host:port/db, rediss://... (TLS) or unix:///path"
    if parts.query or parts.fragment:
        names = sorted({q.split("=", 1)[0] for q in parts.query.split("&") if q}) or ["#fragment"]
        return f"{shown!r}: query parameters are not used here ({', '.join(names)}): refused, not ignored"
    if parts.scheme != "unix" and not parts.hostname:
        return f"{shown!r}: no host"
    if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdigit():
        return f"{shown!r}: the path must be a database number (redis://host:port/0)"
    return None


def redact_url(url: str) -> str:
    """``url`` with any user:password and query removed (what messages and results may show)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<not a URL>"
    if not (parts.username or parts.password or parts.query or parts.fragment):
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    netloc = host if (parts.username or parts.password) else parts.netloc
    return parts._replace(netloc=netloc, query="", fragment="").geturl()


def _password() -> str | None:
    for name in PASSWORD_ENV:
        value = os.environ.get(name)
        if value:
            return value
    return None


class RedisTier:
    """KV entries on a Redis or Valkey server; only keys under this run's prefix are touched."""

    def __init__(
        self,
        url: str,
        capacity_bytes: int,
        connections: int = 16,
        part_bytes: int = DEFAULT_PART_BYTES,
        name: str = "redis",
        timeout_s: float = 30.0,
        namespace: str | None = None,
        ttl_s: float = 3600.0,
        scope: str = "",
    ) -> None:
        """``namespace``: None for this run's own key space (emptied by close()), or NAME of a shared one: every
        key written lives ``ttl_s`` (PX), entries other writers put there are read (``read_shared``), and close()
        leaves it (``kvtier clean --remote`` empties it). ``scope``: in a shared namespace, what besides the key
        names an entry's bytes (model, dtype, layout: ``KeyScope.tag()``), hashed into every key there."""
        self.name = name
        problem = url_problem(url)
        if problem is not None:
            raise ConfigError(f"{name} tier: {problem}")
        self.url = url
        self.capacity_bytes = capacity_bytes
        self.part_bytes = round_up(max(part_bytes, 4096))
        self.writer = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"  # this run (and rank)
        self.namespace = namespace
        self.scope = scope if namespace else ""
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.prefix = (
            f"{KEY_PREFIX}:shared:{namespace}" if namespace else f"{KEY_PREFIX}:{self.writer.split('-', 1)[1]}"
        )
        self._nodes = RespNodes(url, connections, _password(), timeout_s, os.environ.get(CA_ENV) or None)
        self._index: dict[str, list[int]] = {}  # key -> the lengths of its parts
        self._lock = threading.Lock()
        self.cleanup_problems: list[str] = []
        self.unreachable_masters: list[str] = []  # a cluster's masters that did not answer at start
        self._own = OwnKeys(f"{self.prefix}:")  # SCAN's answers filtered to what is really ours
        try:
            with self._conn() as c:
                info = _info(c.call("INFO"))
                keys = c.call("DBSIZE")
            if info.get("cluster_enabled", "").strip() == "1":
                db = urlsplit(url).path.strip("/")
                if db not in ("", "0"):
                    raise ConfigError(f"{name} tier: {url}: a Redis Cluster has database 0 only")
                self._nodes.cluster()
                sizes = self._each_node(lambda c: c.call("DBSIZE"))
                keys = sum(n for n in sizes.values() if isinstance(n, int))
                self.unreachable_masters = [u for u, n in sizes.items() if isinstance(n, Exception)]
                if len(self.unreachable_masters) == len(sizes):
                    raise RespConnectionError(f"no master of the cluster answers ({self.unreachable_masters})")
        except RespError as e:
            hint = f"; set {PASSWORD_ENV[0]}" if "NOAUTH" in str(e) or "WRONGPASS" in str(e) else ""
            raise StorageError(f"{self.name} tier: {url}: {e}{hint}") from e
        except RespConnectionError as e:
            raise TierUnavailable(f"{self.name} tier: cannot reach {url}: {e}") from e
        self.server = {
            "url": url,
            **server_facts(info),
            "keys_at_start": keys if isinstance(keys, int) and keys >= 0 else None,
            "tls": url.startswith("rediss://"),
            "part_bytes": self.part_bytes,
            "connections": self._nodes.seed.size,
            "cluster_masters": len(self._nodes.masters) if self._nodes.is_cluster else None,
            "cluster_masters_unreachable": len(self.unreachable_masters) if self._nodes.is_cluster else None,
            "key_prefix": self.prefix,
            "namespace": f"shared:{namespace}" if namespace else "run",
            "ttl_s": ttl_s if namespace else None,
            "scope": self.scope or None,
            "writer": self.writer,
        }

    @property
    def foreign_keys_listed(self) -> int:
        """Keys a SCAN of our prefix answered that are not under it (never deleted)."""
        return self._own.foreign

    @contextmanager
    def _conn(self, key: str | None = None, pool: RespPool | None = None) -> Iterator[RespConnection]:
        """A pooled connection to the server holding ``key`` (a cluster's master for its slot), or to ``pool``;
        closed instead of returned when its stream may be out of step."""
        pool = pool or self._nodes.pool(key)
        c = pool.get()
        broken = True
        try:
            yield c
            broken = False
        finally:
            pool.put(c, broken)

    def _each_node(self, ask: Callable[[RespConnection], object]) -> dict[str, object]:
        """``ask`` of every server holding keys (each master of a cluster), by its URL: its answer, or the
        RespError/RespConnectionError it gave (a cluster's lost master does not stop the others' answers)."""
        out: dict[str, object] = {}
        for pool in self._nodes.pools():
            try:
                with self._conn(pool=pool) as c:
                    out[pool.url] = ask(c)
            except (RespError, RespConnectionError) as e:
                out[pool.url] = e
        return out

    def _by_node(self, names: Iterable[str]) -> list[tuple[RespPool, list[str]]]:
        """Key names grouped by the server holding them, each group in slot order (one slot's keys together)."""
        groups: dict[int, tuple[RespPool, list[str]]] = {}
        for k in sorted(names, key=key_slot) if self._nodes.is_cluster else names:
            pool = self._nodes.pool(k)
            groups.setdefault(id(pool), (pool, []))[1].append(k)
        return list(groups.values())

    # -- naming ----------------------------------------------------------------------------
    def _base(self, key: str) -> str:
        """An entry's key stem; the digest is its hash tag (a cluster keeps every part in one slot)."""
        return f"{self.prefix}:{{{shared_digest(self.scope, key)}}}"

    def _part_keys(self, key: str, parts: int) -> list[str]:
        base = self._base(key)
        return [f"{base}:{i}" for i in range(parts)]

    def _fail(self, what: str, e: Exception) -> StorageError:
        """A protocol-level failure as kvtier's: unreachable, full (OOM), or a plain failure."""
        if isinstance(e, (RespConnectionError, OSError)) or str(e).startswith(("MOVED", "ASK", "CLUSTERDOWN")):
            self._nodes.stale()  # a master lost or slots moved: the cluster's map is read again
        if isinstance(e, (RespConnectionError, OSError)) or str(e).startswith("CLUSTERDOWN"):
            return TierUnavailable(f"{self.name} tier: {what}: server unreachable ({e})")
        if isinstance(e, RespError) and str(e).startswith("OOM"):
            return TierFullError(f"{self.name} tier: {what}: the server is out of memory ({e})")
        return StorageError(f"{self.name} tier: {what}: {e}")

    def stored_size(self, nbytes: int) -> int:
        return round_up(nbytes)

    # -- Backend ---------------------------------------------------------------------------
    def write(self, key: str, chunks: Iterable[memoryview], nbytes: int) -> IOTiming:
        t0 = time.perf_counter_ns()
        step = self.part_bytes
        lengths: list[int] = []
        base = self._base(key)
        device = 0
        try:
            with self._conn(base) as c:
                for chunk in chunks:
                    cmds: list[Sequence[str | memoryview]] = []
                    for off in range(0, len(chunk), step):
                        part = chunk[off : off + step]
                        cmds.append(("SET", f"{base}:{len(lengths)}", part, *self._expiry()))
                        lengths.append(len(part))
                    t = time.perf_counter_ns()
                    c.send(cmds)
                    replies = [c.reply() for _ in cmds]
                    device += time.perf_counter_ns() - t
                    bad = next((r for r in replies if isinstance(r, RespError)), None)
                    if bad is not None:
                        raise bad
                if self.namespace:  # the entry's description, last: a reader that finds it finds every part
                    meta = " ".join([self.writer, *map(str, lengths)])
                    t = time.perf_counter_ns()
                    reply = c.call("SET", f"{base}:m", meta, *self._expiry())
                    device += time.perf_counter_ns() - t
                    if isinstance(reply, RespError):
                        raise reply
        except BaseException as e:
            self._forget_parts(key, len(lengths))
            if isinstance(e, (RespError, RespConnectionError)):
                raise self._fail(f"write of {key!r}", e) from e
            raise
        with self._lock:
            self._index[key] = lengths
        return IOTiming(host_ns=time.perf_counter_ns() - t0 - device, device_ns=device)

    def _expiry(self) -> tuple[str, ...]:
        """SET's expiry arguments: PX ttl in a shared namespace, none in the run's own."""
        return ("PX", str(self.ttl_ms)) if self.namespace else ()

    def read_shared(
        self, key: str, buf: memoryview, expect: int, cancel: threading.Event | None = None
    ) -> tuple[int, IOTiming, bool] | None:
        """In a shared namespace, an entry this run does not hold but some writer put there (another rank, an
        earlier run): read it through ``buf``; (bytes, timing, whether another writer wrote it), or None when
        the server has no such entry (or its TTL ended). Outside a shared namespace: None.

        Nothing of a writer's is believed before it is checked: the description is read with a bound on its
        length (GETRANGE), its total size and part count must be those of the ``expect``-byte entry the key names,
        and it must carry an expiry (an entry some client made permanent with PERSIST would outlive every writer's
        TTL) before any part is asked for; anything else raises ForeignEntry (a miss by cause, never a hit)."""
        if not self.namespace:
            return None
        t0 = time.perf_counter_ns()
        cap = description_limit(expect)
        try:
            base = self._base(key)
            with self._conn(base) as c:
                c.send([("GETRANGE", f"{base}:m", 0, cap), ("PTTL", f"{base}:m")])  # at most cap + 1 bytes
                meta, pttl = c.reply(), c.reply()
        except (RespError, RespConnectionError) as e:
            raise self._fail(f"lookup of {key!r}", e) from e
        if not isinstance(meta, bytes) or not meta:  # GETRANGE of a missing key is the empty string
            return None
        if len(meta) > cap:
            raise ForeignEntry(f"{self.name} tier: {key!r}: an entry description longer than {cap} bytes")
        fields = meta.decode(errors="replace").split(" ")
        try:
            writer, lengths = fields[0], [int(x) for x in fields[1:] if len(x) <= 20]
        except ValueError:
            raise ForeignEntry(f"{self.name} tier: {key!r}: a malformed entry description") from None
        if len(lengths) != len(fields) - 1 or any(n <= 0 for n in lengths):
            raise ForeignEntry(f"{self.name} tier: {key!r}: a malformed entry description")
        problem = expected_size_problem(sum(lengths), len(lengths), expect)
        if problem is not None:
            raise ForeignEntry(f"{self.name} tier: {key!r}: {problem}")
        if pttl == -1:  # every writer of a shared namespace sets PX: one without has been made permanent (PERSIST)
            raise ForeignEntry(
                f"{self.name} tier: {key!r}: an entry without an expiry in a shared namespace (made permanent by "
                "another client; kvtier's writers set one)"
            )
        timing = IOTiming()
        for _ in self._export_parts(key, lengths, buf, timing, cancel):
            pass
        timing.host_ns = time.perf_counter_ns() - t0 - timing.device_ns
        return sum(lengths), timing, writer != self.writer

    def present(self, keys: Sequence[str]) -> list[bool | None]:
        """In a shared namespace, whether each entry is there (its description, written last, exists): one
        pipelined EXISTS per master, the hint a scheduler asks before it plans a load (the load checks the entry
        itself, ``read_shared``). None for a key whose master did not answer (a cluster that lost one still
        answers for the others' slots); StorageError when no server answered. Outside a shared namespace: all
        False."""
        if not self.namespace:
            return [False] * len(keys)
        metas = [f"{self._base(k)}:m" for k in keys]
        found: dict[str, bool | None] = {}
        failed: list[Exception] = []
        for pool, group in self._by_node(metas):
            try:
                with self._conn(pool=pool) as c:
                    c.send([("EXISTS", m) for m in group])
                    found.update((m, c.reply() == 1) for m in group)
            except (RespError, RespConnectionError) as e:
                failed.append(e)
                found.update((m, None) for m in group)
        if failed and all(v is None for v in found.values()):
            raise self._fail("lookup", failed[0])
        if failed:
            self._nodes.stale()
        return [found.get(m, False) for m in metas]

    def _forget_parts(self, key: str, parts: int) -> None:
        """Best effort: remove what a failed write may have left (close() sweeps the prefix again)."""
        if not parts:
            return
        try:
            with self._conn(self._base(key)) as c:
                c.call("UNLINK", *self._part_keys(key, parts))
        except (RespError, RespConnectionError):
            pass

    def _lengths(self, key: str) -> list[int]:
        with self._lock:
            lengths = self._index.get(key)
        if lengths is None:
            raise EntryNotFound(f"{self.name} tier: {key!r} not stored")
        return lengths

    def _gone(self, key: str) -> StorageError:
        return StorageError(
            f"{self.name} tier: {key!r} is gone from the server (maxmemory-policy {self.server['maxmemory_policy']}?)"
        )

    def export(
        self, key: str, buf: memoryview, timing: IOTiming, cancel: threading.Event | None = None
    ) -> Iterator[memoryview]:
        return self._export_parts(key, self._lengths(key), buf, timing, cancel)

    def _export_parts(
        self, key: str, lengths: list[int], buf: memoryview, timing: IOTiming, cancel: threading.Event | None
    ) -> Iterator[memoryview]:
        keys = self._part_keys(key, len(lengths))
        room = len(buf)
        i = done = 0
        try:
            with self._conn(keys[0] if keys else None) as c:
                while i < len(keys):
                    check_cancel(cancel, f"{self.name} read", done)
                    if lengths[i] > room:  # a part larger than the buffer: GETRANGE pieces of it
                        for off in range(0, lengths[i], room):
                            n = min(room, lengths[i] - off)
                            t = time.perf_counter_ns()
                            c.send([("GETRANGE", keys[i], off, off + n - 1)])
                            got = c.bulk_into(buf)
                            timing.device_ns += time.perf_counter_ns() - t
                            if isinstance(got, RespError):
                                raise got
                            if got != n:
                                raise self._gone(key)
                            yield buf[:n]
                        done += lengths[i]
                        i += 1
                        continue
                    j, group = i, 0  # this round's parts: as many as fit in the buffer together
                    while j < len(keys) and group + lengths[j] <= room:
                        group += lengths[j]
                        j += 1
                    t = time.perf_counter_ns()
                    c.send([("GET", k) for k in keys[i:j]])
                    off = 0
                    problem: StorageError | RespError | None = None
                    for n in lengths[i:j]:  # every reply is read, even after a bad one: the stream stays in step
                        got = c.bulk_into(buf[off:])
                        if isinstance(got, RespError):
                            problem = problem or got
                        elif got is None:
                            problem = problem or self._gone(key)
                        elif got != n:
                            problem = problem or StorageError(
                                f"{self.name} tier: a part of {key!r} has {got} bytes, expected {n}"
                            )
                        off += n
                    timing.device_ns += time.perf_counter_ns() - t
                    if problem is not None:
                        raise problem
                    done += group
                    i = j
                    yield buf[:off]
        except (RespError, RespConnectionError) as e:
            raise self._fail(f"read of {key!r}", e) from e

    def read(self, key: str, buf: memoryview, cancel: threading.Event | None = None) -> IOTiming:
        return read_through_export(self.export, key, buf, cancel)

    def delete(self, key: str) -> None:
        """This run no longer holds the entry. In its own namespace the keys are removed; in a shared one they
        stay until their TTL (another writer may have written the same entry since, or another reader want it)."""
        with self._lock:
            lengths = self._index.pop(key, None)
        if lengths and not self.namespace:
            self._forget_parts(key, len(lengths))

    def stored_bytes(self) -> int:
        """What the server holds under our keys: the sum of their STRLENs, asked of the server."""
        with self._lock:
            entries = [(k, len(v)) for k, v in self._index.items()]
        names = [pk for k, parts in entries for pk in self._part_keys(k, parts)]
        total = 0
        try:
            for pool, group in self._by_node(names):
                with self._conn(pool=pool) as c:
                    c.send([("STRLEN", k) for k in group])
                    total += sum(r for r in (c.reply() for _ in group) if isinstance(r, int))
        except RespConnectionError as e:
            raise self._fail("STRLEN of our keys", e) from e
        return total

    def server_keys(self) -> list[str]:
        """Every key on the server (each master of a cluster) under this run's prefix (SCAN; for checks and
        cleanup). The server's answer is not trusted: a key outside the prefix (a server that ignores MATCH) is
        left out and noted (engine.backend.OwnKeys); a cursor that never returns to 0 ends after MAX_SCAN_CALLS
        calls."""
        out: list[str] = []
        for pool in self._nodes.pools():
            out += self._scan(pool)
        return out

    def _scan(self, pool: RespPool) -> list[str]:
        out: list[str] = []
        cursor = "0"
        with self._conn(pool=pool) as c:
            for _ in range(MAX_SCAN_CALLS):
                reply = c.call("SCAN", cursor, "MATCH", f"{self.prefix}:*", "COUNT", 1000)
                if not (
                    isinstance(reply, list)
                    and len(reply) == 2
                    and isinstance(reply[0], bytes)
                    and isinstance(reply[1], list)
                ):
                    raise RespConnectionError(f"protocol error: SCAN answered {str(reply)[:80]}")
                cursor = reply[0].decode(errors="replace")
                listed = [k.decode(errors="replace") for k in reply[1] if isinstance(k, bytes)]
                out += self._own.keep(listed)
                if cursor == "0":
                    return out
        self.cleanup_problems.append(f"{pool.url}: SCAN did not finish in {MAX_SCAN_CALLS} calls; stopped there")
        return out

    def stalled_operations(self, older_than_s: float) -> int:
        """Operations blocked on the server for more than ``older_than_s`` now (the bench's end-of-run check)."""
        return self._nodes.stalled(older_than_s)

    def abort(self) -> None:
        """The run was interrupted: fail the operations in flight now (their connections are shut down), and
        give the cleanup that follows a short deadline (ABORT_CLEANUP_TIMEOUT_S a call): a hung server must not
        hold the run's exit."""
        self._nodes.abort(ABORT_CLEANUP_TIMEOUT_S)

    def close(self) -> None:
        """Delete every key under this run's prefix (ours only) and drop the connections; a shared namespace
        is left as it is (its keys expire). A server that cannot be reached is noted in ``cleanup_problems``;
        nothing raises."""
        with self._lock:
            self._index.clear()
        try:
            if not self.namespace:
                self.purge()
        finally:
            self._nodes.close()

    def purge_preview(self) -> list[str]:
        """What ``purge`` would delete (``kvtier clean --remote --dry-run``)."""
        return self.server_keys()

    def purge(self) -> int:
        """Delete every key under this tier's prefix (the run's own, or the whole shared namespace: what
        ``kvtier clean --remote`` does), ours only whatever the server lists; the keys deleted. Problems go to
        ``cleanup_problems``; nothing raises. A cluster's masters are emptied one by one: one lost is noted, the
        others are still emptied."""
        removed = 0
        cluster = self._nodes.is_cluster
        for pool in self._nodes.pools():
            try:
                keys = self._scan(pool)
                with self._conn(pool=pool) as c:
                    for batch in _slot_batches(sorted(keys, key=key_slot) if cluster else keys, cluster):
                        c.call("UNLINK", *batch)
                removed += len(keys)
            except (RespError, RespConnectionError) as e:
                self.cleanup_problems.append(f"{pool.url}: keys {self.prefix}:* not removed ({e})")
        problem = self._own.problem(self.url, "SCAN MATCH", "MATCH")
        if problem and problem not in self.cleanup_problems:
            self.cleanup_problems.append(problem)
        return removed


def _slot_batches(keys: list[str], cluster: bool, most: int = 1000) -> Iterator[list[str]]:
    """``keys`` (in slot order) cut into UNLINK batches of at most ``most``; in a cluster, each of one slot (a
    command's keys must share a slot there)."""
    batch: list[str] = []
    for k in keys:
        if batch and (len(batch) >= most or (cluster and key_slot(k) != key_slot(batch[0]))):
            yield batch
            batch = []
        batch.append(k)
    if batch:
        yield batch


ABORT_CLEANUP_TIMEOUT_S = 1.0
"""Each cleanup call's deadline after an interrupt (a healthy server answers in milliseconds)."""
MAX_SCAN_CALLS = 100_000
"""SCAN calls at most per listing (COUNT 1000 each: 10^8 keys) before giving up on a cursor that never ends."""


_TEXT_MAX = 64


def _text(v: str | None) -> str | None:
    """A server's word as data: printable characters only (no terminal escapes), at most _TEXT_MAX of them."""
    if v is None:
        return None
    return "".join(ch if ch.isprintable() else "?" for ch in v[:_TEXT_MAX]).strip() or None


def _count(v: str | None) -> int | None:
    """A non-negative integer INFO field, or None when the server sent something else (``maxmemory:abc``)."""
    v = (v or "").strip()
    return int(v) if v.isdigit() and len(v) <= 20 else None


def server_facts(info: dict[str, str]) -> dict[str, object]:
    """What the result records of the server from its INFO, every field checked: a non-integer where a count
    belongs is null (never a traceback), text loses control characters (never raw to the terminal)."""
    return {
        "server": "valkey" if "valkey_version" in info else "redis",
        "version": _text(info.get("valkey_version") or info.get("redis_version")),
        "maxmemory_bytes": _count(info.get("maxmemory")),
        "maxmemory_policy": _text(info.get("maxmemory_policy")),
        "used_memory_bytes_at_start": _count(info.get("used_memory")),
    }


def _info(reply: object) -> dict[str, str]:
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else ""
    out = {}
    for line in text.splitlines():
        if ":" in line and not line.startswith("#"):
            k, v = line.split(":", 1)
            out[k] = v
    return out


__all__ = ["RedisTier", "url_problem", "server_facts", "PASSWORD_ENV"]
