"""MPI for kvtier: is this process one rank of an ``mpirun`` launch, and bounded-time messages between
ranks.

Detection reads the launcher's environment (Open MPI's ``OMPI_COMM_WORLD_SIZE``, PMIx's
``PMIX_RANK`` with ``OMPI_COMM_WORLD_SIZE``, MPICH/Hydra's ``PMI_SIZE``); only a launch of two or more
ranks is a distributed run, and only then is mpi4py (the ``mpi`` extra) imported. A rank that is
launched by mpirun without mpi4py stops with a clear error instead of running alone N times.

Every exchange has a deadline: messages are posted non-blocking and polled, so a rank that died or
never arrives costs the others a timeout and a name in the result, never a hang. All traffic is
between rank 0 and the others (a star): rank 0 gathers, decides and tells.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvtier.errors import ConfigError, KvtierError, UnsupportedError

SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MPI_LOCALNRANKS")
TAG_READY, TAG_GO, TAG_RESULT, TAG_SEED = 11, 12, 13, 14
POLL_S = 0.005
START_MARGIN_S = 1.0  # between rank 0's go and the shared start: every rank hears it in time
T = TypeVar("T")


def launched_size(environ: Mapping[str, str] | None = None) -> int:
    """The world size the launcher announced in the environment (1 when not launched by mpirun)."""
    env = os.environ if environ is None else environ
    for name in SIZE_VARS:
        value = env.get(name)
        if value and value.strip().isdigit():
            return int(value)
    return 1


@dataclass
class Rank:
    """This process's place in the run and the communicator to the others."""

    rank: int
    size: int
    host: str
    comm: Any  # mpi4py.MPI.Comm
    lost: set[int] = field(default_factory=set)  # peers a message timed out with: MPI_Finalize may hang on them

    def send(self, obj: Any, dest: int, tag: int, timeout_s: float) -> bool:
        """Send ``obj`` (pickled); False when the receiver did not take it within the timeout."""
        req = self.comm.isend(obj, dest=dest, tag=tag)
        deadline = time.monotonic() + timeout_s
        while not req.Test():
            if time.monotonic() > deadline:
                try:
                    req.Cancel()
                except Exception:  # noqa: BLE001 - cancelling a send may be unsupported; the timeout stands
                    pass
                self.lost.add(dest)
                return False
            time.sleep(POLL_S)
        return True

    def recv(self, source: int, tag: int, timeout_s: float) -> tuple[bool, Any]:
        """(True, obj) from ``source``, or (False, None) when nothing came within the timeout."""
        deadline = time.monotonic() + timeout_s
        while not self.comm.iprobe(source=source, tag=tag):
            if time.monotonic() > deadline:
                self.lost.add(source)
                return False, None
            time.sleep(POLL_S)
        return True, self.comm.recv(source=source, tag=tag)

    def gather(self, obj: Any, tag: int, timeout_s: float) -> dict[int, Any] | None:
        """Rank 0: {rank: obj} of every rank heard from within the timeout (its own included); a
        missing rank is absent. Other ranks: send to rank 0 and return None."""
        if self.rank != 0:
            self.send(obj, 0, tag, timeout_s)
            return None
        got = {0: obj}
        deadline = time.monotonic() + timeout_s
        waiting = set(range(1, self.size))
        while waiting and time.monotonic() <= deadline:
            for r in sorted(waiting):
                if self.comm.iprobe(source=r, tag=tag):
                    got[r] = self.comm.recv(source=r, tag=tag)
                    waiting.discard(r)
            if waiting:
                time.sleep(POLL_S)
        self.lost |= waiting
        return got

    def tell(self, obj: Any, ranks: list[int], tag: int, timeout_s: float) -> list[int]:
        """Rank 0 sends ``obj`` to each of ``ranks``; returns the ranks that did not take it."""
        reqs = {r: self.comm.isend(obj, dest=r, tag=tag) for r in ranks}
        deadline = time.monotonic() + timeout_s
        while reqs and time.monotonic() <= deadline:
            reqs = {r: q for r, q in reqs.items() if not q.Test()}
            if reqs:
                time.sleep(POLL_S)
        self.lost |= set(reqs)
        return sorted(reqs)


class RunAborted(KvtierError):
    """This rank stops before the load: a rank could not start, never reported, or missed the start."""


def agree_start(
    r: Rank, timeout_s: float, problem: str | None = None, duration_s: float | None = None, margin_s: float = 1.0
) -> dict[str, float]:
    """Every rank reports ready (or ``problem``, why it cannot run) to rank 0, which answers with one
    start time (now + ``margin_s``; with ``duration_s`` also one deadline) or, when a rank failed or did
    not report within ``timeout_s``, an abort naming it. Raises RunAborted on every rank then (and on a
    rank whose own ``problem`` it is); otherwise returns ``{"start_unix_s", ["deadline_unix_s"]}``."""
    state = {"ok": problem is None, "host": r.host, "error": problem}
    if r.rank == 0:
        states = r.gather(state, TAG_READY, timeout_s) or {}
        bad = [f"rank {k} ({v['host']}): {v['error']}" for k, v in sorted(states.items()) if not v["ok"]]
        missing = [k for k in range(r.size) if k not in states]
        if missing:
            bad.append(f"rank(s) {', '.join(map(str, missing))} did not report within {timeout_s:g} s")
        if bad:
            r.tell({"abort": "; ".join(bad)}, [k for k in states if k != 0], TAG_GO, 30)
            raise RunAborted("the MPI run cannot start: " + "; ".join(bad))
        start = time.time() + margin_s
        go = {"start_unix_s": start, **({"deadline_unix_s": start + duration_s} if duration_s is not None else {})}
        late = r.tell(go, list(range(1, r.size)), TAG_GO, margin_s)
        if late:
            raise RunAborted(f"rank(s) {late} did not take the start message in time")
        return go
    r.send(state, 0, TAG_READY, timeout_s)
    if problem is not None:
        raise RunAborted(problem)
    ok, go = r.recv(0, TAG_GO, timeout_s + 60)
    if not ok:
        raise RunAborted(f"rank {r.rank} ({r.host}): no start from rank 0 within {timeout_s:g} s")
    if "abort" in go:
        raise RunAborted(f"rank {r.rank}: the MPI run was aborted before it started: {go['abort']}")
    return dict(go)


def sleep_until(unix_s: float) -> None:
    delay = unix_s - time.time()
    if delay > 0:
        time.sleep(delay)


def exit_rank(r: Rank, code: int) -> int:
    """The exit of a rank's command: when a peer was lost, leave now (``os._exit``, after flushing)
    rather than in MPI_Finalize, which can wait forever on a dead peer's pending messages."""
    if r.lost:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def current(environ: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> Rank | None:
    """This rank when launched by mpirun with two or more ranks, else None. MPI start-up (MPI_Init,
    run by mpi4py's import) waits for every rank; a rank that dies meanwhile would block the others for
    good, so a watchdog that needs no Python lock (faulthandler's) ends this process after
    ``timeout_s`` with a traceback saying where it waited."""
    size = launched_size(environ)
    if size < 2:
        return None
    import faulthandler
    import sys

    faulthandler.dump_traceback_later(timeout_s, exit=True, file=sys.stderr)
    try:
        from mpi4py import MPI  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise UnsupportedError(
            f"launched by mpirun with {size} ranks, but mpi4py is not installed: pip install 'kvtier[mpi]' "
            f"(it needs the system's Open MPI: bash scripts/install-tools.sh mpirun) ({e})"
        ) from None
    finally:
        faulthandler.cancel_dump_traceback_later()
    comm = MPI.COMM_WORLD
    return Rank(comm.Get_rank(), comm.Get_size(), socket.gethostname(), comm)


@dataclass
class RunEnvironment:
    """Where a run runs: one process (``RunEnvironment.local()``) or one rank of an MPI launch
    (``RunEnvironment.mpi(rank, timeout_s)``). ``kvtier bench`` and ``kvtier replay`` take one and speak one
    protocol through it: ``start`` (every rank ready, or why not; then one start time and, with a duration,
    one deadline), ``wait`` (until the start; the seconds left to the deadline), ``gather`` (rank 0 receives
    every rank's contribution, each within ``timeout_s``), ``share`` and ``mine`` (this rank's part of a
    count and of a list). Locally the same calls cost nothing and never wait on anyone."""

    rank: int = 0
    size: int = 1
    host: str = field(default_factory=socket.gethostname)
    timeout_s: float = 600.0
    peers: Rank | None = None  # the communicator, for an MPI run

    @classmethod
    def local(cls) -> RunEnvironment:
        return cls()

    @classmethod
    def mpi(cls, r: Rank, timeout_s: float) -> RunEnvironment:
        return cls(r.rank, r.size, r.host, timeout_s, r)

    @classmethod
    def detect(cls, timeout_s: float) -> RunEnvironment:
        """This process's environment: a rank when launched by mpirun with two or more ranks, else local."""
        r = current(timeout_s=timeout_s)
        return cls.local() if r is None else cls.mpi(r, timeout_s)

    @property
    def distributed(self) -> bool:
        return self.peers is not None and self.size > 1

    @property
    def lost(self) -> set[int]:
        return self.peers.lost if self.peers is not None else set()

    def start(
        self, problem: str | None = None, duration_s: float | None = None, margin_s: float = 1.0
    ) -> dict[str, float]:
        """The shared window: ``{"start_unix_s", ["deadline_unix_s"]}``. Raises RunAborted when this or another
        rank cannot run (``problem``: why this one cannot)."""
        if self.peers is None:
            if problem is not None:
                raise RunAborted(problem)
            now = time.time()
            return {"start_unix_s": now, **({"deadline_unix_s": now + duration_s} if duration_s is not None else {})}
        return agree_start(self.peers, self.timeout_s, problem=problem, duration_s=duration_s, margin_s=margin_s)

    def wait(self, window: dict[str, float]) -> float:
        """Sleep until the window's start; the seconds then left to its deadline (inf without one)."""
        sleep_until(window["start_unix_s"])
        deadline = window.get("deadline_unix_s")
        return float("inf") if deadline is None else max(0.0, deadline - time.time())

    def gather(self, obj: Any) -> dict[int, Any] | None:
        """Rank 0: {rank: contribution} of every rank heard from (its own included); others: None."""
        if self.peers is None:
            return {0: obj}
        return self.peers.gather(obj, TAG_RESULT, self.timeout_s)

    def share(self, n: int) -> int:
        """This rank's part of ``n``: n // size, plus one for the first n % size ranks."""
        return n // self.size + (1 if self.rank < n % self.size else 0)

    def mine(self, items: Sequence[T]) -> list[T]:
        """This rank's items: rank r takes r, r + size, r + 2 size, ... (together, every item once)."""
        return list(items[self.rank :: self.size])

    def exit(self, code: int) -> int:
        """The command's exit status; a rank that lost a peer leaves at once (``exit_rank``)."""
        return exit_rank(self.peers, code) if self.peers is not None else code


def require_mpi(what: str) -> str:
    """Before starting ranks: mpirun's path, once both mpirun (Open MPI) and mpi4py (the ``mpi`` extra) are here;
    else UnsupportedError (exit 4) naming what installs the missing one. Without mpi4py every rank would stop with
    the same error after mpirun started them all (printed once per rank, between the launcher's own messages)."""
    import shutil

    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise UnsupportedError(
            f"{what}: mpirun (Open MPI) is not installed: bash scripts/install-tools.sh mpirun, "
            "and pip install 'kvtier[mpi]'"
        )
    try:
        import mpi4py  # type: ignore[import-not-found, unused-ignore]  # noqa: F401 - only checked for
    except ImportError:
        raise UnsupportedError(f"{what}: mpi4py is not installed: pip install 'kvtier[mpi]'") from None
    return mpirun


def mpirun_argv(
    command: Sequence[str], ranks: int, *, hosts: Sequence[str] = (), mpirun: str = "mpirun", interface: str = ""
) -> list[str]:
    """The one ``mpirun`` command line (Open MPI) kvtier starts ranks with: ``--allow-run-as-root`` as root; every
    rank on this host (``--oversubscribe``: more ranks than cores is a load test's choice) or ``ranks`` spread evenly
    over ``hosts`` (``--host h:n,…``, ConfigError when they do not divide); ``--enable-recovery``, so a rank that
    dies does not take the others down (they finish and rank 0 reports it lost); on one host, ``ONE_HOST``. A command
    of ``kvtier …`` runs with this interpreter, as this installation. ``command`` alone when one rank on no named
    host. ``interface`` (with ``hosts``): the interfaces or CIDRs the ranks' TCP transport and the wire-up use."""
    import sys

    argv = [sys.executable, "-m", "kvtier", *command[1:]] if command and command[0] == "kvtier" else list(command)
    if ranks <= 1 and not hosts:
        return argv
    placement = ["--oversubscribe", *ONE_HOST]
    if hosts:
        if ranks % len(hosts):
            raise ConfigError(f"{ranks} ranks do not divide over {len(hosts)} hosts")
        placement = ["--host", ",".join(f"{h}:{ranks // len(hosts)}" for h in hosts)]
        if interface:
            placement += ["--mca", "btl_tcp_if_include", interface, "--mca", "oob_tcp_if_include", interface]
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, *placement, "--enable-recovery", "-np", str(ranks), *argv]


ONE_HOST = ["--mca", "btl", "self,vader", "--mca", "oob_tcp_if_include", "lo"]
"""Open MPI on one host: the ranks talk through shared memory (no TCP transport, so no rank listens on a port) and
mpirun advertises only loopback to them. Open MPI 4.1's mpirun still listens on every address for its out-of-band
wire-up whatever it advertises (docs/security.md); with ``--hosts`` the interfaces are the user's to name
(``kvtier mlperf run --mpi-interface``, or ``OMPI_MCA_btl_tcp_if_include``/``OMPI_MCA_oob_tcp_if_include``)."""


__all__ = [
    "mpirun_argv",
    "require_mpi",
    "Rank",
    "RunEnvironment",
    "RunAborted",
    "agree_start",
    "exit_rank",
    "sleep_until",
    "current",
    "launched_size",
    "TAG_READY",
    "TAG_GO",
    "TAG_RESULT",
    "TAG_SEED",
]
