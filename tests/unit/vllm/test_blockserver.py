"""The shared cache server of kvtier's vLLM backend (kvtier/vllm/blockserver.py) and its scheduler-side client
(kvtier/vllm/client.py ServerIndex), without vLLM: two "replicas" are two ServerIndex objects with their own engine
ids, and a worker's I/O thread is a data connection whose page is a memfd, as the real worker's is. The real vLLM
replicas meeting through it are in tests/integration/test_vllm_shared_offload.py."""

from __future__ import annotations

import json
import mmap
import os
import stat
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.engine.backend import round_up
from kvtier.errors import ConfigError
from kvtier.replay.scrape import parse_snapshot
from kvtier.vllm import client
from kvtier.vllm.blockserver import BlockServer
from kvtier.vllm.client import ServerIndex
from kvtier.vllm.protocol import Conn, Refused, connect, sealed_page
from kvtier.vllm.settings import VllmOffloadSettings

BLOCK = 64 * 1024
GEOMETRY = {"block_bytes": BLOCK, "block_tokens": 16, "world_size": 1}


def key_of(k: bytes) -> str:
    return "m_" + k.hex()


class Page:
    """A worker I/O thread's side of a data connection: a memfd page the server maps, and put/get through it."""

    def __init__(self, path: str, engine: str, geometry: dict | None = None, name=key_of) -> None:  # type: ignore[no-untyped-def]
        self.name = name  # a block's key on the server
        self.size = round_up((geometry or GEOMETRY)["block_bytes"])
        self.fd = sealed_page("test-page", self.size)
        self.mm = mmap.mmap(self.fd, self.size)
        self.conn = connect(path, 10)
        self.conn.call({"op": "hello", "role": "data", "engine": engine, "rank": 0, **(geometry or GEOMETRY)},
                       [self.fd])  # fmt: skip

    def put(self, key: bytes, data: bytes) -> dict:
        self.mm[: len(data)] = data
        return self.conn.call({"op": "put", "key": self.name(key)})

    def get(self, key: bytes) -> bytes | None:
        self.mm[:BLOCK] = b"\0" * BLOCK
        r = self.conn.call({"op": "get", "key": self.name(key)})
        return bytes(self.mm[:BLOCK]) if r["hit"] else None

    def close(self) -> None:
        self.conn.close()
        self.mm.close()
        os.close(self.fd)


def payload(i: int) -> bytes:
    return bytes([i % 251]) * (BLOCK // 2) + os.urandom(BLOCK // 2)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BlockServer]:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    settings = VllmOffloadSettings(offload="nvme", staging_gb=2 * BLOCK / 2**30, nvme_dir=str(nvme),
                                   nvme_offload_gb=6 * BLOCK / 2**30, direct_io="off")  # fmt: skip
    s = BlockServer(settings, str(tmp_path / "cache.sock"))
    s.port = s.start()
    yield s
    s.close()


def replica(s: BlockServer, engine: str) -> ServerIndex[bytes]:
    return ServerIndex(s.path, key_of, {"engine": engine, **GEOMETRY})


def store(ix: ServerIndex[bytes], page: Page, keys: list[bytes]) -> dict[bytes, bytes]:
    """What a replica does to offload blocks: plan, each worker puts, the scheduler completes."""
    plan = ix.plan_store(keys)
    assert plan is not None
    data = {k: payload(i) for i, k in enumerate(plan.keys_to_store)}
    for k in plan.keys_to_store:
        assert page.put(k, data[k])["ok"]
    ix.complete_store(plan.keys_to_store)
    return data


def metrics(s: BlockServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{s.port}/metrics", timeout=10) as r:
        return parse_snapshot(r.read().decode()).flat


def test_a_block_replica_a_stored_is_a_hit_on_replica_b_with_its_bytes_after_demotion(server: BlockServer):
    a, b = replica(server, "A"), replica(server, "B")
    pa, pb = Page(server.path, "A"), Page(server.path, "B")
    keys = [bytes([i]) * 8 for i in range(4)]
    data = {**store(a, pa, keys[:2]), **store(a, pa, keys[2:])}
    # the staging tier holds 2: the first two were demoted to the files, in plan order, before their room was used
    # (a file entry is its header block and the block: 6 blocks' bytes hold 5)
    assert [(t.name, t.slots) for t in a.tiers] == [("cpu", 2), ("storage", 5)]
    assert a.counters.placed == {"cpu": 4} and a.counters.demoted == {"cpu": 2}
    for k in keys:
        assert b.lookup(k) == "hit"
    assert b.tier_of(keys[0]).source == "disk" and b.tier_of(keys[3]).source == "host"
    b.pin(keys)
    for k in keys:
        assert pb.get(k) == data[k]  # B reads A's bytes, from whichever tier holds them
    b.unpin(keys)
    m = metrics(server)
    assert m["kvtier_block_server_cross_replica_loads_total"] == 4
    assert m["kvtier_block_server_loaded_shards_total"] == 4 and m["kvtier_block_server_demoted_blocks_total"] == 2
    # A reading its own blocks is not cross-replica
    a.pin(keys[:1])
    assert pa.get(keys[0]) == data[keys[0]]
    assert metrics(server)["kvtier_block_server_cross_replica_loads_total"] == 4
    for p in (pa, pb):
        p.close()


def test_a_replica_that_dies_mid_store_leaves_no_block_pending_and_its_pins_end(server: BlockServer):
    a, b = replica(server, "A"), replica(server, "B")
    pa = Page(server.path, "A")
    k_pending, k_pinned = b"p" * 8, b"q" * 8
    store(b, pa, [k_pinned])
    assert a.plan_store([k_pending]) is not None
    assert b.lookup(k_pending) == "pending"
    a.pin([k_pinned])
    a.close()  # the engine went away
    deadline = time.monotonic() + 10
    while b.lookup(k_pending) != "miss" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.lookup(k_pending) == "miss"
    assert metrics(server)["kvtier_block_server_abandoned_blocks_total"] == 1
    # A's pin ended with it: the block is evictable again (7 slots; 9 new blocks push it out)
    store(b, pa, [bytes([i]) * 8 for i in range(9)])
    assert b.lookup(k_pinned) == "miss"
    pa.close()


def test_a_put_the_index_did_not_plan_is_refused_and_a_failed_put_drops_its_block(server: BlockServer):
    a = replica(server, "A")
    pa = Page(server.path, "A")
    with pytest.raises(Refused, match="not being stored"):
        pa.put(b"x" * 8, payload(1))
    k = b"y" * 8
    assert a.plan_store([k]) is not None
    server.store._tiers[0].backend.write = _broken  # the tier fails under the put  # type: ignore[union-attr,method-assign]
    with pytest.raises(Refused, match="store to cpu"):
        pa.put(k, payload(2))
    a.complete_store([k])  # vLLM says the job finished; the server knows one worker's put failed
    assert a.lookup(k) == "miss" and a.counters.failed_stores == 1
    pa.close()


def _broken(*args: object, **kwargs: object) -> object:
    from kvtier.errors import StorageError

    raise StorageError("the device went away")


def test_another_geometry_is_refused_with_both_named(server: BlockServer):
    replica(server, "A")
    other = {**GEOMETRY, "block_bytes": 2 * BLOCK}
    with pytest.raises(ConfigError, match=f"blocks of at most {BLOCK} bytes.*the engine has {2 * BLOCK} bytes"):
        ServerIndex(server.path, key_of, {"engine": "B", **other})
    with pytest.raises(Refused, match="the page is"):
        c = connect(server.path, 10)
        fd = os.memfd_create("small")
        os.ftruncate(fd, 4096)
        c.call({"op": "hello", "role": "data", "engine": "C", "rank": 0, **GEOMETRY}, [fd])
    assert metrics(server)["kvtier_block_server_refused_connections_total"] == 1  # reason="geometry"


def test_the_first_engine_no_longer_fixes_the_block_for_every_other(tmp_path: Path):
    """#58 item 11: the first hello fixed the block size for everyone, so an engine of a smaller model connecting first
    locked out the real one. A geometry is now checked per client against the server's slot: a smaller block is
    served beside a larger one (each reads back its own bytes), and ``--block-bytes`` sizes the slot before any
    engine connects, so the order of arrival no longer matters."""
    from kvtier.vllm import messages as m

    settings = VllmOffloadSettings(offload="cpu", cpu_offload_gb=8 * BLOCK / 2**30)
    s = BlockServer(settings, str(tmp_path / "c.sock"), slot=m.BlockGeometry(2 * BLOCK, 1, 1))
    s.start()
    try:
        sizes = {"S": BLOCK // 4, "B": 2 * BLOCK}
        geo = {e: {**GEOMETRY, "block_bytes": n} for e, n in sizes.items()}
        ix = {e: ServerIndex(s.path, key_of, {"engine": e, **geo[e]}) for e in sizes}
        pages = {e: Page(s.path, e, geo[e]) for e in sizes}
        data = {e: os.urandom(n) for e, n in sizes.items()}
        for e in sizes:  # the small engine stores first; the big one is served all the same
            plan = ix[e].plan_store([e.encode() * 8])
            assert plan is not None and plan.keys_to_store == [e.encode() * 8]
            pages[e].mm[: sizes[e]] = data[e]
            assert pages[e].conn.call({"op": "put", "key": key_of(e.encode() * 8)})["ok"]
            ix[e].complete_store(plan.keys_to_store)
        for e, n in sizes.items():
            pages[e].mm[:n] = bytes(n)
            r = pages[e].conn.call({"op": "get", "key": key_of(e.encode() * 8)})
            assert r["hit"] and r["n"] == n and bytes(pages[e].mm[:n]) == data[e]
        with pytest.raises(ConfigError, match="at most 131072 bytes per worker and world size 1.*--block-bytes"):
            ServerIndex(s.path, key_of, {"engine": "T", **GEOMETRY, "world_size": 2})
        for p in pages.values():
            p.close()
    finally:
        s.close()


def test_a_server_that_goes_away_is_a_miss_then_a_reconnect(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(client, "RECONNECT_S", 60.0)
    settings = VllmOffloadSettings(offload="cpu", cpu_offload_gb=8 * BLOCK / 2**30)
    path = str(tmp_path / "cache.sock")
    s = BlockServer(settings, path)
    s.start()
    a, b = replica(s, "A"), replica(s, "B")
    pa = Page(path, "A")
    store(a, pa, [b"k" * 8])
    assert a.lookup(b"k" * 8) == "hit"
    pa.close()
    s.close()
    assert a.lookup(b"k" * 8) == "miss" and a.plan_store([b"j" * 8]) is None  # degraded, not raised
    assert a.server_errors >= 1
    s2 = BlockServer(settings, path)  # a restarted server: empty
    s2.start()
    try:
        # B's connection was closed under it: B reconnects at its next call, at once, with a fresh hello
        assert b.plan_store([b"j" * 8]) is not None and b.server_errors == 0
        # A found no server a moment ago: it tries again only after RECONNECT_S
        assert a.plan_store([b"i" * 8]) is None
        monkeypatch.setattr(client, "RECONNECT_S", 0.0)
        assert a.plan_store([b"i" * 8]) is not None
    finally:
        s2.close()


def test_the_socket_is_this_users_only_and_health_names_it(server: BlockServer):
    mode = os.stat(server.path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health", timeout=10) as r:
        body = json.loads(r.read())
    assert body["socket"] == server.path and body["server"] == "kvtier cache-server"
    c = Conn(connect(server.path, 10).sock)
    assert c.call({"op": "hello", "role": "control", "engine": "A", **GEOMETRY})["tiers"]
    with pytest.raises(Refused, match="control: unknown op 'drop-everything'"):
        c.call({"op": "drop-everything"})
    with pytest.raises(Refused, match="keys"):
        c.call({"op": "lookup", "keys": "not a list"})
    # each operation is typed (vllm/messages.py): a field of the wrong type or one it does not have is refused,
    # named, before any handler runs
    with pytest.raises(Refused, match="complete.success: Input should be a valid boolean"):
        c.call({"op": "complete", "keys": ["k"], "success": "yes"})
    with pytest.raises(Refused, match="lookup.everything: Extra inputs are not permitted"):
        c.call({"op": "lookup", "keys": ["k"], "everything": True})


def test_a_reply_that_is_not_its_operations_is_the_servers_failure_never_a_number_for_the_engine(tmp_path: Path):
    """The client checks every answer against its operation's model: a server that answers a lookup with a negative
    tier index or a status word of its own is a failed call (counted), and the lookup a miss."""
    import socket
    import threading

    from kvtier.vllm.protocol import Conn as Framed

    path = str(tmp_path / "liar.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)

    def liar() -> None:
        s, _ = srv.accept()
        c = Framed(s)
        c.recv()
        c.send({"ok": True, "tiers": [["cpu", 8, "host"]]})
        c.recv()
        c.send({"ok": True, "found": [["mine", -3]]})
        try:
            c.recv()
        except ConnectionError:
            pass
        c.close()

    t = threading.Thread(target=liar, daemon=True)
    t.start()
    idx = ServerIndex(path, key_of, {"engine": "A", **GEOMETRY})
    try:
        assert idx.lookup(b"k" * 8) == "miss" and idx.server_errors == 1
    finally:
        idx.close()
        srv.close()


def test_settings_with_a_cache_server_refuse_tier_sizes_of_their_own():
    assert VllmOffloadSettings.from_extra({"cache_server": "/tmp/x.sock", "io_threads": 2}).cache_server
    with pytest.raises(ConfigError, match="cpu_offload_gb: set on the cache server"):
        VllmOffloadSettings.from_extra({"cache_server": "/tmp/x.sock", "cpu_offload_gb": 4})


def test_a_closed_data_connection_leaves_no_descriptor_open(server: BlockServer):
    """The server maps each worker page and keeps no descriptor of it once the connection ends (one leaked per
    connection before: a replica restarting its workers would have piled them up)."""
    replica(server, "A")  # the geometry is fixed; the tiers are open
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        Page(server.path, "A").close()
    deadline = time.monotonic() + 10
    while len(os.listdir("/proc/self/fd")) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= before


def test_a_page_its_sender_could_shrink_is_refused_and_a_sealed_one_cannot_shrink(server: BlockServer):
    """A page the client could shrink after its hello would be a SIGBUS in the shared server (every replica's tiers
    gone): the server takes only a memfd sealed against shrinking and growing."""
    replica(server, "A")
    fd = os.memfd_create("unsealed")
    os.ftruncate(fd, round_up(BLOCK))
    with pytest.raises(Refused, match="sealed against shrinking"):
        connect(server.path, 10).call({"op": "hello", "role": "data", "engine": "C", "rank": 0, **GEOMETRY}, [fd])
    os.close(fd)
    sealed = sealed_page("sealed", round_up(BLOCK))
    with pytest.raises(PermissionError):
        os.ftruncate(sealed, 4096)
    os.close(sealed)


def test_a_client_refuses_a_server_of_another_user(tmp_path: Path):
    """The cache server checks its client's uid; the client checks the server's, before its first byte: a stranger's
    server at the socket path would read the engine's pages and write its KV cache."""
    import subprocess
    import sys

    if os.getuid() != 0:
        pytest.skip("starting a server as another user needs root")
    path = tmp_path / "stranger.sock"  # in this user's 0700 folder: the socket is bound here, then the uid dropped
    code = (
        "import os, socket, time; s = socket.socket(socket.AF_UNIX); "
        f"s.bind({str(path)!r}); os.setgid(65534); os.setuid(65534); s.listen(4); print('up', flush=True); "
        "time.sleep(30)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "up\n"
        with pytest.raises(Refused, match="runs as uid 65534, not this user's"):
            connect(str(path), 10)
        with pytest.raises(ConfigError, match="not ours"):
            ServerIndex(str(path), key_of, {"engine": "A", **GEOMETRY})
    finally:
        p.kill()
        p.wait()


def test_a_socket_reached_through_a_link_is_checked_where_the_link_sits(tmp_path: Path):
    """/var/run -> /run is fine (the link sits in a folder only root changes); a link in a folder others can write
    could be pointed at a stranger's folder, and is refused."""
    import socket

    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "link").symlink_to(real)
    shared.chmod(0o777)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(real / "cache.sock"))
        s.listen(2)
        connect(str(tmp_path / "link" / "cache.sock"), 10).close()
        with pytest.raises(Refused, match=f"{shared / 'link'} is a link in a folder another user could change"):
            connect(str(shared / "link" / "cache.sock"), 10)


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770])
def test_a_client_refuses_a_socket_in_a_folder_others_can_write(tmp_path: Path, mode: int):
    """Whoever can write the socket's folder can put their own server at the path (or rename ours away): the client
    refuses such a path before it connects, sticky or not, naming the folder, even with our own server there."""
    import socket

    folder = tmp_path / "shared"
    folder.mkdir()
    path = folder / "cache.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen(1)
        connect(str(path), 10).close()  # the run's own 0700 folder: fine
        folder.chmod(mode)
        who = "its group" if mode == 0o770 else "others"
        with pytest.raises(Refused, match=f"another user could put their own server.*{folder} is writable by {who}"):
            connect(str(path), 10)
        folder.chmod(0o700)


def test_a_client_refuses_a_socket_in_a_folder_of_another_user(tmp_path: Path):
    import socket

    if os.getuid() != 0:
        pytest.skip("a folder of another user needs root to make")
    folder = tmp_path / "theirs"
    folder.mkdir(mode=0o755)
    path = folder / "cache.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))
        s.listen(1)
        os.chown(folder, 65534, 65534)
        with pytest.raises(Refused, match=f"{folder} belongs to uid 65534"):
            connect(str(path), 10)


def test_unpinning_a_key_twice_releases_only_this_connections_pins(server: BlockServer):
    a, b = replica(server, "A"), replica(server, "B")
    pa = Page(server.path, "A")
    store(a, pa, [b"k" * 8])
    a.pin([b"k" * 8])
    b.pin([b"k" * 8])
    b.unpin([b"k" * 8, b"k" * 8])  # B names it twice: only B's one pin goes
    assert server.index is not None and server.index._pins.get(key_of(b"k" * 8)) == 1
    pa.close()


def test_a_reply_that_does_not_hold_together_is_the_servers_failure(tmp_path: Path):
    """A plan whose stored and placed lists differ, an evicted key that is not hex, a frame nested past the parser:
    each is a failed call (counted), never an exception in the engine's scheduler."""
    import socket
    import threading

    from kvtier.vllm.protocol import Conn as Framed

    path = str(tmp_path / "odd.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    answers = [b'{"ok": true, "store": ["a", "b"], "placed": [0]}', b'{"ok": true, "store": [], "placed": [],'
               b' "evicted": ["zz"]}', b"[" * 100_000]  # fmt: skip

    def odd() -> None:
        s, _ = srv.accept()
        c = Framed(s)
        c.recv()
        c.send({"ok": True, "tiers": [["cpu", 8, "host"]]})
        for raw in answers:
            try:
                c.recv()
            except ConnectionError:
                return
            s.sendall(len(raw).to_bytes(4, "big") + raw)
        s.close()

    threading.Thread(target=odd, daemon=True).start()
    idx = ServerIndex(path, key_of, {"engine": "A", **GEOMETRY})
    try:
        assert idx.plan_store([b"a" * 8, b"b" * 8]) is None and idx.server_errors == 1
        assert idx.plan_store([b"c" * 8]) is None and idx.server_errors == 2
        assert idx.plan_store([b"d" * 8]) is None and idx.server_errors == 3
    finally:
        idx.close()
        srv.close()


def test_a_first_hello_no_tier_can_hold_is_refused_before_any_tier_opens(tmp_path: Path):
    """A same-user client's hellos of a block no tier holds once opened (and leaked) the tiers each time: five such
    hellos took 5 GiB of a CXL tier on /dev/shm. The index is sized first, and nothing opens when it refuses."""
    s = BlockServer(VllmOffloadSettings(offload="cpu", cpu_offload_gb=8 * BLOCK / 2**30), str(tmp_path / "c.sock"))
    s.start()
    try:
        for _ in range(3):
            with pytest.raises(Refused):
                connect(s.path, 10).call({"op": "hello", "role": "probe", "engine": "X", **GEOMETRY,
                                          "block_bytes": 1 << 32})  # fmt: skip
        assert s.store is None and s.geometry is None
        replica(s, "A")  # a geometry the tiers hold is still welcome
        assert s.store is not None
    finally:
        s.close()


def test_flush_drops_one_weights_generation_and_leaves_the_other_and_blocks_in_flight(server: BlockServer, capsys):  # type: ignore[no-untyped-def]
    """#55 item 6: two generations of one model share a server; keys carry the revision (hashed, and shown), so v2
    never reads v1's blocks, and kvtier cache-server flush --revision v1 drops v1's idle blocks only (a pinned one
    is left, counted busy); without --revision every generation of the model goes."""
    from kvtier.cli.main import main
    from kvtier.keys import KeyScope

    gens = {r: KeyScope(model_name="org/Model-7B", model_revision=r).key for r in ("v1", "v2")}
    ix = {r: ServerIndex(server.path, name, {"engine": r, **GEOMETRY}) for r, name in gens.items()}
    pages = {r: Page(server.path, r, name=name) for r, name in gens.items()}
    keys = [bytes([i]) * 8 for i in range(2)]
    for r in gens:
        store(ix[r], pages[r], keys)  # the same prompt blocks, computed by each generation
    assert all(ix[r].lookup(k) == "hit" for r in gens for k in keys)
    assert len(server.index) == 4  # type: ignore[arg-type]  # one key per generation: v2 never meets v1's KV
    ix["v1"].pin(keys[:1])
    flush = ["cache-server", "flush", "--cache-server", server.path, "--model", "org/Model-7B"]
    assert main([*flush, "--revision", "v1"]) == 0
    assert "flushed 1 blocks of 'org/Model-7B' revision 'v1'" in capsys.readouterr().out
    assert server.index is not None and len(server.index) == 3  # v1's pinned block is left (busy), v2's both kept
    assert [ix["v2"].lookup(k) for k in keys] == ["hit", "hit"] and ix["v1"].lookup(keys[1]) == "miss"
    ix["v1"].unpin(keys[:1])
    assert main(flush) == 0
    assert "flushed 3 blocks" in capsys.readouterr().out and len(server.index) == 0
    for p in pages.values():
        p.close()


def test_a_killed_servers_nvme_folder_is_removed_by_the_next_server_and_a_live_ones_is_not(tmp_path: Path):
    """Before: every killed server left its run folder (and its blocks' files) in nvme_dir for good. Now the next
    server removes what a killed one left before its tier sizes itself; a live server's folder (its lock held)
    and a folder without kvtier's marker are never touched."""
    import signal
    import subprocess
    import sys

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    (nvme / "kvtier-run-not-ours").mkdir()  # no marker: never touched
    code = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from kvtier.engine.runs import create_marker, make_run_dir\n"
        "base_fd, run_fd = make_run_dir(Path(sys.argv[1]), 'kvtier-run-%d-killed' % os.getpid())\n"
        "lock = create_marker(run_fd)\n"
        "fd = os.open('entry.kv', os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=run_fd)\n"
        "os.write(fd, b'x' * 65536)\n"
        "print('up', flush=True)\n"
        "time.sleep(60)\n"
    )
    killed = subprocess.Popen([sys.executable, "-c", code, str(nvme)], stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None and killed.stdout.readline() == "up\n"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    settings = VllmOffloadSettings(offload="nvme", staging_gb=2 * BLOCK / 2**30, nvme_dir=str(nvme),
                                   nvme_offload_gb=6 * BLOCK / 2**30, direct_io="off")  # fmt: skip
    live = BlockServer(settings, str(tmp_path / "live.sock"))
    live.start()
    try:
        replica(live, "A").close()  # the first hello opens its tiers: its own run folder, locked
        held = {p.name for p in nvme.iterdir()}
        assert f"kvtier-run-{killed.pid}-killed" not in held  # removed, its entry file with it
        assert "kvtier-run-not-ours" in held and len(held) == 2
        s2 = BlockServer(settings, str(tmp_path / "next.sock"))
        s2.start()
        try:
            replica(s2, "B").close()
            assert held < {p.name for p in nvme.iterdir()}  # the live server's folder is still there
        finally:
            s2.close()
    finally:
        live.close()


def test_a_connection_stays_within_its_models_keys(server: BlockServer):
    """#58 item 11: one engine could read, forget or reset another model's blocks on a shared server. A hello now
    names its scope (its model's key prefix, as kvtier's clients send it): a request naming a key outside it is
    refused, counted, and a reset drops only its own model's blocks."""
    from kvtier.keys import KeyScope, key_prefix

    models = {n: KeyScope(model_name=n).key for n in ("org/Model-A", "org/Model-B")}
    ix = {n: ServerIndex(server.path, name, {"engine": n, "scope": key_prefix(n), **GEOMETRY})
          for n, name in models.items()}  # fmt: skip
    pages = {n: Page(server.path, n, {**GEOMETRY, "scope": key_prefix(n)}, name=name) for n, name in models.items()}
    keys = [bytes([i]) * 8 for i in range(2)]
    data = {n: store(ix[n], pages[n], keys) for n in models}
    a_key = models["org/Model-A"](keys[0])
    b = connect(server.path, 10)
    b.call({"op": "hello", "role": "control", "engine": "B", "scope": key_prefix("org/Model-B"), **GEOMETRY})
    for op in ("lookup", "forget", "pin"):
        with pytest.raises(Refused, match=f"{op}: key 'kvt1_org-model-a_.*outside this connection's scope 'kvt1_org"):
            b.call({"op": op, "keys": [a_key]})
    assert metrics(server)["kvtier_block_server_requests_refused_total"] == 3  # reason="scope"
    b_page = Page(server.path, "B", {**GEOMETRY, "scope": key_prefix("org/Model-B")}, name=models["org/Model-A"])
    with pytest.raises(Refused, match="get: key .* is outside"):  # its worker asking for A's block by A's key
        b_page.conn.call({"op": "get", "key": a_key})
    assert b.call({"op": "reset"})["ok"]  # B's engine resets its prefix cache: B's blocks go, A's stay
    assert [ix["org/Model-B"].lookup(k) for k in keys] == ["miss", "miss"]
    assert [ix["org/Model-A"].lookup(k) for k in keys] == ["hit", "hit"]
    assert pages["org/Model-A"].get(keys[0]) == data["org/Model-A"][keys[0]]
    for p in [*pages.values(), b_page]:
        p.close()
    b.close()
