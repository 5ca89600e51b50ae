"""Who may reach a ``kvtier cache-server`` (vllm/blockserver.py), and how: its listeners and the first exchange
of each connection, apart from what the server serves.

* **A Unix socket** (``--socket``): claimed (a live server's is refused, a dead one's removed), bound under umask
  0177 (0600: only this user may connect), and each peer's uid checked (``SO_PEERCRED``) before it is served.
* **TCP** (``--listen HOST:PORT``, only with a token): the server speaks first, a fresh nonce; the peer's hello
  must carry HMAC-SHA256(token, nonce) (vllm/protocol.py), compared in constant time, within ``HELLO_S``. A wrong
  or missing proof is answered, logged with the peer's address and counted; nothing else is read from it.

Every peer has ``HELLO_S`` to send its hello, on either listener. The server holds at most ``max_conns``
connections, sized from its descriptor limit (raised to the hard limit where allowed; each connection holds up to
two descriptors: its socket and, for a worker's I/O thread, its page). A connection beyond the bound, or one the
kernel could not hand over (out of descriptors, a thread that would not start), is closed and counted by reason,
the listener backs off and goes on accepting, and ``trouble()`` names it for ``/health`` for ``STARVED_S``.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.unixsock import claim
from kvtier.vllm.protocol import MAX_HELLO, MAX_KEYS, Conn, challenge, peer_uid, proof

log = logging.getLogger("kvtier.vllm.server")

HELLO_S = 10.0
"""Longest a peer may take to send its hello (after the challenge, over TCP)."""
STARVED_S = 5.0
"""How long /health reports a connection the server could not take."""
KEYS_PER_S = 200_000.0
"""A control connection's allowance of keys named a second (lookups, pins, stores...): several times what one busy
engine's scheduler names, a fraction of what the server can serve (``benchmarks/blockserver_flood.py``)."""


class KeyRate:
    """One connection's allowance of keys a second: a token bucket holding one second's worth (at least two
    requests of MAX_KEYS). A request beyond it is held back until its keys are paid for, never refused."""

    def __init__(self, per_s: float) -> None:
        self.per_s = per_s
        self.burst = max(per_s, 2.0 * MAX_KEYS)
        self.tokens = self.burst
        self.at = time.monotonic()

    def take(self, n: int) -> float:
        """Pay for ``n`` keys, sleeping while the bucket is in debt; the seconds slept."""
        if self.per_s <= 0:
            return 0.0
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.per_s) - n
        self.at = now
        if self.tokens >= 0:
            return 0.0
        wait = -self.tokens / self.per_s
        time.sleep(wait)
        return wait


FD_RESERVE = 64
"""Descriptors kept back from connections: the tiers' files, the health port, logs."""
BACKOFF_S = (0.01, 1.0)
"""The accept loop's first and longest wait after a failed accept."""
SCARCE = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


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
        self.max_conns = 0  # set by open(), from the descriptor limit
        self.active = 0
        self._count = threading.Lock()
        self._starved: tuple[float, str] = (float("-inf"), "")  # (when, why) a connection was last not taken
        self._logged: dict[str, float] = {}  # reason -> when last logged

    def trouble(self) -> str | None:
        """Why the data path could not take a connection within the last STARVED_S, or None."""
        at, why = self._starved
        return why if time.monotonic() - at < STARVED_S else None

    def open(self) -> None:
        """Bind every listener (ConfigError, and none left open, when one cannot be)."""
        limit = raise_nofile()
        self.max_conns = max(8, (limit - FD_RESERVE) // 2)
        log.info(
            "descriptor limit %d: at most %d connections (a replica holds 1 + its I/O threads)", limit, self.max_conns
        )
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

    def threads(
        self, serve: Callable[[socket.socket, bool], None], failed: Callable[[str], None]
    ) -> list[threading.Thread]:
        """One accept thread per listener (not started); ``failed(reason)`` counts a connection not taken."""
        return [
            threading.Thread(
                target=self._accept, args=(lst, tcp, serve, failed), name="kvtier-blocks-accept", daemon=True
            )
            for lst, tcp in self._socks
        ]

    def _accept(
        self,
        listener: socket.socket,
        tcp: bool,
        serve: Callable[[socket.socket, bool], None],
        failed: Callable[[str], None],
    ) -> None:
        """Accept until close(): a failed accept is counted and waited out (longer each time in a row), never the
        end of the loop; a connection over the bound is closed at once."""
        wait = 0.0
        while not self.closing:
            try:
                s, _ = listener.accept()
            except OSError as e:
                if self.closing:
                    return
                code = errno.errorcode.get(e.errno or 0, "OSError")
                if e.errno in SCARCE:
                    wait = self._not_taken(code, f"accept: {e.strerror} ({code})", failed, wait)
                else:  # the peer gave up before it was taken (ECONNABORTED, EPROTO): its own loss
                    failed(code)
                continue
            wait = 0.0
            if not tcp:
                uid = peer_uid(s)
                if uid is not None and uid != os.getuid():
                    log.warning("refused a connection from uid %d", uid)
                    s.close()
                    continue
            else:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._count:
                full = self.active >= self.max_conns
                self.active += 0 if full else 1
            if full:
                s.close()
                self._not_taken("full", f"{self.max_conns} connections open (the bound the descriptor limit sets)",
                                failed, 0.0)  # fmt: skip
                continue
            try:
                t = threading.Thread(target=self._serve, args=(serve, s, tcp), name="kvtier-blocks-conn", daemon=True)
                t.start()
            except RuntimeError as e:  # no thread to be had
                self._ended()
                s.close()
                wait = self._not_taken("thread", f"a connection's thread: {e}", failed, wait)

    def _serve(self, serve: Callable[[socket.socket, bool], None], s: socket.socket, tcp: bool) -> None:
        try:
            serve(s, tcp)
        finally:
            self._ended()

    def _ended(self) -> None:
        with self._count:
            self.active -= 1

    def _not_taken(self, reason: str, why: str, failed: Callable[[str], None], wait: float) -> float:
        """Count, remember for /health, log at most once a minute per reason; wait ``wait`` grown (0: none)."""
        failed(reason)
        now = time.monotonic()
        self._starved = (now, why)
        if now - self._logged.get(reason, float("-inf")) >= 60:
            self._logged[reason] = now
            log.warning("kvtier cache-server: a connection not taken: %s", why)
        if reason == "full":
            return 0.0
        wait = min(BACKOFF_S[1], max(BACKOFF_S[0], 2 * wait))
        time.sleep(wait)
        return wait

    def greet(self, c: Conn, fds: list[int], refused: Callable[[str], None]) -> dict[str, Any] | None:
        """The connection's first message (its hello); over TCP only after the peer proved it holds the token (a
        refusal is answered, ``refused(reason)`` told, and None returned)."""
        c.sock.settimeout(HELLO_S)
        if not c.inline:
            hello = c.recv(fds, limit=MAX_HELLO)
            c.sock.settimeout(None)
            return hello  # type: ignore[no-any-return]
        assert self.token is not None
        hi = challenge()
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


def raise_nofile() -> int:
    """This process's soft descriptor limit, raised to the hard limit where that is allowed; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            pass  # not allowed here: the bound follows the limit as it is
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


__all__ = ["Listeners", "HELLO_S", "raise_nofile"]
