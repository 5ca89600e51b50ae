"""A server's Unix socket path, claimed before it binds: the folder must exist, a file that is not a socket is
refused, a socket someone answers on is refused, a socket nobody answers on (a killed run's) is removed."""

from __future__ import annotations

import socket
from pathlib import Path

from kvtier.errors import ConfigError


def answers(sock: Path) -> bool:
    """Whether a server accepts connections on the Unix socket ``sock``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2)
        try:
            s.connect(str(sock))
        except OSError:
            return False
        return True


def claim(sock: Path, flag: str = "--socket") -> None:
    if not sock.parent.is_dir():
        raise ConfigError(f"{flag}: directory {sock.parent} does not exist")
    if sock.exists() or sock.is_symlink():
        if not sock.is_socket():
            raise ConfigError(f"{flag}: {sock} exists and is not a socket")
        if answers(sock):
            raise ConfigError(f"{flag}: a server is listening on {sock}; stop it or choose another path")
        sock.unlink()  # a stale socket of an earlier run: nobody answers there


__all__ = ["answers", "claim"]
