"""Who may reach a ``kvtier cache-server`` (vllm/blockserver.py), and how: its listeners and the first exchange
of each connection, apart from what the server serves.

* **A Unix socket** (``--socket``): claimed (a live server's is refused, a dead one's removed), bound under umask
  0177 (0600: only this user may connect), and each peer's uid checked (``SO_PEERCRED``) before it is served.
* **TCP** (``--listen HOST:PORT``, only with a token): the server speaks first, a fresh nonce; the peer's hello
  must carry HMAC-SHA256(token, nonce) (vllm/protocol.py), compared in constant time, within ``HELLO_S``. A wrong
  or missing proof is answered, logged with the peer's address and counted; nothing else is read from it.
"""

from __future__ import annotations

import hmac
import logging
import os
import socket
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.unixsock import claim
from kvtier.vllm.protocol import MAX_HELLO, Conn, challenge, peer_uid, proof

log = logging.getLogger("kvtier.vllm.server")

HELLO_S = 10.0
"""Longest a TCP peer may take to send its hello after the challenge."""


class Listeners:
    """The server's listening sockets; ``serve(sock, tcp)`` is run on a thread of its own per accepted peer."""

    def __init__(self, socket_path: str | None, listen: tuple[str, int] | None, token: bytes | None) -> None:
        if socket_path is None and listen is None:
            raise ConfigError("kvtier cache-server: give --socket (a Unix socket), --listen HOST:PORT (TCP), or both")
        if listen is not None and token is None:
            raise ConfigError(f"--listen {listen[0]}:{listen[1]}: a TCP listener needs --token-file (its shared token)")
        self.path, self.listen, self.token = socket_path, listen, token
        self.tcp_port: int | None = None  # the bound TCP data port
        self._socks: list[tuple[socket.socket, bool]] = []  # (listener, TCP)
        self.closing = False

    def open(self) -> None:
        """Bind every listener (ConfigError, and none left open, when one cannot be)."""
        try:
            if self.path is not None:
                claim(Path(self.path))
                lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._socks.append((lst, False))
                old = os.umask(0o177)  # the socket is made 0600: only this user may connect
                try:
                    lst.bind(self.path)
                finally:
                    os.umask(old)
                lst.listen(128)
            if self.listen is not None:
                self._socks.append((self._tcp(*self.listen), True))
        except BaseException:
            self.close()
            raise

    def _tcp(self, host: str, port: int) -> socket.socket:
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            lst = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            raise ConfigError(f"--listen {host}:{port}: {e}") from e
        try:
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            lst.bind((host, port))
            lst.listen(128)
        except OSError as e:
            lst.close()
            raise ConfigError(f"--listen {host}:{port}: cannot listen there: {e.strerror}") from e
        self.tcp_port = int(lst.getsockname()[1])
        return lst

    def threads(self, serve: Callable[[socket.socket, bool], None]) -> list[threading.Thread]:
        """One accept thread per listener (not started)."""
        return [
            threading.Thread(target=self._accept, args=(lst, tcp, serve), name="kvtier-blocks-accept", daemon=True)
            for lst, tcp in self._socks
        ]

    def _accept(self, listener: socket.socket, tcp: bool, serve: Callable[[socket.socket, bool], None]) -> None:
        while not self.closing:
            try:
                s, _ = listener.accept()
            except OSError:
                return
            if not tcp:
                uid = peer_uid(s)
                if uid is not None and uid != os.getuid():
                    log.warning("refused a connection from uid %d", uid)
                    s.close()
                    continue
            else:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=serve, args=(s, tcp), name="kvtier-blocks-conn", daemon=True).start()

    def greet(self, c: Conn, fds: list[int], refused: Callable[[str], None]) -> dict[str, Any] | None:
        """The connection's first message (its hello); over TCP only after the peer proved it holds the token (a
        refusal is answered, ``refused(reason)`` told, and None returned)."""
        if not c.inline:
            return c.recv(fds, limit=MAX_HELLO)  # type: ignore[no-any-return]
        assert self.token is not None
        hi = challenge()
        c.sock.settimeout(HELLO_S)
        c.send(hi)
        msg = c.recv(limit=MAX_HELLO)
        c.sock.settimeout(None)
        given = msg.get("proof") if isinstance(msg, dict) else None
        if not isinstance(given, str) or not hmac.compare_digest(given, proof(self.token, hi["nonce"])):
            refused("token")
            log.warning("refused a TCP connection from %s: no valid token", c.sock.getpeername()[0])
            c.send({"ok": False, "error": "hello: the shared token does not match (cache_server_token_file)"})
            return None
        return msg  # type: ignore[no-any-return]

    def close(self) -> None:
        self.closing = True
        for lst, _ in self._socks:
            try:
                lst.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            lst.close()
        if self.path is not None and any(not tcp for _, tcp in self._socks):
            Path(self.path).unlink(missing_ok=True)
        self._socks.clear()


__all__ = ["Listeners", "HELLO_S"]
