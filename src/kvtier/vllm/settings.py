"""What kvtier's vLLM offloading backend is asked for: ``kv_connector_extra_config``, read and checked.

The keys are ``kvtier sim``'s offload flags with underscores (``offload``, ``cpu_offload_gb``, ``nvme_dir``,
``nvme_offload_gb``, ``staging_gb``, ``direct_io``, the remote tiers' ``redis_url``, ``s3_bucket``, ...), plus
``io_threads`` and the per-request log (``request_log``, ``request_log_mb``). With ``remote_namespace: shared:NAME``
a Redis/S3 offload tier is one key space every replica writes and reads (no staging tier in front of it: a block is
on the shared store when its store completes). vLLM's own keys of the offloading
connector pass through; any other key is an error that names it, so a misspelt size never silently becomes the
default. No vLLM import here (tested without the engine).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import ValidationError, model_validator

from kvtier.config.base import flag
from kvtier.config.sim import OffloadTierConfig
from kvtier.config.tiers import OffloadKind
from kvtier.errors import ConfigError
from kvtier.tiers import KINDS, REMOTE_KINDS, Ask, TierSpec, is_remote, offload_plan, open_tier
from kvtier.vllm.protocol import read_token, tcp_address

VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "canonical_layout",
        "kv_load_failure_policy",
    }
)
"""Keys of kv_connector_extra_config that vLLM's offloading connector reads itself."""
PRESENCE_TIMEOUT_S = 2.0
"""The longest a scheduler's question to a shared namespace may take (it holds the engine's scheduling step)."""


class VllmOffloadSettings(OffloadTierConfig):
    """kvtier's tiers behind a vLLM engine. Capacities are the engine's in all: each of its workers (tensor
    parallel ranks) holds its share of every block, so each gets capacity / world size."""

    offload: OffloadKind = flag(
        "cpu", "cpu (CPU RAM), or a CPU staging tier in front of nvme files (nvme_dir), redis (redis_url) or s3"
    )
    io_threads: int = flag(
        4, "threads per worker moving blocks between the engine's KV cache and the tiers", ge=1, le=64
    )
    cache_server: str | None = flag(
        None,
        "a shared kvtier cache-server, its Unix socket or tcp://HOST:PORT: its tiers and index instead of this "
        "engine's own (every replica pointed at it shares one offload tier; the tier settings are the server's)",
    )
    gate: bool = flag(
        False,
        "with cache_server: answer miss for a prefix whose fetch this engine expects to take longer than "
        "recomputing it (its measured round trip, load throughput and prefill rate; kvtier/vllm/gate.py)",
    )
    cache_server_token_file: str | None = flag(
        None, "file (mode 0600) holding the cache server's shared token: required for a tcp:// cache_server"
    )

    eviction: Literal["lru", "fanout"] = flag(
        "lru",
        "the index's victim: the least recent block (lru), or the least recent one no two requests' continuations "
        "shared, keeping a shared prefix (a system prompt) over private history (fanout; kvtier plan retention "
        "compares the two on a trace)",
    )
    model_revision: str = flag(
        "",
        "the weights' version (a commit, a checksum, a release name): hashed into every block's key and shown in it, "
        "so engines of another generation of the same model never read these blocks (kvtier cache-server flush "
        "--model M --revision R drops one generation's)",
        max_length=128,
    )
    request_log: str | None = flag(
        None,
        "file the engine appends one JSON line per request to (kvtier/vllm/reqlog.py: its prompt by tier, its loads "
        "and stores, its stamps); kvtier replay --engine-log joins it to the replay's requests (off by default)",
    )
    request_log_mb: float = flag(256.0, "size cap of request_log, MB (records past it are dropped and counted)", gt=0)

    @model_validator(mode="after")
    def _own_namespace(self) -> VllmOffloadSettings:
        """Replicas share a Redis/S3 namespace directly (each engine asks the store about blocks it did not store);
        the other kinds have no shared key space."""
        if self.remote_namespace != "run" and not is_remote(self.offload):
            raise ValueError(
                f"remote_namespace {self.remote_namespace}: needs offload {' or '.join(REMOTE_KINDS)} (a shared key "
                f"space on the store), not {self.offload}"
            )
        return self

    @model_validator(mode="after")
    def _server_owns_the_tiers(self) -> VllmOffloadSettings:
        if self.cache_server is not None:
            try:
                tcp = tcp_address(self.cache_server)
            except ValueError as e:
                raise ValueError(f"cache_server: {e}") from None
            if self.eviction != "lru":
                raise ValueError("eviction: fanout is the engine's own index's; a cache server's is LRU")
            if tcp is not None and self.cache_server_token_file is None:
                raise ValueError("cache_server: a tcp:// cache server needs cache_server_token_file (its shared token)")
            mine = {
                *("cache_server", "cache_server_token_file", "gate", "io_threads", "model_revision"),
                *("request_log", "request_log_mb"),
            }
            own = sorted(self.model_fields_set - mine)
            if own:
                raise ValueError(
                    f"{', '.join(own)}: set on the cache server (kvtier cache-server), "
                    "not here, when cache_server is given"
                )
        return self

    def cache_server_token(self) -> bytes | None:
        """The shared token of a tcp:// cache server (ConfigError naming the file when it is not a usable one)."""
        if self.cache_server_token_file is None:
            return None
        try:
            return read_token(self.cache_server_token_file, "kv_connector_extra_config.cache_server_token_file:")
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @classmethod
    def of_tier_config(cls, cfg: OffloadTierConfig, offload: str) -> VllmOffloadSettings:
        """A cache server's tiers (its OffloadTierConfig flags) as the settings a shared server opens."""
        return cls.model_validate({**{k: getattr(cfg, k) for k in OffloadTierConfig.model_fields}, "offload": offload})

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> VllmOffloadSettings:
        ours = {k: v for k, v in extra.items() if k not in VLLM_KEYS}
        try:
            return cls.model_validate(ours)
        except ValidationError as e:
            problems = []
            for err in e.errors():
                where = ".".join(str(x) for x in err["loc"]) or "(top)"
                if err["type"] == "extra_forbidden":
                    known = ", ".join(sorted(cls.model_fields))
                    problems.append(f"{where}: not a kvtier offload setting (known: {known})")
                else:
                    problems.append(f"{where}: {err['msg']}")
            raise ConfigError("kv_connector_extra_config: " + "; ".join(problems)) from None

    def plan(self, block_bytes: int, world_size: int = 1) -> list[tuple[str, TierSpec, str]]:
        """One worker's tiers (its share of each capacity); a CPU page is one block. In a shared namespace the
        store alone (a block staged in this engine's RAM would be invisible to the other replicas)."""
        rows = offload_plan(
            self.offload, self, Ask(page_bytes=block_bytes, share=max(1, world_size), connections=self.io_threads)
        )
        return rows[-1:] if self.shared_namespace else rows

    def shared_presence(self, key_of: Callable[[Any], str]) -> Callable[[Sequence[Any]], list[bool | None]]:
        """For the scheduler of an engine in a shared namespace: which of a run of blocks the store holds (one
        connection to it, each call's deadline at most PRESENCE_TIMEOUT_S; engine/redis_tier.py, s3_tier.py
        ``present``). ConfigError naming the setting when the store cannot be reached at start."""
        kind, spec, where = self.plan(1)[-1]
        remote = self.model_copy(update={"remote_timeout": min(self.remote_timeout, PRESENCE_TIMEOUT_S)})
        tier = open_tier(kind, replace(spec, remote=remote, connections=1), where)
        present = tier.present  # type: ignore[attr-defined]  # redis, s3
        return lambda keys: present([key_of(k) for k in keys])

    def slots(self, block_bytes: int, world_size: int = 1) -> list[tuple[str, int, str]]:
        """(tier, blocks it holds, by-source label) per tier, fastest first: the scheduler-side index's sizes,
        from the tier table's capacity and entry size of each kind (what the worker's real tier will hold)."""
        out = []
        for kind, spec, _ in self.plan(block_bytes, world_size):
            k = KINDS[kind]
            out.append((spec.name or kind, k.capacity(spec) // k.entry_size(spec)(block_bytes), k.vllm_source))
        return out


__all__ = ["VllmOffloadSettings", "VLLM_KEYS"]
