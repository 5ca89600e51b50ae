"""What a shared kvtier cache server (kvtier/vllm/blockserver.py) says about itself over HTTP on 127.0.0.1: its
Prometheus series (``kvtier_block_server_*``) and /health. The data and control API is never here."""

from __future__ import annotations

import json
import threading
from collections import Counter as Tally
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from kvtier.telemetry.prometheus import CONTENT_TYPE, exposition
from kvtier.vllm.index import StorePlan


class ServerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        p = "kvtier_block_server_"
        tier = ["tier"]
        self.clients = Gauge(
            p + "clients",
            "connections, by kind (control: a manager; data: a worker's I/O thread)",
            ["kind"],
            registry=r,
        )
        self.requests = Counter(p + "requests", "requests served, by operation", ["op"], registry=r)
        self.lookups = Counter(p + "lookups", "block lookups", registry=r)
        self.lookup_hits = Counter(
            p + "lookup_hits", "block lookups that found the block (stored or being stored)", registry=r
        )
        self.placed = Counter(p + "stored_blocks", "blocks placed, by tier", tier, registry=r)
        self.demoted = Counter(p + "demoted_blocks", "blocks demoted, by the tier they left", tier, registry=r)
        self.evicted = Counter(p + "evicted_blocks", "blocks dropped to make room, by tier", tier, registry=r)
        self.rejected = Counter(p + "rejected_blocks", "blocks offered that no tier had room for", registry=r)
        self.loaded = Counter(p + "loaded_shards", "block shards read into a worker's page, by tier", tier, registry=r)
        self.cross = Counter(
            p + "cross_replica_loads", "blocks loaded by an engine other than the one that stored them", registry=r
        )
        self.load_bytes = Counter(p + "load_bytes", "bytes read from the tiers for loads", registry=r)
        self.load_seconds = Counter(p + "load_seconds", "seconds spent in tier reads for loads", registry=r)
        self.store_bytes = Counter(p + "store_bytes", "bytes written to the tiers for stores", registry=r)
        self.store_seconds = Counter(p + "store_seconds", "seconds spent in tier writes for stores", registry=r)
        self.failed_loads = Counter(p + "failed_loads", "shard reads that failed or found nothing", registry=r)
        self.failed_stores = Counter(p + "failed_stores", "shard writes that failed (the block is dropped)", registry=r)
        self.refused = Counter(
            p + "refused_connections",
            "connections refused at their hello, by reason (geometry: blocks larger than the server's slots)",
            ["reason"],
            registry=r,
        )
        self.throttled = Counter(
            p + "throttled_seconds",
            "seconds control requests were held back because their connection named keys faster than its allowance",
            registry=r,
        )
        self.requests_refused = Counter(
            p + "requests_refused",
            "requests refused, by reason (scope: a key outside the prefix its connection's hello named)",
            ["reason"],
            registry=r,
        )
        self.not_taken = Counter(
            p + "connections_not_taken",
            "connections closed before their hello because the server could not take them, by reason (full: at the "
            "bound its descriptor limit sets; EMFILE, ENFILE, ...: the kernel's; thread: no thread to serve it)",
            ["reason"],
            registry=r,
        )
        self.abandoned = Counter(
            p + "abandoned_blocks", "pending blocks dropped because their writer disconnected", registry=r
        )
        self.held = Gauge(p + "tier_blocks", "blocks each tier holds (stored and being stored)", tier, registry=r)
        self.pending = Gauge(
            p + "pending_blocks",
            "blocks placed whose store the engine has not reported complete (a lookup of one answers pending)",
            registry=r,
        )
        self.capacity = Gauge(p + "tier_capacity_blocks", "blocks each tier can hold", tier, registry=r)
        self.info = Gauge(
            p + "info", "the tiers, fastest first, with vLLM's by-source label", ["tier", "source"], registry=r
        )
        # the same tiers under LMCache MP's names (facts.md): a scraper reads kvtier's cache server as it reads
        # LMCache's (kvtier replay's offload counters; the first tier is L1, those below it L2)
        self.lm_req = Counter("lmcache_mp_lookup_requested_tokens", "tokens looked up (blocks x tokens)", registry=r)
        self.lm_hit = Counter("lmcache_mp_lookup_hit_tokens", "tokens found stored", registry=r)
        self.lm_loaded = Counter("lmcache_mp_num_chunks_loaded", "blocks loaded (rank 0's shards)", registry=r)
        self.lm_stored = Counter("lmcache_mp_num_chunks_stored", "blocks stored (rank 0's shards)", registry=r)
        self.lm_l1 = Gauge("lmcache_mp_l1_memory_usage_bytes", "bytes the first tier holds", registry=r)
        self.lm_l1_ratio = Gauge("lmcache_mp_l1_usage_ratio", "the first tier's usage ratio", registry=r)
        self.lm_l2 = Gauge("lmcache_mp_l2_usage_bytes", "bytes the tiers below the first hold", registry=r)
        self.lm_evicted = Gauge(
            "lmcache_mp_l1_evicted_chunks", "blocks demoted or evicted from the first tier", registry=r
        )

    def note_plan(self, names: list[str], plan: StorePlan[str], rejected: int) -> tuple[Tally[str], Tally[str]]:
        """Count what a store plan did, by tier (``names``: the tiers, fastest first); (demoted, evicted) by the tier
        the blocks left: a move goes one tier down, from the tier above its target; an eviction is from the tier
        named."""
        demoted = Tally(names[i - 1] for what, _, i in plan.actions if what == "move")
        evicted = Tally(names[i] for what, _, i in plan.actions if what == "evict")
        for k in plan.keys_to_store:
            self.placed.labels(names[plan.placed[k]]).inc()
        for t, n in demoted.items():
            self.demoted.labels(t).inc(n)
        for t, n in evicted.items():
            self.evicted.labels(t).inc(n)
        self.rejected.inc(rejected)
        return demoted, evicted

    def refresh(self, usage: dict[str, tuple[int, int]], pending: int, block_bytes: int, l1_evicted: int) -> None:
        """The gauges from the index's usage (tier: blocks held, slots), fastest first; ``block_bytes``: a whole
        block (every worker's share)."""
        for name, (held, _) in usage.items():
            self.held.labels(name).set(held)
        self.pending.set(pending)
        (l1_held, l1_slots), *below = usage.values()
        self.lm_l1.set(l1_held * block_bytes)
        self.lm_l1_ratio.set(l1_held / l1_slots if l1_slots else 0.0)
        self.lm_l2.set(sum(h for h, _ in below) * block_bytes)
        self.lm_evicted.set(l1_evicted)


HTTP_CONNS = 32
"""Most health/metrics connections served at once; more are closed as they come."""
HTTP_TIMEOUT_S = 10.0
"""Longest a health/metrics connection may sit between reads."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most HTTP_CONNS at once: an idle scraper cannot hold the port's threads and the
    process's descriptors (its connections also time out: the handler's ``timeout``)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(HTTP_CONNS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def http_handler(server: Any) -> type[BaseHTTPRequestHandler]:
    """/health (the server's socket and geometry; 503 while the data path could not take a connection) and /metrics
    for a BlockServer."""

    class Handler(BaseHTTPRequestHandler):
        timeout = HTTP_TIMEOUT_S

        def do_GET(self) -> None:
            code = 200
            if self.path == "/health":
                trouble = server.listeners.trouble()
                code = 200 if trouble is None else 503
                body = json.dumps(
                    {
                        "status": "ok" if trouble is None else "degraded",
                        "server": "kvtier cache-server",
                        "socket": server.path,
                        "geometry": None if server.geometry is None else server.geometry.__dict__,
                        "trouble": trouble,
                    }
                ).encode()
                kind = "application/json"
            elif self.path == "/metrics":
                server.refresh_gauges()
                body, kind = exposition(server.metrics.registry), CONTENT_TYPE
            else:
                self.send_error(404)
                return
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return Handler


__all__ = ["BoundedHTTPServer", "ServerMetrics", "http_handler"]
