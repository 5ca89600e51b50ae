"""The tier kinds, in one table: what each kind is called, its label in an I/O trace, the flag that places
it, how much of the bytes asked for it really holds, the size an entry takes in it, and how it is built.

Every command builds its tiers here (``open_tier``): ``kvtier bench`` its waterfall, the sim's in-process
offload tier and ``kvtier cache-server`` their staging and offload tiers, ``kvtier trace replay`` and the
bench's trace mode their stand-ins (``stand_in``: a NullTier with the kind's capacity and entry sizes, so
the waterfall decides as it would on the real tier), ``kvtier clean --remote`` the remote tiers it empties.
The table's order is the default waterfall, fastest first. A new kind is a row here and its own module in
``engine/``; the engine modules are imported only when a tier of theirs is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from kvtier.engine.backend import ALIGN, round_up
from kvtier.errors import ConfigError, StorageError, UnusableDirectory

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
    page_bytes: int = ALIGN  # cpu: the page asked for (engine/memory.py page_size decides)
    host_reserved_bytes: int = 0  # cpu: the process's own buffers, which the host keeps beside the tier's floor
    directory: str | None = None  # storage: the folder its run directory goes in
    direct_io: Literal["auto", "on", "off"] = "auto"
    keep_files: bool = False
    gds: bool = False  # storage: its payload through cuFile (engine/gds.py)
    memory_fraction: float = 1.0  # gpu: of the device, for torch's allocator
    remote: RemoteFlags | None = None  # redis, s3: the flags that name the server
    connections: int = 1  # redis, s3: the connection pool
    scope: str = ""  # redis, s3 in a shared namespace: hashed into every key (model, dtype, layout; KeyScope.tag)
    device: DeviceMemory | None = None  # gpu, storage with gds: --gpu-native's device memory (engine/device.py)


@dataclass(frozen=True)
class TierKind:
    name: str
    trace_number: int  # its label in an I/O trace: Tier-<n> (the reference's numbering, 0 fastest)
    flag: str  # the flag that names where it lives, for errors
    make: Callable[[TierSpec], Backend]
    capacity: Callable[[TierSpec], int] = lambda spec: spec.capacity_bytes  # what it holds of the bytes asked
    entry_size: Callable[[TierSpec], Callable[[int], int]] = lambda spec: round_up  # an entry's stored bytes
    # a remote kind (a server behind the flags of config/tiers.py RemoteTierFlags):
    remote: bool = False
    configured: Callable[[RemoteFlags], bool] = lambda flags: False  # do the flags name its server?
    needs: str = ""  # the flags that configure it, as an error says them
    capacity_field: str = ""  # the RemoteTierFlags field holding its capacity in GiB
    entries: str = "entries"  # what its server holds (kvtier clean --remote: "removed 3 keys")
    vllm_source: str = ""  # the label vLLM's prompt_tokens_cached_by_source gives a hit from it

    @property
    def trace_label(self) -> str:
        return f"Tier-{self.trace_number}"


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


def _cpu(spec: TierSpec) -> Backend:
    from kvtier.engine.memory import MemoryTier

    return MemoryTier(
        spec.capacity_bytes, spec.name or "cpu", spec.page_bytes, host_reserved_bytes=spec.host_reserved_bytes
    )


def _cpu_capacity(spec: TierSpec) -> int:
    page = _page(spec)
    return spec.capacity_bytes // page * page  # whole pages


def _cpu_entry(spec: TierSpec) -> Callable[[int], int]:
    page = _page(spec)
    return lambda n: -(-round_up(n) // page) * page


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


def _storage_entry(spec: TierSpec) -> Callable[[int], int]:
    return lambda n: ALIGN + round_up(n)  # one header block, then the padded payload (engine/file.py)


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
        TierKind("gpu", 0, "--gpu-mem-gb", _gpu, vllm_source="gpu"),
        TierKind("cpu", 1, "--cpu-mem-gb", _cpu, _cpu_capacity, _cpu_entry, vllm_source="host"),
        TierKind(
            "redis",
            3,
            "--redis-url",
            _redis,
            remote=True,
            configured=lambda f: bool(f.redis_url),
            needs="give --redis-url and --redis-mem-gb",
            capacity_field="redis_mem_gb",
            entries="keys",
            vllm_source="external_unspecified",
        ),
        TierKind("storage", 2, "--cache-dir", _storage, entry_size=_storage_entry, vllm_source="disk"),
        TierKind(
            "s3",
            4,
            "--s3-endpoint/--s3-bucket",
            _s3,
            remote=True,
            configured=lambda f: bool(f.s3_bucket),
            needs="give --s3-bucket (and --s3-endpoint for a server other than AWS)",
            capacity_field="s3_capacity_gb",
            entries="objects",
            vllm_source="external_unspecified",
        ),
    )
}
"""Every kind, in the default waterfall order: Redis between CPU RAM and the file tier, S3 below it (cold)."""

TIER_KINDS = tuple(KINDS)
TIER_LABELS = {k.name: k.trace_label for k in KINDS.values()}
REMOTE_KINDS = tuple(k.name for k in KINDS.values() if k.remote)
"""The kinds behind a server (what the remote flags configure, what kvtier clean --remote empties)."""
OFFLOAD_KINDS = ("cpu", "nvme", *REMOTE_KINDS)
"""What an offload tier (the sim's, the cache server's, kvtier's vLLM spec) may be: CPU RAM, or a CPU staging tier in
front of NVMe files or a remote kind (``offload_plan``)."""


def is_remote(kind: str) -> bool:
    k = KINDS.get(kind)
    return bool(k and k.remote)


def remote_spec(kind: str, flags: RemoteFlags, connections: int, scope: str = "") -> TierSpec:
    """A remote tier of ``kind`` as its flags ask: its capacity, the server's flags, a pool of ``connections``."""
    return TierSpec(flags.remote_capacity_bytes(kind), remote=flags, connections=connections, scope=scope)


def configured_remote(flags: RemoteFlags) -> list[str]:
    """The remote kinds whose server the flags name, in waterfall order."""
    return [k for k in REMOTE_KINDS if KINDS[k].configured(flags)]


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


def offload_plan(
    kind: str,
    *,
    page_bytes: int,
    cpu_bytes: int,
    staging_bytes: int,
    nvme_dir: str | None,
    nvme_bytes: int,
    direct_io: Literal["auto", "on", "off"] = "auto",
    remote: RemoteFlags | None = None,
    connections: int = 1,
) -> list[tuple[str, TierSpec, str]]:
    """An offload tier's waterfall, fastest first, as (kind, spec, flag) rows — not yet built: CPU RAM (``cpu``),
    or a CPU staging tier in front of the files (``nvme``) or a remote server (``redis``, ``s3``). ``page_bytes``
    is one stored unit (a sim chunk, a vLLM block), so the CPU tiers waste nothing. The sim and kvtier cache-server
    build it (``open_tier``); the vLLM offloading backend (kvtier/vllm) sizes its scheduler-side index from the same
    rows (``KINDS[kind].capacity`` and ``entry_size``) and builds the tiers in its workers."""
    if kind == "cpu":
        return [("cpu", TierSpec(cpu_bytes, page_bytes=page_bytes), "cpu_offload_gb")]
    staging = ("cpu", TierSpec(staging_bytes, page_bytes=page_bytes), "staging_gb")
    if kind == "nvme":
        if not nvme_dir:
            raise ConfigError("--offload nvme: give --nvme-dir")
        return [staging, ("storage", TierSpec(nvme_bytes, directory=nvme_dir, direct_io=direct_io), "--nvme-dir")]
    if is_remote(kind) and remote is not None:
        if not KINDS[kind].configured(remote):
            raise ConfigError(f"--offload {kind}: {KINDS[kind].needs}")
        return [staging, (kind, remote_spec(kind, remote, connections), f"--offload {kind}")]
    raise ConfigError(f"--offload: expected {', '.join(OFFLOAD_KINDS)}, got {kind!r}")


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
    "KINDS",
    "OFFLOAD_KINDS",
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
