"""#41 item 6: launch's last /metrics read of each process had no size cap and no deadline (it passed 4 GB against a
stand-in on the freed port) and wrote through whatever was at the file's name. It is now read up to the scraper's
cap within a deadline, against a real HTTP server on loopback, and written through the atomic writer."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from kvtier.launch.profiles import ProcPlan
from kvtier.launch.running import save_metrics
from kvtier.replay.scrape import MAX_METRICS_BYTES


class Stand:
    """Answers one GET with a 200 and ``body`` (or an endless body, or one byte every ``dribble_s``)."""

    def __init__(self, body: bytes = b"", endless: bool = False, dribble_s: float = 0.0) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/metrics"
        self.body, self.endless, self.dribble_s = body, endless, dribble_s
        self.sent = 0
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")
                if self.dribble_s:
                    while not self.stop.is_set() and self.sent < 1000:
                        conn.sendall(b"#")
                        self.sent += 1
                        time.sleep(self.dribble_s)
                elif self.endless:
                    chunk = b"x" * (1 << 20)
                    while not self.stop.is_set() and self.sent < 64 * MAX_METRICS_BYTES:  # bounded: 1 GiB at most
                        conn.sendall(chunk)
                        self.sent += len(chunk)
                else:
                    conn.sendall(self.body)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _plan(url: str) -> ProcPlan:
    return ProcPlan(name="replica0", argv=[], env={}, health=url, metrics=url, startup_timeout_s=1)


def test_an_honest_page_is_kept(tmp_path: Path):
    srv = Stand(b"vllm:num_requests_running 0\n")
    try:
        save_metrics(tmp_path, [_plan(srv.url)])
    finally:
        srv.close()
    assert (tmp_path / "replica0.prom").read_text() == "vllm:num_requests_running 0\n"


def test_an_endless_page_stops_at_the_cap(tmp_path: Path):
    srv = Stand(endless=True)
    try:
        save_metrics(tmp_path, [_plan(srv.url)])
    finally:
        srv.close()
    text = (tmp_path / "replica0.prom").read_text()
    assert text.startswith("# not saved at the end of the run") and f"larger than {MAX_METRICS_BYTES}" in text
    assert srv.sent < 4 * MAX_METRICS_BYTES  # it stopped reading near the cap, not at the server's leisure


def test_a_dribbling_page_stops_at_the_deadline(tmp_path: Path):
    srv = Stand(dribble_s=0.05)
    try:
        save_metrics(tmp_path, [_plan(srv.url)], deadline_s=1.0)
        sent = srv.sent  # what the stand-in had dribbled when the read gave up
    finally:
        srv.close()
    assert "not read within 1 s" in (tmp_path / "replica0.prom").read_text()
    assert sent < 1000  # it gave up before the stand-in's 1,000 bytes (50 s of dribbling) were all sent


def test_a_link_planted_at_the_name_is_not_written_through(tmp_path: Path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "replica0.prom").symlink_to(victim)
    srv = Stand(b"up 1\n")
    try:
        save_metrics(tmp_path / "m", [_plan(srv.url)])
    finally:
        srv.close()
    assert victim.read_text() == "precious\n" and (tmp_path / "m" / "replica0.prom").read_text() == "up 1\n"


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("no_proxy", "127.0.0.1")
