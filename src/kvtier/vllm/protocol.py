"""The wire between kvtier's replicas (the vLLM backend, the sim) and a shared ``kvtier cache-server``
(vllm/blockserver.py), on one of two transports; an address is a socket path or ``tcp://HOST:PORT``.

* **A Unix stream socket** (a 0600 socket in the run's 0700 folder; each side checks the other's uid, and the client
  the folder's). A data
  connection's first frame carries one file descriptor (``SCM_RIGHTS``): a sealed memfd of one block's padded
  bytes that both sides map. KV bytes never cross the socket: the worker gathers a block into that shared page and
  says ``put``; the server writes the tier from the same page (an ``O_DIRECT`` write straight from it); a ``get``
  is the way back.
* **TCP**, for replicas on other hosts: the server opens with a challenge (a random nonce) and the client's hello
  answers it with HMAC-SHA256(token, nonce), so the shared token never crosses the link and a recorded hello cannot
  be replayed; a server listening beyond loopback refuses to start without a token. A block's bytes travel
  *inline*: a ``put`` frame is followed by exactly the block's bytes, a ``get`` answer that hits by exactly ``n``
  bytes (never more than the geometry's block). The token authenticates; it does not encrypt (docs/security.md).

Every message is one frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON (a connection's first
frame at most ``MAX_HELLO`` bytes). One request is answered before the next is sent on a connection, so each I/O
thread of a worker has its own connection and page.

Control (the scheduler's manager): hello, lookup, pin, unpin, touch, plan, complete, forget, reset, usage.
Data (a worker's I/O thread): hello (+ the page's descriptor), put, get. Every answer has ``ok``; a refusal has
``error`` (a sentence). No vLLM or numpy import here.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import ipaddress
import json
import mmap
import os
import secrets
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.unixsock import socket_folder_problem

HEADER = struct.Struct("!I")
MAX_FRAME = 8 * 1024 * 1024
"""Largest frame either side accepts (a plan of ~40,000 keys); a larger length is a protocol error."""
MAX_HELLO = 64 * 1024
"""Largest first frame of a connection (its hello, read before the peer is known)."""
MAX_KEYS = 16384
"""Keys one control request may name."""
VERSION = 1


class ProtocolError(ConnectionError):
    """The peer sent something that is not this protocol (a bad length, not JSON); the connection is dropped."""


class Conn:
    """One framed connection (either side). Not thread-safe: one request at a time."""

    def __init__(self, sock: socket.socket, inline: bool = False) -> None:
        self.sock = sock
        self.inline = inline  # TCP: a block's bytes follow its put, and a get's hit
        self.proof: str | None = None  # TCP, client side: what the hello must carry (the challenge answered)
        self._buf = bytearray()

    def send(self, obj: Any, fds: list[int] | None = None) -> None:
        data = json.dumps(obj, separators=(",", ":")).encode()
        if len(data) > MAX_FRAME:
            raise ProtocolError(f"a {len(data)}-byte message is over the {MAX_FRAME}-byte frame limit")
        frame = HEADER.pack(len(data)) + data
        if fds:
            sent = socket.send_fds(self.sock, [frame], fds)
            if sent < len(frame):
                self.sock.sendall(frame[sent:])
        else:
            self.sock.sendall(frame)

    def _fill(self, n: int, fds: list[int] | None = None) -> None:
        while len(self._buf) < n:
            if fds is not None and not fds:
                chunk, got, _, _ = socket.recv_fds(self.sock, 65536, 4)
                fds.extend(got)
            else:
                chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                raise ConnectionError("the peer closed the connection")
            self._buf += chunk

    def recv(self, fds: list[int] | None = None, limit: int = MAX_FRAME) -> Any:
        """The next message; ``fds``: a list that receives the descriptors sent with it."""
        self._fill(HEADER.size, fds)
        (n,) = HEADER.unpack_from(self._buf)
        if n > limit:
            raise ProtocolError(f"a frame of {n} bytes announced; at most {limit}")
        self._fill(HEADER.size + n, fds)
        data = bytes(self._buf[HEADER.size : HEADER.size + n])
        del self._buf[: HEADER.size + n]
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"a frame that is not JSON, or nested too deep ({type(e).__name__})") from None

    def send_bytes(self, data: memoryview) -> None:
        """A block's bytes after the frame that announced them (TCP)."""
        self.sock.sendall(data)

    def recv_bytes(self, into: memoryview) -> None:
        """Exactly ``len(into)`` bytes (a block after the frame that announced it), what was buffered first."""
        have = min(len(self._buf), len(into))
        into[:have] = self._buf[:have]
        del self._buf[:have]
        while have < len(into):
            got = self.sock.recv_into(into[have:])
            if not got:
                raise ConnectionError("the peer closed the connection inside a block")
            have += got

    def call(self, obj: Any, fds: list[int] | None = None, payload: memoryview | None = None) -> dict[str, Any]:
        """Send a request (and ``payload``, a block's bytes, inline) and return its answer; a refusal raises
        Refused with the server's sentence."""
        self.send(obj, fds)
        if payload is not None:
            self.send_bytes(payload)
        reply = self.recv()
        if not isinstance(reply, dict):
            raise ProtocolError("an answer that is not an object")
        if not reply.get("ok"):
            raise Refused(str(reply.get("error") or "refused without a reason"))
        return reply

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class Refused(Exception):
    """The server answered with ok: false (the sentence is its reason)."""


def peer_uid(s: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (SO_PEERCRED), None where it cannot be read."""
    try:
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return int(struct.unpack("3i", creds)[1])


def tcp_address(address: str, listen: bool = False) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://HOST:PORT`` address (an IPv6 host in brackets; port 0, any free port, only to
    ``listen``), None for a socket path; ValueError for a tcp:// address that is not one."""
    if not address.startswith("tcp://"):
        return None
    rest = address[len("tcp://") :]
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not (0 if listen else 1) <= int(port) < 65536:
        raise ValueError(f"{address!r}: a TCP address is tcp://HOST:PORT (an IPv6 host in brackets)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address: what needs no token."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(path: str, what: str) -> bytes:
    """The shared token in ``path`` (its first line): refused, naming the file, when it is missing, empty, shorter
    than 16 characters, or readable by others than its owner (a token others can read is no secret)."""
    p = Path(path)
    try:
        st = p.stat()
        text = p.read_text().strip()
    except OSError as e:
        raise ValueError(f"{what} {path}: {e.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what} {path}: mode {stat.S_IMODE(st.st_mode):04o}; a token file must be 0600 (chmod 600)")
    if len(text) < 16:
        raise ValueError(f"{what} {path}: the token must be at least 16 characters (e.g. openssl rand -hex 32)")
    return text.encode()


def proof(token: bytes, nonce: str) -> str:
    """The hello's answer to the server's challenge."""
    return hmac.new(token, nonce.encode(), hashlib.sha256).hexdigest()


def challenge() -> dict[str, Any]:
    """The first frame a TCP server sends: a fresh nonce the client's hello must answer."""
    return {"op": "challenge", "nonce": secrets.token_hex(16), "version": VERSION}


def connect(path: str, timeout_s: float, token: bytes | None = None) -> Conn:
    """A connection to the cache server at ``path``, a socket path or tcp://HOST:PORT.

    A Unix socket is refused (Refused) unless the process listening there runs as this user (the server admits only
    its own user's engines too), and unless its folder, every one above it and any link on the way are this user's
    or root's and writable by nobody else (a sticky parent aside; ``unixsock.socket_folder_problem``): a stranger's
    server at that path would read the pages and write the engine's KV cache. Both are checked before the first
    byte. Over TCP the server speaks first (its
    challenge), and ``Conn.proof`` is what the hello must carry; a client with no token is refused before it
    connects."""
    tcp = tcp_address(path)
    if tcp is not None:
        if token is None:
            raise Refused(f"{path}: a cache server over TCP needs the shared token (cache_server_token_file)")
        s = socket.create_connection(tcp, timeout=timeout_s)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = Conn(s, inline=True)
        try:
            hi = c.recv(limit=MAX_HELLO)
        except BaseException:
            c.close()
            raise
        if not isinstance(hi, dict) or hi.get("op") != "challenge" or not isinstance(hi.get("nonce"), str):
            c.close()
            raise ProtocolError(f"{path}: the server did not open with a challenge: not a kvtier cache server")
        c.proof = proof(token, hi["nonce"])
        return c
    why = socket_folder_problem(path)
    if why is not None:
        raise Refused(f"{path}: another user could put their own server at this path: {why}")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    uid = peer_uid(s)
    if uid != os.getuid():
        s.close()
        raise Refused(
            f"{path}: the server there runs as uid {uid}, not this user's ({os.getuid()}): not ours (a cache server "
            "serves engines of its own user, and they use only such a server)"
        )
    return Conn(s)


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_page(name: str, nbytes: int) -> int:
    """A memfd of ``nbytes`` whose size neither side can change any more (a shrunk page would be a SIGBUS in the
    other process): what a data connection's hello carries."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def is_sealed(fd: int) -> bool:
    """Whether a received page can no longer shrink or grow."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return False
    return seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW) == fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def data_page(name: str, padded: int, inline: bool) -> tuple[int | None, mmap.mmap]:
    """One I/O thread's page: a sealed memfd the server maps too (a Unix socket), or this process's own memory that
    a block's bytes are sent from and received into (TCP)."""
    if inline:
        return None, mmap.mmap(-1, padded, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, mmap.PROT_READ | mmap.PROT_WRITE)
    fd = sealed_page(name, padded)
    return fd, mmap.mmap(fd, padded, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def page_fds(fd: int) -> Callable[[], list[int]]:
    """What a data connection's hello sends again on every reconnect: its page's descriptor."""
    return lambda: [fd]


__all__ = [
    "Conn",
    "ProtocolError",
    "Refused",
    "challenge",
    "connect",
    "is_loopback",
    "proof",
    "read_token",
    "tcp_address",
    "is_sealed",
    "peer_uid",
    "sealed_page",
    "data_page",
    "page_fds",
    "MAX_FRAME",
    "MAX_HELLO",
    "MAX_KEYS",
    "VERSION",
]
