"""Scrape servers' Prometheus /metrics during a replay and reduce them honestly.

Hit rates come from counter *deltas* (never gauges), as a rolling rate over ``rate_window_s``;
the reported figure is the mean of the final quarter of that series (steady state) and the whole
series is kept. A counter that goes down was reset: its delta is the new value. KV cache usage is
the mean of all samples. Mean prefill and queue times are before/after histogram diffs (sum/count).
A series the server does not expose is null, never zero. When the run ends before a second sample,
the rates fall back to the before/after diff.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvtier.results.replay import ScrapeSummary

MAX_METRICS_BYTES = 16 * 1024 * 1024
"""Largest /metrics page read; an endless or huge one is a scrape error, not memory."""

RATES = {
    "prefix_cache_hit_rate": ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
    "external_prefix_cache_hit_rate": (
        "vllm:external_prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
    ),
    "lmcache_lookup_hit_rate": ("lmcache_mp_lookup_hit_tokens_total", "lmcache_mp_lookup_requested_tokens_total"),
}
OFFLOAD_COUNTERS = {  # LMCache MP server counters (facts.md): whole-run deltas; a missing series stays null
    "lmcache_lookup_requested_tokens": "lmcache_mp_lookup_requested_tokens_total",
    "lmcache_lookup_hit_tokens": "lmcache_mp_lookup_hit_tokens_total",
    "lmcache_lookup_hit_l1_tokens": "lmcache_mp_lookup_hit_l1_tokens_total",
    "lmcache_lookup_hit_l2_tokens": "lmcache_mp_lookup_hit_l2_tokens_total",
    "lmcache_chunks_loaded": "lmcache_mp_num_chunks_loaded_total",
    "lmcache_chunks_stored": "lmcache_mp_num_chunks_stored_total",
}
OFFLOAD_GAUGES = {  # sampled: the most seen over the run
    "lmcache_l1_usage_bytes_max": "lmcache_mp_l1_memory_usage_bytes",
    "lmcache_l2_usage_bytes_max": "lmcache_mp_l2_usage_bytes",
    "lmcache_l1_evicted_chunks_max": "lmcache_mp_l1_evicted_chunks",
}
OFFLOAD_TRANSFER = {  # vLLM's offloading connector (any spec): whole-run deltas
    "kv_offload_load_bytes": "vllm:kv_offload_load_bytes_total",
    "kv_offload_load_time_s": "vllm:kv_offload_load_time_total",
    "kv_offload_store_bytes": "vllm:kv_offload_store_bytes_total",
    "kv_offload_store_time_s": "vllm:kv_offload_store_time_total",
    "kvtier_offload_failed_loads": "kvtier:offload_failed_loads_total",  # kvtier's vLLM backend (kvtier/vllm)
    "kvtier_offload_failed_stores": "kvtier:offload_failed_stores_total",
    "kvtier_offload_server_errors": "kvtier:offload_server_errors_total",  # its shared store not answering
    "kvtier_offload_shared_found_blocks": "kvtier:offload_shared_found_blocks_total",  # other replicas' blocks found
    # a shared kvtier cache-server (kvtier cache-server): blocks one replica loaded that another stored
    "kvtier_shared_cross_replica_loads": "kvtier_block_server_cross_replica_loads_total",
    "sim_fetch_gate_recomputes": "kvtier_sim:fetch_gate_recompute_total",  # the sim's own degradation counts
    "sim_offload_failed_loads": "kvtier_sim:offload_failed_loads_total",
    "sim_offload_bypassed": "kvtier_sim:offload_bypassed",  # a gauge holding a count since the start
}
BY_LABEL = {  # series read by one label: whole-run deltas per label value
    "prompt_tokens_by_source": ("vllm:prompt_tokens_by_source_total", "source"),
    "prompt_tokens_cached_by_source": ("vllm:prompt_tokens_cached_by_source_total", "source"),
    "kvtier_offload_loaded_blocks": ("kvtier:offload_loaded_blocks_total", "tier"),
    "kvtier_offload_load_io_s": ("kvtier:offload_load_io_seconds_total", "tier"),
}
HISTS = {
    "prefill_time_s": "vllm:request_prefill_time_seconds",
    "queue_time_s": "vllm:request_queue_time_seconds",
    "ttft_server_s": "vllm:time_to_first_token_seconds",
}


@dataclass
class Snapshot:
    """One /metrics page: each sample's value summed over its label sets (``flat``), and the labelled samples kept
    by (name, labels) for the series read by label (a tier's counter, vLLM's cache_config_info)."""

    flat: dict[str, float] = field(default_factory=dict)
    labelled: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    def get(self, name: str, **labels: str) -> float | None:
        """The sample ``name`` (summed over the label sets matching ``labels``); None when absent, never 0."""
        if not labels:
            return self.flat.get(name)
        total, seen = 0.0, False
        for (n, lab), v in self.labelled.items():
            if n == name and all(dict(lab).get(k) == want for k, want in labels.items()):
                total += v
                seen = True
        return total if seen else None

    def labels_of(self, name: str) -> list[dict[str, str]]:
        return [dict(lab) for (n, lab) in self.labelled if n == name]


def parse_snapshot(text: str) -> Snapshot:
    """The plain text format (which keeps vLLM's colons) into a Snapshot."""
    s = Snapshot()
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            s.flat[smp.name] = s.flat.get(smp.name, 0.0) + float(smp.value)
            if smp.labels:
                key = (smp.name, tuple(sorted(smp.labels.items())))
                s.labelled[key] = s.labelled.get(key, 0.0) + float(smp.value)
    return s


def parse(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets."""
    return parse_snapshot(text).flat


async def read_metrics(session: aiohttp.ClientSession, url: str, timeout_s: float = 10.0) -> str:
    """The text of ``url``/metrics, read up to MAX_METRICS_BYTES; raises ValueError for a non-200 answer or a page
    over the bound, aiohttp's or the OS's errors for a server that does not answer."""
    async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
        if r.status != 200:
            raise ValueError(f"/metrics answered HTTP {r.status}")
        body = bytearray()
        async for chunk in r.content.iter_chunked(1 << 20):
            body += chunk
            if len(body) > MAX_METRICS_BYTES:
                raise ValueError(f"/metrics larger than {MAX_METRICS_BYTES} bytes")
        return body.decode("utf-8", "replace")


async def scrape_snapshot(session: aiohttp.ClientSession, url: str) -> Snapshot | None:
    """One scrape as a Snapshot; None when the server did not answer it (a failed scrape is never zeros)."""
    try:
        return parse_snapshot(await read_metrics(session, url, 15.0))
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
        return None


class Scraper:
    def __init__(self, url: str, interval_s: float, rate_window_s: float) -> None:
        self.url = url.rstrip("/")
        self.interval_s = interval_s
        self.rate_window_s = rate_window_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.errors = 0
        self.config_labels: list[dict[str, str]] = []  # vllm:cache_config_info's labels, as last seen

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        """One sample; a failure, a non-200 or a body over MAX_METRICS_BYTES counts as a scrape error. The series
        of BY_LABEL are kept per label value too, as ``name{label=value}``."""
        try:
            snap = parse_snapshot(await read_metrics(session, self.url))
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            self.errors += 1
            return
        flat = snap.flat
        for name, label in BY_LABEL.values():
            for labels in snap.labels_of(name):
                if label in labels:
                    flat[f"{name}{{{label}={labels[label]}}}"] = snap.get(name, **{label: labels[label]}) or 0.0
        self.config_labels = snap.labels_of("vllm:cache_config_info") or self.config_labels
        self.samples.append((time.time(), flat))

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Scrape until ``stop``, then once more. ``ready`` is set once the first scrape is done (or failed):
        the replay sends nothing before it, so the first sample precedes every request it counts."""
        async with aiohttp.ClientSession() as session:
            try:
                await self.scrape_once(session)
            finally:
                if ready is not None:
                    ready.set()
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), self.interval_s)
                    break
                except TimeoutError:
                    await self.scrape_once(session)
            await self.scrape_once(session)

    def hit_rates_so_far(self) -> dict[str, float | None]:
        """Each hit rate over the samples taken so far (first to latest; progress lines)."""
        if len(self.samples) < 2:
            return {}
        a, b = self.samples[0][1], self.samples[-1][1]
        out: dict[str, float | None] = {}
        for name, (hits, queries) in RATES.items():
            if hits in b and queries in b:
                dh, dq = self._delta(a.get(hits, 0.0), b[hits]), self._delta(a.get(queries, 0.0), b[queries])
                out[name] = round(dh / dq, 4) if dh is not None and dq else None
        return out

    @staticmethod
    def _delta(a: float | None, b: float | None) -> float | None:
        if a is None or b is None:
            return None
        return b - a if b >= a else b  # reset: the counter restarted from 0

    def summary(self) -> ScrapeSummary:
        """The run's figures from the scraped series; a series the server lacks stays null."""
        s = self.samples
        out: dict[str, Any] = {"url": self.url, "samples": len(s), "scrape_errors": self.errors}
        if len(s) < 2:
            return ScrapeSummary(**out)
        for name, (hits, queries) in RATES.items():
            if hits not in s[-1][1] or queries not in s[-1][1]:
                continue
            # cumulative (reset-corrected) counters, then a rolling rate over the window
            cum_h, cum_q, H, Q = [0.0], [0.0], 0.0, 0.0
            for (_, a), (_, b) in zip(s, s[1:]):
                H += self._delta(a.get(hits), b.get(hits)) or 0.0
                Q += self._delta(a.get(queries), b.get(queries)) or 0.0
                cum_h.append(H)
                cum_q.append(Q)
            series = []
            j = 0
            for i in range(1, len(s)):
                while s[i][0] - s[j][0] > self.rate_window_s and j < i - 1:
                    j += 1
                dq = cum_q[i] - cum_q[j]
                series.append(
                    {
                        "t": round(s[i][0] - s[0][0], 3),
                        "rate": None if dq <= 0 else round((cum_h[i] - cum_h[j]) / dq, 6),
                    }
                )
            vals = [x["rate"] for x in series[-max(1, len(series) // 4) :] if x["rate"] is not None]
            out[name] = round(sum(vals) / len(vals), 6) if vals else None
            out[name + "_overall"] = round(H / Q, 6) if Q > 0 else None
            out[name + "_series"] = series
            if name == "external_prefix_cache_hit_rate":
                out["external_prefix_cache_queries"], out["external_prefix_cache_hits"] = Q, H
            elif name == "prefix_cache_hit_rate":
                out["prefix_cache_queries"], out["prefix_cache_hits"] = Q, H
        for key, name in OFFLOAD_COUNTERS.items():
            out[key] = self._delta(s[0][1].get(name), s[-1][1].get(name))
        for key, name in OFFLOAD_TRANSFER.items():  # these appear with their first count: absent at the start is 0
            last_v = s[-1][1].get(name)
            out[key] = None if last_v is None else self._delta(s[0][1].get(name, 0.0), last_v)
        for key, (name, label) in BY_LABEL.items():
            prefix = f"{name}{{{label}="
            values = {k[len(prefix) : -1] for k in s[-1][1] if k.startswith(prefix)}
            if values:
                deltas = {
                    v: self._delta(s[0][1].get(f"{prefix}{v}}}", 0.0), s[-1][1][f"{prefix}{v}}}"]) for v in values
                }
                out[key] = {v: d for v, d in sorted(deltas.items()) if d is not None}
        for key, name in OFFLOAD_GAUGES.items():
            seen = [x[name] for _, x in s if name in x]
            out[key] = max(seen) if seen else None
        sizes = {int(b) for b in (x.get("block_size") for x in self.config_labels) if b and b.isdigit()}
        out["block_size"] = sizes.pop() if len(sizes) == 1 else None
        usage = [x["vllm:kv_cache_usage_perc"] for _, x in s if "vllm:kv_cache_usage_perc" in x]
        out["kv_cache_usage_perc_mean"] = round(sum(usage) / len(usage), 6) if usage else None
        first, last = s[0][1], s[-1][1]
        for key, h in HISTS.items():
            dsum = self._delta(first.get(h + "_sum"), last.get(h + "_sum"))
            dcnt = self._delta(first.get(h + "_count"), last.get(h + "_count"))
            out[key + "_mean"] = None if dsum is None or not dcnt else round(dsum / dcnt, 6)
        return ScrapeSummary(**out)
