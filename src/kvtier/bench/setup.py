"""From a validated BenchConfig to what the runner needs, checking everything before load starts.

Two steps, in this order:
* ``derive(cfg)`` — no I/O on the device: the model and its per-rank entry size, the seed, the
  I/O slots, the workload (users, conversations, system prompts, RAG corpus, trace or dataset
  read and validated, autoscaler), the memory check, and the warnings these imply.
* ``build_components(plan, sink)`` — the live parts: the tiers, the waterfall store, the noise
  buffer and the cache directory. Engine errors are translated here into ConfigErrors that name
  the flag (the engine itself knows no flags).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.autoscale import Autoscaler
from kvtier.bench.plan import Plan, Workload
from kvtier.bench.tier_setup import build_tiers, gds_for, host_tier_bytes
from kvtier.config.bench import BenchConfig
from kvtier.config.tiers import parse_tier_order
from kvtier.engine.backend import Backend
from kvtier.engine.device import DeviceMemory, DeviceNoise, native_memory
from kvtier.engine.file import FileTier
from kvtier.engine.memory import default_floor
from kvtier.engine.noise import EntrySource, NoiseBuffer
from kvtier.engine.runs import find_stale_runs, remove_stale_run, system_directory, wait_removals
from kvtier.engine.tiered import EventSink, StoreConfig, TieredStore
from kvtier.errors import ConfigError
from kvtier.keys import KeyScope
from kvtier.modelspec import ModelSpec, build_catalog, resolve_model
from kvtier.results.envelope import ResultWarning, WarningCode, warning
from kvtier.telemetry.host import mem_available_bytes
from kvtier.tiers import is_remote
from kvtier.tokenizer import load_tokenizer
from kvtier.tracefile import IOTraceWriter
from kvtier.units import GiB, MiB
from kvtier.workload.conversations import ConversationManager, ConversationSettings
from kvtier.workload.rag import RagCorpus, RagSettings, chunk_tokens_for, is_large_model
from kvtier.workload.sharegpt import Dataset, load_sharegpt
from kvtier.workload.traces import Trace, TraceFormat, load_trace
from kvtier.workload.users import make_users

MAX_IMPLICIT_IO_SLOTS = 500
"""--max-concurrent-allocs 0: one worker per user, at most this many (the reference's worker cap)."""


def io_slots(cfg: BenchConfig) -> tuple[int, int]:
    """(I/O workers, bytes per worker buffer). One worker per user up to 500, as the reference's workers
    (--max-concurrent-allocs then bounds writes only, bench/service.py); with --alloc-bound all-io,
    --max-concurrent-allocs workers when it is set. Each buffer is --io-chunk-mb unless the workers'
    buffers together would exceed --io-buffer-budget-mb, then budget / workers (a whole MiB, at least 1)."""
    slots = min(cfg.num_users, MAX_IMPLICIT_IO_SLOTS)
    if cfg.alloc_bound == "all-io" and cfg.max_concurrent_allocs:
        slots = cfg.max_concurrent_allocs
    per_slot_mb = max(1, min(cfg.io_chunk_mb, cfg.io_buffer_budget_mb // slots))
    return slots, per_slot_mb * MiB


"""I/O slots when --max-concurrent-allocs is 0 (unlimited in the reference): min(users, this)."""

log = logging.getLogger("kvtier.bench")


@dataclass
class Components:
    """The live parts of a run; ``close()`` releases memory and removes every file of ours."""

    store: TieredStore
    noise: NoiseBuffer
    file_tier: FileTier
    cache_dir: str
    owns_cache_dir: bool
    keep_cache: bool
    stop: threading.Event = field(default_factory=threading.Event)
    warnings: list[ResultWarning] = field(default_factory=list)
    stale_runs: dict[str, object] | None = None  # setup.stale_runs of the result
    io_trace: IOTraceWriter | None = None  # --io-trace-log: every tier is a NullTier, each operation a row
    io_trace_stats: dict[str, Any] | None = None  # the writer's figures once closed
    gds: dict[str, Any] = field(default_factory=dict)  # storage.gds: --gds requested, used, why
    remote: list[Backend] = field(default_factory=list)  # the Redis/S3 tiers (their servers, their cleanup)
    device: DeviceMemory | None = None  # --gpu-native: the device memory entries are made in and land in
    entries: EntrySource | None = None  # where requests' entries come from: --gpu-native's DeviceNoise, else noise

    @property
    def source(self) -> EntrySource:
        """What a request's write takes its entry's chunks from."""
        return self.entries if self.entries is not None else self.noise

    @property
    def trace_mode(self) -> bool:
        return self.io_trace is not None

    def close_trace(self) -> dict[str, Any] | None:
        """Finish the I/O trace file (idempotent); its figures."""
        if self.io_trace is not None and self.io_trace_stats is None:
            self.io_trace_stats = self.io_trace.close()
        return self.io_trace_stats

    def close(self) -> list[str]:
        """Release everything; returns what could not be removed (never raises for that)."""
        self.close_trace()
        self.store.close()
        if self.trace_mode:  # not among the store's tiers: a NullTier stood in for it
            self.file_tier.close()
        problems = list(self.file_tier.cleanup_problems)
        problems += [p for t in self.remote for p in getattr(t, "cleanup_problems", [])]
        if self.owns_cache_dir and not self.keep_cache:
            try:
                os.rmdir(self.cache_dir)
            except OSError as e:
                if problems:
                    problems.append(f"{self.cache_dir}: {e.strerror}")
        return problems


def check_config(cfg: BenchConfig) -> ModelSpec:
    """Checks that need no I/O: the model is known."""
    catalog = build_catalog(
        {k: v.model_dump(exclude_none=True, exclude_defaults=True) for k, v in cfg.tuning.model_configs.items()}
    )
    return resolve_model(cfg.model, catalog)


def _load_inputs(cfg: BenchConfig) -> tuple[Trace | None, Dataset | None]:
    trace = None
    if cfg.use_burst_trace or cfg.trace_path:
        path = cfg.trace_path or cfg.burst_trace_path
        if not path:
            raise ConfigError("--use-burst-trace: give --burst-trace-path (a BurstGPT CSV file or directory)")
        fmt: TraceFormat = "burstgpt" if (cfg.use_burst_trace and cfg.trace_format == "auto") else cfg.trace_format
        trace = load_trace(path, fmt)
    dataset = None
    if cfg.dataset_path:
        if trace is not None:
            raise ConfigError("--dataset-path: give either a dataset or a trace, not both")
        sg = cfg.tuning.sharegpt
        dataset = load_sharegpt(
            cfg.dataset_path,
            cfg.max_conversations,
            load_tokenizer("auto", chars_per_token=sg.chars_per_token_estimate),
            max_context_tokens=sg.max_context_tokens,
            max_generation_tokens=sg.max_generation_tokens,
        )
    return trace, dataset


def rag_settings(cfg: BenchConfig, model: ModelSpec) -> RagSettings:
    """The RAG corpus's shape from config ``rag`` (the reference's keys) and the model."""
    rt = cfg.tuning.rag
    size = "large" if is_large_model(model.hidden_dim, model.num_layers) else "small"
    lo, hi = getattr(rt, f"{size}_model_doc_tokens_min"), getattr(rt, f"{size}_model_doc_tokens_max")
    return RagSettings(
        num_docs=cfg.rag_num_docs,
        top_k=cfg.rag_top_k or rt.top_k_chunks,
        request_probability=rt.request_probability,
        doc_tokens=(lo, hi),
        chunk_tokens=chunk_tokens_for(
            rt.chunk_size_tokens, rt.max_chunk_bytes, model.kv_bytes_per_token_per_rank(cfg.tensor_parallel)
        ),
        distribution=rt.retrieval_distribution,
        max_documents=rt.max_documents,
    )


def shared_key_scope(cfg: BenchConfig, seed: int) -> dict[str, Any]:
    """In a shared remote namespace a key must name content wherever it is read: a conversation id names it
    only with the seed that drew the conversation, so it carries the seed; the system prompts, which every
    user of one deployment shares, are the namespace's (drawn from its name), so every rank and every run on
    it serves the same ones under the same keys."""
    name = cfg.shared_namespace
    if name is None:
        return {}
    return {
        "key_scope": f"s{seed}/",
        "prompt_seed": int.from_bytes(hashlib.blake2b(name.encode()).digest()[:4], "little"),
    }


def derive_workload(
    cfg: BenchConfig, model: ModelSpec, seed: int, trace: Trace | None, dataset: Dataset | None
) -> Workload:
    t = cfg.tuning
    conv, pc = t.conversation, t.prefix_cache
    scope = KeyScope(
        model_name=model.key,
        kv_dtype=model.dtype,
        attention_layout=model.attention,
        world_size=cfg.tensor_parallel,
        chunk_size=cfg.kv_chunk_tokens,
    )
    settings = ConversationSettings(
        layout=cfg.kv_layout,
        chunk_tokens=cfg.kv_chunk_tokens,
        multi_turn=not cfg.disable_multi_turn,
        prefix_caching=not cfg.disable_prefix_caching,
        end_probability=conv.end_conversation_probability,
        max_turns_per_conv=conv.max_turns_per_conv,
        max_context_tokens=conv.max_context_tokens,
        num_system_prompts=min(pc.num_system_prompts, pc.max_prefix_entries),
        system_prompt_tokens=(int(pc.system_prompt_tokens.low), int(pc.system_prompt_tokens.high)),
        system_prompt_probability=pc.system_prompt_hit_probability,
        min_prefix_length=pc.min_prefix_length,
        **shared_key_scope(cfg, seed),
    )
    rag = RagCorpus(rag_settings(cfg, model), seed) if cfg.enable_rag else None
    # The autoscaler changes live synthetic users; a trace or dataset replay fixes the load itself.
    autoscaler = (
        Autoscaler(
            cfg.autoscaler_mode,
            cfg.target_saturation,
            t.autoscaler,
            t.qos_profiles,
            t.saturation_detection,
            algorithm=cfg.autoscaler_algorithm,
        )
        if cfg.enable_autoscaling and trace is None and dataset is None
        else None
    )
    return Workload(
        users=make_users(cfg.num_users, t, seed),
        scope=scope,
        settings=settings,
        conversations=ConversationManager(conv.max_conversations),
        rag=rag,
        trace=trace,
        dataset=dataset,
        autoscaler=autoscaler,
        per_token_s=getattr(t.generation_timing, cfg.generation_mode),
        decode_batch=t.decode.batch_size,
    )


def derive(cfg: BenchConfig) -> Plan:
    """Everything the config implies, checked, before any tier is built."""
    model = check_config(cfg)
    system = system_directory(cfg.cache_dir) if cfg.cache_dir else None
    if system is not None:  # checked before the folder is created: the reference refuses these too
        raise ConfigError(f"--cache-dir {cfg.cache_dir}: a system directory ({system}); give a folder for the cache")
    trace, dataset = _load_inputs(cfg)
    # read up front, with the other inputs: a bad file is an error before the load, naming file and line
    validation = load_trace(cfg.validation_trace) if cfg.validation_trace else None
    seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")
    slots, chunk = io_slots(cfg)
    buffers = cfg.noise_mb * MiB + slots * chunk
    avail = mem_available_bytes()
    if avail and buffers > avail:
        raise ConfigError(
            f"--io-buffer-budget-mb {cfg.io_buffer_budget_mb}, --noise-mb {cfg.noise_mb}: the I/O buffers need "
            f"{buffers / GiB:.1f} GiB but only {avail / GiB:.1f} GiB of memory is available; lower them"
        )
    plan = Plan(cfg, model, seed, slots, chunk, derive_workload(cfg, model, seed, trace, dataset))
    cpu_tier, flags = host_tier_bytes(plan)  # the memory tiers that take host RAM
    if avail and cpu_tier + buffers > avail:
        # The tier's pages are taken as entries arrive (engine/memory.py): the size is a bound, not a claim.
        floor = default_floor() + buffers  # what engine/memory.py keeps for the host
        plan.warnings.append(
            warning(
                WarningCode.cpu_tier_exceeds_host,
                f"{', '.join(flags)}: the memory tiers and the I/O buffers ({(cpu_tier + buffers) / GiB:.1f}"
                f" GiB) are more than the {avail / GiB:.1f} GiB available now; the tier takes its pages as entries "
                f"arrive and stops growing if the host would keep less than {floor / GiB:.1f} GiB "
                "(host-memory-short)",
                cpu_tier_bytes=cpu_tier,
                buffer_bytes=buffers,
                host_available_bytes=avail,
                host_floor_bytes=floor,
            )
        )
    plan.validation = validation
    if chunk < cfg.io_chunk_mb * MiB:
        plan.warnings.append(
            warning(
                WarningCode.io_chunk_reduced,
                f"{slots} I/O workers share --io-buffer-budget-mb {cfg.io_buffer_budget_mb}: each I/O call "
                f"moves at most {chunk // MiB} MiB (--io-chunk-mb {cfg.io_chunk_mb})",
                io_slots=slots,
                io_chunk_bytes=chunk,
                requested_io_chunk_bytes=cfg.io_chunk_mb * MiB,
            )
        )
    tp = cfg.tensor_parallel
    if not model.shards_like_reference(tp):
        share = (
            "the whole MLA latent"
            if model.attention == "mla"
            else f"{model.kv_heads_per_rank(tp)} of {model.kv_heads} KV heads"
        )
        plan.warnings.append(
            warning(
                WarningCode.tp_sharding_differs,
                f"--tensor-parallel {tp}: each rank stores {model.kv_bytes_per_token_per_rank(tp):,} B/token "
                f"({share}); "
                f"the MLPerf reference divides every entry by {tp}",
                tensor_parallel=tp,
                kv_bytes_per_token_per_rank=model.kv_bytes_per_token_per_rank(tp),
                reference_kv_bytes_per_token_per_rank=model.kv_bytes_per_token / tp,
            )
        )
    if dataset is not None and dataset.skipped_records:
        plan.warnings.append(
            warning(
                WarningCode.dataset_records_skipped,
                f"dataset: {dataset.skipped_records} records without a human/assistant pair skipped",
                count=dataset.skipped_records,
            )
        )
    if trace is not None and trace.skipped_rows:
        plan.warnings.append(
            warning(
                WarningCode.trace_rows_skipped,
                f"trace: {trace.skipped_rows} rows with 0 response tokens (failed in the source) skipped",
                count=trace.skipped_rows,
            )
        )
    log.debug(
        "derived: model %s (%d B/token per rank), seed %d, %d I/O slots",
        model.key,
        model.kv_bytes_per_token_per_rank(tp),
        seed,
        slots,
    )
    return plan


def stale_runs(cache_dir: str, keep: bool, warnings: list[ResultWarning]) -> dict[str, object] | None:
    """What earlier runs left in ``cache_dir``: their background removals, waited for (no run measures another's
    deletion), and the folders of killed runs, removed (unless ``keep``) and said so. Done before the file tier
    measures the free space, so it sizes itself from what is really free."""
    under_way, waited = wait_removals(cache_dir)
    wait = {"removals_under_way": under_way, "removal_wait_s": round(waited, 3)} if under_way else {}
    if under_way:
        log.info("waited %.1f s for %d earlier runs' files to be removed from %s", waited, under_way, cache_dir)
    found = find_stale_runs(cache_dir)
    if not found:
        return {"folders": [], "bytes": 0, "removed": False, "problems": [], **wait} if wait else None
    folders, nbytes = [r.path for r in found], sum(r.bytes for r in found)
    problems = [] if keep else [p for r in found for p in remove_stale_run(r.path)]
    if keep:
        warnings.append(
            warning(
                WarningCode.stale_runs_found,
                f"{len(found)} run folders of killed kvtier runs "
                f"({nbytes / GiB:.2f} GiB) are in {cache_dir} and were kept (--keep-stale); "
                "`kvtier clean` removes them",
                folders=folders,
                bytes=nbytes,
            )
        )
    else:
        warnings.append(
            warning(
                WarningCode.stale_runs_removed,
                f"removed {len(found)} run folders of killed kvtier runs ({nbytes / GiB:.2f} GiB) from {cache_dir}",
                folders=folders,
                bytes=nbytes,
                problems=problems,
            )
        )
    return {"folders": folders, "bytes": nbytes, "removed": not keep, "problems": problems, **wait}


def build_components(plan: Plan, sink: EventSink) -> Components:
    """The tiers, the store, the noise buffer and the cache directory of a derived run."""
    cfg = plan.config
    warnings: list[ResultWarning] = []
    device = native_memory() if cfg.gpu_native else None  # refused without a device, before anything is made
    owns = cfg.cache_dir is None
    cache_dir = cfg.cache_dir or tempfile.mkdtemp(prefix="kvtier-cache-")
    if not owns and not os.path.lexists(cache_dir):  # created, as the reference does
        try:
            os.makedirs(cache_dir)
        except OSError as e:
            raise ConfigError(f"--cache-dir: cannot create {cache_dir}: {e.strerror}") from e
        log.info("created --cache-dir %s", cache_dir)
    stop = threading.Event()
    stale = None if owns else stale_runs(cache_dir, cfg.keep_stale, warnings)
    try:
        order = parse_tier_order(cfg.tier_order, cfg.configured_tiers())
        gds = gds_for(cfg, warnings)
        backends, file_tier = build_tiers(plan, cache_dir, warnings, order, gds, device)
        ev = cfg.tuning.eviction
        try:
            store = TieredStore(
                backends,
                StoreConfig(
                    target_usage_ratio=ev.target_usage_ratio,
                    large_entry_limit_ratio=ev.large_entry_limit_ratio,
                    max_recursion=ev.max_recursion_depth,
                    promotion=cfg.promotion,
                    max_evictions_hard_cap=ev.max_evictions_hard_cap,
                    max_evictions_min=ev.max_evictions_min,
                    reserve_wait_s=ev.reserve_wait_s,
                    tier_eviction_caps={"gpu": cfg.tuning.gpu_backend.max_eviction_attempts},
                    tier_target_ratios={"storage": cfg.s3_cold_threshold} if cfg.s3_cold_threshold else {},
                ),
                sink,
                stop,
                device,
            )
        except ValueError as e:  # the engine names no flag: say which ones size the tiers
            for b in backends:
                b.close()
            raise ConfigError(
                f"--cpu-mem-gb / --storage-capacity-gb: {e} (the storage tier found "
                f"{file_tier.detected_free_bytes} bytes free)"
            ) from e
        except BaseException:
            for b in backends:
                b.close()
            raise
    except BaseException:
        if owns:
            shutil.rmtree(cache_dir, ignore_errors=True)
        raise
    io_trace = None
    if cfg.io_trace_log:
        try:
            io_trace = IOTraceWriter(cfg.io_trace_log)
        except OSError as e:
            store.close()
            file_tier.close()
            if owns:
                shutil.rmtree(cache_dir, ignore_errors=True)
            raise ConfigError(f"--io-trace-log: cannot write {cfg.io_trace_log}: {e.strerror or e}") from e
        store.io_log = io_trace
        warnings.append(
            warning(
                WarningCode.trace_mode,
                f"I/O trace mode: no tier I/O was performed (each operation is a row of {cfg.io_trace_log}); "
                "latencies and bandwidths of this result are not measurements",
                io_trace_log=cfg.io_trace_log,
            )
        )
    largest_entry = plan.entry_bytes(max(int(t.context_range.high) for t in cfg.tuning.user_templates.values()))
    # the largest entry any tier accepts (an entry too large for one tier goes on to the next)
    bottom = max(t.capacity_bytes for t in backends) * cfg.tuning.eviction.large_entry_limit_ratio
    if largest_entry > bottom:
        warnings.append(
            warning(
                WarningCode.entry_exceeds_tier,
                f"the largest possible entry ({largest_entry / GiB:.2f} GiB) exceeds what any "
                f"tier accepts ({bottom / GiB:.2f} GiB): such requests will fail",
                largest_entry_bytes=largest_entry,
                tier_limit_bytes=int(bottom),
            )
        )
    log.debug(
        "components: tiers %s, direct I/O %s, cache dir %s",
        " > ".join(store.tier_names),
        "on" if file_tier.direct else "off",
        cache_dir,
    )
    noise = NoiseBuffer(cfg.noise_mb * MiB, plan.seed, cfg.payload)
    return Components(
        store,
        noise,
        file_tier,
        cache_dir,
        owns,
        cfg.keep_cache,
        stop,
        warnings,
        stale,
        io_trace,
        gds=gds,
        remote=[b for b in backends if is_remote(b.name)] if not cfg.io_trace_log else [],
        device=device,
        entries=DeviceNoise(noise, device) if device is not None else None,
    )


__all__ = [
    "Plan",
    "Workload",
    "Components",
    "derive",
    "derive_workload",
    "build_components",
    "check_config",
    "MAX_IMPLICIT_IO_SLOTS",
    "io_slots",
]
