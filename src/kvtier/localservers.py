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


@contextmanager
def redis_server(
    maxmemory_mb: int = 0, policy: str = "noeviction", extra: tuple[str, ...] = ()
) -> Iterator[LocalServer]:
    """A fresh ``redis-server`` on 127.0.0.1 (no persistence), stopped when the block ends."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise FileNotFoundError("redis-server is not installed (scripts/install-tools.sh redis-server)")
    work = Path(tempfile.mkdtemp(prefix="kvtier-redis-"))
    log = work / "redis.log"
    for _attempt in range(5):  # the port is free when chosen; another process may take it before redis binds
        port = _free_port()
        args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        args += ["--dir", str(work), "--logfile", str(log), "--maxmemory-policy", policy]
        args += ["--maxmemory", f"{maxmemory_mb}mb", *extra]
        proc = start(args, name="redis-server", stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(64).startswith((b"+PONG", b"-NOAUTH")):  # up (with --requirepass it asks who we are)
                        break
            except OSError:
                time.sleep(0.05)
        else:
            _stop(proc)
            continue
        try:
            yield LocalServer(f"redis://127.0.0.1:{port}/0", port, proc.popen, log)
        finally:
            _stop(proc)
            shutil.rmtree(work, ignore_errors=True)
        return
    raise RuntimeError(f"redis-server did not start; see {log}")


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


__all__ = ["LocalServer", "redis_server", "s3_server", "S3_TEST_CREDENTIALS"]
