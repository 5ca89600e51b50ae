"""kvtier's tiers as a vLLM offloading backend: an out-of-tree ``OffloadingSpec`` for vLLM 0.32's offloading
connector, and a thin subclass of that connector that reports failed loads to vLLM.

Use (kvtier importable in the engine's environment: ``kvtier launch`` puts it on the replica's PYTHONPATH)::

    --kv-transfer-config '{"kv_connector": "KvtierOffloadingConnector",
      "kv_connector_module_path": "kvtier.vllm.spec", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"spec_name": "KvtierOffloadingSpec", "spec_module_path": "kvtier.vllm.spec",
                                    "offload": "nvme", "staging_gb": 0.25, "nvme_dir": "/mnt/nvme",
                                    "nvme_offload_gb": 8}}'

``kv_connector: OffloadingConnector`` (vLLM's own) works too, but a failed load then stops the engine: its
connector asserts every transfer succeeded. Ours finishes the job and names the failed blocks
(``get_block_ids_with_load_errors``), so vLLM recomputes them.

Scheduler side: ``KvtierManager`` keeps the index (kvtier/vllm/index.py) and answers vLLM's lookups, loads
and stores; a hit's source is the tier's (CPU RAM ``host``, NVMe ``disk``), so vLLM's own
``prompt_tokens_cached_by_source`` counter says which tier served a prefix. Worker side: ``KvtierWorker``
adapts kvtier/vllm/worker.py's BlockWorker. The spec's own series (``kvtier:offload_*``, by tier) are
emitted through vLLM's connector stats on the engine's /metrics.

With ``cache_server`` (a socket of ``kvtier cache-server --serve vllm``) the index and the tiers are that server's,
shared by every replica pointed at it: the manager asks it instead of its own index (kvtier/vllm/client.py
``ServerIndex``) and the workers move blocks through pages they share with it (``ServerBlockWorker``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.errors import ConfigError
from kvtier.keys import KeyScope
from kvtier.tiers import open_tiers
from kvtier.vllm.client import ServerBlockWorker, ServerIndex
from kvtier.vllm.index import BlockIndex, StorePlan
from kvtier.vllm.settings import VllmOffloadSettings
from kvtier.vllm.worker import BlockLayout, BlockWorker

log = logging.getLogger("kvtier.vllm")

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


@dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler metadata, plus the workers' own counts (kvtier/vllm/worker.py ``Counts``): what
    each tier really served and what failed, summed over the workers of a step."""

    counts: dict[str, int] = field(default_factory=dict)
    lost_keys: list[bytes] = field(default_factory=list)  # blocks a worker could not load: the index forgets them

    def aggregate(self, other: Any) -> Any:
        base = super().aggregate(other)
        merged = dict(self.counts)
        for k, v in getattr(other, "counts", {}).items():
            merged[k] = merged.get(k, 0) + v
        return KvtierWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            counts=merged,
            lost_keys=[*self.lost_keys, *getattr(other, "lost_keys", [])],
        )


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The keys of a load, or a store's plan (its keys in the order of vLLM's source blocks, and the actions)."""

    def __init__(self, keys: list[OffloadKey], plan: StorePlan[OffloadKey] | None = None) -> None:
        self.keys = keys
        self.plan = plan

    def __repr__(self) -> str:
        return f"KvtierLoadStoreSpec({len(self.keys)} blocks{', plan' if self.plan else ''})"


def _settings(config: OffloadingConfig) -> VllmOffloadSettings:
    if config.cache.blocks_per_chunk != 1:
        raise ConfigError(
            f"kv_connector_extra_config: blocks_per_chunk {config.cache.blocks_per_chunk}: kvtier's backend stores "
            "one vLLM block per entry (leave blocks_per_chunk and block_size unset)"
        )
    if len(config.groups) != 1:
        raise ConfigError(
            f"kvtier's vLLM backend serves models with one KV cache group; this one has {len(config.groups)}"
        )
    return VllmOffloadSettings.from_extra(config.extra_config)


def _scope(config: OffloadingConfig, rank: int) -> KeyScope:
    """Keys scoped by model, dtype, layout, tensor-parallel shard and block size: a block stored by one model,
    dtype or rank is never read as another's."""
    p = config.parallel
    layout = f"vllm:{config.kv_cache_layout or 'default'}:tp{p.tp_size}:pp{p.pp_size}:pcp{p.pcp_size}:dcp{p.dcp_size}"
    return KeyScope(
        model_name=config.model.name,
        kv_dtype=str(config.model.dtype),
        attention_layout=layout,
        world_size=max(1, p.world_size),
        kv_rank=rank,
        chunk_size=config.groups[0].tokens_per_block,
    )


def _hello(config: OffloadingConfig) -> dict[str, Any]:
    """What an engine tells a shared cache server about itself: its identity and block geometry."""
    return {
        "engine": config.engine_id,
        "block_bytes": config.worker_kv_bytes_per_block,
        "block_tokens": config.groups[0].tokens_per_block,
        "world_size": max(1, config.parallel.world_size),
        "rank": config.parallel.rank,
    }


def _shared_key(config: OffloadingConfig) -> Any:
    """A block's key on a shared cache server: vLLM's key in the scope of every worker (rank 0's scope; the server
    keeps each worker's share under the key and its rank)."""
    scope = _scope(config, 0)
    return lambda k: scope.key(bytes(k))


class KvtierManager(OffloadingManager):
    def __init__(
        self, settings: VllmOffloadSettings, block_bytes: int, world_size: int, block_tokens: int, index: Any = None
    ) -> None:
        self.settings = settings
        self.block_tokens = block_tokens
        # the engine's own index (BlockIndex), or a shared cache server's (client.ServerIndex: the same calls)
        self.index: Any = index if index is not None else BlockIndex(settings.slots(block_bytes, world_size))
        self._hit_tokens: dict[str, int] = {}
        self._reported: dict[str, dict[str, int]] = {}
        self._worker_counts: dict[str, dict[str, int]] = {
            M_LOADED_BLOCKS: {},
            M_FAILED_LOADS: {},
            M_FAILED_STORES: {},
            M_MOVES: {},
        }
        log.info(
            "kvtier offload tiers%s: %s (blocks of %d bytes per worker)",
            f" on cache server {settings.cache_server}" if settings.cache_server else "",
            ", ".join(f"{t.name} {t.slots} blocks" for t in self.index.tiers),
            block_bytes,
        )

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        r = self.index.lookup(key)
        return LookupResult.HIT if r == "hit" else LookupResult.HIT_PENDING if r == "pending" else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        t = self.index.tier_of(key)
        return CacheHitSource(t.source) if t is not None else CacheHitSource.EXTERNAL_UNSPECIFIED

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        for k in keys:
            t = self.index.tier_of(k)
            if t is not None:
                self._hit_tokens[t.name] = self._hit_tokens.get(t.name, 0) + self.block_tokens
        self.index.pin(keys)
        return KvtierLoadStoreSpec(keys)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.index.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.index.unpin(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        plan = self.index.plan_store(keys)
        if plan is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=list(plan.keys_to_store),
            store_spec=KvtierLoadStoreSpec(list(plan.keys_to_store), plan),
            evicted_keys=list(plan.evicted),
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.index.complete_store(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def reset_cache(self) -> None:
        self.index.clear()

    def add_worker_counts(self, counts: dict[str, int]) -> None:
        """The workers' counts of one step (``loaded:TIER``, ``failed_loads``, ...), for the next stats."""
        for name, n in counts.items():
            what, _, tier = name.partition(":")
            metric = {
                "loaded": M_LOADED_BLOCKS,
                "failed_loads": M_FAILED_LOADS,
                "failed_stores": M_FAILED_STORES,
                "moves": M_MOVES,
            }.get(what)
            if metric is not None:
                d = self._worker_counts[metric]
                d[tier] = d.get(tier, 0) + n

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        c = self.index.counters
        for name, now in (
            (M_HIT_TOKENS, self._hit_tokens),
            (M_STORED_BLOCKS, c.placed),
            (M_DEMOTED_BLOCKS, c.demoted),
            (M_EVICTED_BLOCKS, c.evicted),
            (M_REJECTED_BLOCKS, {"": c.rejected}),
            *self._worker_counts.items(),
            (M_SERVER_ERRORS, {"": getattr(self.index, "server_errors", 0)}),
        ):
            before = self._reported.setdefault(name, {})
            for tier, n in now.items():
                if n != before.get(tier, 0):
                    stats.increase_counter(name, n - before.get(tier, 0), (tier,) if tier else ())
                    before[tier] = n
        for tier, (held, slots) in self.index.usage().items():
            stats.set_gauge(M_HELD_BLOCKS, held, (tier,))
            stats.set_gauge(M_CAPACITY_BLOCKS, slots, (tier,))
            stats.set_gauge(M_INFO, 1, (tier, next(t.source for t in self.index.tiers if t.name == tier)))
        return stats


class KvtierWorker(OffloadingWorker):
    def __init__(self, spec: KvtierOffloadingSpec, kv_caches: CanonicalKVCaches) -> None:
        layout = BlockLayout.from_canonical(kv_caches)
        cfg = spec.config
        if layout.nbytes != cfg.worker_kv_bytes_per_block:
            log.warning(
                "kvtier: a block is %d bytes in the KV tensors, vLLM says %d per worker",
                layout.nbytes,
                cfg.worker_kv_bytes_per_block,
            )
        if spec.settings.cache_server:
            self.io: BlockWorker = ServerBlockWorker(
                spec.settings.cache_server,
                layout,
                _shared_key(cfg),
                {**_hello(cfg), "block_bytes": layout.nbytes},
                spec.settings.io_threads,
            )
        else:
            scope = _scope(cfg, cfg.parallel.rank)
            tiers = open_tiers(spec.settings.plan(layout.nbytes, cfg.parallel.world_size))
            self.io = BlockWorker(tiers, layout, lambda k: scope.key(bytes(k)), spec.settings.io_threads)
        log.info(
            "kvtier offload worker rank %d: tiers %s, %d-byte blocks, %d I/O threads",
            cfg.parallel.rank,
            ", ".join(self.io.tier_names),
            layout.nbytes,
            spec.settings.io_threads,
        )

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvtierLoadStoreSpec) and dst_spec.plan is not None
        self.io.submit_store(job_id, [int(b) for b in src_spec.block_ids], dst_spec.plan)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KvtierLoadStoreSpec)
        self.io.submit_load(job_id, src_spec.keys, [int(b) for b in dst_spec.block_ids])
        return True

    def get_finished(self) -> list[TransferResult]:
        return [TransferResult(r.job_id, r.success, r.nbytes, r.seconds) for r in self.io.take_results()]

    def wait(self, job_ids: set[int]) -> None:
        self.io.wait(job_ids)

    def shutdown(self) -> None:
        self.io.close()


class KvtierOffloadingSpec(OffloadingSpec):
    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        tier = ("tier",)
        return {
            M_HIT_TOKENS: OffloadingCounterMetadata(
                "Prompt tokens loaded from kvtier's offload tiers, by tier (the scheduler's planned tier)", tier
            ),
            M_STORED_BLOCKS: OffloadingCounterMetadata("Blocks placed in kvtier's offload tiers, by tier", tier),
            M_DEMOTED_BLOCKS: OffloadingCounterMetadata("Blocks demoted to the next tier, by the tier they left", tier),
            M_EVICTED_BLOCKS: OffloadingCounterMetadata("Blocks dropped from the bottom tier", tier),
            M_REJECTED_BLOCKS: OffloadingCounterMetadata("Blocks offered for storing that no tier had room for"),
            M_HELD_BLOCKS: OffloadingGaugeMetadata("Blocks each offload tier holds (stored and being stored)", tier),
            M_CAPACITY_BLOCKS: OffloadingGaugeMetadata("Blocks each offload tier can hold", tier),
            M_INFO: OffloadingGaugeMetadata(
                "kvtier's offload tiers, fastest first, and the source label vLLM's by-source counters give their hits",
                ("tier", "source"),
            ),
            M_LOADED_BLOCKS: OffloadingCounterMetadata(
                "Block shards the workers loaded, by the tier that served them", tier
            ),
            M_FAILED_LOADS: OffloadingCounterMetadata(
                "Block shards whose load failed: reported to vLLM as failed blocks (recomputed), never as data"
            ),
            M_FAILED_STORES: OffloadingCounterMetadata("Block shards whose store failed (a later load of them fails)"),
            M_MOVES: OffloadingCounterMetadata("Demotions the workers carried out"),
            M_SERVER_ERRORS: OffloadingCounterMetadata(
                "Scheduler calls a shared kvtier cache-server did not answer (taken as misses, stores not offered)"
            ),
        }

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = _settings(config)
        self._manager: KvtierManager | None = None
        self._worker: KvtierWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            c = self.config
            index = None
            if self.settings.cache_server:
                index = ServerIndex(self.settings.cache_server, _shared_key(c), _hello(c))
            self._manager = KvtierManager(
                self.settings,
                c.worker_kv_bytes_per_block,
                max(1, c.parallel.world_size),
                c.groups[0].tokens_per_block,
                index,
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierWorker(self, kv_caches)
        return self._worker


class KvtierOffloadingConnector(OffloadingConnector):
    """vLLM's offloading connector, with failed loads reported as failed blocks instead of stopping the engine,
    and the workers' counts carried to the scheduler (so they reach the engine's /metrics)."""

    def _kvtier_worker(self) -> KvtierWorker | None:
        w = getattr(self.connector_worker, "worker", None)
        return w if isinstance(w, KvtierWorker) else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        w = self._kvtier_worker()
        return w.io.take_load_errors() if w is not None else set()

    def build_connector_worker_meta(self) -> Any:
        meta = super().build_connector_worker_meta()
        w = self._kvtier_worker()
        if w is None:
            return meta
        lost = [bytes(k) for k in w.io.take_lost_keys()]
        counts = w.io.counters.take()
        if not counts and not lost:
            return meta
        base = meta if meta is not None else OffloadingWorkerMetadata()
        return KvtierWorkerMetadata(
            completed_jobs=base.completed_jobs, transfer_stats=base.transfer_stats, counts=counts, lost_keys=lost
        )

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = getattr(self.connector_scheduler, "manager", None)
        if isinstance(meta, KvtierWorkerMetadata) and isinstance(manager, KvtierManager):
            manager.add_worker_counts(meta.counts)
            if meta.lost_keys:
                manager.index.forget(OffloadKey(k) for k in meta.lost_keys)
        super().update_connector_output(connector_output)


__all__ = ["KvtierOffloadingSpec", "KvtierOffloadingConnector", "KvtierManager", "KvtierWorker", "KvtierWorkerMetadata"]
