"""The series kvtier's vLLM backend adds to the engine's /metrics (through vLLM's offloading connector stats): each
name, its kind, its help and its labels, as data. No vLLM import here: vllm/spec.py makes vLLM's metadata of it."""

from __future__ import annotations

from typing import Literal

M_HIT_TOKENS = "kvtier:offload_hit_tokens"
M_STORED_BLOCKS = "kvtier:offload_stored_blocks"
M_DEMOTED_BLOCKS = "kvtier:offload_demoted_blocks"
M_EVICTED_BLOCKS = "kvtier:offload_evicted_blocks"
M_REJECTED_BLOCKS = "kvtier:offload_rejected_blocks"
M_HELD_BLOCKS = "kvtier:offload_tier_blocks"
M_CAPACITY_BLOCKS = "kvtier:offload_tier_capacity_blocks"
M_INFO = "kvtier:offload_info"
M_LOADED_BLOCKS = "kvtier:offload_loaded_blocks"
M_FAILED_LOADS = "kvtier:offload_failed_loads"
M_FAILED_STORES = "kvtier:offload_failed_stores"
M_MOVES = "kvtier:offload_worker_moves"
M_SERVER_ERRORS = "kvtier:offload_server_errors"
M_LOAD_IO_SECONDS = "kvtier:offload_load_io_seconds"
M_GATE = "kvtier:offload_gate_blocks"
M_SHARED_FOUND = "kvtier:offload_shared_found_blocks"

TIER = ("tier",)
SERIES: dict[str, tuple[Literal["counter", "gauge"], str, tuple[str, ...]]] = {
    M_HIT_TOKENS: (
        "counter",
        "Prompt tokens loaded from kvtier's offload tiers, by tier (the scheduler's planned tier)",
        TIER,
    ),
    M_STORED_BLOCKS: ("counter", "Blocks placed in kvtier's offload tiers, by tier", TIER),
    M_DEMOTED_BLOCKS: ("counter", "Blocks demoted to the next tier, by the tier they left", TIER),
    M_EVICTED_BLOCKS: ("counter", "Blocks dropped from the bottom tier", TIER),
    M_REJECTED_BLOCKS: ("counter", "Blocks offered for storing that no tier had room for", ()),
    M_HELD_BLOCKS: ("gauge", "Blocks each offload tier holds (stored and being stored)", TIER),
    M_CAPACITY_BLOCKS: ("gauge", "Blocks each offload tier can hold", TIER),
    M_INFO: (
        "gauge",
        "kvtier's offload tiers, fastest first, and the source label vLLM's by-source counters give their hits",
        ("tier", "source"),
    ),
    M_LOADED_BLOCKS: ("counter", "Block shards the workers loaded, by the tier that served them", TIER),
    M_FAILED_LOADS: (
        "counter",
        "Block shards whose load failed: reported to vLLM as failed blocks (recomputed), never as data",
        (),
    ),
    M_FAILED_STORES: ("counter", "Block shards whose store failed (a later load of them fails)", ()),
    M_MOVES: ("counter", "Demotions the workers carried out", ()),
    M_SERVER_ERRORS: (
        "counter",
        "Scheduler calls a shared store did not answer (a kvtier cache-server, or a shared Redis/S3 namespace): taken "
        "as misses, stores not offered",
        (),
    ),
    M_LOAD_IO_SECONDS: (
        "counter",
        "Seconds the tiers spent reading the block shards the workers loaded (each read's own time), by tier",
        TIER,
    ),
    M_SHARED_FOUND: (
        "counter",
        "Lookups of blocks this engine had not stored that a shared Redis/S3 namespace held (another replica's)",
        (),
    ),
    M_GATE: (
        "counter",
        "Blocks the live gate decided, by outcome: fetched, gated (answered miss: slower than recompute), probe, "
        "learning (kvtier/vllm/gate.py)",
        ("outcome",),
    ),
}

__all__ = ["SERIES", *[n for n in dir() if n.startswith("M_")]]
