"""#41 item 11: the stream cuts Caddy made at a stream's start against real vLLM ("aborting with incomplete response
... use of closed network connection": the response's headers came, then Caddy closed its own upstream connection).
Measured with two real CPU vLLMs behind the launch's Caddy 2.6 and 4 clients with idle gaps of 0-6 s
(benchmarks/caddy_stream_cuts.py): 3 of 320 streams cut in each of two runs with the old Caddyfile, 0 of 640 with
request bodies buffered (benchmarks/routing_real_vllm.py and the real-vLLM launch test now allow none).

What can be checked here without a vLLM: that the real Caddy reads the launch's Caddyfile as meant (the body
buffered, responses flushed at once), and that streams through it, bodies buffered, still arrive whole."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvtier.launch.caddy import caddyfile
from kvtier.launch.procs import free_ports, http_ok

pytestmark = pytest.mark.skipif(shutil.which("caddy") is None, reason="caddy is not installed (install-tools.sh)")

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]


def test_caddy_reads_the_launchs_caddyfile_as_meant():
    out = subprocess.run(["caddy", "adapt", "--adapter", "caddyfile", "--config", "/dev/stdin"],
                         input=caddyfile("cpu", 8000, ["127.0.0.1:1", "127.0.0.1:2"]), capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    handler = json.loads(out.stdout)["apps"]["http"]["servers"]["srv0"]["routes"][0]["handle"][0]["routes"][0]
    proxy = handler["handle"][0]
    assert proxy["handler"] == "reverse_proxy" and proxy["buffer_requests"] is True and proxy["flush_interval"] == -1


class Streamer:
    """An HTTP/1.1 upstream streaming a chunked SSE answer to every POST, an event every 50 ms; GET /health 200."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(c,), daemon=True).start()

    def _serve(self, c: socket.socket) -> None:
        f = c.makefile("rb")
        try:
            while line := f.readline():
                length = 0
                while (h := f.readline()) not in (b"\r\n", b""):
                    if h.lower().startswith(b"content-length:"):
                        length = int(h.split(b":", 1)[1])
                f.read(length)
                if line.startswith(b"GET"):
                    c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    continue
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                for ev in EVENTS:
                    c.sendall(b"%x\r\n%s\r\n" % (len(ev), ev))
                    time.sleep(0.05)
                c.sendall(b"0\r\n\r\n")
        except OSError:
            return
        finally:
            c.close()

    def close(self) -> None:
        self.sock.close()


def test_streams_through_the_launchs_caddy_arrive_whole(tmp_path: Path):
    up = Streamer()
    (port,) = free_ports(1)
    (tmp_path / "Caddyfile").write_text(caddyfile("cpu", port, [f"127.0.0.1:{up.port}"]))
    home = tmp_path / "home"
    env = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / "c"), "XDG_DATA_HOME": str(home / "d"), "PATH": "/usr/bin"}
    caddy = subprocess.Popen(["caddy", "run", "--config", str(tmp_path / "Caddyfile"), "--adapter", "caddyfile"],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not http_ok(f"http://127.0.0.1:{port}/health") and time.monotonic() < deadline:
            time.sleep(0.1)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        for i in range(12):  # one client connection, reused, as the replay's are
            conn.request("POST", "/v1/chat/completions", body=json.dumps({"n": i, "pad": "x" * 5000}),
                         headers={"Content-Type": "application/json"})  # fmt: skip
            r = conn.getresponse()
            got = r.read()
            assert r.status == 200 and got == b"".join(EVENTS), got
        conn.close()
    finally:
        caddy.terminate()
        caddy.wait(timeout=20)
        up.close()
