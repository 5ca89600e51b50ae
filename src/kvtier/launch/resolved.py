"""``LaunchPlan``: a resolved launch (every process, port, URL and command; nothing started), the type
``launch/orchestrate.py`` makes and ``launch/running.py`` reads."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config.base import config_argv
from kvtier.config.launch import KVTIER_SPEC_ENGINES, LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.launch.caddy import lb_policy, routing_tier
from kvtier.launch.devices import VISIBLE, Inventory
from kvtier.launch.engines import EngineCheck
from kvtier.launch.profiles import ProcPlan, Profile
from kvtier.mpi import mpirun_argv
from kvtier.results.envelope import (
    ResultWarning,
)


def kvtier_argv(argv: list[str]) -> list[str]:
    """Profiles say `kvtier ...`; run it with this interpreter, so the run uses this installation."""
    return [sys.executable, "-m", "kvtier", *argv[1:]] if argv and argv[0] == "kvtier" else argv


def show_command(env: dict[str, str], argv: list[str], unset: tuple[str, ...] = ()) -> str:
    """The command as a shell line: ``env -u`` for removed variables, then ``NAME=value`` for set ones."""
    prefix = ["env", *(f"-u {shlex.quote(u)}" for u in unset)] if unset else []
    return " ".join([*prefix, *(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(argv)])


@dataclass
class LaunchPlan:
    """A resolved launch: every process, port, URL and command; nothing started yet."""

    config: LaunchConfig
    profile_name: str
    profile_source: str
    profile: Profile
    out: Path
    sockdir: Path
    nvme_dir: Path
    front_url: str
    sidecar: ProcPlan | None
    replicas: list[ProcPlan]
    replica_ports: list[int]
    ports: dict[str, int | None]
    replay: ReplayConfig  # the user's replay, pointed at the front URL, writing into OUTDIR/replay
    caddyfile: str | None
    caddy_argv: list[str] | None
    inventory: Inventory | None  # None: the sim places no device
    sizes: dict[str, Any]
    commands: list[tuple[str, dict[str, str], list[str]]] = field(default_factory=list)
    warnings: list[ResultWarning] = field(default_factory=list)
    assumed: list[str] = field(default_factory=list)  # --dry-run: placeholders for what this host lacks

    @property
    def processes(self) -> list[ProcPlan]:
        return [*([self.sidecar] if self.sidecar else []), *self.replicas]

    def devices(self) -> dict[str, Any]:
        """launch.json's ``devices``: where the list came from and each replica's set."""
        inv = self.inventory
        return {
            "source": inv.source if inv else "not used (simulated engine)",
            "available": list(inv.devices) if inv else [],
            "per_replica": {p.name: list(p.devices) for p in self.replicas},
            "variable": VISIBLE[self.config.build] if inv else None,
            "notes": list(inv.notes) if inv else [],
        }

    @property
    def route_tier(self) -> str:
        """The tier whose routing Caddy applies (launch/caddy.py ``routing_tier``)."""
        return routing_tier(self.config.tier, self.config.engine, str(self.sizes.get("offload_engine", "")))

    def policies(self) -> dict[str, Any]:
        ktc = self.profile.kv_transfer_config or {}
        argv = self.sidecar.argv if self.sidecar else []
        evict = argv[argv.index("--eviction-policy") + 1] if "--eviction-policy" in argv[:-1] else None
        if self.sizes.get("offload_engine") in KVTIER_SPEC_ENGINES and self.config.engine == "vllm":
            evict = "lru"  # kvtier's waterfall LRU (kvtier/vllm/index.py)
        return {
            "kv_load_failure_policy": ktc.get("kv_load_failure_policy"),
            "eviction_policy": evict,
            "lb_policy": lb_policy(self.route_tier, self.config.lb_policy) if self.caddyfile else None,
        }

    def identity(self, engines: EngineCheck | None) -> dict[str, Any]:
        """What ran, for the replay summary's ``server.launch``."""
        versions = {k: getattr(engines, k) for k in ("vllm", "lmcache", "torch")} if engines else None
        return {
            "profile": self.profile_name,
            "engine": self.config.engine,
            "build": self.config.build,
            "tier": self.config.tier,
            "replicas": self.config.replicas,
            "engine_versions": versions,
            "lmcache_compiled_module": engines.compiled_import if engines else None,
            "devices": self.devices()["per_replica"],
            "sizes": self.sizes,
            "policies": self.policies(),
        }

    @property
    def replay_argv(self) -> list[str]:
        return ["kvtier", "replay", *config_argv(self.replay)]

    @property
    def client_argv(self) -> list[str]:
        """The replay as launch runs it: in this process, or under mpirun with ``--client-ranks`` N."""
        n = self.config.client_ranks
        return mpirun_argv(self.replay_argv, n) if n > 1 else self.replay_argv

    def lines(self) -> list[str]:
        """The commands one per line, as --dry-run prints them."""
        unset = {p.name: p.unset for p in self.processes}
        out = [show_command(env, argv, unset.get(name, ())) for name, env, argv in self.commands]
        if self.caddy_argv:
            out.append(shlex.join(self.caddy_argv))
        out.append(shlex.join(self.client_argv if self.config.client_ranks > 1 else self.replay_argv))
        return out


__all__ = ["LaunchPlan"]
