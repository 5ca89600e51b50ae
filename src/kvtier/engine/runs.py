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


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_run_dir(parent_fd: int, name: str) -> int | None:
    """The run folder ``name`` in ``parent_fd``, opened as a directory and never through a symlink (a
    ``kvtier-run-*`` symlink to a folder elsewhere is not a run folder: ELOOP / ENOTDIR -> None)."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None


def _our_files(run_fd: int) -> list[tuple[str, int]]:
    """(name, size) of kvtier's own regular files in the folder behind ``run_fd`` (symlinks never count)."""
    out = []
    with os.scandir(run_fd) as it:
        for e in it:
            if (e.name.endswith(OURS) or e.name.startswith(PROBE_PREFIX)) and e.is_file(follow_symlinks=False):
                try:
                    out.append((e.name, e.stat(follow_symlinks=False).st_size))
                except OSError:
                    out.append((e.name, 0))
    return out


def _lock_marker(run_fd: int) -> int | None:
    """The marker, opened through the run folder's own descriptor and locked; None when it is missing or a live
    run holds it. The caller closes the fd (which drops the lock)."""
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), dir_fd=run_fd)
    except OSError:
        return None  # no marker (or not ours to open): never touched
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # a live run holds it
    return fd


def find_stale_runs(base: str | os.PathLike[str]) -> list[StaleRun]:
    """Run folders in ``base`` whose marker proves kvtier made them and whose lock is free. Every look goes
    through directory descriptors: a symlinked ``kvtier-run-*`` is never followed."""
    out: list[StaleRun] = []
    try:
        parent = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return out
    try:
        with os.scandir(parent) as it:
            names = sorted(e.name for e in it if e.name.startswith(RUN_DIR_PREFIX))
        for name in names:
            run_fd = _open_run_dir(parent, name)
            if run_fd is None:
                continue
            try:
                lock = _lock_marker(run_fd)
                if lock is None:
                    continue
                os.close(lock)
                files = _our_files(run_fd)
                out.append(StaleRun(str(Path(base) / name), sum(n for _, n in files), len(files)))
            finally:
                os.close(run_fd)
    finally:
        os.close(parent)
    return out


def remove_stale_run(run_dir: str | os.PathLike[str]) -> list[str]:
    """Remove a stale run folder's own files and, if then empty, the folder. The folder is opened once (never
    through a symlink), its marker is proven and locked through that descriptor, and every unlink goes through
    it too (``unlinkat``): a folder swapped in under the same name mid-clean is never touched. Returns problems
    (files left, errors); an empty list means it is gone."""
    d = Path(run_dir)
    try:
        parent = os.open(d.parent, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        return [f"{d.parent}: {e.strerror}: left alone"]
    problems: list[str] = []
    try:
        run_fd = _open_run_dir(parent, d.name)
        if run_fd is None:
            return [f"{d}: not a run folder (missing, or a symlink): left alone"]
        try:
            lock = _lock_marker(run_fd)
            if lock is None:
                return [f"{d}: no marker, or in use by a live run: left alone"]
            try:
                for name, _ in _our_files(run_fd):
                    try:
                        os.unlink(name, dir_fd=run_fd)
                    except OSError as e:
                        problems.append(f"{d / name}: {e.strerror}")
                try:
                    os.unlink(MARKER, dir_fd=run_fd)
                except OSError as e:
                    problems.append(f"{d / MARKER}: {e.strerror}")
            finally:
                os.close(lock)
            mine = os.fstat(run_fd)
            try:  # the folder itself, only if the name still names the folder we emptied
                now = os.stat(d.name, dir_fd=parent, follow_symlinks=False)
                if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
                    return [*problems, f"{d}: another folder took its name meanwhile: left alone"]
                os.rmdir(d.name, dir_fd=parent)
            except OSError as e:
                problems.append(f"{d}: not removed ({e.strerror})")
        finally:
            os.close(run_fd)
    finally:
        os.close(parent)
    return problems


__all__ = ["RUN_DIR_PREFIX", "MARKER", "create_marker", "find_stale_runs", "remove_stale_run", "StaleRun"]
