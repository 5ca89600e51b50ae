"""A small RESP2 client (the Redis/Valkey wire protocol) that moves values without copying them.

Why not redis-py: it packs or parses every value through its own buffers (measured here at 4 MiB
values: 0.44x redis-benchmark's SET and 0.40x its GET rate with the pure-Python parser, 0.26x/0.49x
with hiredis). The tier needs only a handful of commands, and two things no general client offers:
a SET whose value is sent straight from the caller's (aligned, possibly reused) buffer with
``sendall``, and a GET whose value is received straight into the caller's buffer with ``recv_into``.

Connections come from a bounded pool (one per I/O slot); a connection that saw any socket or
protocol error is closed, never reused, so a half-read reply can never be taken for the next one.

A Redis Cluster (``cluster_enabled:1`` in the seed's INFO) is served by ``RespNodes``: a pool per master, and
the cluster's own slot map (``CLUSTER SLOTS``) picks a key's master by its hash slot (CRC16 of the key, or of
its ``{hash tag}``, modulo 16384), as the cluster specification defines. A ``MOVED`` or ``ASK`` answer, or a
master that cannot be reached, fails that operation (the caller counts it) and has the map read again before the
next one: nothing is retried against a node the cluster did not name.
"""

from __future__ import annotations

import queue
import socket
import ssl
import threading
import time
import weakref
from collections.abc import Sequence
from ipaddress import ip_address
from urllib.parse import unquote, urlsplit

CRLF = b"\r\n"
READ_SIZE = 256 * 1024
MAX_LINE_BYTES = 64 * 1024
"""Longest reply line (a type byte, a length or a simple string) read: a server that never sends CRLF is a
protocol error, not an ever-growing buffer."""
MAX_REPLY_BULK_BYTES = 8 * 1024 * 1024
"""Largest bulk string a non-data reply (INFO, SCAN keys, CONFIG) may carry; values are read with
``bulk_into``, whose bound is the caller's buffer. A hostile ``$3000000000`` is refused before allocating."""
MAX_ARRAY_ITEMS = 1 << 20
MAX_DEPTH = 8


class RespError(Exception):
    """An error reply of the server (``-ERR ...``, ``-OOM ...``)."""


class RespConnectionError(OSError):
    """The connection failed or the server closed it (the server is unreachable or died)."""


def _arg(a: str | bytes | int) -> bytes:
    return a if isinstance(a, bytes) else str(a).encode()


class RespConnection:
    def __init__(self, url: str, password: str | None, timeout_s: float, ca_file: str | None = None) -> None:
        parts = urlsplit(url)
        self.peer = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
        try:
            if parts.scheme == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(min(timeout_s, 5.0))
                sock.connect(parts.path)
            else:
                sock = socket.create_connection((parts.hostname, parts.port or 6379), timeout=min(timeout_s, 5.0))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if parts.scheme == "rediss":
                    ctx = ssl.create_default_context(cafile=ca_file)
                    sock = ctx.wrap_socket(sock, server_hostname=parts.hostname)
        except OSError as e:
            raise RespConnectionError(f"cannot connect to {self.peer}: {e}") from e
        sock.settimeout(timeout_s)
        self.sock = sock
        self.op_timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s
        self.blocked_since: float | None = None  # monotonic time a socket call began that has not returned
        self._rbuf = bytearray()
        self._pos = 0
        if password:
            user = unquote(parts.username) if parts.username else None
            self.call(*(["AUTH", user, password] if user else ["AUTH", password]))
        db = parts.path.strip("/") if parts.scheme != "unix" else ""
        if db and db != "0":
            self.call("SELECT", db)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _arm(self) -> None:
        """Before each socket call: the time left of the operation's deadline, or a timeout now. One operation
        (a send and the replies it asks for) has ``op_timeout_s`` in all, so a server that dribbles a byte at a
        time cannot stretch it (a per-recv timeout would restart with every byte)."""
        now = time.monotonic()
        left = self._deadline - now
        if left <= 0:
            raise self._timed_out()
        self.sock.settimeout(left)
        self.blocked_since = now  # cleared when the call returns (RespPool.stalled finds a server that never does)

    # -- sending ------------------------------------------------------------------------------
    def send(self, commands: Sequence[Sequence[str | bytes | int | memoryview]]) -> None:
        """Send commands (pipelined); a memoryview argument goes from its own memory, not copied. Starts the
        operation's deadline: these commands and their replies have ``op_timeout_s`` together."""
        self._deadline = time.monotonic() + self.op_timeout_s
        out: list[bytes | memoryview] = []
        small = bytearray()
        for cmd in commands:
            small += b"*%d\r\n" % len(cmd)
            for a in cmd:
                if isinstance(a, memoryview):
                    small += b"$%d\r\n" % a.nbytes
                    out.append(bytes(small))
                    out.append(a)
                    small = bytearray(CRLF)
                else:
                    b = _arg(a)
                    small += b"$%d\r\n%s\r\n" % (len(b), b)
        if small:
            out.append(bytes(small))
        try:
            for piece in out:
                self._arm()
                self.sock.sendall(piece)
        except OSError as e:
            raise RespConnectionError(f"{self.peer}: send failed: {e}") from e
        finally:
            self.blocked_since = None

    # -- receiving ----------------------------------------------------------------------------
    def _timed_out(self) -> RespConnectionError:
        return RespConnectionError(f"{self.peer}: timed out: the operation took more than {self.op_timeout_s:g} s")

    def _fill(self) -> None:
        self._arm()
        try:
            data = self.sock.recv(READ_SIZE)
        except TimeoutError:
            raise self._timed_out() from None
        except OSError as e:
            raise RespConnectionError(f"{self.peer}: receive failed: {e}") from e
        finally:
            self.blocked_since = None
        if not data:
            raise RespConnectionError(f"{self.peer}: the server closed the connection")
        if self._pos:
            del self._rbuf[: self._pos]
            self._pos = 0
        self._rbuf += data

    def _line(self) -> bytes:
        while True:
            end = self._rbuf.find(CRLF, self._pos)
            if end >= 0:
                if end - self._pos > MAX_LINE_BYTES:
                    raise RespConnectionError(f"protocol error: a reply line longer than {MAX_LINE_BYTES} bytes")
                line = bytes(self._rbuf[self._pos : end])
                self._pos = end + 2
                return line
            if len(self._rbuf) - self._pos > MAX_LINE_BYTES:
                raise RespConnectionError(f"protocol error: no CRLF within {MAX_LINE_BYTES} bytes")
            self._fill()

    @staticmethod
    def _length(rest: bytes, what: str, most: int) -> int:
        """A reply's length field: an integer from -1 to ``most``; anything else is a protocol error."""
        try:
            n = int(rest)
        except ValueError:
            raise RespConnectionError(f"protocol error: {what} length {rest[:40]!r} is not an integer") from None
        if n < -1 or n > most:
            raise RespConnectionError(f"protocol error: {what} of {n} (at most {most} accepted)")
        return n

    def _exact_into(self, view: memoryview) -> None:
        have = len(self._rbuf) - self._pos
        take = min(have, len(view))
        if take:
            view[:take] = self._rbuf[self._pos : self._pos + take]
            self._pos += take
        got = take
        while got < len(view):
            self._arm()
            try:
                n = self.sock.recv_into(view[got:])
            except TimeoutError:
                raise self._timed_out() from None
            except OSError as e:
                raise RespConnectionError(f"{self.peer}: receive failed: {e}") from e
            finally:
                self.blocked_since = None
            if n == 0:
                raise RespConnectionError(f"{self.peer}: the server closed the connection")
            got += n

    def _crlf(self) -> None:
        while len(self._rbuf) - self._pos < 2:
            self._fill()
        self._pos += 2

    def reply(self, max_bulk: int = MAX_REPLY_BULK_BYTES, depth: int = 0) -> object:
        """One reply: str (simple), int, bytes or None (bulk), list (array), RespError (error). Lengths are
        checked before anything is allocated (``max_bulk``, MAX_ARRAY_ITEMS, MAX_DEPTH); a violation is a
        RespConnectionError, so the connection is dropped and the operation fails."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest.decode(errors="replace")
        if kind == b"-":
            return RespError(rest.decode(errors="replace"))
        if kind == b":":
            return (
                self._length(rest, "an integer reply", 2**63 - 1)
                if rest[:1] != b"-"
                else -self._length(rest[1:], "an integer reply", 2**63)
            )
        if kind == b"$":
            n = self._length(rest, "a bulk string", max_bulk)
            if n < 0:
                return None
            data = bytearray(n)
            self._exact_into(memoryview(data))
            self._crlf()
            return bytes(data)
        if kind == b"*":
            if depth >= MAX_DEPTH:
                raise RespConnectionError(f"protocol error: arrays nested deeper than {MAX_DEPTH}")
            n = self._length(rest, "an array", MAX_ARRAY_ITEMS)
            return None if n < 0 else [self.reply(max_bulk, depth + 1) for _ in range(n)]
        raise RespConnectionError(f"protocol error: unexpected reply {line[:40]!r}")

    def bulk_into(self, view: memoryview) -> int | RespError | None:
        """A bulk reply received straight into ``view`` (its length must fit); its length, None for a
        missing key, or the server's error."""
        line = self._line()
        if line[:1] == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if line[:1] != b"$":
            raise RespConnectionError(f"protocol error: expected a bulk reply, got {line[:40]!r}")
        n = self._length(line[1:], "a bulk value", 2**62)
        if n < 0:
            return None
        if n > len(view):
            raise RespConnectionError(f"protocol error: a {n}-byte value for a {len(view)}-byte buffer")
        self._exact_into(view[:n])
        self._crlf()
        return n

    def call(self, *args: str | bytes | int) -> object:
        """One command, its reply; an error reply raises RespError."""
        self.send([args])
        r = self.reply()
        if isinstance(r, RespError):
            raise r
        return r


class RespPool:
    """At most ``size`` connections, handed out one per thread at a time (blocking when all are out)."""

    def __init__(self, url: str, size: int, password: str | None, timeout_s: float, ca_file: str | None) -> None:
        self.url, self.size, self.timeout_s = url, max(1, size), timeout_s
        self._password, self._ca = password, ca_file
        self._idle: queue.LifoQueue[RespConnection] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(self.size)
        self._closed = False
        self._made: weakref.WeakSet[RespConnection] = weakref.WeakSet()  # every connection, idle or in use

    def get(self) -> RespConnection:
        if not self._slots.acquire(timeout=self.timeout_s):
            raise RespConnectionError(f"no free connection to {self.url} within {self.timeout_s:g} s")
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        try:
            conn = RespConnection(self.url, self._password, self.timeout_s, self._ca)
        except BaseException:
            self._slots.release()
            raise
        self._made.add(conn)
        return conn

    def put(self, conn: RespConnection, broken: bool = False) -> None:
        if broken or self._closed:
            conn.close()
        else:
            self._idle.put(conn)
        self._slots.release()

    def stalled(self, older_than_s: float) -> int:
        """Connections blocked in one socket call on the server for more than ``older_than_s`` now: a server that
        stopped answering (a healthy one answers each call in milliseconds)."""
        now = time.monotonic()
        return sum(1 for c in list(self._made) if c.blocked_since is not None and now - c.blocked_since > older_than_s)

    def abort(self, timeout_s: float) -> None:
        """Shut every connection down, the ones in use too: an operation blocked on a hung server fails at once
        (a run's Ctrl+C must not wait out the deadline). Connections made afterwards (cleanup) get ``timeout_s``."""
        self.timeout_s = min(self.timeout_s, timeout_s)
        for conn in list(self._made):
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        while True:  # the idle ones are dead now: never handed out again
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return

    def close(self) -> None:
        self._closed = True
        while True:
            try:
                self._idle.get_nowait().close()
            except queue.Empty:
                return


CLUSTER_SLOTS = 16384
REFRESH_EVERY_S = 1.0
"""A stale slot map is read again at most this often (a dead master must not turn every operation into a
CLUSTER SLOTS call)."""


def _crc16_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table.append(crc & 0xFFFF)
    return table


_CRC16 = _crc16_table()


def key_slot(key: str | bytes) -> int:
    """A key's hash slot in a Redis Cluster: CRC16 (XMODEM) of its hash tag (the text between the first ``{``
    and the next ``}``, when not empty) or of the whole key, modulo 16384."""
    k = key.encode() if isinstance(key, str) else key
    start = k.find(b"{")
    if start >= 0:
        end = k.find(b"}", start + 1)
        if end > start + 1:
            k = k[start + 1 : end]
    crc = 0
    for b in k:
        crc = ((crc << 8) & 0xFFFF) ^ _CRC16[((crc >> 8) ^ b) & 0xFF]
    return crc % CLUSTER_SLOTS


def _loopback(host: str) -> bool:
    try:
        return ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


class RespNodes:
    """The servers behind one URL: a standalone server (one pool), or a Redis Cluster's masters (a pool each;
    ``pool(key)`` picks the master serving the key's slot). ``cluster()`` switches to cluster routing from the
    seed's ``CLUSTER SLOTS``."""

    def __init__(self, url: str, size: int, password: str | None, timeout_s: float, ca_file: str | None) -> None:
        self.url = url
        self._args = (size, password, timeout_s, ca_file)
        self.seed = RespPool(url, size, password, timeout_s, ca_file)
        self.masters: dict[str, RespPool] = {}  # "host:port" -> its pool (a cluster's; empty when standalone)
        self._slots: list[str | None] | None = None  # slot -> master address; None when standalone
        self._lock = threading.Lock()
        self._stale_since: float | None = None
        self._last_refresh = 0.0
        self.refreshes = 0  # slot map reads after the first (a MOVED, a master lost)

    @property
    def is_cluster(self) -> bool:
        return self._slots is not None

    def cluster(self) -> None:
        """Route by the cluster's slot map from now on (RespError/RespConnectionError when it cannot be read)."""
        self._read_map(self.seed)

    def _node_url(self, host: str, port: int) -> str:
        parts = urlsplit(self.url)
        user = f"{parts.username}@" if parts.username else ""
        shown = f"[{host}]" if ":" in host else host
        return parts._replace(netloc=f"{user}{shown}:{port}", path="", query="", fragment="").geturl()

    def _read_map(self, pool: RespPool) -> None:
        c = pool.get()
        broken = True
        try:
            reply = c.call("CLUSTER", "SLOTS")
            broken = False
        finally:
            pool.put(c, broken)
        seed_host = urlsplit(self.url).hostname or "127.0.0.1"
        slots: list[str | None] = [None] * CLUSTER_SLOTS
        addrs: set[str] = set()
        for item in reply if isinstance(reply, list) else []:
            if not (isinstance(item, list) and len(item) >= 3 and isinstance(item[2], list) and len(item[2]) >= 2):
                raise RespConnectionError(f"protocol error: CLUSTER SLOTS answered {str(item)[:80]}")
            lo, hi, (host_b, port, *_) = item[0], item[1], item[2]
            if not (isinstance(lo, int) and isinstance(hi, int) and isinstance(port, int) and 0 <= lo <= hi):
                raise RespConnectionError(f"protocol error: CLUSTER SLOTS answered {str(item)[:80]}")
            host = host_b.decode(errors="replace") if isinstance(host_b, bytes) and host_b else seed_host
            if _loopback(seed_host) and not _loopback(host):  # a loopback seed names loopback masters only
                raise RespConnectionError(f"the cluster at {seed_host} names master {host}: refused (not loopback)")
            addr = f"{host}:{port}"
            addrs.add(addr)
            for s in range(lo, min(hi, CLUSTER_SLOTS - 1) + 1):
                slots[s] = addr
        if not addrs:
            raise RespConnectionError("CLUSTER SLOTS: the cluster serves no slot")
        with self._lock:
            old = self.masters
            self.masters = {a: old.get(a) or RespPool(self._node_url(*_split(a)), *self._args) for a in addrs}
            self._slots = slots
            self._stale_since = None
            self._last_refresh = time.monotonic()
        for a, p in old.items():
            if a not in self.masters:
                p.close()

    def stale(self) -> None:
        """An answer says the map is out of date (MOVED, ASK, a master unreachable): read it again soon."""
        if self._slots is not None and self._stale_since is None:
            self._stale_since = time.monotonic()

    def pool(self, key: str | None = None) -> RespPool:
        """The pool for ``key``'s master (the seed's for a standalone server, or with no key)."""
        if self._slots is None or key is None:
            return self.seed
        if self._stale_since is not None and time.monotonic() - self._last_refresh >= REFRESH_EVERY_S:
            self._last_refresh = time.monotonic()
            for p in [self.seed, *self.masters.values()]:
                try:
                    self._read_map(p)
                    self.refreshes += 1
                    break
                except (RespError, RespConnectionError):
                    continue
        slot = key_slot(key)
        addr = self._slots[slot]
        pool = self.masters.get(addr) if addr else None
        if pool is None:
            raise RespConnectionError(f"hash slot {slot} has no master in the cluster's map")
        return pool

    def pools(self) -> list[RespPool]:
        """Every server that holds keys: the cluster's masters, or the one server."""
        return list(self.masters.values()) if self._slots is not None else [self.seed]

    def stalled(self, older_than_s: float) -> int:
        return sum(p.stalled(older_than_s) for p in {id(p): p for p in [self.seed, *self.masters.values()]}.values())

    def abort(self, timeout_s: float) -> None:
        for p in [self.seed, *self.masters.values()]:
            p.abort(timeout_s)

    def close(self) -> None:
        for p in [self.seed, *self.masters.values()]:
            p.close()


def _split(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


__all__ = ["RespConnection", "RespPool", "RespNodes", "RespError", "RespConnectionError", "key_slot"]
