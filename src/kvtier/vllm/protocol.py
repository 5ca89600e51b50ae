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

import json
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
        except ValueError as e:
            raise ProtocolError(f"a frame that is not JSON ({e})") from None

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


def connect(path: str, timeout_s: float) -> Conn:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        s.connect(path)
    except OSError:
        s.close()
        raise
    return Conn(s)


__all__ = ["Conn", "ProtocolError", "Refused", "connect", "MAX_FRAME", "MAX_KEYS", "VERSION"]
