"""The bench's tiers as its flags ask for them, built through the tier table (kvtier/tiers.py): the GPU tier
capped to what the device allows, the CPU tier's page, the storage tier (with --gds resolved), the remote
tiers and what their servers' limits imply; in trace mode, each kind's stand-in instead."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from kvtier.config.bench import BenchConfig
from kvtier.engine.backend import Backend
from kvtier.engine.device import gpu_available, gpu_memory_bytes
from kvtier.engine.file import FileTier
from kvtier.errors import ConfigError
from kvtier.results.envelope import ResultWarning, WarningCode, warning
from kvtier.tiers import KINDS, Ask, TierSpec, is_remote, open_tier, stand_in
from kvtier.units import GiB, MiB

if TYPE_CHECKING:
    from kvtier.bench.plan import Plan
    from kvtier.engine.device import DeviceMemory


def _gpu_tier(cfg: BenchConfig, warnings: list[ResultWarning], device: DeviceMemory | None = None) -> Backend:
    """The GPU tier: --gpu-mem-gb x --num-gpus, within what gpu_backend lets this process use of
    the device (memory_fraction, less free_memory_threshold kept free); capped with a warning. ``device``:
    --gpu-native's device memory (the tier then hands out views of its memory to reads)."""
    gb = cfg.tuning.gpu_backend
    asked = int(cfg.gpu_mem_gb * cfg.num_gpus * GiB)
    total = device.total_bytes() if device is not None else gpu_memory_bytes(0)
    usable = int(total * min(gb.memory_fraction, 1.0 - gb.free_memory_threshold))
    if asked > usable:
        warnings.append(
            warning(
                WarningCode.gpu_tier_capped,
                f"GPU tier capped at {usable / GiB:.2f} GiB: --gpu-mem-gb {cfg.gpu_mem_gb:g} x --num-gpus "
                f"{cfg.num_gpus} asks {asked / GiB:.2f} GiB of one {total / GiB:.2f} GiB device "
                f"(gpu_backend.memory_fraction {gb.memory_fraction:g}, free_memory_threshold "
                f"{gb.free_memory_threshold:g})",
                requested_bytes=asked,
                capacity_bytes=usable,
                device_bytes=total,
            )
        )
    return open_tier("gpu", TierSpec(min(asked, usable), memory_fraction=gb.memory_fraction, device=device))


def _trace_tiers(plan: Plan, file_tier: FileTier, order: list[str]) -> list[Backend]:
    """Trace mode: each tier its kind's stand-in (kvtier/tiers.py) at the real tier's capacity, so the
    waterfall decides as in a real run. The GPU tier is modelled whenever --gpu-mem-gb > 0, device or not,
    as the reference's trace mode does (a trace of a GPU host, written anywhere); remote tiers are modelled
    at their capacity without connecting; the storage tier takes the real directory's capacity and sizes."""
    tiers = {name: stand_in(name, _spec(plan, name, "")) for name in order if name != "storage"}
    tiers["storage"] = stand_in("storage", TierSpec(file_tier.capacity_bytes), file_tier.stored_size)
    return [tiers[name] for name in order]


def _spec(plan: Plan, name: str, cache_dir: str, gds: bool = False) -> TierSpec:
    """What the flags ask of tier ``name``: its kind's own spec (kvtier/tiers.py), given what the bench knows
    besides (the GPU tier's cap against the device is _gpu_tier's)."""
    cfg = plan.config
    ask = Ask(
        page_bytes=cpu_page_bytes(plan),
        host_reserved_bytes=plan.io_slots * plan.io_chunk_bytes + cfg.noise_mb * MiB,  # touched as the run goes
        directory=cache_dir,
        gds=gds,
        connections=plan.io_slots,
        scope=f"{plan.workload.scope.tag()}/{cfg.kv_layout}",  # a shared namespace's keys name model and layout
    )
    return KINDS[name].spec(cfg, ask)


def host_tier_bytes(plan: Plan) -> tuple[int, list[str]]:
    """The host RAM the configured tiers may take (each kind's ``host_bytes``), and their flags; 0 in trace
    mode, whose tiers hold no bytes."""
    if plan.config.io_trace_log:
        return 0, []
    total, flags = 0, list[str]()
    for name in plan.config.configured_tiers():
        k = KINDS[name]
        if not k.remote and name != "gpu" and (n := k.host_bytes(_spec(plan, name, ""))):
            total, flags = total + n, [*flags, k.flag]
    return total, flags


def remote_warnings(tier: Backend, warnings: list[ResultWarning]) -> None:
    """Say where a Redis server's own limits can undercut kvtier's capacity accounting."""
    server = getattr(tier, "server", {})
    maxmem, policy = server.get("maxmemory_bytes"), server.get("maxmemory_policy")
    if maxmem and maxmem < tier.capacity_bytes:
        warnings.append(
            warning(
                WarningCode.remote_tier_limit,
                f"{tier.name} tier: the server's maxmemory ({maxmem / GiB:.2f} GiB) is below the tier's capacity "
                f"({tier.capacity_bytes / GiB:.2f} GiB): writes past it are refused (OOM) and fall through",
                maxmemory_bytes=maxmem,
                capacity_bytes=tier.capacity_bytes,
            )
        )
    if policy and policy != "noeviction":
        warnings.append(
            warning(
                WarningCode.remote_tier_limit,
                f"{tier.name} tier: maxmemory-policy {policy} lets the server evict kvtier's keys; such entries "
                "are counted as unreadable (entries_dropped_unreadable)",
                maxmemory_policy=policy,
            )
        )


CPU_PAGE_TOKENS = 256
"""The CPU tier's default page holds this many tokens of KV (LMCache's chunk), so a typical entry is a few pages."""


def cpu_page_bytes(plan: Plan) -> int:
    """The CPU tier's page asked for: --cpu-page-mb, or CPU_PAGE_TOKENS of the model's KV per rank."""
    cfg = plan.config
    if cfg.cpu_page_mb > 0:
        return int(cfg.cpu_page_mb * MiB)
    return CPU_PAGE_TOKENS * plan.model.kv_bytes_per_token_per_rank(cfg.tensor_parallel)


def exposure_warning(file_tier: FileTier, warnings: list[ResultWarning]) -> None:
    """A cache folder any user may rename in (writable by others, no sticky bit) is named in the result."""
    if file_tier.exposure:
        warnings.append(
            warning(
                WarningCode.cache_dir_exposed,
                f"--cache-dir: {file_tier.exposure}",
                path=str(file_tier.directory.parent),
            )
        )


def build_tiers(
    plan: Plan,
    cache_dir: str,
    warnings: list[ResultWarning],
    order: list[str],
    gds: dict[str, Any],
    device: DeviceMemory | None = None,
) -> tuple[list[Backend], FileTier]:
    cfg = plan.config
    if cfg.io_trace_log:  # a real file tier sizes the stand-in (its directory's free space, its entry sizes)
        sizer = open_tier("storage", replace(_spec(plan, "storage", cache_dir), keep_files=False))
        assert isinstance(sizer, FileTier)
        exposure_warning(sizer, warnings)
        return _trace_tiers(plan, sizer, order), sizer
    built: dict[str, Backend] = {}
    try:
        for name in order:
            if name != "gpu":
                spec = _spec(plan, name, cache_dir, bool(gds["used"]))
                if name == "storage" and spec.gds:
                    spec = replace(spec, device=device)  # --gpu-native: GPU <-> file through cuFile, no staging
                built[name] = tier = open_tier(name, spec)
                if is_remote(name):
                    remote_warnings(tier, warnings)
                continue
            ok, why = (True, "") if device is not None else gpu_available()
            if ok:
                built[name] = _gpu_tier(cfg, warnings, device)
            else:
                warnings.append(
                    warning(
                        WarningCode.gpu_tier_off,
                        f"GPU tier off: --gpu-mem-gb {cfg.gpu_mem_gb:g} asked for, but {why}",
                        requested_gb=cfg.gpu_mem_gb,
                        reason=why,
                    )
                )
    except BaseException:
        for b in built.values():
            b.close()
        raise
    file_tier = built["storage"]  # "storage" is in every order
    assert isinstance(file_tier, FileTier)
    exposure_warning(file_tier, warnings)
    if not file_tier.direct:
        why = "--direct-io off" if cfg.direct_io == "off" else "the filesystem refuses O_DIRECT"
        warnings.append(
            warning(
                WarningCode.direct_io_off,
                f"direct I/O off ({why}): buffered write+fsync and fadvise(DONTNEED) are used instead",
                reason=why,
            )
        )
    return [built[n] for n in order if n in built], file_tier


def gds_for(cfg: BenchConfig, warnings: list[ResultWarning]) -> dict[str, Any]:
    """Resolve --gds: refused when 'on' cannot be honoured; a warning when 'auto' falls back."""
    from kvtier.engine.gds import gds_choice

    if cfg.io_trace_log:
        return {"requested": cfg.gds, "used": False, "reason": "trace mode: no bytes move"}
    choice = gds_choice(cfg.gds)
    if cfg.gds == "on" and not choice["used"]:
        raise ConfigError(f"--gds on: GPUDirect Storage is not usable here: {choice['reason']}")
    if cfg.gds == "auto" and not choice["used"] and gpu_available()[0]:
        warnings.append(  # a GPU host without cuFile: worth a word (without a GPU there is nothing to say)
            warning(
                WarningCode.gds_off,
                f"--gds auto: the file tier uses O_DIRECT, not GPUDirect Storage: {choice['reason']}",
                reason=choice["reason"],
            )
        )
    return choice
