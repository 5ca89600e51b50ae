"""The tier kinds, in one table. Each kind is declared once, in its row: what it is called (its one name;
``offload_name`` where a flag keeps another spelling), its label in an I/O trace and the tier ``kvtier trace
replay`` runs it on, the flag that places it, whether its flags configure it, the spec its flags build (for
``kvtier bench``'s waterfall and for an offload tier alike), how much of the bytes asked for it really holds and
takes of the host's RAM, the size an entry takes in it, how it is built, whether it may be an offload tier on
its own or behind a CPU staging tier, and the label vLLM's by-source counters give a hit from it.

Every command builds its tiers here (``open_tier``): ``kvtier bench`` its waterfall, the sim's in-process
offload tier and ``kvtier cache-server`` their staging and offload tiers, kvtier's vLLM spec its workers' tiers,
``kvtier trace replay`` and the bench's trace mode their stand-ins (``stand_in``: a NullTier with the kind's
capacity and entry sizes, so the waterfall decides as it would on the real tier), ``kvtier clean --remote`` the
remote tiers it empties. The table's order is the default waterfall, fastest first. A new kind is a row here,
its own module in ``engine/`` and its flags in config/tiers.py ``TierFlags``; the engine modules are imported
only when a tier of theirs is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvtier.engine.backend import ALIGN, round_up
from kvtier.errors import ConfigError, StorageError, UnusableDirectory
from kvtier.units import GiB

if TYPE_CHECKING:
    from kvtier.engine.backend import Backend
    from kvtier.engine.device import DeviceMemory
    from kvtier.engine.null import NullTier


class RemoteFlags(Protocol):
    """The remote tiers' flags (config/tiers.py ``RemoteTierFlags``, which every command's config has)."""

    redis_url: str | None
    redis_part_mb: int
    s3_bucket: str | None
    s3_endpoint: str | None
    s3_prefix: str
    s3_part_mb: int
    remote_timeout: float
    remote_ttl: float

    @property
    def shared_namespace(self) -> str | None: ...

    def remote_capacity_bytes(self, kind: str) -> int: ...


@dataclass(frozen=True)
class TierSpec:
    """What one tier is built from: the bytes asked for and the settings of its kind."""

    capacity_bytes: int
    name: str | None = None  # the tier's own name, when not its kind's
    page_bytes: int = ALIGN  # a paged memory tier (cpu, cxl): the page asked for (engine/memory.py page_size decides)
    host_reserved_bytes: int = 0  # cpu: the process's own buffers, which the host keeps beside the tier's floor
    directory: str | None = None  # storage: the folder its run directory goes in; cxl: its DAX device or folder
    direct_io: Literal["auto", "on", "off"] = "auto"
    keep_files: bool = False
    gds: bool = False  # storage: its payload through cuFile (engine/gds.py)
    memory_fraction: float = 1.0  # gpu: of the device, for torch's allocator
    remote: RemoteFlags | None = None  # redis, s3: the flags that name the server
    connections: int = 1  # redis, s3: the connection pool
    scope: str = ""  # redis, s3 in a shared namespace: hashed into every key (model, dtype, layout; KeyScope.tag)
    device: DeviceMemory | None = None  # gpu, storage with gds: --gpu-native's device memory (engine/device.py)


@dataclass(frozen=True)
class Ask:
    """What a command knows beyond its flags when it asks a kind for its spec (``TierKind.spec``)."""

    offload: bool = False  # an offload tier (the sim's, the cache server's, a vLLM worker's), not kvtier bench's
    page_bytes: int = ALIGN  # one stored unit: a bench CPU page, a sim chunk, a vLLM block
    share: int = 1  # an offload tier's workers (vLLM's world size): each builds this share of the capacity
    host_reserved_bytes: int = 0  # kvtier bench: its I/O buffers, touched as the run goes
    directory: str = ""  # kvtier bench: --cache-dir
    gds: bool = False  # kvtier bench: --gds resolved to on
    connections: int = 1  # a remote tier's connection pool
    scope: str = ""  # a shared remote namespace's key scope


def _no_spec(flags: Any, ask: Ask) -> TierSpec:
    raise ConfigError("this tier kind is built by its command, not from flags")


@dataclass(frozen=True)
class TierKind:
    name: str
    trace_number: int  # its label in an I/O trace: Tier-<n> (the reference's numbering, 0 fastest)
    flag: str  # the flag that names where it lives, for errors
    make: Callable[[TierSpec], Backend]
    capacity: Callable[[TierSpec], int] = lambda spec: spec.capacity_bytes  # what it holds of the bytes asked
    entry_size: Callable[[TierSpec], Callable[[int], int]] = lambda spec: round_up  # an entry's stored bytes
    configured: Callable[[Any], bool] = lambda flags: False  # do the flags put it in kvtier bench's waterfall?
    spec: Callable[[Any, Ask], TierSpec] = _no_spec  # what the flags ask of it (ConfigError: what is missing)
    host_bytes: Callable[[TierSpec], int] = lambda spec: 0  # the host RAM it may take
    offload: Literal["", "alone", "staged"] = ""  # an offload tier on its own, or behind a CPU staging tier
    offload_name: str = ""  # its --offload choice, where that flag keeps another spelling (storage: nvme)
    offload_flag: str = ""  # as an offload tier, the flag that names where it lives (default: --offload CHOICE)
    replay_as: str = ""  # the tier kvtier trace replay runs its rows on ("": none, the run is replayed instead)
    vllm_source: str = ""  # the label vLLM's prompt_tokens_cached_by_source gives a hit from it
    # a remote kind (a server behind the flags of config/tiers.py RemoteTierFlags):
    remote: bool = False
    needs: str = ""  # the flags that configure it, as an error says them
    capacity_field: str = ""  # the RemoteTierFlags field holding its capacity in GiB
    entries: str = "entries"  # what its server holds (kvtier clean --remote: "removed 3 keys")

    @property
    def trace_label(self) -> str:
        return f"Tier-{self.trace_number}"

    @property
    def choice(self) -> str:
        """Its name as --offload takes it."""
        return self.offload_name or self.name


def _gpu(spec: TierSpec) -> Backend:
    from kvtier.engine.gpu import GpuTier

    return GpuTier(
        spec.capacity_bytes,
        spec.name or "gpu",
        memory_fraction=spec.memory_fraction,
        memory=spec.device,
        native=spec.device is not None,
    )


def _page(spec: TierSpec) -> int:
    from kvtier.engine.memory import page_size

    return page_size(spec.capacity_bytes, spec.page_bytes)


def paged_capacity(spec: TierSpec) -> int:
    """A paged memory tier's capacity: whole pages."""
    page = _page(spec)
    return spec.capacity_bytes // page * page


def paged_entry(spec: TierSpec) -> Callable[[int], int]:
    """A paged memory tier's entry: whole pages."""
    page = _page(spec)
    return lambda n: -(-round_up(n) // page) * page


def _cpu(spec: TierSpec) -> Backend:
    from kvtier.engine.memory import MemoryTier

    return MemoryTier(
        spec.capacity_bytes, spec.name or "cpu", spec.page_bytes, host_reserved_bytes=spec.host_reserved_bytes
    )


def _cpu_spec(f: Any, ask: Ask) -> TierSpec:
    gb = f.cpu_offload_gb if ask.offload else f.cpu_mem_gb
    return TierSpec(int(gb * GiB) // ask.share, page_bytes=ask.page_bytes, host_reserved_bytes=ask.host_reserved_bytes)


def _gpu_spec(f: Any, ask: Ask) -> TierSpec:
    return TierSpec(int(f.gpu_mem_gb * f.num_gpus * GiB))


def _cxl(spec: TierSpec) -> Backend:
    from kvtier.engine.cxl import CxlTier

    assert spec.directory is not None, "a cxl tier needs its device or folder"
    return CxlTier(spec.capacity_bytes, spec.directory, spec.name or "cxl", spec.page_bytes)


def _cxl_spec(f: Any, ask: Ask) -> TierSpec:
    if not f.cxl_path:
        raise ConfigError("--offload cxl: give --cxl-path and --cxl-mem-gb")
    return TierSpec(int(f.cxl_mem_gb * GiB) // ask.share, page_bytes=ask.page_bytes, directory=f.cxl_path)


def _cxl_host(spec: TierSpec) -> int:
    from kvtier.engine.cxl import host_bytes

    return host_bytes(spec.directory, spec.capacity_bytes)


def _storage(spec: TierSpec) -> Backend:
    from kvtier.engine.file import FileTier

    assert spec.directory is not None, "a storage tier needs its directory"
    args = (spec.directory, spec.capacity_bytes, spec.direct_io)
    name = spec.name or "storage"
    if spec.gds:
        from kvtier.engine.gds import GdsFileTier

        native = spec.device is not None
        return GdsFileTier(*args, name=name, keep_files=spec.keep_files, memory=spec.device, native=native)
    return FileTier(*args, name=name, keep_files=spec.keep_files)


def _storage_spec(f: Any, ask: Ask) -> TierSpec:
    if not ask.offload:
        return TierSpec(
            int(f.storage_capacity_gb * GiB),
            directory=ask.directory,
            direct_io=f.direct_io,
            keep_files=f.keep_cache,
            gds=ask.gds,
        )
    if not f.nvme_dir:
        raise ConfigError("--offload nvme: give --nvme-dir")
    return TierSpec(int(f.nvme_offload_gb * GiB) // ask.share, directory=f.nvme_dir, direct_io=f.direct_io)


def _storage_entry(spec: TierSpec) -> Callable[[int], int]:
    return lambda n: ALIGN + round_up(n)  # one header block, then the padded payload (engine/file.py)


def _remote_spec(f: Any, ask: Ask, kind: str) -> TierSpec:
    if not KINDS[kind].configured(f):
        raise ConfigError(f"--offload {kind}: {KINDS[kind].needs}")
    return remote_spec(kind, f, ask.connections, ask.scope)


def _redis(spec: TierSpec) -> Backend:
    from kvtier.engine.redis_tier import RedisTier

    f = spec.remote
    assert f is not None and f.redis_url is not None, "a redis tier needs --redis-url"
    return RedisTier(
        f.redis_url,
        spec.capacity_bytes,
        spec.connections,
        f.redis_part_mb * 1024**2,
        timeout_s=f.remote_timeout,
        namespace=f.shared_namespace,
        ttl_s=f.remote_ttl,
        scope=spec.scope,
    )


def _s3(spec: TierSpec) -> Backend:
    from kvtier.engine.s3_tier import S3Tier

    f = spec.remote
    assert f is not None and f.s3_bucket is not None, "an s3 tier needs --s3-bucket"
    return S3Tier(
        f.s3_endpoint,
        f.s3_bucket,
        spec.capacity_bytes,
        f.s3_prefix,
        spec.connections,
        f.s3_part_mb * 1024**2,
        timeout_s=f.remote_timeout,
        namespace=f.shared_namespace,
        ttl_s=f.remote_ttl,
        scope=spec.scope,
    )


KINDS: dict[str, TierKind] = {
    k.name: k
    for k in (
        TierKind(
            "gpu",
            0,
            "--gpu-mem-gb",
            _gpu,
            configured=lambda f: f.gpu_mem_gb > 0,
            spec=_gpu_spec,
            replay_as="cpu",
            vllm_source="gpu",
        ),
        TierKind(
            "cpu",
            1,
            "--cpu-mem-gb",
            _cpu,
            paged_capacity,
            paged_entry,
            configured=lambda f: f.cpu_mem_gb > 0,
            spec=_cpu_spec,
            host_bytes=lambda spec: spec.capacity_bytes,
            offload="alone",
            offload_flag="cpu_offload_gb",
            replay_as="cpu",
            vllm_source="host",
        ),
        TierKind(
            "cxl",
            5,
            "--cxl-path",
            _cxl,
            paged_capacity,
            paged_entry,
            configured=lambda f: bool(f.cxl_path),
            spec=_cxl_spec,
            host_bytes=_cxl_host,
            offload="alone",
            replay_as="cpu",
            vllm_source="host",  # vLLM has no label of its own for CXL memory: a hit from it counts as host
        ),
        TierKind(
            "redis",
            3,
            "--redis-url",
            _redis,
            configured=lambda f: bool(f.redis_url),
            spec=lambda f, ask: _remote_spec(f, ask, "redis"),
            offload="staged",
            vllm_source="external_unspecified",
            remote=True,
            needs="give --redis-url and --redis-mem-gb",
            capacity_field="redis_mem_gb",
            entries="keys",
        ),
        TierKind(
            "storage",
            2,
            "--cache-dir",
            _storage,
            entry_size=_storage_entry,
            configured=lambda f: True,
            spec=_storage_spec,
            offload="staged",
            offload_name="nvme",
            offload_flag="--nvme-dir",
            replay_as="storage",
            vllm_source="disk",
        ),
        TierKind(
            "s3",
            4,
            "--s3-endpoint/--s3-bucket",
            _s3,
            configured=lambda f: bool(f.s3_bucket),
            spec=lambda f, ask: _remote_spec(f, ask, "s3"),
            offload="staged",
            vllm_source="external_unspecified",
            remote=True,
            needs="give --s3-bucket (and --s3-endpoint for a server other than AWS)",
            capacity_field="s3_capacity_gb",
            entries="objects",
        ),
    )
}
"""Every kind, in the default waterfall order: CXL memory behind CPU RAM, Redis between them and the file tier, S3
below it (cold)."""

TIER_KINDS = tuple(KINDS)
TIER_LABELS = {k.name: k.trace_label for k in KINDS.values()}
REMOTE_KINDS = tuple(k.name for k in KINDS.values() if k.remote)
"""The kinds behind a server (what the remote flags configure, what kvtier clean --remote empties)."""
OFFLOAD_KINDS = tuple(k.choice for k in KINDS.values() if k.offload)
"""What an offload tier (the sim's, the cache server's, kvtier's vLLM spec) may be: a kind on its own (CPU RAM),
or a kind behind a CPU staging tier (NVMe files, a remote store) (``offload_plan``)."""
BY_CHOICE = {k.choice: k for k in KINDS.values()}


def is_remote(kind: str) -> bool:
    k = KINDS.get(kind)
    return bool(k and k.remote)


def remote_spec(kind: str, flags: RemoteFlags, connections: int, scope: str = "") -> TierSpec:
    """A remote tier of ``kind`` as its flags ask: its capacity, the server's flags, a pool of ``connections``."""
    return TierSpec(flags.remote_capacity_bytes(kind), remote=flags, connections=connections, scope=scope)


def configured_remote(flags: RemoteFlags) -> list[str]:
    """The remote kinds whose server the flags name, in waterfall order."""
    return [k for k in REMOTE_KINDS if KINDS[k].configured(flags)]


def configured_kinds(flags: Any) -> list[str]:
    """The kinds kvtier bench's flags put in its waterfall, in the table's order."""
    return [k.name for k in KINDS.values() if k.configured(flags)]


def open_tier(kind: str, spec: TierSpec, flag: str | None = None) -> Backend:
    """Build a tier of ``kind``. What stops it becomes a ConfigError naming the flag to fix: ``flag`` (the
    caller's own name for where the tier lives, e.g. ``--nvme-dir``) or the kind's."""
    k = KINDS[kind]
    try:
        return k.make(spec)
    except UnusableDirectory as e:
        raise ConfigError(f"{'--direct-io on' if e.direct_io else flag or k.flag}: {e}") from e
    except StorageError as e:  # a remote server that cannot be reached or refuses the tier
        raise ConfigError(f"{flag or k.flag}: {e}") from e


def offload_plan(choice: str, flags: Any, ask: Ask) -> list[tuple[str, TierSpec, str]]:
    """An offload tier's waterfall, fastest first, as (kind, spec, flag) rows — not yet built: a kind that serves
    alone (CPU RAM), or a CPU staging tier (``--staging-gb``) in front of one that is staged (NVMe files, a remote
    server). ``ask.page_bytes`` is one stored unit (a sim chunk, a vLLM block), so the paged tiers waste nothing.
    The sim and kvtier cache-server build it (``open_tier``); the vLLM offloading backend (kvtier/vllm) sizes its
    scheduler-side index from the same rows (``KINDS[kind].capacity`` and ``entry_size``) and builds the tiers in
    its workers."""
    k = BY_CHOICE.get(choice)
    if k is None or not k.offload:
        raise ConfigError(f"--offload: expected {', '.join(OFFLOAD_KINDS)}, got {choice!r}")
    ask = Ask(**{**ask.__dict__, "offload": True})
    row = (k.name, k.spec(flags, ask), k.offload_flag or f"--offload {choice}")
    if k.offload == "alone":
        return [row]
    staging = TierSpec(int(flags.staging_gb * GiB) // ask.share, page_bytes=ask.page_bytes)
    return [("cpu", staging, "staging_gb"), row]


def open_tiers(plan: list[tuple[str, TierSpec, str]]) -> list[Backend]:
    """Build a waterfall's tiers in order; if one fails, those already built are closed."""
    built: list[Backend] = []
    try:
        for kind, spec, where in plan:
            built.append(tier := open_tier(kind, spec, where if where.startswith("-") else None))
            exposure = getattr(tier, "exposure", None)  # a file tier's cache folder others may rename in
            if exposure:
                import logging

                logging.getLogger("kvtier").warning("%s: %s", where, exposure)
    except BaseException:
        for b in built:
            b.close()
        raise
    return built


def stand_in(kind: str, spec: TierSpec, entry_size: Callable[[int], int] | None = None) -> NullTier:
    """A tier of ``kind`` that moves no bytes (trace mode): the kind's capacity and entry sizes
    (``entry_size`` overrides them: a storage tier measured on the real directory)."""
    from kvtier.engine.null import NullTier

    k = KINDS[kind]
    return NullTier(spec.name or kind, k.capacity(spec), entry_size or k.entry_size(spec))


__all__ = [
    "Ask",
    "BY_CHOICE",
    "KINDS",
    "OFFLOAD_KINDS",
    "configured_kinds",
    "paged_capacity",
    "paged_entry",
    "REMOTE_KINDS",
    "configured_remote",
    "is_remote",
    "remote_spec",
    "TIER_KINDS",
    "TIER_LABELS",
    "TierKind",
    "TierSpec",
    "open_tier",
    "open_tiers",
    "offload_plan",
    "stand_in",
]
