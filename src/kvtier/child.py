"""Every child process kvtier starts, started, waited for and stopped here (the ground floor: the standard library
and kvtier.errors only, so engines, telemetry, bench, mlperf and launch all use it).

* ``start``: a long-running child — a server (Redis, moto, an engine, a sim, Caddy), mpirun and its ranks, bpftrace.
  By default in a session of its own (``group``: a stop reaches its whole process group, children included), told
  SIGTERM if kvtier dies first (``die_with_parent``, even when kvtier is SIGKILLed), stdin from /dev/null, its
  output to the file, pipe or terminal given. mpirun in the foreground stays in the terminal's group
  (``group=False``), so Ctrl+C reaches its ranks, which write their partial results.
* ``Child.stop``: the signal (SIGTERM, or bpftrace's SIGINT), ``grace_s`` to exit, then SIGKILL to the group.
* ``Child.finish``: wait; on Ctrl+C give the child (which the terminal told too) ``grace_s`` to write what it has,
  then stop it. ``Child.forwarding``: pass a launcher's SIGTERM/SIGINT on to the child (the MLPerf wrapper).
* ``run``: a short command whose output is read (a probe: ``nvidia-smi``, ``sudo -n true``, an engine's imports),
  always with a time limit; None when it cannot start or runs out of time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

from kvtier.errors import LaunchError

Output = int | IO[Any] | None
"""Where a child's stdout (and stderr) go: a file, ``subprocess.PIPE``, ``DEVNULL``, or None (the terminal)."""


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen[Any]
    group: bool  # in a session of its own: a stop signals the whole group
    log: Path | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def send(self, sig: int) -> None:
        """``sig`` to the child's group (its own session) or to the child alone; nothing if it is gone. ``stop``
        signals the group before it reaps the leader, while the group's id is surely still this child's."""
        try:
            if self.group:
                os.killpg(self.popen.pid, sig)
            else:
                self.popen.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout_s: float | None = None) -> int | None:
        """The exit status, or None when it is still running after ``timeout_s``."""
        try:
            return self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, grace_s: float = 15.0, sig: int = signal.SIGTERM) -> int | None:
        """``sig``, up to ``grace_s`` to exit, then SIGKILL (to the group, which may hold children even after the
        leader exited); the exit status, None if it would not die."""
        if self.popen.returncode is None:
            self.send(sig)
            deadline = time.monotonic() + grace_s
            while not self._exited() and time.monotonic() < deadline:
                time.sleep(0.02)
        self.send(signal.SIGKILL)  # the group may hold children even after the leader exited (not yet reaped here)
        return self.wait(5)

    def _exited(self) -> bool:
        """Whether the leader has exited, without reaping it (its pid, and so the group's, stays ours)."""
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.popen.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True

    def kill(self) -> None:
        """SIGKILL at once: a crash, not a shutdown."""
        self.send(signal.SIGKILL)
        self.wait(10)

    def finish(self, grace_s: float, sig: int | None = None) -> int | None:
        """Wait for the child. On Ctrl+C (the terminal told the child too; ``sig`` tells it again, for a child in
        another group) it has ``grace_s`` to write its partial results, then is stopped, and KeyboardInterrupt is
        raised again."""
        try:
            return self.popen.wait()
        except KeyboardInterrupt:
            if sig is not None:
                self.send(sig)
            try:
                if self.wait(grace_s) is None:
                    self.stop(grace_s=0)
            except KeyboardInterrupt:  # a second Ctrl+C: stop now
                self.stop(grace_s=0)
            raise

    @contextmanager
    def forwarding(self, stopping: list[int]) -> Iterator[None]:
        """While the block runs: the SIGTERM and SIGINT kvtier receives are recorded in ``stopping`` and passed on
        to the child (which then writes its partial result)."""

        def forward(signum: int, _frame: FrameType | None) -> None:
            stopping.append(signum)
            self.send(signum)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


def _prctl() -> Any:
    """libc's prctl, resolved here in the parent: the forked child only calls it (an import or a library load in
    the child could wait forever on a lock another thread of the parent held at fork time)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def _die_with_parent() -> None:
    """In the child: SIGTERM when kvtier itself dies (even by SIGKILL), so nothing is orphaned."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1


def start(
    argv: Sequence[str],
    *,
    name: str | None = None,
    stdout: Output = subprocess.DEVNULL,
    stderr: Output = subprocess.STDOUT,
    env: Mapping[str, str] | None = None,
    group: bool = True,
    die_with_parent: bool = True,
    text: bool = False,
    log: Path | None = None,
    cwd: Path | str | None = None,
    pass_fds: Sequence[int] = (),
) -> Child:
    """A long-running child (see the module's text); LaunchError naming the program when it cannot start."""
    args = list(argv)
    who = name or Path(args[0]).name
    try:
        p = subprocess.Popen(
            args,
            stdout=stdout,
            stderr=stderr if stdout is not None else None,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            start_new_session=group,
            preexec_fn=_die_with_parent if die_with_parent else None,
            text=text,
            cwd=cwd,
            pass_fds=tuple(pass_fds),
        )
    except OSError as e:
        raise LaunchError(f"{who}: cannot start {args[0]!r}: {e.strerror or e}") from e
    return Child(who, args, p, group, log)


def run(
    argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str] | None:
    """A short command's exit status and text output, within ``timeout_s`` (killed past it); None when it cannot
    start or runs out of time."""
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=dict(env) if env is not None else None,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None


__all__ = ["Child", "run", "start"]
