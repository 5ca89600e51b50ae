"""Reading and writing result files: the one atomic writer, JSON, and the check that an output's folder
can take a file before a run starts."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

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


def write_text_atomic(path: str | os.PathLike[str], text: str, flag: str = "--output") -> Path:
    """Write ``text`` to a new temporary file beside ``path`` (created exclusively, with a random name, so a
    planted file or symlink is never followed), then rename it over ``path``, so a reader never sees half a
    file. The one way kvtier writes a result file. A failure is a KvtierError naming ``flag``."""
    p = Path(path)
    tmp: str | None = None
    try:
        if p.parent and not p.parent.exists():
            p.parent.mkdir(parents=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent or ".")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, p)
    except OSError as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise KvtierError(f"{flag}: cannot write {p}: {e.strerror}") from e
    return p


def write_json(result: BaseModel | dict[str, Any], path: str | os.PathLike[str], flag: str = "--output") -> Path:
    """Write ``result`` as indented JSON, atomically (``write_text_atomic``)."""
    return write_text_atomic(path, json.dumps(to_jsonable(result), indent=2) + "\n", flag)
