"""Run folders: the one place a file tier keeps its entries, proven ours and locked while in use.

A file tier works inside ``<dir>/kvtier-run-<pid>-<id>/``. Beside its entry files it keeps a
marker file, ``.kvtier-run`` (JSON: pid, host, start time), and holds an exclusive ``flock`` on it
for the run's life. A run killed with SIGKILL (or a crashed host) leaves its folder behind; the
kernel drops its lock. So at the next start a folder is *stale* when its marker exists and its lock
can be taken; it is then removed — only kvtier's own files (entries, the O_DIRECT probe, the
marker), and the folder itself if nothing else is left. A folder without the marker is never
touched, and neither is one whose lock is held (a live run, in this process or another).
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

RUN_DIR_PREFIX = "kvtier-run-"
MARKER = ".kvtier-run"
OURS = (".kv",)  # entry files
PROBE_PREFIX = ".kvtier-odirect-probe-"


def create_marker(run_dir: Path) -> int:
    """Write the marker into a new run folder and lock it; returns the fd that holds the lock (keep
    it open for the run's life, close it to release)."""
    fd = os.open(run_dir / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(), "started_unix_s": time.time()}).encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


@dataclass(frozen=True)
class StaleRun:
    path: str
    bytes: int  # what its entry files hold
    files: int


def _our_files(run_dir: Path) -> list[Path]:
    return [p for p in run_dir.iterdir() if p.is_file() and (p.suffix in OURS or p.name.startswith(PROBE_PREFIX))]


def find_stale_runs(base: str | os.PathLike[str]) -> list[StaleRun]:
    """Run folders in ``base`` whose marker proves kvtier made them and whose lock is free."""
    out: list[StaleRun] = []
    try:
        candidates = sorted(p for p in Path(base).iterdir() if p.name.startswith(RUN_DIR_PREFIX) and p.is_dir())
    except OSError:
        return out
    for d in candidates:
        if _lock_free(d):
            files = _our_files(d)
            out.append(StaleRun(str(d), sum(_size(f) for f in files), len(files)))
    return out


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _lock_free(run_dir: Path) -> bool:
    marker = run_dir / MARKER
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # no marker (or not ours to open): never touched
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # a live run holds it
    finally:
        os.close(fd)  # also drops the lock we may have taken


def remove_stale_run(run_dir: str | os.PathLike[str]) -> list[str]:
    """Remove a stale run folder's own files and, if then empty, the folder. Checks the lock again
    while holding it. Returns problems (files left, errors); an empty list means it is gone."""
    d = Path(run_dir)
    try:
        fd = os.open(d / MARKER, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        return [f"{d}: no marker ({e.strerror}): left alone"]
    problems: list[str] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return [f"{d}: in use by a live run: left alone"]
        for f in _our_files(d):
            try:
                f.unlink()
            except OSError as e:
                problems.append(f"{f}: {e.strerror}")
        try:
            (d / MARKER).unlink()
        except OSError as e:
            problems.append(f"{d / MARKER}: {e.strerror}")
    finally:
        os.close(fd)
    try:
        d.rmdir()
    except OSError as e:
        problems.append(f"{d}: not removed ({e.strerror})")
    return problems


__all__ = ["RUN_DIR_PREFIX", "MARKER", "create_marker", "find_stale_runs", "remove_stale_run", "StaleRun"]
