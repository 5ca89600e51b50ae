"""Run folders: the one place a file tier keeps its entries, proven ours and locked while in use.

A file tier works inside ``<dir>/kvtier-run-<pid>-<id>/``. Beside its entry files it keeps a
marker file, ``.kvtier-run`` (JSON: pid, host, start time), and holds an exclusive ``flock`` on it
for the run's life. A run killed with SIGKILL (or a crashed host) leaves its folder behind; the
kernel drops its lock. So at the next start a folder is *stale* when its marker exists and its lock
can be taken; it is then removed — only kvtier's own files (entries, the O_DIRECT probe, the
marker), and the folder itself if nothing else is left. A folder without the marker is never
touched, and neither is one whose lock is held (a live run, in this process or another).

Removing tens of GB of entry files takes seconds (0.19 s a GB on this project's ext4 disk with ``discard``, one file
at a time whatever the threads), and a user would wait for it after the window closed. So a run that holds more
than ``BACKGROUND_REMOVAL_BYTES`` hands its folder off once its result is written (``hand_off_removal``): the marker
becomes ``.kvtier-removing`` and a process of its own, holding the same lock, removes the files and the folder. The
next run in that folder waits for it before its load starts (``wait_removals``, reported in its setup), so no run
measures another's deletion; a remover that was killed leaves a stale folder, removed as any other.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import platform
import select
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RUN_DIR_PREFIX = "kvtier-run-"
MARKER = ".kvtier-run"
REMOVING = ".kvtier-removing"
"""The marker's name once its run is over and a background remover holds it."""
MARKERS = (MARKER, REMOVING)
BACKGROUND_REMOVAL_BYTES = 4 << 30
"""A run whose files hold more than this is removed in the background (under a second's unlinking at most is
waited for)."""
OURS = (".kv",)  # entry files
PROBE_PREFIX = ".kvtier-odirect-probe-"


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | _CLOEXEC
"""A run folder is opened with these: as a directory, never through a symlink."""


def create_marker(run_fd: int) -> int:
    """Write the marker into a new run folder (through its descriptor) and lock it; returns the fd that holds
    the lock (keep it open for the run's life, close it to release)."""
    fd = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _CLOEXEC, 0o600, dir_fd=run_fd)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": platform.node(), "started_unix_s": time.time()}).encode())
    except BaseException:
        os.close(fd)
        raise
    return fd


SYSTEM_DIRECTORIES = ("/etc", "/bin", "/sbin", "/usr/bin", "/usr/sbin", "/boot", "/sys", "/proc", "/dev", "/root")
"""Where no cache goes: the MLPerf reference refuses a --cache-dir under these (it compares the strings, so it
also refuses /etcd or /devices; kvtier compares whole path components); kvtier adds / itself, /usr (not
/usr/local) and /lib."""
SYSTEM_TREES = (*SYSTEM_DIRECTORIES, "/usr", "/lib", "/lib32", "/lib64")


def system_directory(path: str | os.PathLike[str]) -> str | None:
    """The system directory ``path`` is, or lies under, once links are resolved (None for any other path)."""
    real = os.path.realpath(path)
    if real == "/":
        return "/"
    if real == "/usr/local" or real.startswith("/usr/local/"):
        return None  # the site's own tree: a cache there is odd, not dangerous
    for d in SYSTEM_TREES:
        if real == d or real.startswith(d + "/"):
            return d
    return None


def make_run_dir(base: Path, name: str) -> tuple[int, int]:
    """Create the run folder ``name`` in ``base``, mode 0700, and open it: ``(base_fd, run_fd)``. Every entry is
    then opened and unlinked through ``run_fd`` (``openat``/``unlinkat``), so renaming the folder, or putting a
    symlink or another folder under its name, cannot redirect the run's writes. A name that does not open as the
    folder just made (a symlink or another user's folder swapped in between ``mkdir`` and ``open``) is refused."""
    base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    run_fd = -1
    try:
        os.mkdir(name, 0o700, dir_fd=base_fd)
        run_fd = os.open(name, DIR_FLAGS, dir_fd=base_fd)  # ELOOP/ENOTDIR for a symlink swapped in
        with os.scandir(run_fd) as it:
            empty = next(it, None) is None
        if os.fstat(run_fd).st_uid != os.geteuid() or not empty:
            raise OSError(errno.EEXIST, f"{name} was replaced between its creation and its opening")
        os.fchmod(run_fd, 0o700)  # whatever the umask: other users never list or enter the run folder
        return base_fd, run_fd
    except BaseException:
        if run_fd >= 0:
            os.close(run_fd)
        os.close(base_fd)
        raise


def remove_if_same(parent_fd: int, name: str, run_fd: int) -> bool:
    """Remove the folder ``name`` in ``parent_fd`` only if that name still names the folder open as ``run_fd``;
    False when another folder (or nothing) has the name. rmdir's own OSError (not empty, read-only) propagates."""
    mine = os.fstat(run_fd)
    try:
        now = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if (now.st_dev, now.st_ino) != (mine.st_dev, mine.st_ino):
        return False
    os.rmdir(name, dir_fd=parent_fd)
    return True


def exposed_cache_dir(base: Path) -> str | None:
    """Why ``base`` lets other local users tamper with the run folders in it (writable by others without the
    sticky bit: anyone may rename or replace the folders kvtier makes there), or None. kvtier's own reads and
    writes stay in its folder whatever they do (``make_run_dir``), but they can still move it away, fill it
    or plant names beside it; a folder only its owner writes, or one with the sticky bit (/tmp), prevents it."""
    try:
        st = os.stat(base)
    except OSError:
        return None
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        return (
            f"{base} is writable by every user and has no sticky bit: any local user can rename or replace the "
            "run folders kvtier creates in it (kvtier reads and writes through the folder's descriptor, so its "
            "entries cannot be redirected, but the run can be disturbed); use a folder only you can write "
            f"(chmod o-w {base}) or set the sticky bit (chmod +t {base})"
        )
    return None


@dataclass(frozen=True)
class StaleRun:
    path: str
    bytes: int  # what its entry files hold
    files: int


def _open_run_dir(parent_fd: int, name: str) -> int | None:
    """The run folder ``name`` in ``parent_fd``, opened as a directory and never through a symlink (a
    ``kvtier-run-*`` symlink to a folder elsewhere is not a run folder: ELOOP / ENOTDIR -> None), and only if this
    user owns it (another user's folder in a shared cache dir is never waited for, locked or emptied)."""
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError:
        return None
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


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
    fd = _open_marker(run_fd)
    if fd is None:
        return None  # no marker (or not ours to open): never touched
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None  # a live run holds it
    return fd


def _open_marker(run_fd: int, names: tuple[str, ...] = MARKERS) -> int | None:
    """The run folder's marker, under either name, opened read-only through the folder's descriptor: a regular
    file of this user's, never a link, and without blocking (a FIFO under the marker's name would hold an open)."""
    for name in names:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | _CLOEXEC, dir_fd=run_fd)
        except OSError:
            continue
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
            return fd
        os.close(fd)
    return None


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


def wait_runs_released(base: str | os.PathLike[str], timeout_s: float = 15.0) -> int:
    """Wait (bounded) until every run folder in ``base`` is stale: a process stopped with SIGKILL holds its folder's
    lock until the kernel has finished it, which on a busy host can be after its parent saw it go. Returns how many
    were still held at the deadline (0: all released)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            held = sum(1 for e in os.scandir(base) if e.name.startswith(RUN_DIR_PREFIX)) - len(find_stale_runs(base))
        except OSError:
            return 0
        if held <= 0 or time.monotonic() >= deadline:
            return max(0, held)
        time.sleep(0.1)


def remove_stale_runs(base: str | os.PathLike[str] | None, say: Callable[[str], None]) -> int:
    """Remove the run folders killed kvtier runs left in ``base`` (None: nothing to do), each said through ``say``
    with its size and any file left; returns how many were found. For a server or a sim about to open a file tier
    there; ``kvtier bench`` reports its own (results.json's ``stale_runs``), and ``kvtier clean`` does it by hand."""
    found = find_stale_runs(base) if base else []
    for r in found:
        problems = remove_stale_run(r.path)
        say(f"kvtier: removed the run folder of a killed kvtier run: {r.path} ({r.bytes} bytes)"
            + (f"; {problems[0]}" if problems else ""))  # fmt: skip
    return len(found)


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
    try:
        run_fd = _open_run_dir(parent, d.name)
        if run_fd is None:
            return [f"{d}: not a run folder (missing, or a symlink): left alone"]
        try:
            lock = _lock_marker(run_fd)
            if lock is None:
                return [f"{d}: no marker, or in use by a live run: left alone"]
            problems = _empty(parent, run_fd, lock, d)
        finally:
            os.close(run_fd)
    finally:
        os.close(parent)
    return problems


def _empty(parent: int, run_fd: int, lock: int, d: Path) -> list[str]:
    """Remove kvtier's files and the marker from a run folder whose lock ``lock`` holds (closed here, which drops it),
    then the folder itself if ``d.name`` in ``parent`` still names it; what could not be removed."""
    problems: list[str] = []
    try:
        for name, _ in _our_files(run_fd):
            try:
                os.unlink(name, dir_fd=run_fd)
            except OSError as e:
                problems.append(f"{d / name}: {e.strerror}")
        _unlink_marker(run_fd, problems, d)
    finally:
        os.close(lock)
    try:  # the folder itself, only if the name still names the folder we emptied
        if not remove_if_same(parent, d.name, run_fd):
            return [*problems, f"{d}: another folder took its name meanwhile: left alone"]
    except OSError as e:
        problems.append(f"{d}: not removed ({e.strerror})")
    return problems


def _unlink_marker(run_fd: int, problems: list[str], d: Path) -> None:
    """Remove the marker, whichever name it has; a failure is noted in ``problems``."""
    for name in MARKERS:
        try:
            os.unlink(name, dir_fd=run_fd)
            return
        except FileNotFoundError:
            continue
        except OSError as e:
            problems.append(f"{d / name}: {e.strerror}")
            return
    problems.append(f"{d / MARKER}: missing")


REMOVER_START_S = 15.0
"""Longest a run waits for its remover to say it started (a Python start-up and this module's imports)."""
_REMOVERS: list[subprocess.Popen[Any]] = []
"""The background removers this process started (their ``Popen``), reaped as later ones start."""


def hand_off_removal(base_fd: int, run_fd: int, lock_fd: int, name: str) -> int:
    """Hand a finished run's folder (``name`` in ``base_fd``) to a background remover: the marker is renamed
    ``REMOVING`` and a process in a session of its own, outliving this one, inherits the three descriptors (the
    lock with them), removes kvtier's files through ``run_fd`` and the folder if it is still the same one. Returns
    its pid; the caller closes its own copies. OSError (or LaunchError) when it cannot be started: the caller then
    removes the files itself."""
    import sys

    from kvtier.child import start

    if not sys.executable:
        raise OSError("no Python interpreter to run the remover (sys.executable is empty)")
    os.rename(MARKER, REMOVING, src_dir_fd=run_fd, dst_dir_fd=run_fd)
    ready, told = os.pipe()
    try:  # -P: nothing from the current folder on the child's path
        argv = [sys.executable, "-P", "-m", "kvtier.engine.runs", *map(str, (base_fd, run_fd, lock_fd, told)), name]
        child = start(
            argv,
            name="kvtier-remove",
            stdout=subprocess.DEVNULL,
            die_with_parent=False,
            pass_fds=(base_fd, run_fd, lock_fd, told),
        )
        os.close(told)
        told = -1
        if not select.select([ready], [], [], REMOVER_START_S)[0] or os.read(ready, 1) != b"1":
            child.stop(grace_s=1)  # it could not start (kvtier not importable there): the caller removes the files
            raise OSError(f"the remover did not start within {REMOVER_START_S:g} s")
    except BaseException:
        os.rename(REMOVING, MARKER, src_dir_fd=run_fd, dst_dir_fd=run_fd)
        raise
    finally:
        os.close(ready)
        if told >= 0:
            os.close(told)
    _REMOVERS[:] = [p for p in _REMOVERS if p.poll() is None]  # reap the finished ones (a long-lived caller)
    _REMOVERS.append(child.popen)  # never waited for: it may outlive this process, by design
    return child.pid


def wait_removals(base: str | os.PathLike[str], timeout_s: float = 300.0) -> tuple[int, float]:
    """Wait (bounded) for the background removals earlier runs left in ``base``: (how many were under way when
    this began, seconds waited). A removal still going at the deadline is left to go on."""
    t0 = time.monotonic()

    def busy() -> int:
        n = 0
        try:
            parent = os.open(base, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
        except OSError:
            return 0
        try:
            with os.scandir(parent) as it:
                names = [e.name for e in it if e.name.startswith(RUN_DIR_PREFIX)]
            for name in names:
                run_fd = _open_run_dir(parent, name)
                if run_fd is None:
                    continue
                fd = _open_marker(run_fd, (REMOVING,))
                os.close(run_fd)
                if fd is None:
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    n += 1  # its remover holds it
                finally:
                    os.close(fd)
        finally:
            os.close(parent)
        return n

    first = busy()
    while first and busy() and time.monotonic() - t0 < timeout_s:
        time.sleep(0.1)
    return first, time.monotonic() - t0


if __name__ == "__main__":  # the remover: python -P -m kvtier.engine.runs BASE_FD RUN_FD LOCK_FD READY_FD NAME
    import sys

    base, run, lock, ready = (int(a) for a in sys.argv[1:5])
    os.write(ready, b"1")  # started: the run may exit now
    os.close(ready)
    # what it could not remove stays for the next run (stale once this exits) or ``kvtier clean``
    _empty(base, run, lock, Path(sys.argv[5]))


__all__ = [
    "BACKGROUND_REMOVAL_BYTES",
    "hand_off_removal",
    "wait_removals",
    "wait_runs_released",
    "RUN_DIR_PREFIX",
    "MARKER",
    "DIR_FLAGS",
    "create_marker",
    "make_run_dir",
    "remove_if_same",
    "exposed_cache_dir",
    "find_stale_runs",
    "remove_stale_run",
    "remove_stale_runs",
    "StaleRun",
]
