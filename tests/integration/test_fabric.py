"""The shared store across a real network (benchmarks/_fabric.py): network namespaces as hosts, veth links shaped
by the kernel's token bucket, a relay that adds round-trip time, and kvtier's one cache server over TCP with its
shared token between two real vLLM replicas (the CPU build) on two other hosts.

Needs root (namespaces, tc): skipped with the reason elsewhere; the engine tests also skip where vLLM is not
installed. Every namespace and link is the test's own, named for its process, and gone afterwards.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _fabric import Fabric, World, measure_rate, sh, start_world, stop_world, why_not

WHY = why_not()
pytestmark = [pytest.mark.skipif(WHY is not None, reason=WHY or ""), pytest.mark.serial]


PING = """
import socket, time
for _ in range(100):
    try:
        c = socket.create_connection(("127.0.0.1", 48001))
        break
    except OSError:
        time.sleep(0.1)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
ts = []
for _ in range(7):
    t = time.perf_counter()
    c.sendall(b"x")
    c.recv(1)
    ts.append(time.perf_counter() - t)
print(sorted(ts)[3] * 1e3)
"""


def namespaces(prefix: int | str) -> list[str]:
    """The namespaces of a pid, or of one testbed (``kvf-<pid>-<tag>-``: another, the engine tests' module-scoped
    one, may be up at the same time in this process)."""
    start = f"kvf-{prefix}-" if isinstance(prefix, int) else prefix
    return [n.split()[0] for n in sh("ip", "netns", "list").splitlines() if n.startswith(start)]


def mine(f: Fabric) -> str:
    return f"kvf-{f.pid}-{f.tag}-"


def test_links_run_at_the_shaped_rate_the_relay_adds_its_round_trip_and_nothing_is_left(tmp_path: Path):
    with Fabric(["s", "b"]) as f:
        ln = f.link("b", "s", rate_mbit=40)
        rate = measure_rate(f, "b", "s", ln.addr("s"), 4 << 20)
        assert 0.8 * 40 < rate < 1.05 * 40, rate  # what TCP gets through the token bucket
        f.shape(ln, 200)
        assert measure_rate(f, "b", "s", ln.addr("s"), 16 << 20) > 2 * 40
        code = ("import socket;s=socket.create_server(('0.0.0.0',48000));c,_=s.accept()\n"
                "while d:=c.recv(64): c.sendall(d)")  # fmt: skip
        echo = subprocess.Popen(f.argv("s", [sys.executable, "-c", code]))
        delay = tmp_path / "rtt"
        delay.write_text("30\n")
        relay = subprocess.Popen(f.argv("b", [sys.executable, str(Path(__file__).resolve().parents[2] / "benchmarks"
                                                                   / "_fabric.py"), "relay", "--listen",
                                              "127.0.0.1:48001", "--to", f"{ln.addr('s')}:48000", "--delay-file",
                                              str(delay)]))  # fmt: skip
        ping = PING
        try:
            rtt = float(f.run("b", sys.executable, "-c", ping))
        finally:
            relay.kill()
            echo.kill()
        assert 30 <= rtt < 60, rtt  # the relay's 30 ms and the links' own (tens of microseconds), never less
        assert len(namespaces(mine(f))) == 2
    assert namespaces(mine(f)) == []


SINK = """
import socket
s = socket.create_server(("0.0.0.0", 47001))
print("ready", flush=True)
c, _ = s.accept()
n = 0
while d := c.recv(1 << 20):
    n += len(d)
print(n, flush=True)
"""
FLOOD = """
import socket, sys
c = socket.create_connection((sys.argv[1], 47001))
chunk = bytes(1 << 20)
for i in range(32):
    c.sendall(chunk)
    if i == 8:
        print("flowing", flush=True)
c.close()
"""


def test_a_rate_lowered_while_a_bulk_flow_fills_the_queue_keeps_the_link_moving():
    """The kernel's token bucket cannot send a queued packet longer than its bucket: lowered from 200 to 100 Mbit/s
    with 64 KiB GSO packets queued (about 68 KB each as the queue counts them), a bucket of 64 KiB stopped the link
    for good. Every byte arrives after the change."""
    with Fabric(["s", "b"]) as f:
        ln = f.link("b", "s", rate_mbit=200)
        sink = subprocess.Popen(f.argv("s", [sys.executable, "-c", SINK]), stdout=subprocess.PIPE, text=True)
        flood: subprocess.Popen[str] | None = None
        try:
            assert sink.stdout is not None
            assert sink.stdout.readline().strip() == "ready"  # listening: the flood may connect
            flood = subprocess.Popen(f.argv("b", [sys.executable, "-c", FLOOD, ln.addr("s")]),
                                     stdout=subprocess.PIPE, text=True)  # fmt: skip
            assert flood.stdout is not None
            assert flood.stdout.readline().strip() == "flowing"
            f.shape(ln, 100)
            got, _ = sink.communicate(timeout=120)  # 24 MiB left: 2 s at 100 Mbit/s; a stalled link never ends
        finally:
            if flood is not None:
                flood.kill()
            sink.kill()
        assert int(got) == 32 << 20


def test_a_dead_runs_namespaces_are_removed_by_the_next_run_and_a_live_runs_are_not():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    live = Fabric(["y"]).__enter__()
    sh("ip", "netns", "add", f"kvf-{pid}-x")  # as a run killed before its teardown leaves it
    try:
        assert pid in Fabric.remove_leftovers()
        assert namespaces(pid) == [] and len(namespaces(mine(live))) == 1
    finally:
        live.close()


def test_an_old_runs_namespace_under_this_pid_does_not_stop_a_new_testbed():
    """The system reuses pids: a killed run's namespace may carry this process's pid. A testbed's names carry a
    tag of their own, so it starts beside it (and leaves it to the run that finds its owner gone)."""
    import os

    stale = f"kvf-{os.getpid()}-s"  # the names an older layout, or a dead run of this pid, would have used
    sh("ip", "netns", "add", stale)
    try:
        with Fabric(["s", "b"]) as f:
            f.link("b", "s")
            f.management("b")
            assert len(namespaces(mine(f))) == 2 and f"kvf{f.pid}m1r" in sh("ip", "-o", "link", "show")
        assert namespaces(mine(f)) == [] and stale in namespaces(os.getpid())
        assert f"kvf{f.pid}m1r" not in sh("ip", "-o", "link", "show")
    finally:
        sh("ip", "netns", "del", stale)


def test_the_cache_server_refuses_tcp_without_a_token_and_binds_only_inside_its_host(tmp_path: Path):
    r = subprocess.run([sys.executable, "-m", "kvtier", "cache-server", "--listen", "0.0.0.0:7070"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and "needs --token-file" in r.stderr
    token = tmp_path / "token"
    token.write_text("x" * 32)
    token.chmod(0o600)
    with Fabric(["s"]) as f:
        srv = subprocess.Popen(f.argv("s", [sys.executable, "-m", "kvtier", "cache-server", "--offload", "cpu",
                                             "--cpu-offload-gb", "0.01", "--listen", "0.0.0.0:7070", "--token-file",
                                             str(token), "--port", "9100"]), stderr=subprocess.PIPE)  # fmt: skip
        try:
            deadline = time.monotonic() + 60
            while ":7070" not in (listening := f.run("s", "ss", "-ltnp")) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert ":7070" in listening and "127.0.0.1:9100" in listening, listening
            assert ":7070" not in sh("ss", "-ltnp")  # the root namespace (this machine's network) has no such port
        finally:
            srv.terminate()
            srv.wait(30)


# -- two real vLLM replicas on two hosts, the store on a third -------------------------------------------------
def _engine_problem() -> str | None:
    from tests.integration.test_real_vllm import PROBLEM

    return PROBLEM


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    problem = _engine_problem()
    if problem is not None:
        pytest.skip(problem)
    from kvtier.modelmaker import Geometry, make_model
    from tests.integration.test_real_vllm import ENGINE_PYTHON, STARTUP_S

    d = tmp_path_factory.mktemp("fabric")
    model = make_model(d / "tiny", Geometry())
    with Fabric(["s", "a", "b"]) as fab:
        w = start_world(fab, d, str(ENGINE_PYTHON), str(model), 16384, 8192, 0.25, STARTUP_S)
        try:
            yield w
        finally:
            stop_world(w)


@pytest.mark.slow
@pytest.mark.engine
def test_a_prefix_replica_a_computed_crosses_a_shaped_link_to_replica_b_with_the_same_answer(world: World):
    from tests.integration.test_vllm_shared_offload import ask
    from tests.integration.test_vllm_shared_offload import metrics as scrape

    rnd = random.Random(3)
    words = [f"w{rnd.randrange(100000)}" for _ in range(900)]
    usage, answer = ask(world.urls["a"], words, "fabric-a")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    blocks = usage["prompt_tokens"] // 128
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        srv = scrape(world.urls["s"])
        if (srv.get("kvtier_block_server_stored_blocks_total") or 0) >= blocks and not srv.get(
            "kvtier_block_server_pending_blocks"
        ):
            break
        time.sleep(0.2)
    world.shape(50)
    world.set_rtt(10)
    try:
        before = scrape(world.urls["s"])
        usage_b, answer_b = ask(world.urls["b"], words, "fabric-b")
        after = scrape(world.urls["s"])
    finally:
        world.shape(None)
        world.set_rtt(0)
    cached = usage_b["prompt_tokens_details"]["cached_tokens"]
    assert cached == blocks * 128 and answer_b == answer  # B never computed the prefix: A's KV, over the link
    loads = after.get("kvtier_block_server_cross_replica_loads_total") - (
        before.get("kvtier_block_server_cross_replica_loads_total") or 0
    )
    assert loads == blocks
    # B's own record of the request: its prompt from the shared server's CPU tier
    from kvtier.results.engine_log import EngineLogTail

    log = EngineLogTail([str(world.work / "b.requests.jsonl")])
    deadline = time.monotonic() + 30
    while "fabric-b" not in log.by_id and time.monotonic() < deadline:
        time.sleep(0.1)
        log.poll()
    assert log.by_id["fabric-b"].tier_tokens == {"shared-cpu": cached}
