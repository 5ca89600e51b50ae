"""The Prometheus series the simulator exposes, under vLLM's and LMCache's names (the cache server's are
vllm/server_http.py's).

Each server owns its own registry (no process-wide state), written by telemetry/prometheus.py ``exposition``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LAT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class OffloadView(Protocol):
    """What the gauges read from an offload tier (sim/model.py's Offload and RemoteOffload)."""

    loaded_bytes: int
    load_seconds: float
    stored_bytes: int
    store_seconds: float

    def usage(self) -> dict[str, Any] | None: ...


class LMCacheGauges:
    """LMCache MP server gauges of an offload tier (facts: the ``lmcache_mp_`` metric prefix)."""

    def __init__(
        self, registry: CollectorRegistry, labelnames: Iterable[str] = (), labels: tuple[str, ...] = ()
    ) -> None:
        def g(name: str, doc: str) -> Any:
            gauge = Gauge(name, doc, list(labelnames), registry=registry)
            return gauge.labels(*labels) if labels else gauge

        self.l1 = g("lmcache_mp_l1_memory_usage_bytes", "bytes in the CPU tier")
        self.l1_ratio = g("lmcache_mp_l1_usage_ratio", "CPU tier usage ratio")
        self.l2 = g("lmcache_mp_l2_usage_bytes", "bytes in the disk tier")
        self.evicted = g("lmcache_mp_l1_evicted_chunks", "chunks demoted or evicted from the CPU tier")
        self.load_tp = g("lmcache_mp_l2_load_throughput_GB_per_second", "mean load throughput so far, GB/s")
        self.store_tp = g("lmcache_mp_l2_store_throughput_GB_per_second", "mean store throughput so far, GB/s")

    def update(self, o: OffloadView) -> None:
        """Set every gauge from the tier's usage and its load/store accounting."""
        u = o.usage()
        if u is not None:
            self.l1.set(u["cpu_used_bytes"])
            if u["cpu_capacity_bytes"]:
                self.l1_ratio.set(u["cpu_used_bytes"] / u["cpu_capacity_bytes"])
            self.l2.set(u["l2_used_bytes"])
            self.evicted.set(u["evicted_chunks"])
        if o.load_seconds > 0:
            self.load_tp.set(o.loaded_bytes / o.load_seconds / 1e9)
        if o.store_seconds > 0:
            self.store_tp.set(o.stored_bytes / o.store_seconds / 1e9)


class VllmMetrics:
    """The sim's series: vLLM's names (labelled by model_name, as vLLM does), the fetch gate's, and
    the offload tier's LMCache-style lookups and gauges."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        names = ["model_name"]
        labels = (model_name,)

        def c(name: str, doc: str) -> Any:
            return Counter(name, doc, names, registry=r).labels(*labels)

        def g(name: str, doc: str) -> Any:
            return Gauge(name, doc, names, registry=r).labels(*labels)

        def h(name: str, doc: str) -> Any:
            return Histogram(name, doc, names, buckets=LAT_BUCKETS, registry=r).labels(*labels)

        self.running = g("vllm:num_requests_running", "requests in the running batch")
        self.waiting = g("vllm:num_requests_waiting", "requests waiting for a slot or KV blocks")
        self.preemptions = c("vllm:num_preemptions", "requests preempted (their blocks freed, computed anew)")
        self.kv_usage = g("vllm:kv_cache_usage_perc", "fraction of GPU KV blocks in use (0-1)")
        self.pc_queries = c("vllm:prefix_cache_queries", "prompt tokens looked up in the GPU prefix cache")
        self.pc_hits = c("vllm:prefix_cache_hits", "prompt tokens found in the GPU prefix cache")
        self.ext_queries = c("vllm:external_prefix_cache_queries", "prompt tokens looked up in the offload tier")
        self.ext_hits = c("vllm:external_prefix_cache_hits", "prompt tokens loaded from the offload tier")
        self.prompt_tokens = c("vllm:prompt_tokens", "prompt tokens processed")
        self.gen_tokens = c("vllm:generation_tokens", "tokens generated")
        self.success = c("vllm:request_success", "requests finished")
        self.ttft = h("vllm:time_to_first_token_seconds", "time to first token")
        self.itl = h("vllm:inter_token_latency_seconds", "time between output tokens")
        self.tpot = h("vllm:request_time_per_output_token_seconds", "mean time per output token of a request")
        self.e2e = h("vllm:e2e_request_latency_seconds", "request latency")
        self.queue = h("vllm:request_queue_time_seconds", "time waiting for admission")
        self.prefill = h("vllm:request_prefill_time_seconds", "prefill time including offload loads")
        self.decode = h("vllm:request_decode_time_seconds", "decode time")
        self.gate_recompute = c(
            "kvtier_sim:fetch_gate_recompute", "offload hits recomputed because fetching was slower"
        )
        self.failed_loads = c(
            "kvtier_sim:offload_failed_loads",
            "offload loads that brought back fewer chunks than the lookup found (the rest recomputed)",
        )
        self.offload_errors = g(
            "kvtier_sim:offload_errors",
            "failed calls to the offload tier: a cache server, Redis, S3 or files (treated as misses)",
        )
        self.offload_bypassed = g(
            "kvtier_sim:offload_bypassed",
            "requests recomputed without asking the offload tier: it failed repeatedly (its breaker was open)",
        )
        self.stores_skipped = g(
            "kvtier_sim:offload_stores_skipped",
            "stores after prefill not made: the tier's breaker was open, or 64 stores were already queued",
        )
        # where each prompt token came from, as vLLM 0.32 counts it (local_compute, local_cache_hit,
        # external_kv_transfer), and kvtier's per-tier split of the external part under the sim's own tier names
        # (cpu, storage, redis, s3, or the cache server's): what kvtier ladder verifies a point by
        self.by_source = Counter(
            "vllm:prompt_tokens_by_source", "prompt tokens by where their KV came from", [*names, "source"], registry=r
        )
        self.by_tier = Counter(
            "kvtier_sim:prompt_tokens_by_tier",
            "prompt tokens whose KV an offload tier served, by tier (the engine's tier names)",
            [*names, "tier"],
            registry=r,
        )
        self.tier_capacity = Gauge(
            "kvtier_sim:offload_tier_capacity_tokens",
            "tokens each offload tier holds (its capacity over the model's KV bytes per token)",
            [*names, "tier"],
            registry=r,
        )
        self.cache_config = Gauge(
            "vllm:cache_config_info",
            "the modelled GPU's KV cache geometry, under vLLM's labels",
            [
                *names,
                "block_size",
                "num_gpu_blocks",
                "kv_cache_size_tokens",
                "kv_bytes_per_token",
                "enable_prefix_caching",
            ],
            registry=r,
        )
        self.timing = Gauge(
            "kvtier_sim:timing_info",
            "where the latency model's figures come from: assumed (a preset) or measured (a ladder calibration)",
            [*names, "source", "calibration"],
            registry=r,
        )
        self.extrapolated = c(
            "kvtier_sim:timing_extrapolated",
            "requests whose prefill or decode was timed outside the calibration's measured range",
        )
        self.model_name = model_name
        self.stores_pending = g(
            "kvtier_sim:offload_stores_pending", "stores after prefill queued or running (kvtier ladder waits for 0)"
        )
        self.lm_req = c("lmcache_mp_lookup_requested_tokens", "tokens looked up in the offload tier")
        self.lm_hit = c("lmcache_mp_lookup_hit_tokens", "tokens found in the offload tier")
        self.lm_loaded = c("lmcache_mp_num_chunks_loaded", "chunks loaded from the offload tier")
        self.lmcache = LMCacheGauges(r, names, labels)

    def count_sources(self, by_source: dict[str, int]) -> None:
        """A prompt's tokens by source into vLLM's prompt_tokens_by_source (local_cache_hit, external_kv_transfer,
        local_compute) and kvtier's per-tier counter (the engine's tier names)."""
        ext = 0
        for src, n in by_source.items():
            if src in ("gpu", "recomputed") or not n:
                continue
            self.by_tier.labels(self.model_name, src).inc(n)
            ext += n
        if by_source.get("gpu"):
            self.by_source.labels(self.model_name, "local_cache_hit").inc(by_source["gpu"])
        if ext:
            self.by_source.labels(self.model_name, "external_kv_transfer").inc(ext)
        if by_source.get("recomputed"):
            self.by_source.labels(self.model_name, "local_compute").inc(by_source["recomputed"])


__all__ = ["VllmMetrics", "LMCacheGauges", "LAT_BUCKETS"]
