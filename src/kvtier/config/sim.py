"""Configuration of ``kvtier sim`` (the simulated server) and ``kvtier cache-server``."""

from __future__ import annotations

from importlib import resources
from typing import Any, Literal

from pydantic import model_validator

from kvtier.config.base import StrictModel, flag
from kvtier.config.replay import EventLoopKind
from kvtier.config.tiers import OffloadKind, SimOffloadKind, TierFlags

DEFAULT_PRESET = "h100-llama3.1-8b"
OFFLOAD = "offload tier"


class OffloadTierConfig(TierFlags):
    """The real offload tier behind a sim replica or a cache server (kvtier's engine): CPU RAM, NVMe
    files, or a remote store (Redis/Valkey with --redis-url, S3 with --s3-bucket) behind a CPU staging tier."""

    cpu_offload_gb: float = flag(4.0, "CPU RAM offload tier, GB (--offload cpu)", gt=0, group=OFFLOAD)
    nvme_dir: str | None = flag(
        None, "existing directory of the NVMe offload tier's files (--offload nvme)", group=OFFLOAD
    )
    nvme_offload_gb: float = flag(8.0, "NVMe offload tier capacity, GB", gt=0, group=OFFLOAD)
    staging_gb: float = flag(0.5, "CPU staging tier in front of NVMe, Redis or S3, GB", gt=0, group=OFFLOAD)
    direct_io: Literal["auto", "on", "off"] = flag("auto", "O_DIRECT for the NVMe tier's files", group=OFFLOAD)

    @model_validator(mode="after")
    def _own_namespace(self) -> OffloadTierConfig:
        """The sim's offload tier looks up only what it stored; replicas share one tier through ``kvtier
        cache-server``, not through a shared Redis/S3 namespace (kvtier bench's --remote-namespace)."""
        if self.remote_namespace != "run":
            raise ValueError(
                f"--remote-namespace {self.remote_namespace}: kvtier bench only; sim replicas share an offload "
                "tier through kvtier cache-server (--offload remote)"
            )
        return self


class SimConfig(OffloadTierConfig):
    """Every input of ``kvtier sim``. Latency-model fields left unset take the preset's value."""

    preset: str = flag(DEFAULT_PRESET, "latency preset from sim/presets.yaml (its figures are assumed, not measured)")
    calibration: str | None = flag(
        None,
        "a kvtier ladder result (ladder.json) measured on a real server: prefill (with its attention term), its fixed "
        "cost and decode come from the ladder's fit instead of the preset; prompts longer than it measured are "
        "timed by extrapolation, and responses say so (kvtier.timing)",
    )
    accept_unreliable: bool = flag(
        False,
        "use a --calibration whose fit the ladder marked unreliable (its errors past their bounds: the twin then "
        "carries them); refused without it",
    )
    model: str | None = flag(None, "catalog model whose KV bytes per token size the caches (default: the preset's)")
    hf_config: str | None = flag(
        None,
        "a Hugging Face config.json (or its model folder, e.g. a kvtier model make folder) whose KV geometry sizes "
        "the caches, instead of --model: the twin of a server serving that model holds as many bytes per token",
        metavar="FILE",
    )
    served_model_name: str | None = flag(None, "name clients send as 'model' (default: --model, or the preset's)")
    gpu_kv_gb: float | None = flag(None, "GPU memory for KV cache, GB (default: the preset's)", gt=0)
    prefill_tps: float | None = flag(None, "prefill throughput, tokens/s (default: the preset's)", gt=0)
    tpot_ms: float | None = flag(None, "time per output token of a lone sequence, ms (default: the preset's)", ge=0)
    prefill_overhead_ms: float | None = flag(None, "fixed cost per prefill, ms (default: the preset's)", ge=0)
    batch_slowdown: float | None = flag(
        None, "TPOT grows by this fraction per extra running sequence (default: the preset's)", ge=0
    )
    gpu_kv_tokens: int | None = flag(
        None,
        "GPU KV capacity in tokens, as vLLM reports it ('KV cache size: N tokens'; one block of it is vLLM's "
        "null block, so N / --block-tokens - 1 blocks cache); replaces --gpu-kv-gb",
        ge=1,
    )
    block_tokens: int = flag(
        16, "tokens per KV block of the prefix cache (vLLM: 16 on GPUs, 128 on its CPU build)", ge=1
    )
    max_model_len: int | None = flag(
        None, "longest prompt + max_tokens served (default: what the GPU holds, at most 131072)", ge=16
    )
    tokenizer: str = flag(
        "auto",
        "how prompts become token ids: auto, tiktoken, chars, or hf:DIR (a model folder's tokenizer.json; a kvtier "
        "model make folder's chat template too, so prompt ids match a real vLLM serving that folder)",
        pattern=r"^(auto|tiktoken|chars|hf:.+)$",
    )
    max_num_seqs: int = flag(256, "running sequences at most", ge=1)
    max_num_batched_tokens: int = flag(
        8192,
        "prompt tokens one prefill chunk computes (vLLM's chunked prefill: a longer prompt's blocks are taken "
        "chunk by chunk; its CPU build's default is 2048)",
        ge=16,
    )
    max_waiting: int = flag(1024, "requests waiting for a slot at most; more get 429 with Retry-After", ge=1)
    queue_timeout: float = flag(600.0, "seconds a request may wait for a slot before it gets 429", gt=0)
    idle_timeout: float = flag(15.0, "seconds an idle or half-sent connection is kept (the header-read deadline)", gt=0)
    body_timeout: float = flag(
        30.0, "seconds a request body may take to arrive (then HTTP 408); 32 bodies are received at once", gt=0
    )
    cache_timeout: float = flag(
        10.0,
        "seconds one call to the cache server may take (--offload remote); a "
        "timeout is a miss, counted in kvtier_sim:offload_errors",
        gt=0,
    )
    offload: SimOffloadKind = flag(
        "none",
        "offload tier: none; in-process cpu, nvme, redis (--redis-url) or s3 (--s3-bucket); or remote "
        "(a kvtier cache-server, --cache-server)",
    )
    cache_server: str | None = flag(
        None, "a kvtier cache-server, its Unix socket or tcp://HOST:PORT, for --offload remote"
    )
    cache_server_token_file: str | None = flag(
        None, "file (mode 0600) holding the cache server's shared token: required for a tcp:// --cache-server"
    )
    no_fetch_gate: bool = flag(
        False,
        "load every offload-tier hit, as kvtier's CPU tier inside vLLM and vLLM's own offloading do; by default a hit "
        "is loaded only when that is expected to beat recomputing it (the fetch gate, on the tier's measured loads)",
    )
    offload_chunk_tokens: int = flag(
        256,
        "tokens per entry of an in-process offload tier (cpu, nvme, redis, s3): LMCache's chunk is 256; kvtier's "
        "spec inside vLLM stores vLLM's blocks (128 on its CPU build), so a twin of that engine sets 128",
        ge=16,
        le=4096,
    )
    host: str = flag("127.0.0.1", "address to listen on")
    event_loop: EventLoopKind = flag("auto", "uvloop when installed (auto), or asyncio")
    port: int = flag(8000, "TCP port (0 = any free port, printed)", ge=0, le=65535)
    port_file: str | None = flag(None, "write the bound port here once the server accepts requests")
    replica_id: str | None = flag(None, "value of the x-kvtier-replica header (default host:port)")
    seed: int = flag(0, "seed of the offload tier's data")

    @model_validator(mode="after")
    def _gate_needs_a_tier(self) -> SimConfig:
        if self.no_fetch_gate and self.offload == "none":
            raise ValueError("--no-fetch-gate: the fetch gate is the offload tier's; give --offload")
        return self


class CacheServerConfig(OffloadTierConfig):
    """Every input of ``kvtier cache-server`` (vllm/blockserver.py): one set of offload tiers shared by sim replicas
    (``--offload remote --cache-server PATH``) and by vLLM replicas running kvtier's offloading spec
    (kv_connector_extra_config ``cache_server``). The tiers hold slots of one block: ``--block-bytes`` per worker times
    ``--world-size``, or the first replica's geometry; a replica whose blocks do not fit is refused."""

    offload: OffloadKind = flag(
        "cpu", "the tier: CPU RAM, or CPU staging in front of NVMe files, Redis (--redis-url) or S3 (--s3-bucket)"
    )
    socket: str | None = flag(None, "Unix socket path of the data API (replicas: --cache-server PATH)")
    listen: str | None = flag(
        None,
        "HOST:PORT of a TCP data API, for replicas on other hosts (replicas: --cache-server tcp://HOST:PORT); "
        "needs --token-file",
    )
    token_file: str | None = flag(
        None, "file (mode 0600, one line of at least 16 characters) holding the shared token TCP replicas must prove"
    )
    host: str = flag("127.0.0.1", "address of /health and /metrics")
    port: int = flag(0, "TCP port of /health and /metrics (0 = any free port)", ge=0, le=65535)
    port_file: str | None = flag(None, "write the TCP port here once the server accepts requests")
    block_bytes: int | None = flag(
        None,
        "slot size: the largest block's bytes per worker (vLLM's KV bytes per token x block size / TP) the server "
        "serves; the tiers open at start (default: the first replica's block)",
        gt=0,
        le=1 << 32,
    )
    world_size: int = flag(
        1, "slot size: the largest world size (TP x PP) among the replicas, with --block-bytes", gt=0, le=1024
    )
    keys_per_s: float = flag(
        200_000.0,
        "keys a second each replica's scheduler connection may name (lookups, pins, stores) before it is slowed; 0 = "
        "unbounded, else at least 1000",
        ge=0,
    )

    @model_validator(mode="after")
    def _allowance(self) -> CacheServerConfig:
        """A tiny allowance would hold one request for years (a reset counts 16,384 keys)."""
        if 0 < self.keys_per_s < 1000:
            raise ValueError(f"--keys-per-s {self.keys_per_s:g}: 0 (unbounded) or at least 1000")
        return self


class CacheFlushConfig(StrictModel):
    """``kvtier cache-server flush``: drop one model's blocks, or one weights generation's, from a running cache
    server (a rollout's old KV, which the new generation's keys never meet but which holds the tiers' room)."""

    cache_server: str = flag(..., "the server: its Unix socket, or tcp://HOST:PORT")
    cache_server_token_file: str | None = flag(
        None, "file (mode 0600) holding the server's shared token: required for a tcp:// --cache-server"
    )
    model: str = flag(..., "the model as the engines name it (vLLM's model name or path)", max_length=512)
    revision: str | None = flag(
        None, "only this generation of it (the engines' model_revision setting); default: every one", max_length=128
    )


def load_presets() -> dict[str, dict[str, Any]]:
    """The sim's latency presets (kvtier/sim/presets.yaml), read without importing the sim."""
    import yaml

    text = resources.files("kvtier").joinpath("sim/presets.yaml").read_text()
    presets: dict[str, dict[str, Any]] = yaml.safe_load(text)
    return presets


__all__ = ["load_presets", "OffloadTierConfig", "SimConfig", "CacheServerConfig", "CacheFlushConfig", "DEFAULT_PRESET"]
