"""Start, health-wait and stop the processes of a launch, without leaving orphans.

Every process starts through kvtier/child.py in its own session (process group) with its output in
``logs/NAME.log``; stopping sends SIGTERM to the whole group, waits, then SIGKILLs what is left, in reverse start
order. Ports are chosen free on 127.0.0.1 by binding port 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.child import Child, start
from kvtier.errors import LaunchError
from kvtier.launch.profiles import ProcPlan
from kvtier.results.io import open_append


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out for a bind to port 0 (ip_local_port_range; 32768 where unreadable)."""
    try:
        return int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free TCP ports (bound together, then released), drawn at random below the kernel's ephemeral
    range: a server started on one a minute later (Caddy, after the replicas are healthy) cannot find it taken by
    some other process's bind to port 0 meanwhile (CI once lost a launch so, to a test running beside it). Two kvtier
    processes of this user never draw the same port while both live: each draw is recorded (``_Reservations``)."""
    import random

    high = _ephemeral_low() - 1
    low = max(1024, high - 12287)
    rng = random.SystemRandom()
    with _Reservations() as held:
        for _ in range(64):
            socks: list[socket.socket] = []
            try:
                # never one another live kvtier process drew (it may not have started its server yet)
                pool = held.free(range(low, high + 1))
                if len(pool) < n:
                    break
                picks = rng.sample(pool, n)
                for port in picks:
                    s = socket.socket()
                    socks.append(s)
                    s.bind((host, port))
                held.add(picks)
                return picks
            except OSError:
                time.sleep(rng.uniform(0.001, 0.02))  # one was taken: draw again, out of step with whoever took it
                continue
            finally:
                for s in socks:
                    s.close()
    raise LaunchError(f"no {n} free ports on {host} in {low}-{high} after 64 draws")


class _Reservations:
    """The ports this user's live kvtier processes have drawn, as files ``PORT`` holding the drawer's pid in a
    folder of this user's under the temp folder, read and written under a lock: a port drawn by one launch is not
    drawn by another before the first binds it (two launches started together drew the same port once in 12 runs
    of four at a time). A file whose process has ended is removed. Where the folder cannot be this user's own, the
    draw goes on without it (as before: a collision is then refused at start, naming the port)."""

    def __init__(self) -> None:
        import tempfile

        self.folder = Path(tempfile.gettempdir()) / f"kvtier-ports-{os.getuid()}"
        self.lock_fd: int | None = None
        self.live: set[int] = set()

    def __enter__(self) -> _Reservations:
        import fcntl
        import stat

        try:
            self.folder.mkdir(mode=0o700, exist_ok=True)
            st = os.lstat(self.folder)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return self  # not a folder only this user can change: no reservations
            fd = os.open(self.folder / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                os.close(fd)
                raise
            self.lock_fd = fd
            for f in self.folder.iterdir():
                if f.name.isdigit():
                    if _alive(f):
                        self.live.add(int(f.name))
                    else:
                        f.unlink(missing_ok=True)
        except OSError:
            pass
        return self

    def free(self, ports: range) -> Sequence[int]:
        return [p for p in ports if p not in self.live] if self.live else ports

    def add(self, ports: list[int]) -> None:
        if self.lock_fd is None:
            return
        for p in ports:
            try:
                fd = os.open(self.folder / str(p), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(f"{os.getpid()} {_started(os.getpid())}")
            except OSError:
                pass

    def __exit__(self, *exc: object) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # the lock goes with it


def _started(pid: int) -> str:
    """When process ``pid`` started (``/proc/PID/stat`` field 22, clock ticks since boot); "" where unreadable. With
    the pid it names one process: a pid reused by another is not the drawer."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else ""


def _alive(f: Path) -> bool:
    """Whether the process ``f`` names (its pid and start time) is running."""
    try:
        pid_text, _, when = f.read_text().strip().partition(" ")
        pid = int(pid_text)
    except (OSError, ValueError):
        return False
    return pid > 0 and bool(when) and _started(pid) == when


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something already listens on (or holds) ``host:port`` — checked by binding, never by
    connecting."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            status: int = r.status
            return 200 <= status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


NO_TELEMETRY = {"DO_NOT_TRACK": "1"}
"""Set for every child: vLLM and LMCache send usage data otherwise."""


def child_environment(inherited: Mapping[str, str], plan: ProcPlan) -> dict[str, str]:
    """The inherited environment, less ``plan.unset``, plus ``plan.env`` and NO_TELEMETRY."""
    env = {k: v for k, v in inherited.items() if k not in plan.unset}
    return {**env, **plan.env, **NO_TELEMETRY}


@dataclass
class Proc:
    name: str
    argv: list[str]
    child: Child  # kvtier/child.py: its own session, told SIGTERM if kvtier dies
    log: Path
    plan: ProcPlan

    @property
    def popen(self) -> subprocess.Popen[bytes]:
        return self.child.popen


@dataclass
class Supervisor:
    logdir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, plan: ProcPlan, argv: list[str] | None = None) -> Proc:
        self.logdir.mkdir(parents=True, exist_ok=True)
        log = self.logdir / f"{plan.name}.log"
        argv = argv or plan.argv
        with open_append(log) as f:  # never through a link planted in the log folder
            f.write(("$ " + " ".join(argv) + "\n").encode())
            f.flush()
            child = start(argv, name=plan.name, stdout=f, env=child_environment(os.environ, plan), log=log)
        proc = Proc(plan.name, argv, child, log, plan)
        self.procs.append(proc)
        return proc

    def restart(self, proc: Proc) -> Proc:
        """Kill ``proc``'s whole group at once (a crash, not a shutdown) and start it again with the same command,
        in its place in the stop order (its log gets the new command line appended)."""
        i = self.procs.index(proc)
        proc.child.kill()
        self.procs.remove(proc)
        new = self.start(proc.plan, proc.argv)
        self.procs.remove(new)
        self.procs.insert(i, new)
        return new

    def wait_healthy(
        self,
        proc: Proc,
        url: str,
        timeout_s: float,
        identify: Callable[[], str | None] | None = None,
        waiting: Callable[[float, str], None] | None = None,
        every_s: float = 10.0,
        cancel: threading.Event | None = None,
    ) -> float:
        """Seconds until our process is alive, ``url`` answers 2xx and ``identify()`` (when given)
        finds the answering server to be ours (None; else a reason); LaunchError (with the log's tail)
        if the process exits or the time runs out. The process is checked first: another server
        answering on its port must not pass for it. ``waiting(seconds, state)`` is told every ``every_s``
        while it waits (a model loading for minutes is not silence)."""
        t0 = time.monotonic()
        why = "it never answered"
        next_word = t0 + every_s
        while True:
            if cancel is not None and cancel.is_set():  # the launch is ending: a part still starting is not waited for
                raise LaunchError(f"{proc.name}: the launch stopped while it was waiting for {url} to answer")
            if proc.popen.poll() is not None:
                raise LaunchError(
                    f"{proc.name} exited with status {proc.popen.returncode} before {url} answered; "
                    f"log {proc.log}:\n{tail(proc.log)}"
                )
            if http_ok(url):
                why = (identify() if identify is not None else None) or ""
                if not why:
                    return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise LaunchError(
                    f"{proc.name}: {url} did not answer as {proc.name} within {timeout_s:.0f} s "
                    f"({why or 'no answer'}); log {proc.log}:\n{tail(proc.log)}"
                )
            if waiting is not None and time.monotonic() >= next_word:
                next_word += every_s
                last = tail(proc.log, 1).strip()[:160]
                state = "not answering yet" if why == "it never answered" else f"answering, not as ours: {why}"
                waiting(time.monotonic() - t0, f"{state}; log: {last or '(empty)'}")
            if cancel is not None:
                cancel.wait(0.1)
            else:
                time.sleep(0.1)

    def stop(self, proc: Proc, grace_s: float = 15.0) -> None:
        proc.child.stop(grace_s)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


class HealthWatch:
    """While the replay runs: each process's state every ``every_s`` — exited (with its status), healthy
    (its health URL answers 2xx) or not answering — and ``changed(name, state)`` on every change."""

    def __init__(
        self, watched: list[tuple[str, Proc, str]], changed: Callable[[str, str], None], every_s: float = 10.0
    ) -> None:
        self.watched = watched
        self.changed = changed
        self.every_s = every_s
        self.states = {name: "healthy" for name, _, _ in watched}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvtier-health-watch", daemon=True)

    def replace(self, name: str, proc: Proc) -> None:
        """Watch ``proc`` under ``name`` from now on (a restarted process)."""
        self.watched = [(n, proc if n == name else p, u) for n, p, u in self.watched]

    def check(self) -> None:
        for name, proc, url in self.watched:
            rc = proc.popen.poll()
            state = f"exited (status {rc})" if rc is not None else "healthy" if http_ok(url) else "not answering"
            if state != self.states[name]:
                self.states[name] = state
                self.changed(name, state)

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            self.check()

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.check()  # once more at the end: a process that died in the last interval is said too


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


__all__ = ["Supervisor", "Proc", "HealthWatch", "LaunchError", "free_ports", "http_ok", "port_in_use", "tail"]
