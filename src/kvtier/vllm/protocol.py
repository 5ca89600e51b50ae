"""The wire between kvtier's vLLM backend and a shared ``kvtier cache-server`` (vllm/blockserver.py).

A Unix stream socket (a 0600 socket in the run's 0700 folder; the server also checks the peer's uid). Every message
is one frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON. A data connection's first frame
carries one file descriptor (``SCM_RIGHTS``): a memfd of one block's padded bytes that both sides map. KV bytes
never cross the socket: the worker gathers a block from the engine's KV cache into that shared page and says
``put``; the server writes the tier from the same page (an ``O_DIRECT`` write straight from it); a ``get`` is the
way back. One request is answered before the next is sent on a connection, so each I/O thread of a worker has
its own connection and page.

Control (the scheduler's manager): hello, lookup, pin, unpin, touch, plan, complete, forget, reset, usage.
Data (a worker's I/O thread): hello (+ the page's descriptor), put, get. Every answer has ``ok``; a refusal has
``error`` (a sentence). No vLLM or numpy import here.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
from typing import Any

HEADER = struct.Struct("!I")
MAX_FRAME = 8 * 1024 * 1024
"""Largest frame either side accepts (a plan of ~40,000 keys); a larger length is a protocol error."""
MAX_KEYS = 16384
"""Keys one control request may name."""
VERSION = 1


class ProtocolError(ConnectionError):
    """The peer sent something that is not this protocol (a bad length, not JSON); the connection is dropped."""


class Conn:
    """One framed connection (either side). Not thread-safe: one request at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
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

    def recv(self, fds: list[int] | None = None) -> Any:
        """The next message; ``fds``: a list that receives the descriptors sent with it."""
        self._fill(HEADER.size, fds)
        (n,) = HEADER.unpack_from(self._buf)
        if n > MAX_FRAME:
            raise ProtocolError(f"a frame of {n} bytes announced; at most {MAX_FRAME}")
        self._fill(HEADER.size + n, fds)
        data = bytes(self._buf[HEADER.size : HEADER.size + n])
        del self._buf[: HEADER.size + n]
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as e:
            raise ProtocolError(f"a frame that is not JSON, or nested too deep ({type(e).__name__})") from None

    def call(self, obj: Any, fds: list[int] | None = None) -> dict[str, Any]:
        """Send a request and return its answer; a refusal raises Refused with the server's sentence."""
        self.send(obj, fds)
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


def connect(path: str, timeout_s: float) -> Conn:
    """A connection to the cache server at ``path``, refused (Refused) unless the process listening there runs as
    this user: a stranger's server at that path would read the pages and write the engine's KV cache."""
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
        raise Refused(f"{path}: the server there runs as uid {uid}, not this user's ({os.getuid()}): not ours")
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


__all__ = [
    "Conn",
    "ProtocolError",
    "Refused",
    "connect",
    "is_sealed",
    "peer_uid",
    "sealed_page",
    "MAX_FRAME",
    "MAX_KEYS",
    "VERSION",
]
