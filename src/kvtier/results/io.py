"""Reading and writing result files: the one atomic writer, JSON, and the check that an output's folder
can take a file before a run starts."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel

from kvtier.errors import ConfigError, KvtierError


def check_output_path(flag: str, path: str | None) -> None:
    """The folder of an output file exists and is writable (checked before the load, not after)."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag}: directory {parent} is not writable")


def to_jsonable(result: BaseModel | dict[str, Any]) -> dict[str, Any]:
    return result.model_dump(mode="json") if isinstance(result, BaseModel) else result


@contextmanager
def atomic_file(
    path: str | os.PathLike[str], mode: str = "w", flag: str = "--output", perm: int = 0o644
) -> Iterator[IO[Any]]:
    """A file to write ``path`` through: a new temporary file beside it (created exclusively, with a random name,
    so a planted file or symlink at ``path`` is never followed or written through), renamed over ``path`` when the
    block ends without an error (removed otherwise), so a reader never sees half a file. The one way kvtier
    writes an output file (results, requests.jsonl, model files, trace outputs, plots). A failure to write is a
    KvtierError naming ``flag``."""
    p = Path(path)
    tmp: str | None = None
    try:
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
        os.chmod(tmp, perm)
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise KvtierError(f"{flag}: cannot write {p}: {e.strerror or e}") from e
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def write_text_atomic(path: str | os.PathLike[str], text: str, flag: str = "--output") -> Path:
    """Write ``text`` to ``path`` through ``atomic_file``."""
    with atomic_file(path, "w", flag) as f:
        f.write(text)
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes, flag: str = "--output") -> Path:
    """Write ``data`` to ``path`` through ``atomic_file``."""
    with atomic_file(path, "wb", flag) as f:
        f.write(data)
    return Path(path)


def open_append(path: str | os.PathLike[str]) -> IO[bytes]:
    """A log to append to (a process's log in a folder of kvtier's own), opened without following a link: a
    symlink planted at the name is an OSError (ELOOP), never written through."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "ab")


def open_fresh(path: str | os.PathLike[str], flag: str = "--output") -> IO[bytes]:
    """A new file at ``path`` for a stream that must be readable while it grows (an I/O trace log): whatever the
    name held (a file, a planted symlink or hard link) is unlinked — never written through — and the file is
    created exclusively without following links (a name re-planted in between is an error, not a write)."""
    p = Path(path)
    try:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise KvtierError(f"{flag}: cannot write {p}: {e.strerror or e}") from e
    return os.fdopen(fd, "wb")


def write_json(result: BaseModel | dict[str, Any], path: str | os.PathLike[str], flag: str = "--output") -> Path:
    """Write ``result`` as indented JSON, atomically (``write_text_atomic``)."""
    return write_text_atomic(path, json.dumps(to_jsonable(result), indent=2) + "\n", flag)
