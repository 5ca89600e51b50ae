"""A small real network on this machine, for a store on another "host": network namespaces joined by veth pairs,
each link shaped by the kernel (``tc`` token bucket, ``tbf``), and added round-trip time from a relay process
kvtier runs (this kernel has no ``netem``; the code under test never sleeps). Used by benchmarks/fabric.py and
tests/integration/test_fabric.py. Needs root (``ip netns``); ``why_not()`` says why it cannot run.

* **Names**: every namespace is ``kvf-<pid>-<tag>-<host>``, ``<pid>`` the process that built it and ``<tag>`` a
  random one per testbed (a pid the system reuses never meets an old run's names); the veth ends are named
  inside their namespaces, and the root namespace's ends of the management links ``kvf<pid>m…``, deleted
  first if a dead run with that pid left one. ``Fabric.remove_leftovers()`` deletes the namespaces of processes
  that are gone (a run killed before its teardown), never another live run's.
* **Addresses**: link i joins its two ends in 10.231.i.0/24 (.1 and .2). A host can also get a management link to
  the root namespace (10.232.j.0/24: root .1, host .2), unshaped, for the driver's HTTP; nothing is routed
  between links, and no address outside these namespaces is used.
* **Teardown** (``close``, also run at exit and on SIGTERM/SIGINT by the caller's ``with``): every process still
  in a namespace is killed, then the namespaces are deleted (their veth ends go with them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PREFIX = "kvf"
FABRIC_NET = "10.231"
MGMT_NET = "10.232"


def why_not() -> str | None:
    """Why this machine cannot build the testbed (None: it can)."""
    if os.geteuid() != 0:
        return "the fabric testbed needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the fabric testbed needs {tool} (iproute2)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
    except RuntimeError as e:
        return f"cannot create a network namespace here: {e}"
    sh("ip", "netns", "del", probe, check=False)
    return None


def sh(*argv: str, check: bool = True) -> str:
    """A short ``ip``/``tc``/``ss`` command's output, through kvtier's one runner (kvtier/child.py)."""
    from kvtier.child import run

    r = run(argv, 60)
    if check and (r is None or r.returncode != 0):
        raise RuntimeError(f"{' '.join(argv)}: {'did not run' if r is None else r.stderr.strip() or r.returncode}")
    return "" if r is None else r.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass
class Link:
    """A veth pair between two hosts: ``a``'s end and ``b``'s, each with its address; shaped per direction."""

    index: int
    a: str
    b: str
    dev_a: str
    dev_b: str
    rate_mbit: float | None = None

    def addr(self, host: str) -> str:
        return f"{FABRIC_NET}.{self.index}.{1 if host == self.a else 2}"


@dataclass
class Fabric:
    hosts: list[str]
    pid: int = field(default_factory=os.getpid)
    links: list[Link] = field(default_factory=list)
    mgmt: dict[str, str] = field(default_factory=dict)  # host -> its management address
    _closed: bool = False

    tag: str = field(default_factory=lambda: os.urandom(3).hex())

    def ns(self, host: str) -> str:
        return f"{PREFIX}-{self.pid}-{self.tag}-{host}"

    def __post_init__(self) -> None:
        for h in self.hosts:
            if not re.fullmatch(r"[a-z0-9]{1,8}", h):
                raise ValueError(f"host name {h!r}: 1 to 8 lowercase letters or digits")

    # -- build ---------------------------------------------------------------------------------
    def __enter__(self) -> Fabric:
        self.remove_leftovers()
        try:
            for h in self.hosts:
                sh("ip", "netns", "add", self.ns(h))
                self.run(h, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, host: str, *argv: str, check: bool = True) -> str:
        return sh("ip", "netns", "exec", self.ns(host), *argv, check=check)

    def link(self, a: str, b: str, rate_mbit: float | None = None) -> Link:
        i = len(self.links) + 1
        ln = Link(i, a, b, f"{PREFIX}{self.pid}l{i}a", f"{PREFIX}{self.pid}l{i}b")
        sh("ip", "link", "add", ln.dev_a, "netns", self.ns(a), "type", "veth", "peer", "name", ln.dev_b,
           "netns", self.ns(b))  # fmt: skip
        for host, dev in ((a, ln.dev_a), (b, ln.dev_b)):
            self.run(host, "ip", "addr", "add", f"{ln.addr(host)}/24", "dev", dev)
            self.run(host, "ip", "link", "set", dev, "up")
        self.links.append(ln)
        if rate_mbit is not None:
            self.shape(ln, rate_mbit)
        return ln

    def management(self, host: str) -> str:
        """An unshaped link from the root namespace to ``host``; returns the host's address on it."""
        j = len(self.mgmt) + 1
        root_dev, ns_dev = f"{PREFIX}{self.pid}m{j}r", f"{PREFIX}{self.pid}m{j}n"
        sh("ip", "link", "del", root_dev, check=False)  # a dead run's of the same pid (its namespace is gone)
        sh("ip", "link", "add", root_dev, "type", "veth", "peer", "name", ns_dev, "netns", self.ns(host))
        sh("ip", "addr", "add", f"{MGMT_NET}.{j}.1/24", "dev", root_dev)
        sh("ip", "link", "set", root_dev, "up")
        self.run(host, "ip", "addr", "add", f"{MGMT_NET}.{j}.2/24", "dev", ns_dev)
        self.run(host, "ip", "link", "set", ns_dev, "up")
        self.mgmt[host] = f"{MGMT_NET}.{j}.2"
        return self.mgmt[host]

    def shape(self, ln: Link, rate_mbit: float) -> None:
        """Both directions of ``ln`` at ``rate_mbit`` (a token bucket on each end's egress), at once or while traffic
        flows. The bucket holds 4 ms of the rate, and never less than the largest packet the device queues
        (``bucket_floor``). The queue holds 32 MiB: more than a fetch of the largest context puts in flight, so the
        link queues rather than drops (a lossless fabric's behaviour; a drop at the tail of a pipelined run would
        cost TCP a 200 ms retransmission timeout, which would be the testbed's, not the store's)."""
        rate_bytes = rate_mbit * 1e6 / 8
        limit = 32 << 20
        for host, dev in ((ln.a, ln.dev_a), (ln.b, ln.dev_b)):
            burst = max(self.bucket_floor(host, dev), int(rate_bytes * 0.004))
            self.run(host, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                     "burst", str(burst), "limit", str(limit))  # fmt: skip
        ln.rate_mbit = rate_mbit

    def bucket_floor(self, host: str, dev: str) -> int:
        """The least bucket, in bytes, that sends every packet ``dev`` can queue: 5/4 of its largest GSO packet
        (``gso_max_size``, 64 KiB on a veth), for the queue counts a GSO packet's length with the headers of each of
        its segments (about 68 KB for 64 KiB). A packet longer than the bucket is cut into segments when it
        arrives, but one queued before the rate was lowered is not: it can never be sent, and the link stops for
        good behind it (the kernel's tbf; seen as a 200 to 100 Mbit/s change stalling a replica's stores)."""
        out = self.run(host, "ip", "-d", "-j", "link", "show", "dev", dev)
        gso = json.loads(out)[0].get("gso_max_size", 65536)
        return max(64 * 1024, int(gso) * 5 // 4)

    def unshape(self, ln: Link) -> None:
        for host, dev in ((ln.a, ln.dev_a), (ln.b, ln.dev_b)):
            self.run(host, "tc", "qdisc", "del", "dev", dev, "root", check=False)
        ln.rate_mbit = None

    def argv(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host`` (``ip netns exec`` execs it: the pid is the program's)."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    # -- teardown ------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._remove(self.pid, self.tag)

    @staticmethod
    def _remove(pid: int, tag: str = "") -> None:
        """The namespaces of ``pid`` (of its testbed ``tag`` alone, when given), the processes in them first, and
        then any root-side link of ``pid`` left behind."""
        names = [n.split()[0] for n in sh("ip", "netns", "list", check=False).splitlines() if n.strip()]
        mine = [n for n in names if n.startswith(f"{PREFIX}-{pid}-{tag}")]
        for n in mine:  # a process left in a namespace keeps it (and its links) alive: kill it first
            for p in sh("ip", "netns", "pids", n, check=False).split():
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for n in mine:
            sh("ip", "netns", "del", n, check=False)
        for line in sh("ip", "-o", "link", "show", check=False).splitlines():
            m = re.match(rf"\d+: ({PREFIX}{pid}m\d+r)[@:]", line)
            if m:
                sh("ip", "link", "del", m.group(1), check=False)

    @classmethod
    def remove_leftovers(cls) -> list[int]:
        """Remove the namespaces and links of runs whose process is gone; returns their pids."""
        pids: set[int] = set()
        for n in sh("ip", "netns", "list", check=False).splitlines():
            m = re.match(rf"{PREFIX}-(\d+)-", n.strip())
            if m:
                pids.add(int(m.group(1)))
        for line in sh("ip", "-o", "link", "show", check=False).splitlines():
            m = re.match(rf"\d+: {PREFIX}(\d+)m\d+r", line)
            if m:
                pids.add(int(m.group(1)))
        gone = sorted(p for p in pids if not _alive(p))
        for p in gone:
            cls._remove(p)
        return gone


# -- the delay relay ------------------------------------------------------------------------------
class DelayRelay:
    """A TCP relay that holds every chunk it forwards for ``one_way_s`` in each direction: ``2 × one_way_s`` of
    added round trip, without capping throughput (the chunks queue, each released at its own time). Runs in the
    process that starts it; ``benchmarks/_fabric.py relay`` runs one as a process inside a namespace. The delay can
    be changed while it runs (``delay_file``: a number of ms of round trip, read every 0.2 s). Reports what it
    added: on SIGTERM it prints the median time its chunks were held, one way, to its log."""

    def __init__(self, listen: tuple[str, int], to: tuple[str, int], rtt_ms: float, delay_file: str | None = None):
        self.listen, self.to = listen, to
        self.one_way_s = rtt_ms / 2000.0
        self.delay_file = delay_file
        self.lst = socket.create_server(listen, reuse_port=False)
        self.held: deque[float] = deque(maxlen=10000)
        self.stop = threading.Event()

    def serve(self) -> None:
        if self.delay_file:
            threading.Thread(target=self._watch, daemon=True).start()
        while not self.stop.is_set():
            try:
                c, _ = self.lst.accept()
            except OSError:
                return
            try:
                u = socket.create_connection(self.to, timeout=10)
            except OSError:
                c.close()
                continue
            u.settimeout(None)
            for s in (c, u):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for src, dst in ((c, u), (u, c)):
                q: deque[tuple[float, bytes]] = deque()
                cv = threading.Condition()
                threading.Thread(target=self._read, args=(src, q, cv), daemon=True).start()
                threading.Thread(target=self._write, args=(dst, q, cv), daemon=True).start()

    def _watch(self) -> None:
        assert self.delay_file is not None
        while not self.stop.is_set():
            try:
                self.one_way_s = float(Path(self.delay_file).read_text().strip()) / 2000.0
            except (OSError, ValueError):
                pass
            time.sleep(0.2)

    def _read(self, src: socket.socket, q: deque[tuple[float, bytes]], cv: threading.Condition) -> None:
        while True:
            try:
                data = src.recv(1 << 20)
            except OSError:
                data = b""
            with cv:
                q.append((time.monotonic() + self.one_way_s, data))
                cv.notify()
            if not data:
                return

    def _write(self, dst: socket.socket, q: deque[tuple[float, bytes]], cv: threading.Condition) -> None:
        while True:
            with cv:
                while not q:
                    cv.wait()
                due, data = q.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            self.held.append(max(0.0, time.monotonic() - due + self.one_way_s))
            try:
                dst.sendall(data)
            except OSError:
                return


def relay_main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="_fabric.py relay", description="a TCP relay that adds round-trip time")
    ap.add_argument("--listen", required=True, help="HOST:PORT")
    ap.add_argument("--to", required=True, help="HOST:PORT")
    ap.add_argument("--rtt-ms", type=float, default=0.0)
    ap.add_argument("--delay-file", help="a file holding the round trip to add, ms (changed while running)")
    a = ap.parse_args(argv)

    def hp(s: str) -> tuple[str, int]:
        h, _, p = s.rpartition(":")
        return h, int(p)

    r = DelayRelay(hp(a.listen), hp(a.to), a.rtt_ms, a.delay_file)

    def report(*_: object) -> None:
        held = sorted(r.held)
        if held:
            print(f"relay: {len(held)} chunks forwarded, each held {held[len(held) // 2] * 1e3:.2f} ms one way at the "
                  "median", flush=True)  # fmt: skip
        else:
            print("relay: nothing forwarded", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, report)
    print(f"relay {a.listen} -> {a.to}, +{a.rtt_ms} ms round trip", flush=True)
    r.serve()
    return 0


def measure_rate(fab: Fabric, sender: str, receiver: str, addr: str, nbytes: int = 8 << 20) -> float:
    """Mbit/s that one TCP stream moves from ``sender`` to ``receiver`` (listening on ``addr``) over the testbed:
    the shaper's rate as TCP sees it."""
    code_rx = (
        "import socket,sys;s=socket.create_server((sys.argv[1],47000));print('ready',flush=True);c,_=s.accept();n=0\n"
        "while True:\n d=c.recv(1<<20)\n if not d: break\n n+=len(d)\nc.sendall(b'x');print(n)"
    )
    code_tx = (
        "import socket,sys,time;n=int(sys.argv[2]);c=socket.create_connection((sys.argv[1],47000));b=b'\\0'*(1<<20)\n"
        "t=time.perf_counter();s=0\nwhile s<n: c.sendall(b[:min(len(b),n-s)]); s+=min(len(b),n-s)\n"
        "c.shutdown(socket.SHUT_WR);c.recv(1);print(time.perf_counter()-t)"
    )
    rx = subprocess.Popen(fab.argv(receiver, [sys.executable, "-c", code_rx, addr]), stdout=subprocess.PIPE, text=True)
    try:
        assert rx.stdout is not None
        rx.stdout.readline()
        out = subprocess.run(fab.argv(sender, [sys.executable, "-c", code_tx, addr, str(nbytes)]),
                             capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
        seconds = float(out.stdout.strip())
    finally:
        rx.wait(timeout=60)
    return nbytes * 8 / seconds / 1e6


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "relay":
        sys.exit(relay_main(sys.argv[2:]))
    print("usage: _fabric.py relay --listen HOST:PORT --to HOST:PORT [--rtt-ms MS] [--delay-file F]")
    sys.exit(2)


# -- a store on one host, two vLLM replicas on two others -----------------------------------------
STORE_PORT, RELAY_PORT, METRICS_PORT, ENGINE_PORT = 7070, 7071, 9100, 8000
S3_PORT, REDIS_PORT, MASTERS = 7072, 7000, 3  # a Redis Cluster's masters on REDIS_PORT + i, bus ports + 10000
SERVICE = "10.233.0.1"
"""The store host's own address (on its loopback), which every replica reaches over its own link to s: one address a
Redis Cluster can announce for its masters, whichever replica asks (each link is its own /24)."""
STORES = ("cache-server", "redis-cluster", "s3")


@dataclass
class World:
    """The testbed of benchmarks/fabric.py: a shared store on host s, vLLM replicas on the other hosts (a, b, ...),
    each with its own link to s. The store (``kind``) is ``kvtier cache-server`` (TCP, token; b reaches it through
    a delay relay on its own loopback, so b's link has a rate, ``shape``, and an added round trip, ``set_rtt``, the
    others' only a rate), a Redis Cluster of three masters (a password; the engines' tiers in one shared
    namespace) or an S3 server (moto's; one shared namespace in a bucket). The driver (this process, in the root
    namespace) reaches each host's ports over unshaped management links (``mgmt``)."""

    fab: Fabric
    work: Path
    links: dict[str, Link]  # replica host -> its link to s
    urls: dict[str, str]  # each replica: its engine's URL; s: the cache server's /metrics root
    delay_file: Path
    sup: Any = None  # the Supervisor of every process started (kvtier/launch/procs.py)
    store: Any = None  # the cache server's Proc (the first Redis master's, moto's)
    kind: str = "cache-server"
    mgmt: dict[str, str] = field(default_factory=dict)  # host -> its management address
    secrets: dict[str, str] = field(default_factory=dict)  # the store's credentials, as the engines get them

    def set_rtt(self, rtt_ms: float) -> None:
        self.delay_file.write_text(f"{rtt_ms}\n")
        time.sleep(0.5)  # the relay reads it every 0.2 s

    def restart_store(self) -> float:
        """Kill the cache server at once (a crash: its tiers are gone) and start it again; returns the seconds
        until it answered. The new server dies with the thread that started it (kvtier/child.py's
        PR_SET_PDEATHSIG): call this from a thread that lives until ``stop_world``."""
        self.store = self.sup.restart(self.store)
        return float(self.sup.wait_healthy(self.store, self.store.plan.health, 60))

    def shape(self, rate_mbit: float | None, host: str = "b") -> None:
        if rate_mbit is None:
            self.fab.unshape(self.links[host])
        else:
            self.fab.shape(self.links[host], rate_mbit)

    def stored_blocks(self) -> int:
        """Whole blocks the store holds, asked of the store itself: the cache server's placed and not pending, a
        Redis Cluster's entry descriptions (written after the parts) on every master, the S3 namespace's objects."""
        from kvtier.replay.scrape import parse_snapshot

        s = self.mgmt["s"]
        if self.kind == "cache-server":
            with urllib.request.urlopen(self.urls["s"] + "/metrics", timeout=10) as r:
                m = parse_snapshot(r.read().decode())
            placed = m.get("kvtier_block_server_stored_blocks_total") or 0.0
            return int(placed - (m.get("kvtier_block_server_pending_blocks") or 0.0))
        if self.kind == "s3":
            import boto3

            s3 = boto3.client("s3", endpoint_url=f"http://{s}:{S3_PORT}", region_name="us-east-1",
                              aws_access_key_id=self.secrets["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=self.secrets["AWS_SECRET_ACCESS_KEY"])  # fmt: skip
            pages = s3.get_paginator("list_objects_v2").paginate(Bucket="kvtier-fabric", Prefix="kvtier/shared/fabric/")
            return sum(int(p.get("KeyCount", 0)) for p in pages)
        from kvtier.engine.resp import RespConnection

        n = 0
        for i in range(MASTERS):
            try:
                c = RespConnection(f"redis://{s}:{REDIS_PORT + i}", self.secrets["KVTIER_REDIS_PASSWORD"], 10.0)
            except OSError:
                continue  # a master the test killed
            try:
                cursor: object = b"0"
                while True:
                    reply = c.call("SCAN", cursor, "MATCH", "kvtier:shared:fabric:*:m", "COUNT", 1000)
                    assert isinstance(reply, list)
                    cursor, keys = reply
                    n += len(keys)
                    if cursor == b"0":
                        break
            finally:
                c.close()
        return n


def start_world(fab: Fabric, work: Path, engine_python: str, model_dir: str, kv_tokens: int, max_len: int,
                store_gb: float, startup_s: float = 900.0,
                settings: dict[str, dict] | None = None, kind: str = "cache-server") -> World:  # fmt: skip
    """Build the hosts and links, start the store (``kind``, one of STORES), the relay and the replicas (every host
    but s; ``settings``: more kv_connector_extra_config per host), and wait until all answer.

    On a machine of few cores the hosts would share them: an engine's compute threads then starve the store and
    the relay (Python processes moving the bytes), and a fetch waits on the CPU, not on the link. So the engines
    get every core but the last and the store and the relay the last (``taskset``), where there are two or more."""
    from kvtier.launch import cpu_engine
    from kvtier.launch.procs import Supervisor
    from kvtier.launch.profiles import ProcPlan
    from kvtier.modelmaker import Geometry
    from kvtier.vllm import engine_pythonpath, kv_transfer_arg

    replicas = [h for h in fab.hosts if h != "s"]
    links = {h: fab.link(h, "s") for h in replicas}
    link_b = links["b"]
    mgmt = {h: fab.management(h) for h in fab.hosts}
    secret = work / "secret"
    secret.mkdir(mode=0o700, exist_ok=True)
    token = secret / "token"
    token.write_text(os.urandom(24).hex() + "\n")
    token.chmod(0o600)
    delay = work / "rtt_ms"
    delay.write_text("0\n")
    sup = Supervisor(work / "logs")
    ncpu = len(os.sched_getaffinity(0))
    cores = sorted(os.sched_getaffinity(0))
    engine_cores = [str(c) for c in cores[:-1]] if ncpu >= 2 else [str(c) for c in cores]
    pin = ["taskset", "-c", str(cores[-1])] if ncpu >= 2 else []
    store = ProcPlan("store", fab.argv("s", [*pin,
        sys.executable, "-m", "kvtier", "cache-server", "--offload", "cpu", "--cpu-offload-gb", str(store_gb),
        "--listen", f"0.0.0.0:{STORE_PORT}", "--token-file", str(token), "--host", mgmt["s"],
        "--port", str(METRICS_PORT)]), {}, f"http://{mgmt['s']}:{METRICS_PORT}/health", None, 60)  # fmt: skip
    relay = ProcPlan("relay", fab.argv("b", [*pin,
        sys.executable, str(Path(__file__)), "relay", "--listen", f"127.0.0.1:{RELAY_PORT}",
        "--to", f"{link_b.addr('s')}:{STORE_PORT}", "--delay-file", str(delay)]), {}, "", None, 10)  # fmt: skip
    kv_bytes = kv_tokens * Geometry().kv_bytes_per_token
    env = {"PYTHONPATH": engine_pythonpath(str(work / "pylib"))}
    urls = {"s": f"http://{mgmt['s']}:{METRICS_PORT}"}
    secrets: dict[str, str] = {}
    if kind == "cache-server":
        procs = [sup.start(store), sup.start(relay)]
        sup.wait_healthy(procs[0], store.health, 60)
    else:
        procs, shared, secrets = _shared_store(fab, sup, kind, links, mgmt["s"], pin, store_gb, work)
        env.update(secrets)
    engines = []
    for host in replicas:
        server = f"tcp://127.0.0.1:{RELAY_PORT}" if host == "b" else f"tcp://{links[host].addr('s')}:{STORE_PORT}"
        where = {"cache_server": server, "cache_server_token_file": str(token)} if kind == "cache-server" else shared
        extra = {**where, "request_log": str(work / f"{host}.requests.jsonl"),
                 **(settings or {}).get(host, {})}  # fmt: skip
        plan = cpu_engine.replica_plan(engine_python, model_dir, "tiny", ENGINE_PORT, kv_bytes, max_len, engine_cores,
                                       name=f"vllm-{host}", extra=["--kv-transfer-config", kv_transfer_arg(extra)],
                                       env=env)  # fmt: skip
        argv = [mgmt[host] if a == "127.0.0.1" else a for a in plan.argv]  # --host: its management address
        url = f"http://{mgmt[host]}:{ENGINE_PORT}"
        plan = ProcPlan(plan.name, fab.argv(host, argv), plan.env, url + "/health", url + "/metrics",
                        plan.startup_timeout_s, plan.unset, plan.devices)  # fmt: skip
        engines.append((sup.start(plan), plan))
        urls[host] = url
    for proc, plan in engines:
        sup.wait_healthy(proc, plan.health, startup_s)
    return World(fab, work, links, urls, delay, sup, procs[0], kind, mgmt, secrets)


def _shared_store(fab: Fabric, sup: Any, kind: str, links: dict[str, Link], at: str, pin: list[str],
                  store_gb: float, work: Path) -> tuple[list[Any], dict[str, Any], dict[str, str]]:  # fmt: skip
    """A Redis Cluster or an S3 server on host s at SERVICE, routed to from every replica over its own link;
    (its processes, the engines' kv_connector_extra_config for it, the credentials the engines get as env)."""
    from kvtier.launch.profiles import ProcPlan
    from kvtier.localservers import S3_TEST_CREDENTIALS, form_cluster

    fab.run("s", "ip", "addr", "add", f"{SERVICE}/32", "dev", "lo")
    for host, ln in links.items():
        fab.run(host, "ip", "route", "add", f"{SERVICE}/32", "via", ln.addr("s"))
    if kind == "s3":
        plan = ProcPlan("moto", fab.argv("s", [*pin, sys.executable, "-m", "moto.server", "-H", "0.0.0.0",
                                                "-p", str(S3_PORT)]), {}, "", None, 60)  # fmt: skip
        procs = [sup.start(plan)]
        _wait_port(at, S3_PORT)
        import boto3

        boto3.client("s3", endpoint_url=f"http://{at}:{S3_PORT}", region_name="us-east-1",
                     aws_access_key_id=S3_TEST_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=S3_TEST_CREDENTIALS["AWS_SECRET_ACCESS_KEY"]).create_bucket(
            Bucket="kvtier-fabric")  # fmt: skip
        extra = {"offload": "s3", "s3_endpoint": f"http://{SERVICE}:{S3_PORT}", "s3_bucket": "kvtier-fabric",
                 "s3_capacity_gb": store_gb, "remote_namespace": "shared:fabric"}  # fmt: skip
        return procs, extra, {**S3_TEST_CREDENTIALS, "AWS_DEFAULT_REGION": "us-east-1"}
    if kind != "redis-cluster":
        raise ValueError(f"store {kind!r}: expected one of {', '.join(STORES)}")
    password = os.urandom(16).hex()
    procs = []
    for i in range(MASTERS):
        d = work / f"redis-{i}"
        d.mkdir(mode=0o700)
        conf = d / "redis.conf"  # the password in a file of its own, never on a command line
        conf.write_text(f"requirepass {password}\n")
        conf.chmod(0o600)
        port = REDIS_PORT + i
        argv = [*pin, "redis-server", str(conf), "--port", str(port), "--bind", "0.0.0.0", "--save", "",
                "--appendonly", "no", "--dir", str(d), "--cluster-enabled", "yes", "--cluster-config-file",
                "nodes.conf", "--cluster-port", str(port + 10000), "--cluster-announce-ip", SERVICE,
                "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no"]  # fmt: skip
        procs.append(sup.start(ProcPlan(f"redis-{i}", fab.argv("s", argv), {}, "", None, 30)))
    for i in range(MASTERS):
        _wait_port(at, REDIS_PORT + i)
    form_cluster([f"redis://{at}:{REDIS_PORT + i}" for i in range(MASTERS)],
                 [(SERVICE, REDIS_PORT + i, REDIS_PORT + i + 10000) for i in range(MASTERS)], password)  # fmt: skip
    extra = {"offload": "redis", "redis_url": f"redis://{SERVICE}:{REDIS_PORT}", "redis_mem_gb": store_gb,
             "remote_namespace": "shared:fabric"}  # fmt: skip
    return procs, extra, {"KVTIER_REDIS_PASSWORD": password}


def _wait_port(host: str, port: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing answered at {host}:{port} within {timeout_s:g} s") from None
            time.sleep(0.1)


def prepare(name: str, output: Path | None, engine_python: str) -> tuple[Path, str] | None:
    """A fabric benchmark's start: None (the reason printed) where the testbed or the engine is missing; else its
    work folder (``output`` or a fresh one) and ``kvtier model make``'s model made in it."""
    import tempfile

    why = why_not() or (None if Path(engine_python).exists() else
                        f"no vLLM at {engine_python} (bash scripts/install-engines.sh cpu)")  # fmt: skip
    if why is not None:
        print(f"{name}: cannot run here: {why}", file=sys.stderr)
        return None
    from kvtier.modelmaker import Geometry, make_model

    work = output or Path(tempfile.mkdtemp(prefix=f"kvtier-{name}-"))
    work.mkdir(parents=True, exist_ok=True)
    return work, str(make_model(work / "tiny", Geometry()))


def stop_world(w: World) -> None:
    w.sup.stop_all()
