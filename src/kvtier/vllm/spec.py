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

With ``cache_server`` (a socket of ``kvtier cache-server``) the index and the tiers are that server's,
shared by every replica pointed at it: the manager asks it instead of its own index (kvtier/vllm/client.py
``ServerIndex``) and the workers move blocks through pages they share with it (``ServerBlockWorker``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
)
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
from kvtier.keys import KeyScope, key_prefix
from kvtier.tiers import open_tiers
from kvtier.vllm import series as sr
from kvtier.vllm.client import ServerBlockWorker, ServerIndex
from kvtier.vllm.gate import LiveGate, chain, following
from kvtier.vllm.index import BlockIndex, SharedIndex, StorePlan
from kvtier.vllm.reqlog import RequestLog
from kvtier.vllm.settings import VllmOffloadSettings
from kvtier.vllm.worker import BlockLayout, BlockWorker, RequestIO

log = logging.getLogger("kvtier.vllm")


@dataclass
class KvtierConnectorMetadata(OffloadingConnectorMetadata):
    """vLLM's scheduler-to-worker metadata of a step, numbered: the workers echo the number back with the step's
    output, so the request log knows which step's output reached the scheduler (async scheduling included)."""

    step: int = 0


@dataclass
class KvtierWorkerMetadata(OffloadingWorkerMetadata):
    """vLLM's worker-to-scheduler metadata, plus the workers' own counts (kvtier/vllm/worker.py ``Counts``): what
    each tier really served and what failed, summed over the workers of a step; with the request log on, the
    step it answers and each request's finished loads (``RequestIO``)."""

    counts: dict[str, int] = field(default_factory=dict)
    lost_keys: list[bytes] = field(default_factory=list)  # blocks a worker could not load: the index forgets them
    step: int | None = None
    request_io: dict[str, RequestIO] = field(default_factory=dict)

    def aggregate(self, other: Any) -> Any:
        base = super().aggregate(other)
        merged = dict(self.counts)
        for k, v in getattr(other, "counts", {}).items():
            merged[k] = merged.get(k, 0) + v
        io = dict(self.request_io)
        for rid, got in getattr(other, "request_io", {}).items():
            io[rid] = io[rid].merge(got) if rid in io else got
        return KvtierWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            counts=merged,
            lost_keys=[*self.lost_keys, *getattr(other, "lost_keys", [])],
            step=self.step if self.step is not None else getattr(other, "step", None),
            request_io=io,
        )


class KvtierLoadStoreSpec(LoadStoreSpec):
    """The keys of a load, or a store's plan (its keys in the order of vLLM's source blocks, and the actions); the
    request it is for (the workers tag its loads with it for the request log)."""

    def __init__(self, keys: list[OffloadKey], plan: StorePlan[OffloadKey] | None = None, req_id: str = "") -> None:
        self.keys = keys
        self.plan = plan
        self.req_id = req_id

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
        model_revision=str(config.extra_config.get("model_revision") or ""),  # checked by the settings
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
        "scope": key_prefix(config.model.name),  # its keys stay this model's: another model's reset keeps them
    }


def _shared_key(config: OffloadingConfig) -> Any:
    """A block's key on a shared cache server: vLLM's key in the scope of every worker (rank 0's scope; the server
    keeps each worker's share under the key and its rank)."""
    scope = _scope(config, 0)
    return lambda k: scope.key(bytes(k))


class KvtierManager(OffloadingManager):
    def __init__(
        self,
        settings: VllmOffloadSettings,
        block_bytes: int,
        world_size: int,
        block_tokens: int,
        index: Any = None,
        engine: str = "",
    ) -> None:
        self.settings = settings
        self.block_tokens = block_tokens
        # the engine's own index (BlockIndex), a shared cache server's (client.ServerIndex: the same calls), SharedIndex
        self.index: Any = index
        if index is None:
            self.index = BlockIndex(settings.slots(block_bytes, world_size), settings.eviction)
        # a hit's source in the request log: the tier's name, on a shared cache server prefixed "shared-"
        self._prefix = "shared-" if settings.cache_server else ""
        if isinstance(self.index, ServerIndex) and settings.gate:
            self.index.gate = LiveGate(block_tokens, block_bytes * world_size)
        self.requests: RequestLog | None = None
        if settings.request_log:
            header = {
                "engine": engine,
                "block_tokens": block_tokens,
                "block_bytes": block_bytes * world_size,
                "world_size": world_size,
                "tiers": [{"name": self._prefix + t.name, "source": t.source} for t in self.index.tiers],
                "cache_server": settings.cache_server,
            }
            cap = int(settings.request_log_mb * 1024 * 1024)
            self.requests = RequestLog(
                settings.request_log, cap, header, block_tokens, block_bytes * world_size, tier_prefix=self._prefix
            )
        self._load_tiers: dict[str, dict[OffloadKey, str]] = {}  # the blocks of each admitted load, by request
        self._noted: set[str] = set()  # requests whose chain the index has seen
        self._hit_tokens: dict[str, int] = {}
        self._reported: dict[str, dict[str, int]] = {}
        self._worker_counts: dict[str, dict[str, int]] = {
            sr.M_LOADED_BLOCKS: {},
            sr.M_FAILED_LOADS: {},
            sr.M_FAILED_STORES: {},
            sr.M_MOVES: {},
            sr.M_LOAD_IO_SECONDS: {},
        }
        log.info(
            "kvtier offload tiers%s: %s (blocks of %d bytes per worker)",
            f" on cache server {settings.cache_server}" if settings.cache_server else "",
            ", ".join(f"{t.name} {t.slots} blocks" for t in self.index.tiers),
            block_bytes,
        )

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if isinstance(self.index, (ServerIndex, SharedIndex)):  # this block and the request's next, in one trip
            r = self.index.lookup(key, lambda: following(req_context, key))
        else:
            r = self.index.lookup(key)
        return LookupResult.HIT if r == "hit" else LookupResult.HIT_PENDING if r == "pending" else LookupResult.MISS

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        t = self.index.tier_of(key)
        return CacheHitSource(t.source) if t is not None else CacheHitSource.EXTERNAL_UNSPECIFIED

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        tiers: dict[OffloadKey, str] = {}
        for k in keys:
            t = self.index.tier_of(k)
            if t is not None:
                self._hit_tokens[t.name] = self._hit_tokens.get(t.name, 0) + self.block_tokens
                tiers[k] = self._prefix + t.name
        self.index.pin(keys)
        if self.requests is not None:
            self._load_tiers[req_context.req_id] = tiers
            self.requests.load_planned(req_context.req_id)
        return KvtierLoadStoreSpec(keys, req_id=req_context.req_id)

    def take_load_tiers(self, req_id: str) -> dict[OffloadKey, str]:
        """The tier of each block of the load just prepared for ``req_id`` (the request log's split of its hit)."""
        return self._load_tiers.pop(req_id, {})

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.index.touch(keys)

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.index.unpin(keys)

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if isinstance(self.index, BlockIndex) and req_context.req_id not in self._noted:
            self._noted.add(req_context.req_id)  # eviction fanout learns which blocks two continuations share
            self.index.note_chain(chain(req_context))
        plan = self.index.plan_store(keys)
        if plan is None:
            return None
        if self.requests is not None and plan.keys_to_store:
            by_tier: dict[str, int] = {}
            for i in plan.placed.values():
                name = self._prefix + self.index.tiers[i].name
                by_tier[name] = by_tier.get(name, 0) + 1
            self.requests.stores_planned(req_context.req_id, by_tier)
        return PrepareStoreOutput(
            keys_to_store=list(plan.keys_to_store),
            store_spec=KvtierLoadStoreSpec(list(plan.keys_to_store), plan),
            evicted_keys=list(plan.evicted),
        )

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self.index.complete_store(keys, success)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        """vLLM issues nothing more for the request: its record is complete (its last stores were started)."""
        self._noted.discard(req_context.req_id)
        if self.requests is not None:
            self._load_tiers.pop(req_context.req_id, None)
            self.requests.closed(req_context.req_id)

    def reset_cache(self) -> None:
        self.index.clear()

    def shutdown(self) -> None:
        if self.requests is not None:
            self.requests.close()

    def add_worker_counts(self, counts: dict[str, int]) -> None:
        """The workers' counts of one step (``loaded:TIER``, ``failed_loads``, ...), for the next stats."""
        for name, n in counts.items():
            what, _, tier = name.partition(":")
            metric = {
                "loaded": sr.M_LOADED_BLOCKS,
                "failed_loads": sr.M_FAILED_LOADS,
                "failed_stores": sr.M_FAILED_STORES,
                "moves": sr.M_MOVES,
                "load_ns": sr.M_LOAD_IO_SECONDS,
            }.get(what)
            if metric is not None:
                d = self._worker_counts[metric]
                d[tier] = d.get(tier, 0) + n
        gate = getattr(self.index, "gate", None)
        if gate is not None and counts.get("load_job:bytes"):
            gate.loaded(counts["load_job:bytes"], counts.get("load_job:ns", 0) / 1e9)

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = OffloadingConnectorStats()
        c = self.index.counters
        for name, now in (
            (sr.M_HIT_TOKENS, self._hit_tokens),
            (sr.M_STORED_BLOCKS, c.placed),
            (sr.M_DEMOTED_BLOCKS, c.demoted),
            (sr.M_EVICTED_BLOCKS, c.evicted),
            (sr.M_REJECTED_BLOCKS, {"": c.rejected}),
            *self._worker_counts.items(),
            (sr.M_SERVER_ERRORS, {"": getattr(self.index, "server_errors", 0)}),
            (sr.M_SHARED_FOUND, {"": getattr(self.index, "shared_found", 0)}),
            (sr.M_GATE, dict(self.index.gate.counts) if getattr(self.index, "gate", None) else {}),
        ):
            before = self._reported.setdefault(name, {})
            scale = 1e-9 if name == sr.M_LOAD_IO_SECONDS else 1  # kept in ns, exported in seconds
            for tier, n in now.items():
                if n != before.get(tier, 0):
                    stats.increase_counter(name, (n - before.get(tier, 0)) * scale, (tier,) if tier else ())
                    before[tier] = n
        for tier, (held, slots) in self.index.usage().items():
            stats.set_gauge(sr.M_HELD_BLOCKS, held, (tier,))
            stats.set_gauge(sr.M_CAPACITY_BLOCKS, slots, (tier,))
            stats.set_gauge(sr.M_INFO, 1, (tier, next(t.source for t in self.index.tiers if t.name == tier)))
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
                spec.settings.cache_server_token(),
            )
        else:
            scope = _scope(cfg, cfg.parallel.rank)
            if spec.settings.offload == "nvme":  # what killed engines left there, before the tier sizes itself
                from kvtier.engine.runs import remove_stale_runs

                remove_stale_runs(spec.settings.nvme_dir, log.warning)
            tiers = open_tiers(spec.settings.plan(layout.nbytes, cfg.parallel.world_size))
            self.io = BlockWorker(tiers, layout, lambda k: scope.key(bytes(k)), spec.settings.io_threads)
        self.tag_loads = bool(spec.settings.request_log)  # each load's timing by request, for the request log
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
        tag = src_spec.req_id if self.tag_loads else None
        self.io.submit_load(job_id, src_spec.keys, [int(b) for b in dst_spec.block_ids], tag)
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
        kinds = {"counter": OffloadingCounterMetadata, "gauge": OffloadingGaugeMetadata}
        return {name: kinds[kind](help_, labels) for name, (kind, help_, labels) in sr.SERIES.items()}

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.settings = _settings(config)
        self._manager: KvtierManager | None = None
        self._worker: KvtierWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            c = self.config
            index: Any = None
            if self.settings.cache_server:
                index = ServerIndex(
                    self.settings.cache_server, _shared_key(c), _hello(c), self.settings.cache_server_token()
                )
            elif self.settings.shared_namespace:  # another replica's blocks are found by asking the store
                slots = self.settings.slots(c.worker_kv_bytes_per_block, max(1, c.parallel.world_size))
                index = SharedIndex(slots, self.settings.shared_presence(_shared_key(c)), self.settings.eviction)
            self._manager = KvtierManager(
                self.settings,
                c.worker_kv_bytes_per_block,
                max(1, c.parallel.world_size),
                c.groups[0].tokens_per_block,
                index,
                str(c.engine_id),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvtierWorker(self, kv_caches)
        return self._worker


class KvtierOffloadingConnector(OffloadingConnector):
    """vLLM's offloading connector, with failed loads reported as failed blocks instead of stopping the engine,
    and the workers' counts carried to the scheduler (so they reach the engine's /metrics). With ``request_log``
    set, its scheduler side stamps every request for the manager's request log (kvtier/vllm/reqlog.py): when the
    scheduler got it, the lookup that admitted it, the admission's split (vLLM's own prefix-cache hit, the loaded
    tokens by tier), each step that scheduled it, and the step whose output held its first token."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tracked: dict[str, Any] = {}  # requests the log follows: vLLM's Request, for its computed tokens
        self._step = 0  # steps built (KvtierConnectorMetadata.step)

    def _kvtier_worker(self) -> KvtierWorker | None:
        w = getattr(self.connector_worker, "worker", None)
        return w if isinstance(w, KvtierWorker) else None

    def _requests(self) -> tuple[KvtierManager, RequestLog] | None:
        """The scheduler side's manager and its request log, when the log is on."""
        manager = getattr(self.connector_scheduler, "manager", None)
        if isinstance(manager, KvtierManager) and manager.requests is not None:
            return manager, manager.requests
        return None

    # -- worker side --------------------------------------------------------------------------------------
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
        io = w.io.take_request_io() if w.tag_loads else {}
        if not counts and not lost and not w.tag_loads:
            return meta
        base = meta if meta is not None else OffloadingWorkerMetadata()
        step = getattr(getattr(self, "_connector_metadata", None), "step", None)
        return KvtierWorkerMetadata(
            completed_jobs=base.completed_jobs,
            transfer_stats=base.transfer_stats,
            counts=counts,
            lost_keys=lost,
            step=step,
            request_io=io,
        )

    # -- scheduler side -------------------------------------------------------------------------------------
    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        manager = getattr(self.connector_scheduler, "manager", None)
        gate = getattr(getattr(manager, "index", None), "gate", None)
        if gate is not None and getattr(self, "_step_at", None):
            gate.prefilled(self._step_at[1], time.monotonic() - self._step_at[0])
        if isinstance(meta, KvtierWorkerMetadata) and isinstance(manager, KvtierManager):
            manager.add_worker_counts(meta.counts)
            if meta.lost_keys:
                manager.index.forget(OffloadKey(k) for k in meta.lost_keys)
            if manager.requests is not None:
                manager.requests.loads_done(meta.request_io)
                manager.requests.step_done(meta.step)
        super().update_connector_output(connector_output)

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        r = self._requests()
        if r is not None:
            self._tracked[request.request_id] = request
            r[1].seen(request.request_id, int(request.num_prompt_tokens), getattr(request, "arrival_time", None))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        started = time.monotonic()
        out = super().get_num_new_matched_tokens(request, num_computed_tokens)
        r = self._requests()
        if r is not None:
            r[1].lookup(request.request_id, started)
        return out

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        r = self._requests()
        if r is None:
            return
        manager, reqlog = r
        # the load's token ranges: vLLM keeps them on its per-request state (no public accessor in 0.32)
        status = self.connector_scheduler._req_status.get(request.request_id)
        local = status.num_locally_computed_tokens if status is not None else 0
        stats = getattr(request, "prefill_stats", None)
        if stats is not None and request.num_preemptions <= 0:
            local = int(stats.num_local_cached_tokens)  # what vLLM counts as its prefix cache's hit
        by_tier: dict[str, int] = {}
        tiers: dict[OffloadKey, str] = {}
        if num_external_tokens:
            tiers = manager.take_load_tiers(request.request_id)
            lo_all, hi_all = local, local + num_external_tokens
            for lo, hi, key in status.load_key_ranges if status is not None else ():
                lo, hi = max(lo, lo_all), min(hi, hi_all)
                if hi > lo:
                    name = tiers.get(key, "external_unspecified")
                    by_tier[name] = by_tier.get(name, 0) + hi - lo
            left = num_external_tokens - sum(by_tier.values())
            if left:  # tokens no loaded block covers: vLLM's external_unspecified
                by_tier["external_unspecified"] = by_tier.get("external_unspecified", 0) + left
        reqlog.admitted(request.request_id, local, num_external_tokens, by_tier, int(request.num_preemptions), tiers)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        self._step_at = (time.monotonic(), int(scheduler_output.total_num_scheduled_tokens))  # the live gate's
        r = self._requests()
        if r is None:
            return meta
        self._step += 1
        step = self._step
        scheduled = {
            rid: (int(self._tracked[rid].num_computed_tokens), int(n))
            for rid, n in scheduler_output.num_scheduled_tokens.items()
            if rid in self._tracked
        }
        r[1].scheduled(step, scheduled)
        return KvtierConnectorMetadata(
            load_jobs=meta.load_jobs, store_jobs=meta.store_jobs, jobs_to_flush=meta.jobs_to_flush, step=step
        )

    def _finished(self, request: Any) -> None:
        r = self._requests()
        if r is not None:
            self._tracked.pop(request.request_id, None)
            r[1].finished(request.request_id, getattr(request.status, "name", str(request.status)))

    def request_finished(self, request: Any, block_ids: list[int]) -> Any:
        self._finished(request)
        return super().request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]) -> Any:
        self._finished(request)
        return super().request_finished_all_groups(request, block_ids)


__all__ = [
    "KvtierOffloadingSpec",
    "KvtierOffloadingConnector",
    "KvtierManager",
    "KvtierWorker",
    "KvtierWorkerMetadata",
    "KvtierConnectorMetadata",
]
