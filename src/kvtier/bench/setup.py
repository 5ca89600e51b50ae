"""Turn a validated BenchConfig into live components, checking everything before load starts."""

from __future__ import annotations

import math
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field

from kvtier.config.bench import BenchConfig
from kvtier.engine.backend import Backend
from kvtier.engine.file import FileTier
from kvtier.engine.gpu import GpuTier, gpu_available
from kvtier.engine.memory import MemoryTier
from kvtier.engine.noise import NoiseBuffer
from kvtier.engine.tiered import StoreConfig, TieredStore
from kvtier.errors import ConfigError
from kvtier.modelspec import ModelSpec, build_catalog, resolve_model
from kvtier.telemetry.host import mem_available_bytes
from kvtier.workload.sharegpt import Dataset, load_sharegpt
from kvtier.workload.traces import Trace, load_trace

GiB = 1024**3
MiB = 1024**2
MAX_IMPLICIT_IO_SLOTS = 32
"""I/O slots when --max-concurrent-allocs is 0 (unlimited in the reference): min(users, this)."""


@dataclass
class Components:
    config: BenchConfig
    model: ModelSpec
    seed: int
    store: TieredStore
    noise: NoiseBuffer
    file_tier: FileTier | None
    io_slots: int
    io_chunk_bytes: int
    cache_dir: str
    owns_cache_dir: bool
    stop: threading.Event = field(default_factory=threading.Event)
    warnings: list[str] = field(default_factory=list)
    trace: Trace | None = None
    dataset: Dataset | None = None

    def close(self) -> None:
        self.store.close()
        if self.owns_cache_dir and not self.config.keep_cache:
            try:
                os.rmdir(self.cache_dir)
            except OSError:
                pass


def check_config(cfg: BenchConfig) -> ModelSpec:
    """Checks that need no I/O: model known, flags not silently ignored."""
    missing = cfg.not_yet_implemented()
    if missing:
        raise ConfigError(f"{missing[0]}: not implemented in this version of kvtier bench "
                          "(workload modes arrive with the 'realistic workloads' issue)")
    catalog = build_catalog({k: v.model_dump(exclude_none=True, exclude_defaults=True)
                             for k, v in cfg.tuning.model_configs.items()})
    return resolve_model(cfg.model, catalog)


def build_components(cfg: BenchConfig, sink: object) -> Components:
    model = check_config(cfg)
    trace = None
    if cfg.use_burst_trace or cfg.trace_path:
        path = cfg.trace_path or cfg.burst_trace_path
        if not path:
            raise ConfigError("--use-burst-trace: give --burst-trace-path (a BurstGPT CSV file or directory)")
        fmt = "burstgpt" if (cfg.use_burst_trace and cfg.trace_format == "auto") else cfg.trace_format
        trace = load_trace(path, fmt)  # type: ignore[arg-type]
    dataset = None
    if cfg.dataset_path:
        if trace is not None:
            raise ConfigError("--dataset-path: give either a dataset or a trace, not both")
        dataset = load_sharegpt(cfg.dataset_path, cfg.max_conversations)
    stop = threading.Event()
    warnings: list[str] = []
    seed = cfg.seed if cfg.seed is not None else int.from_bytes(os.urandom(4), "little")

    slots = cfg.max_concurrent_allocs or min(cfg.num_users, MAX_IMPLICIT_IO_SLOTS)
    need = int(cfg.cpu_mem_gb * GiB) + cfg.noise_mb * MiB + slots * cfg.io_chunk_mb * MiB
    avail = mem_available_bytes()
    if avail and need > avail:
        raise ConfigError(f"--cpu-mem-gb {cfg.cpu_mem_gb:g}: the CPU tier plus buffers need {need / GiB:.1f} GiB "
                          f"but only {avail / GiB:.1f} GiB of memory is available; lower --cpu-mem-gb")
    owns = cfg.cache_dir is None
    cache_dir = cfg.cache_dir or tempfile.mkdtemp(prefix="kvtier-cache-")
    backends: list[Backend] = []
    file_tier: FileTier | None = None
    try:
        if cfg.gpu_mem_gb > 0:
            ok, why = gpu_available()
            if ok:
                backends.append(GpuTier(int(cfg.gpu_mem_gb * cfg.num_gpus * GiB)))
            else:
                warnings.append(f"GPU tier off: --gpu-mem-gb {cfg.gpu_mem_gb:g} asked for, but {why}")
        if cfg.cpu_mem_gb > 0:
            backends.append(MemoryTier(int(cfg.cpu_mem_gb * GiB)))
        file_tier = FileTier(cache_dir, int(cfg.storage_capacity_gb * GiB), cfg.direct_io,
                             keep_files=cfg.keep_cache)
        backends.append(file_tier)
        if not file_tier.direct:
            why = "--direct-io off" if cfg.direct_io == "off" else "the filesystem refuses O_DIRECT"
            warnings.append(f"direct I/O off ({why}): buffered write+fsync and fadvise(DONTNEED) are used instead")
        ev = cfg.tuning.eviction
        store = TieredStore(backends, StoreConfig(ev.target_usage_ratio, ev.large_entry_limit_ratio,
                                                  ev.max_recursion_depth, cfg.promotion), sink, stop)  # type: ignore[arg-type]
    except BaseException:
        for b in backends:
            b.close()
        if owns:
            shutil.rmtree(cache_dir, ignore_errors=True)
        raise

    largest_entry = math.ceil(model.kv_bytes(max(int(t.context_range.high) for t in cfg.tuning.user_templates.values()))
                              / cfg.tensor_parallel)
    bottom = file_tier.capacity_bytes * cfg.tuning.eviction.large_entry_limit_ratio
    if largest_entry > bottom:
        warnings.append(f"the largest possible entry ({largest_entry / GiB:.2f} GiB) exceeds what the storage tier "
                        f"accepts ({bottom / GiB:.2f} GiB): such requests will fail")
    if dataset is not None and dataset.skipped_records:
        warnings.append(f"dataset: {dataset.skipped_records} records without a human/assistant pair skipped")
    if trace is not None and trace.skipped_rows:
        warnings.append(f"trace: {trace.skipped_rows} rows with 0 response tokens (failed in the source) skipped")
    return Components(cfg, model, seed, store, NoiseBuffer(cfg.noise_mb * MiB, seed), file_tier, slots,
                      cfg.io_chunk_mb * MiB, cache_dir, owns, stop, warnings, trace, dataset)
