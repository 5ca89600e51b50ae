"""The RESP client against a hostile server on loopback (#28): lengths are checked before anything is
allocated, a reply without CRLF cannot grow without bound, and malformed lengths are protocol errors — each a
RespConnectionError (the connection is dropped, the operation fails), never a traceback or a hang."""

from __future__ import annotations

import resource
import socket
import threading
import time

import pytest

from kvtier.engine.resp import MAX_LINE_BYTES, RespConnection, RespConnectionError


class Hostile:
    """Accepts one connection, reads a command, answers ``reply`` (then keeps dribbling ``tail`` if given)."""

    def __init__(self, reply: bytes, tail: bytes = b"") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.port = self.sock.getsockname()[1]
        self.reply, self.tail, self.stop = reply, tail, threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            conn.recv(65536)
            try:
                conn.sendall(self.reply)
                deadline = time.monotonic() + 10
                while self.tail and not self.stop.is_set() and time.monotonic() < deadline:
                    conn.sendall(self.tail)
            except OSError:
                pass

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize(
    ("reply", "tail", "words"),
    [
        (b"$3000000000\r\n", b"", "a bulk string of 3000000000"),
        (b"*99999999999\r\n", b"", "an array of 99999999999"),
        (b"$abc\r\n", b"", "is not an integer"),
        (b":12x\r\n", b"", "is not an integer"),
        (b"+" + b"a" * 1000, b"b" * 65536, f"no CRLF within {MAX_LINE_BYTES} bytes"),
        (b"*1\r\n" * 20 + b":1\r\n", b"", "nested deeper"),
    ],
)
def test_a_hostile_reply_is_a_protocol_error_not_memory(reply: bytes, tail: bytes, words: str):
    srv = Hostile(reply, tail)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        conn = RespConnection(f"redis://127.0.0.1:{srv.port}", None, timeout_s=5.0)
        with pytest.raises(RespConnectionError, match=words):
            conn.call("INFO")
        conn.close()
    finally:
        srv.close()
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mib < 64  # nothing near the 2.8 GiB the length asked for


def test_a_value_longer_than_the_callers_buffer_is_refused():
    srv = Hostile(b"$1048577\r\n")
    try:
        conn = RespConnection(f"redis://127.0.0.1:{srv.port}", None, timeout_s=5.0)
        conn.send([("GET", "k")])
        with pytest.raises(RespConnectionError, match="1048577-byte value for a 1024-byte buffer"):
            conn.bulk_into(memoryview(bytearray(1024)))
        conn.close()
    finally:
        srv.close()


def test_a_dribbling_server_cannot_stretch_an_operation_past_its_deadline():
    """#28 medium 4 (in part): a byte every 0.1 s restarted a per-recv timeout forever; an operation now has
    ``timeout_s`` in all — command, reply and value together. The server dribbles 40 bytes (4 s), then goes
    quiet: a per-recv timeout would fail only then, and say so differently."""

    class Dribbler(Hostile):
        def _serve(self) -> None:
            conn, _ = self.sock.accept()
            with conn:
                conn.recv(65536)
                try:
                    conn.sendall(b"$100000\r\n")
                    for _ in range(40):
                        conn.sendall(b"x")
                        time.sleep(0.1)
                    self.stop.wait(30)
                except OSError:
                    pass

    srv = Dribbler(b"")
    try:
        conn = RespConnection(f"redis://127.0.0.1:{srv.port}", None, timeout_s=1.0)
        with pytest.raises(RespConnectionError, match="timed out: the operation took more than 1 s"):
            conn.call("GET", "k")
        conn.close()
    finally:
        srv.close()


def _slots(*ranges: tuple[int, int, bytes, int]) -> bytes:
    out = b"*%d\r\n" % len(ranges)
    for lo, hi, host, port in ranges:
        out += b"*3\r\n:%d\r\n:%d\r\n*2\r\n$%d\r\n%s\r\n:%d\r\n" % (lo, hi, len(host), host, port)
    return out


def test_a_cluster_map_from_a_loopback_seed_may_not_send_keys_elsewhere():
    """A loopback seed whose CLUSTER SLOTS names a master on another address is refused, not followed."""
    from kvtier.engine.resp import RespNodes

    srv = Hostile(_slots((0, 8191, b"127.0.0.1", 7000), (8192, 16383, b"10.1.2.3", 7001)))
    nodes = RespNodes(f"redis://127.0.0.1:{srv.port}", 1, None, 5.0, None)
    try:
        with pytest.raises(RespConnectionError, match="names master 10.1.2.3: refused"):
            nodes.cluster()
        assert not nodes.is_cluster and nodes.pool("k") is nodes.seed  # nothing routed by the refused map
    finally:
        nodes.close()
        srv.close()


def test_a_cluster_map_routes_each_key_by_its_slot_and_an_empty_host_is_the_seeds():
    from kvtier.engine.resp import RespNodes, key_slot

    srv = Hostile(_slots((0, 8191, b"", 7000), (8192, 16383, b"127.0.0.1", 7001)))
    nodes = RespNodes(f"redis://127.0.0.1:{srv.port}", 1, None, 5.0, None)
    try:
        nodes.cluster()
        low = next(k for k in (f"k{i}" for i in range(100)) if key_slot(k) < 8192)
        high = next(k for k in (f"k{i}" for i in range(100)) if key_slot(k) >= 8192)
        assert nodes.pool(low).url == "redis://127.0.0.1:7000" and nodes.pool(high).url == "redis://127.0.0.1:7001"
        assert nodes.pool("{x}a") is nodes.pool("{x}b")  # one hash tag, one slot, one master
    finally:
        nodes.close()
        srv.close()
