"""Real servers on loopback for the remote tiers' tests and benchmarks: ``redis-server`` and an S3
server (moto's, ``python -m moto.server``), each on a port the OS chose, stopped on exit.

Why moto for S3: it is a real HTTP server speaking the S3 REST protocol (SigV4-signed requests,
multipart uploads, ranged GETs, paginated listings) and it installs from the package index with
kvtier's test extra. SeaweedFS and MinIO ship as Go binaries that are on neither PyPI nor Debian's
archive, and no Go toolchain is here to build them. Its objects live in the server's memory and
temporary files, so its figures say what *this* server does, not what an object store would.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvtier.child import Child, start
from kvtier.results.io import open_fresh

S3_TEST_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "kvtier-test", "AWS_SECRET_ACCESS_KEY": "kvtier-test-secret"}


@dataclass
class LocalServer:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def kill(self) -> None:
        """SIGKILL: the server dies as in a crash (the faults tests)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(child: Child) -> None:
    child.stop(grace_s=10)


def _start_redis(exe: str, work: Path, extra: list[str]) -> tuple[Child, int]:
    """A ``redis-server`` on 127.0.0.1 in ``work`` (no persistence), up and answering; (its child, its port)."""
    log = work / "redis.log"
    for _attempt in range(5):  # the port is free when chosen; another process may take it before redis binds
        port = _free_port()
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(work), "--logfile", str(log), *extra]
        proc = start(args, name="redis-server", stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # up (with --requirepass it asks who we are)
                        return proc, port
            except OSError:
                time.sleep(0.05)
        _stop(proc)
    raise RuntimeError(f"redis-server did not start; see {log}")


def _redis_exe() -> str:
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (scripts/install-tools.sh redis-server)")
    return exe


@contextmanager
def redis_server(
    maxmemory_mb: int = 0, policy: str = "noeviction", extra: tuple[str, ...] = ()
) -> Iterator[LocalServer]:
    """A fresh ``redis-server`` on 127.0.0.1 (no persistence), stopped when the block ends."""
    work = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
    try:
        args = ["--maxmemory-policy", policy, "--maxmemory", f"{maxmemory_mb}mb", *extra]
        proc, port = _start_redis(_redis_exe(), work, args)
        try:
            yield LocalServer(f"redis://127.0.0.1:{port}/0", port, proc.popen, work / "redis.log")
        finally:
            _stop(proc)
    finally:
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class LocalCluster:
    """A Redis Cluster's masters on loopback; ``url`` is the first one's (any master is a seed)."""

    nodes: list[LocalServer]

    @property
    def url(self) -> str:
        return self.nodes[0].url


@contextmanager
def redis_cluster(masters: int = 3, extra: tuple[str, ...] = ()) -> Iterator[LocalCluster]:
    """A fresh Redis Cluster of ``masters`` masters (no replicas) on 127.0.0.1, the 16384 slots split evenly,
    stopped when the block ends. ``cluster-require-full-coverage no``: a master lost takes its slots with it,
    the others keep serving theirs (what a cache wants: a lost slice is recomputed, not the whole store down)."""
    exe = _redis_exe()
    work = Path(tempfile.mkdtemp(prefix="kvtier-redis-cluster-"))
    children: list[Child] = []
    try:
        nodes, buses = [], []
        for i in range(masters):
            (work / f"node{i}").mkdir()
            bus = _free_port()
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus)]
            args += ["--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no", *extra]
            proc, port = _start_redis(exe, work / f"node{i}", args)
            children.append(proc)
            nodes.append(LocalServer(f"redis://127.0.0.1:{port}/0", port, proc.popen, work / f"node{i}" / "redis.log"))
            buses.append(bus)
        form_cluster([n.url for n in nodes], [("127.0.0.1", n.port, b) for n, b in zip(nodes, buses, strict=True)])
        yield LocalCluster(nodes)
    finally:
        for c in children:
            _stop(c)
        shutil.rmtree(work, ignore_errors=True)


def form_cluster(
    urls: list[str], meet: list[tuple[str, int, int]], password: str | None = None, timeout_s: float = 30.0
) -> None:
    """Make fresh cluster-enabled nodes one cluster: each (reached at ``urls[i]``) gets an even share of the slots,
    the first meets the others (at ``meet[i]``: the host, port and bus port the nodes know each other by), and
    every node must see them all, ok, within ``timeout_s``."""
    from kvtier.engine.resp import CLUSTER_SLOTS, RespConnection

    conns = [RespConnection(u, password, 10.0) for u in urls]
    try:
        n = len(urls)
        for i, c in enumerate(conns):
            c.call("CLUSTER", "ADDSLOTSRANGE", i * CLUSTER_SLOTS // n, (i + 1) * CLUSTER_SLOTS // n - 1)
        for host, p, b in meet[1:]:
            conns[0].call("CLUSTER", "MEET", host, p, b)
        deadline = time.monotonic() + timeout_s
        while True:
            infos = [str(c.call("CLUSTER", "INFO")) for c in conns]
            maps = [c.call("CLUSTER", "SLOTS") for c in conns]
            if all("cluster_state:ok" in i and f"cluster_known_nodes:{n}" in i for i in infos) and all(
                isinstance(m, list) and len(m) == n for m in maps
            ):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Redis Cluster at {urls} did not form in {timeout_s:g} s: {infos}")
            time.sleep(0.1)
    finally:
        for c in conns:
            c.close()


@contextmanager
def s3_server() -> Iterator[LocalServer]:
    """moto's S3 server on 127.0.0.1 (port chosen by the OS, read from its first lines)."""
    work = Path(tempfile.mkdtemp(prefix="kvtier-s3-"))
    log = work / "moto.log"
    with open_fresh(log, "moto's log") as out:
        proc = start(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
            name="moto",
            stdout=out,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    port = 0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None and not port:
        m = re.search(rb"Running on http://127\.0\.0\.1:(\d+)", log.read_bytes())
        if m:
            port = int(m.group(1))
        else:
            time.sleep(0.05)
    if not port:
        _stop(proc)
        raise RuntimeError(f"moto's S3 server did not start: {log.read_text(errors='replace')[-500:]}")
    try:
        yield LocalServer(f"http://127.0.0.1:{port}", port, proc.popen, log)
    finally:
        _stop(proc)
        shutil.rmtree(work, ignore_errors=True)


__all__ = [
    "LocalServer",
    "LocalCluster",
    "form_cluster",
    "redis_server",
    "redis_cluster",
    "s3_server",
    "S3_TEST_CREDENTIALS",
]
