"""Flags of the remote tiers (Redis/Valkey, S3), shared by ``kvtier bench`` and the offload tier of
``kvtier sim`` / ``kvtier cache-server``. Credentials are never flags: the Redis password comes from
``KVTIER_REDIS_PASSWORD``, S3 credentials from the standard AWS chain."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Literal

from pydantic import field_validator, model_validator

from kvtier.config.base import StrictModel, flag
from kvtier.engine.backend import MAX_TTL_S
from kvtier.tiers import KINDS, OFFLOAD_KINDS, TIER_KINDS
from kvtier.units import GiB

REMOTE = "remote tiers"
CXL = "CXL / DAX memory tier"
DEFAULT_TIER_ORDER = TIER_KINDS  # the tier table's order (kvtier/tiers.py): Redis between CPU RAM and files, S3 last


if TYPE_CHECKING:
    OffloadKind = str
    SimOffloadKind = str
else:  # choices built from the tier table (kvtier/tiers.py): a new remote kind is a new choice, here and in --help
    OffloadKind = Literal[OFFLOAD_KINDS]
    SimOffloadKind = Literal[("none", *OFFLOAD_KINDS, "remote")]


class RemoteTierFlags(StrictModel):
    redis_url: str | None = flag(
        None,
        "Redis/Valkey tier at redis://host:port/db (rediss:// for TLS, unix:///path); password from "
        "KVTIER_REDIS_PASSWORD, never the URL",
        group=REMOTE,
        metavar="URL",
    )
    redis_mem_gb: float = flag(0, "Redis tier capacity, GB (kvtier's reservation enforces it)", group=REMOTE, ge=0)
    redis_part_mb: int = flag(
        4, "largest value kvtier stores in Redis, MiB (an entry is cut into parts)", group=REMOTE, ge=1, le=512
    )
    s3_bucket: str | None = flag(
        None, "S3 tier: bucket (created when missing, never removed); credentials from the AWS chain", group=REMOTE
    )
    s3_endpoint: str | None = flag(
        None, "S3 tier: endpoint URL of an S3-compatible server (default: AWS)", group=REMOTE, metavar="URL"
    )
    s3_prefix: str = flag(
        "kvtier", "S3 tier: key prefix; each run writes (and deletes) only under PREFIX/<run>/", group=REMOTE
    )
    s3_capacity_gb: float = flag(100, "S3 tier capacity, GB (kvtier's reservation enforces it)", group=REMOTE, gt=0)
    s3_part_mb: int = flag(
        16, "S3 tier: multipart part size, MiB; entries up to it go in one PUT", group=REMOTE, ge=5, le=5120
    )

    remote_timeout: float = flag(
        10.0,
        "seconds one remote-tier operation may take in all (Redis: a command and its reply; S3: connect and each "
        "read); a dribbling or hung server then fails that operation",
        group=REMOTE,
        gt=0,
    )

    remote_namespace: str = flag(
        "run",
        "key space of the Redis/S3 tiers: run (this run's own prefix, emptied at its end) or shared:NAME (one key "
        "space for every rank and every later run: entries carry --remote-ttl, are read by the others, and stay "
        "until their TTL or kvtier clean --remote)",
        group=REMOTE,
        pattern=r"^(run|shared:[A-Za-z0-9._-]{1,64})$",
    )
    remote_ttl: float = flag(
        3600.0,
        "seconds an entry of a shared: namespace lives on the server (Redis PX; S3: read as a miss past it); "
        "at most 10 years (Redis refuses an expiry past its clock's range, and every write would fail)",
        group=REMOTE,
        gt=0,
        le=MAX_TTL_S,
    )

    @property
    def shared_namespace(self) -> str | None:
        """NAME of --remote-namespace shared:NAME, or None for the run's own key space."""
        return self.remote_namespace.removeprefix("shared:") if self.remote_namespace != "run" else None

    def remote_capacity_bytes(self, kind: str) -> int:
        """The capacity of the remote tier ``kind``, bytes (its field is the tier table's ``capacity_field``)."""
        return int(getattr(self, KINDS[kind].capacity_field) * GiB)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str | None) -> str | None:
        from kvtier.engine.redis_tier import url_problem

        problem = None if v is None else url_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("s3_bucket")
    @classmethod
    def _bucket(cls, v: str | None) -> str | None:
        """S3's naming rule, checked before any connection: 3-63 of a-z, 0-9, '.', '-', starting and
        ending with a letter or digit."""
        if v is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]", v):
            raise ValueError(
                f"{v!r} is not a valid S3 bucket name (3-63 of a-z 0-9 . -, starting and ending alphanumeric)"
            )
        return v

    @model_validator(mode="after")
    def _remote_consistent(self) -> Any:
        if self.redis_url and self.redis_mem_gb <= 0:
            raise ValueError("--redis-url needs --redis-mem-gb > 0 (the Redis tier's capacity)")
        if self.redis_mem_gb > 0 and not self.redis_url:
            raise ValueError("--redis-mem-gb needs --redis-url")
        if self.s3_endpoint and not self.s3_bucket:
            raise ValueError("--s3-endpoint needs --s3-bucket")
        return self


class TierFlags(RemoteTierFlags):
    """Every tier kind's own flags, for every command that builds tiers: ``kvtier bench``'s waterfall, the offload
    tier of ``kvtier sim`` and ``kvtier cache-server``, and kvtier's vLLM spec (its kv_connector_extra_config). A
    new kind's flags go here (its row in kvtier/tiers.py reads them); the CPU, GPU and storage tiers keep their
    MLPerf and offload spellings in each command's config."""

    cxl_path: str | None = flag(
        None,
        "CXL / persistent-memory tier: a DAX device (/dev/daxN.M) or a folder on a memory-backed filesystem (a DAX "
        "mount, or a tmpfs: /dev/shm, or one bound to a CXL memory node with mpol=bind:N); an arena of --cxl-mem-gb "
        "is mapped there in fixed pages (--offload cxl: the offload tier)",
        group=CXL,
        metavar="PATH",
    )
    cxl_mem_gb: float = flag(0, "CXL tier capacity, GB (claimed whole at start)", group=CXL, ge=0)

    @model_validator(mode="after")
    def _cxl_consistent(self) -> Any:
        if bool(self.cxl_path) != (self.cxl_mem_gb > 0):
            raise ValueError("--cxl-path and --cxl-mem-gb > 0 go together (the CXL tier's place and capacity)")
        return self


def parse_tier_order(order: str | None, configured: list[str]) -> list[str]:
    """The waterfall's order, fastest first: ``order`` ("gpu,cpu,redis,storage,s3") checked against the
    tiers the flags configure, or the default order of those. Raises ValueError naming the problem."""
    if not order:
        return [t for t in DEFAULT_TIER_ORDER if t in configured]
    names = [n.strip() for n in order.split(",") if n.strip()]
    unknown = [n for n in names if n not in TIER_KINDS]
    if unknown:
        raise ValueError(f"unknown tier {unknown[0]!r} (tiers: {', '.join(TIER_KINDS)})")
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise ValueError(f"{dup!r} is named twice")
    extra = [n for n in names if n not in configured]
    if extra:
        raise ValueError(f"names {extra[0]!r}, which is not configured (configured: {', '.join(configured)})")
    missing = [n for n in configured if n not in names]
    if missing:
        raise ValueError(f"leaves out the configured {missing[0]!r} tier (give every tier: {', '.join(configured)})")
    return names


__all__ = ["RemoteTierFlags", "TierFlags", "parse_tier_order", "TIER_KINDS", "DEFAULT_TIER_ORDER", "REMOTE"]
