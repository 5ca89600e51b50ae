"""What a ladder learns of the server before it measures: its kind, KV geometry, offload tiers and the counters
that can verify each point — and how those counters are read.

Every verifying series is a counter of prompt tokens by where their KV came from:

    GPU prefix cache   vllm:prefix_cache_hits_total (vLLM and the sim)
    any offload        vllm:external_prefix_cache_hits_total
    one offload tier   kvtier_sim:prompt_tokens_by_tier_total{tier}       the sim (its engine's tier names)
                       vllm:prompt_tokens_cached_by_source_total{source}  vLLM's native offloading (host, disk, ...),
                       and kvtier's tiers inside vLLM (kvtier:offload_info names them and their source, with
                       kvtier:offload_tier_capacity_blocks their size)
                       lmcache_mp_lookup_hit_l{1,2}_tokens_total           an LMCache MP server (l1, l2)

A series a server does not expose is absent, never zero: a tier without its own counter is reported as such and
its points are never verified (the ladder does not assume which tier served a prefix).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.replay.scrape import Snapshot
from kvtier.results.ladder import TierFacts
from kvtier.tiers import KINDS

GPU_HITS = "vllm:prefix_cache_hits_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
SIM_BY_TIER = "kvtier_sim:prompt_tokens_by_tier_total"
SIM_TIER_CAPACITY = "kvtier_sim:offload_tier_capacity_tokens"
VLLM_BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
LMCACHE_TIERS = {"l1": "lmcache_mp_lookup_hit_l1_tokens_total", "l2": "lmcache_mp_lookup_hit_l2_tokens_total"}
CACHE_CONFIG = "vllm:cache_config_info"
KVTIER_INFO = "kvtier:offload_info"  # kvtier's vLLM backend (kvtier/vllm): its tiers, fastest first, and their source
KVTIER_CAPACITY = "kvtier:offload_tier_capacity_blocks"
LOCAL_SOURCES = frozenset(k.vllm_source for k in KINDS.values() if k.offload and not k.remote)
"""The by-source labels of kvtier's local offload tiers inside vLLM (the tier table's)."""
STORES_PENDING = "kvtier_sim:offload_stores_pending"


@dataclass
class Reading:
    """What the counters say of the prompt tokens served between two snapshots."""

    gpu: int | None
    external: int | None
    tiers: dict[str, int]


@dataclass
class Server:
    kind: str  # kvtier-sim | vllm | unknown
    max_model_len: int | None
    block_tokens: int | None
    gpu_kv_tokens: int | None
    kv_bytes_per_token: int | None
    tiers: list[TierFacts]
    counters: list[str]
    notes: list[str]

    def reading(self, a: Snapshot | None, b: Snapshot | None) -> Reading | None:
        """Counter deltas from ``a`` to ``b``; None when either scrape failed."""
        if a is None or b is None:
            return None

        def delta(name: str, **labels: str) -> int | None:
            x, y = a.get(name, **labels), b.get(name, **labels)
            if y is None:
                return None
            return int(round(y - (x or 0.0)))

        tiers: dict[str, int] = {}
        for t in self.tiers:
            if t.counter is None:
                continue
            name, labels = counter_of(self.kind, t.name)
            d = delta(name, **labels)
            tiers[t.name] = d if d is not None else 0  # a labelled series appears with its first count
        return Reading(delta(GPU_HITS), delta(EXTERNAL_HITS), tiers)


def counter_of(kind: str, tier: str) -> tuple[str, dict[str, str]]:
    """The series (and labels) counting the tokens ``tier`` served, on a server of ``kind``."""
    if kind == "kvtier-sim":
        return SIM_BY_TIER, {"tier": tier}
    if tier in LMCACHE_TIERS:
        return LMCACHE_TIERS[tier], {}
    return VLLM_BY_SOURCE, {"source": tier}


def _int_label(labels: dict[str, str], key: str) -> int | None:
    v = labels.get(key)
    try:
        return int(float(v)) if v not in (None, "None", "") else None
    except ValueError:
        return None


def describe(max_len: int | None, snap: Snapshot | None) -> Server:
    """The server from its max_model_len (GET /models: replay.driver.server_identity) and one /metrics scrape
    (module docstring)."""
    notes: list[str] = []
    if snap is None:
        notes.append("no /metrics: no point can be verified by counters (usage.cached_tokens only)")
        return Server("unknown", max_len, None, None, None, [], [], notes)
    kind = (
        "kvtier-sim"
        if any(k.startswith("kvtier_sim:") for k in snap.flat)
        else ("vllm" if any(k.startswith("vllm:") for k in snap.flat) else "unknown")
    )
    cfg = (snap.labels_of(CACHE_CONFIG) or [{}])[0]
    block = _int_label(cfg, "block_size")
    blocks = _int_label(cfg, "num_gpu_blocks")
    gpu_tokens = blocks * block if blocks and block else None
    kvpt = _int_label(cfg, "kv_bytes_per_token")
    tiers: list[TierFacts] = []
    if kind == "kvtier-sim":
        for lab in snap.labels_of(SIM_TIER_CAPACITY):
            cap = snap.get(SIM_TIER_CAPACITY, tier=lab["tier"])
            tiers.append(TierFacts(name=lab["tier"], capacity_tokens=int(cap) if cap else None, counter=SIM_BY_TIER))
    else:
        for name, series in LMCACHE_TIERS.items():
            if series in snap.flat:
                tiers.append(TierFacts(name=name, capacity_tokens=None, counter=series))
        offload_on = cfg.get("kv_offloading_size") not in (None, "None") or cfg.get("kv_offloading_backend") not in (
            None,
            "None",
            "native",
        )
        for lab in snap.labels_of(KVTIER_INFO):  # kvtier's tiers inside vLLM: hits counted by vLLM's by-source
            source = lab.get("source", "")
            if source in LOCAL_SOURCES and source not in {t.name for t in tiers}:
                cap = snap.get(KVTIER_CAPACITY, tier=lab.get("tier", ""))
                tokens = int(cap) * block if cap and block else None
                tiers.append(TierFacts(name=source, capacity_tokens=tokens, counter=VLLM_BY_SOURCE))
        if offload_on and VLLM_BY_SOURCE in snap.flat and not tiers:
            tiers.append(TierFacts(name="host", capacity_tokens=None, counter=VLLM_BY_SOURCE))
        if EXTERNAL_HITS in snap.flat and not tiers and kind == "vllm":
            notes.append(
                "vLLM counts external prefix-cache hits, but no offload tier is configured or named by a counter: "
                "cold and GPU points only (name a tier with --sources and --flood-tokens to measure it)"
            )
    counters = [
        c
        for c in (GPU_HITS, EXTERNAL_HITS, SIM_BY_TIER, VLLM_BY_SOURCE, *LMCACHE_TIERS.values())
        if c in snap.flat or (c == SIM_BY_TIER and kind == "kvtier-sim")
    ]
    if GPU_HITS not in snap.flat:
        notes.append(f"{GPU_HITS} absent: GPU hits are read from usage.prompt_tokens_details.cached_tokens")
    for t in tiers:
        if t.capacity_tokens is None:
            notes.append(
                f"tier {t.name}: the server does not report its capacity; --flood-tokens {t.name}=N sizes "
                "the flood that pushes a prefix down to it"
            )
    return Server(kind, max_len, block, gpu_tokens, kvpt, tiers, counters, notes)


__all__ = ["STORES_PENDING", "Reading", "Server", "describe", "counter_of"]
