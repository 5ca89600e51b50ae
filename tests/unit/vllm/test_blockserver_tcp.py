"""The one cache server over TCP (kvtier/vllm/blockserver.py ``--listen``), for replicas on other hosts: the
challenge and the shared token, blocks inline in both directions, and the refusals. On loopback here; across
shaped links between network namespaces in tests/integration/test_fabric.py."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import KeyScope
from kvtier.sim.remote import RemoteOffload
from kvtier.vllm import messages as m
from kvtier.vllm.blockserver import BlockServer
from kvtier.vllm.client import ServerDown, ServerIndex, ServerLink
from kvtier.vllm.protocol import Conn, Refused, connect, read_token, tcp_address
from kvtier.vllm.settings import VllmOffloadSettings
from tests.unit.vllm.test_blockserver import BLOCK, GEOMETRY, key_of, metrics, payload

TOKEN = b"0123456789abcdef-test-token"


def token_file(d: Path, text: bytes = TOKEN, mode: int = 0o600) -> Path:
    p = d / "token"
    p.write_bytes(text + b"\n")
    p.chmod(mode)
    return p


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BlockServer]:
    settings = VllmOffloadSettings(offload="cpu", cpu_offload_gb=8 * BLOCK / 2**30)
    s = BlockServer(settings, None, listen=("127.0.0.1", 0), token=TOKEN)
    s.port = s.start()
    yield s
    s.close()


def address(s: BlockServer) -> str:
    return f"tcp://127.0.0.1:{s.listen_port}"


def data_link(s: BlockServer, engine: str, token: bytes = TOKEN) -> ServerLink:
    link = ServerLink(address(s), m.Hello(role="data", engine=engine, rank=0, **GEOMETRY), 10, token=token)
    link.open()
    return link


def test_a_block_stored_over_tcp_by_one_replica_comes_back_byte_for_byte_on_another(server: BlockServer):
    a = ServerIndex(address(server), key_of, {"engine": "A", **GEOMETRY}, TOKEN)
    b = ServerIndex(address(server), key_of, {"engine": "B", **GEOMETRY}, TOKEN)
    da, db = data_link(server, "A"), data_link(server, "B")
    keys = [bytes([i]) * 8 for i in range(3)]
    plan = a.plan_store(keys)
    assert plan is not None and plan.keys_to_store == keys
    sent = {k: payload(i) for i, k in enumerate(keys)}
    for k in keys:
        assert da.call(m.Put(key=key_of(k)), m.PutReply, payload=memoryview(sent[k])).tier == "cpu"
    a.complete_store(keys)  # posted: the scheduler does not wait for its answer
    a.settle()
    page = memoryview(bytearray(BLOCK))
    for k in keys:
        assert b.lookup(k) == "hit"
        r = db.call(m.Get(key=key_of(k)), m.GetReply, into=page)
        assert r.hit and r.n == BLOCK and bytes(page) == sent[k]
    # a miss sends no bytes: the connection stays in step for the next request
    r = db.call(m.Get(key=key_of(b"nothere!")), m.GetReply, into=page)
    assert not r.hit
    assert db.call(m.Get(key=key_of(keys[0])), m.GetReply, into=page).hit and bytes(page) == sent[keys[0]]
    assert metrics(server)["kvtier_block_server_cross_replica_loads_total"] == 4
    for x in (a, b):
        x.close()
    da.close()
    db.close()


def test_a_wrong_token_is_refused_and_counted_and_no_token_never_connects(server: BlockServer):
    stranger = ServerLink(address(server), m.Hello(role="data", engine="X", rank=0, **GEOMETRY), 10, token=b"y" * 20)
    with pytest.raises(ServerDown, match="token does not match"):  # an engine's I/O degrades: a failed load
        stranger.call(m.Get(key="k"), m.GetReply)
    with pytest.raises(Refused, match="token does not match"):
        ServerLink(address(server), m.Hello(role="probe", engine="X", **GEOMETRY), 10, token=b"x" * 20).open()
    with pytest.raises(Refused, match="needs the shared token"):
        connect(address(server), 10, None)
    assert metrics(server)["kvtier_block_server_refused_connections_total"] == 2


def test_a_hello_without_the_challenges_answer_is_refused_before_any_tier_opens(server: BlockServer):
    s = socket.create_connection(("127.0.0.1", server.listen_port), timeout=10)
    c = Conn(s, inline=True)
    assert c.recv()["op"] == "challenge"
    with pytest.raises(Refused, match="token does not match"):
        c.call({"op": "hello", "role": "probe", "engine": "X", **GEOMETRY, "proof": "0" * 64})
    assert server.geometry is None  # nothing opened for a stranger
    c.close()


def test_refusals_before_anything_listens(tmp_path: Path):
    settings = VllmOffloadSettings(offload="cpu", cpu_offload_gb=0.01)
    with pytest.raises(ConfigError, match="needs --token-file"):
        BlockServer(settings, None, listen=("0.0.0.0", 0))
    with pytest.raises(ConfigError, match="give --socket"):
        BlockServer(settings, None)
    with pytest.raises(ValueError, match="must be 0600"):
        read_token(str(token_file(tmp_path, mode=0o644)), "--token-file")
    with pytest.raises(ValueError, match="at least 16"):
        read_token(str(token_file(tmp_path, b"short")), "--token-file")
    assert read_token(str(token_file(tmp_path)), "--token-file") == TOKEN
    assert tcp_address("tcp://[::1]:7000") == ("::1", 7000) and tcp_address("/run/x.sock") is None
    for bad in ("tcp://host", "tcp://:80", "tcp://h:0", "tcp://h:99999"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            tcp_address(bad)
    with pytest.raises(ValueError, match="needs cache_server_token_file"):
        VllmOffloadSettings(cache_server="tcp://127.0.0.1:9")


def test_a_hit_larger_than_the_page_drops_the_connection_instead_of_reading_into_the_engine(tmp_path: Path):
    """A confused or hostile server announcing more bytes than a block: the client must not read them."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)

    def serve() -> None:
        s, _ = lst.accept()
        c = Conn(s, inline=True)
        c.send({"op": "challenge", "nonce": "ab" * 16, "version": 1})
        c.recv()
        c.send({"ok": True, "tiers": [["cpu", 8, "host"]]})
        c.recv()
        c.send({"ok": True, "hit": True, "tier": "cpu", "n": 10 * BLOCK, "seconds": 0.0})
        c.send_bytes(memoryview(b"\xff" * 1024))
        s.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    port = lst.getsockname()[1]
    link = ServerLink(f"tcp://127.0.0.1:{port}", m.Hello(role="data", engine="E", rank=0, **GEOMETRY), 10, token=TOKEN)
    link.open()
    page = memoryview(bytearray(BLOCK))
    with pytest.raises(ServerDown, match="this page holds"):
        link.call(m.Get(key="k"), m.GetReply, into=page)
    assert bytes(page) == bytes(BLOCK) and link.conn is None
    t.join(10)
    lst.close()


def test_a_sim_replica_shares_the_server_over_tcp(server: BlockServer, tmp_path: Path):
    """sim/remote.py over TCP: what one replica stored is the next one's hit, its chunks read over the link."""
    scope = KeyScope("tiny", chunk_size=16)

    async def run() -> tuple[int, tuple[float, int, int]]:
        a = RemoteOffload(address(server), scope, BLOCK // 16, 16, engine="a", token=TOKEN)
        b = RemoteOffload(address(server), scope, BLOCK // 16, 16, engine="b", token=TOKEN)
        await a.connect()
        await b.connect()
        keys = a.chunk_keys(list(range(64)))
        a.store_later(keys)
        await a.aclose()
        found = await b.alookup(keys)
        loaded = await b.aload(keys)
        await b.aclose()
        return found, loaded

    found, (_, nbytes, n) = asyncio.run(run())
    assert found == 4 and n == 4 and nbytes == 4 * BLOCK
    assert metrics(server)["kvtier_block_server_cross_replica_loads_total"] == 4


def test_a_prefix_is_looked_up_and_loaded_in_one_round_trip_each(server: BlockServer):
    """vLLM asks the manager one block at a time: the first ask carries the request's blocks after it, and the
    loads of a run of blocks are pipelined on one connection — over a link, one round trip instead of one a block."""
    a = ServerIndex(address(server), key_of, {"engine": "A", **GEOMETRY}, TOKEN)
    da = data_link(server, "A")
    keys = [bytes([i]) * 8 for i in range(4)]
    sent = {k: payload(i) for i, k in enumerate(keys)}
    plan = a.plan_store(keys[:3])
    assert plan is not None
    for k in keys[:3]:
        da.call(m.Put(key=key_of(k)), m.PutReply, payload=memoryview(sent[k]))
    a.complete_store(keys[:3])
    a.settle()
    b = ServerIndex(address(server), key_of, {"engine": "B", **GEOMETRY}, TOKEN)
    before = metrics(server)["kvtier_block_server_lookups_total"]
    statuses = [b.lookup(k, lambda i=i: keys[i:]) for i, k in enumerate(keys)]
    assert statuses == ["hit", "hit", "hit", "miss"]
    assert metrics(server)["kvtier_block_server_lookups_total"] - before == 4  # one request named all four
    assert b.lookup(keys[0]) == "hit"  # a later ask is a request of its own
    db = data_link(server, "B")
    page = memoryview(bytearray(BLOCK))
    got: list[tuple[bool, bytes]] = []
    db.pipeline([m.Get(key=key_of(k)) for k in keys], m.GetReply, page, lambda r: got.append((r.hit, bytes(page))))
    assert [hit for hit, _ in got] == [True, True, True, False]
    assert [data for _, data in got[:3]] == [sent[k] for k in keys[:3]]
    # the connection is in step after the pipeline: a plain get still works
    assert db.call(m.Get(key=key_of(keys[1])), m.GetReply, into=page).hit and bytes(page) == sent[keys[1]]
    for x in (a, b):
        x.close()
    da.close()
    db.close()


def test_posted_requests_are_acted_on_in_order_and_a_refused_one_is_counted(server: BlockServer):
    a = ServerIndex(address(server), key_of, {"engine": "A", **GEOMETRY}, TOKEN)
    da = data_link(server, "A")
    k = b"posted!!"
    assert a.plan_store([k]) is not None
    da.call(m.Put(key=key_of(k)), m.PutReply, payload=memoryview(payload(1)))
    a.complete_store([k])  # posted
    assert a.lookup(k) == "hit"  # the same connection: the server completed it before it answered the lookup
    a.pin([k])
    a.unpin([k])  # posted
    before = a.server_errors
    a._link.post(m.Unpin.model_construct(keys=["x" * 2000]), m.Done)  # over the limit: refused when it arrives
    a.settle()
    assert a.server_errors == before + 1 and "posted" in a._link.last_error
    assert a.lookup(k) == "hit"  # the connection is in step after the refusal
    a.close()
    da.close()


def test_a_replica_lost_inside_a_block_ends_its_connection_quietly_and_the_server_serves_on(
    server: BlockServer, monkeypatch: pytest.MonkeyPatch
):
    """Found on the shaped testbed: a worker whose connection closed in the middle of a put's bytes left the server's
    connection thread dying with BufferError (the page still had a slice in the traceback). Now the connection ends
    as any lost peer's does, and the next replica is served."""
    died: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: died.append(args.exc_value))
    a = ServerIndex(address(server), key_of, {"engine": "A", **GEOMETRY}, TOKEN)
    plan = a.plan_store([b"k" * 8])
    assert plan is not None
    link = data_link(server, "A")
    assert link.conn is not None
    open_now = len(server._conns)  # A's control connection and this data one
    link.conn.send(m.Put(key=key_of(b"k" * 8)).model_dump())
    link.conn.sock.sendall(b"\0" * (BLOCK // 3))  # a third of the block, then the peer is gone
    link.conn.sock.close()
    import time

    deadline = time.monotonic() + 20
    while len(server._conns) == open_now and time.monotonic() < deadline:  # the lost connection's thread ended
        time.sleep(0.02)
    assert len(server._conns) == open_now - 1
    b = data_link(server, "B")
    assert b.conn is not None and b.call(m.Get(key=key_of(b"nothing" * 2)), m.GetReply).hit is False
    assert died == []


def test_a_silent_server_is_tried_less_and_less_often_and_each_try_is_bounded(monkeypatch: pytest.MonkeyPatch):
    """A store whose link went silent (connections open, nothing answers): each attempt to reach it gives up after
    OPEN_S, and the wait before the next doubles from 1 s up to 30 s, so the engine's scheduler pays one bounded
    timeout per wait instead of CONTROL_TIMEOUT_S on every call."""
    from kvtier.vllm import client

    monkeypatch.setattr(client, "OPEN_S", 0.2)
    lst = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def take() -> None:
        while True:
            try:
                accepted.append(lst.accept()[0])  # held, never answered
            except OSError:
                return

    threading.Thread(target=take, daemon=True).start()
    link = ServerLink(f"tcp://127.0.0.1:{lst.getsockname()[1]}", m.Hello(role="control", engine="A", **GEOMETRY),
                      10.0, token=b"t" * 16)  # fmt: skip
    waits = []
    try:
        for _ in range(7):
            link._tried = float("-inf")  # the wait is over: the next call tries
            with pytest.raises(ServerDown, match="timed out"):
                link.call(m.Usage(), m.UsageReply)
            waits.append(link.wait_s)
            with pytest.raises(ServerDown):  # inside the wait: refused at once, the server not tried
                link.call(m.Usage(), m.UsageReply)
        assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
        assert len(accepted) == 7 and link.errors == 7
    finally:
        lst.close()
        for s in accepted:
            s.close()
