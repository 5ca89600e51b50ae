"""Paths another user could change, and a server's Unix socket path claimed before it binds.

``folder_problem``: why another user could change what a folder holds (a folder of theirs, or one they can write
on the way to it): kvtier's shim refuses to write its scripts there, and a cache server's client refuses a socket
there. ``claim``: the folder must exist, a file that is not a socket is refused, a socket someone answers on is
refused, a socket nobody answers on (a killed run's) is removed."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from kvtier.errors import ConfigError


def folder_problem(folder: Path) -> str | None:
    """Why another user could change what ``folder`` (which exists) holds, or None."""
    if folder.is_symlink():
        return f"{folder} is a symbolic link (give the folder it points to)"
    me = os.geteuid()
    real = Path(os.path.realpath(folder))
    for i, q in enumerate([real, *real.parents]):
        st = os.stat(q)
        if st.st_uid not in (me, 0):
            return f"{q} belongs to uid {st.st_uid}, not to this user or root"
        writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if writable and not (i > 0 and st.st_mode & stat.S_ISVTX):  # a sticky parent: others cannot rename ours
            who = "others" if st.st_mode & stat.S_IWOTH else "its group"
            return f"{q} is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def socket_folder_problem(path: str) -> str | None:
    """Why another user could replace the server at the Unix socket ``path``, or None: its folder, resolved, and every
    folder above it (``folder_problem``), and the folder each link on the way sits in (``/var/run`` -> ``/run`` is
    fine; a link in a folder others can write is not). None for a folder that does not exist (yet): the connection
    fails, and the next attempt checks again."""
    folder = Path(os.path.abspath(path)).parent
    if not folder.is_dir():
        return None
    why = folder_problem(Path(os.path.realpath(folder)))
    if why is not None:
        return why
    for q in [folder, *folder.parents]:
        if q.is_symlink():
            why = folder_problem(Path(os.path.realpath(q.parent)))
            if why is not None:
                return f"{q} is a link in a folder another user could change: {why}"
    return None


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


__all__ = ["answers", "claim", "folder_problem", "socket_folder_problem"]
