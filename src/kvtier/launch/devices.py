"""Which GPUs a launch may use, and which replica gets which.

The devices come from the host, never from a replica's index: ``--gpus`` when given, else the
allocation the launch inherited (``CUDA_VISIBLE_DEVICES`` on NVIDIA; ``HIP_VISIBLE_DEVICES``, then
``CUDA_VISIBLE_DEVICES``, which HIP also honours, on AMD), else what ``nvidia-smi -L`` or ``rocm-smi``
lists. Replicas are dealt disjoint, consecutive sets of ``gpus_per_replica`` devices; too few devices
is an error before anything starts. A child is given its set in the vendor's variable and nothing
else: on AMD ``CUDA_VISIBLE_DEVICES`` is removed, because vLLM on ROCm refuses to start when the two
variables disagree.

Everything here is logic over an environment mapping and a command runner, so tests feed it
inventories without a GPU.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvtier.child import run
from kvtier.errors import ConfigError, LaunchError

Runner = Callable[[list[str]], str | None]
"""Runs a command and returns its stdout, or None when it is missing or fails."""

VISIBLE = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES", "cpu": "VLLM_CPU_OMP_THREADS_BIND"}
"""The variable that gives a replica its devices; on the CPU build, the cores its OpenMP threads bind to."""
_NVIDIA_SMI = re.compile(r"^GPU (\d+):", re.MULTILINE)
_ROCM_SMI = re.compile(r"^GPU\[(\d+)\]", re.MULTILINE)


def run_quiet(argv: list[str]) -> str | None:
    """stdout of ``argv``, or None when it is not installed, fails or hangs (10 s)."""
    p = run(argv, timeout_s=10)
    return p.stdout if p is not None and p.returncode == 0 else None


def parse_list(text: str, where: str) -> list[str]:
    """A device list ``0,1`` (indices or UUIDs); duplicates and empty items are errors."""
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise ConfigError(f"{where}: {text!r} is not a comma-separated list of devices")
    dup = sorted({x for x in items if items.count(x) > 1})
    if dup:
        raise ConfigError(f"{where}: device {', '.join(dup)} is listed twice")
    return items


@dataclass(frozen=True)
class Inventory:
    """The devices this launch may use, and where that list came from."""

    build: str
    devices: list[str]
    source: str  # "--gpus", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "nvidia-smi -L", "rocm-smi", "none"
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        listed = ",".join(self.devices) if self.devices else "no devices"
        return f"{listed} (from {self.source})"


def discover(build: str, gpus: str | None, environ: Mapping[str, str], run: Runner = run_quiet) -> Inventory:
    """The devices for ``build`` (nvidia | amd): ``--gpus``, the inherited allocation, or the vendor tool."""
    if gpus is not None:
        return Inventory(build, parse_list(gpus, "--gpus"), "--gpus")
    notes: list[str] = []
    names = ["HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"] if build == "amd" else ["CUDA_VISIBLE_DEVICES"]
    for name in names:
        value = environ.get(name)
        if value is None:
            continue
        if not value.strip():  # set but empty: the scheduler gave this job no device
            return Inventory(build, [], name, [f"{name} is set and empty: no device was allocated to this job"])
        devices = parse_list(value, name)
        other = environ.get("CUDA_VISIBLE_DEVICES")
        if build == "amd" and name == "HIP_VISIBLE_DEVICES" and other is not None and other != value:
            notes.append(
                f"CUDA_VISIBLE_DEVICES={other} disagrees with HIP_VISIBLE_DEVICES={value}: HIP's is used "
                "and children get no CUDA_VISIBLE_DEVICES"
            )
        return Inventory(build, devices, name, notes)
    if build == "amd":
        out = run(["rocm-smi", "--showid"])
        found = sorted(set(_ROCM_SMI.findall(out or "")), key=int)
        return Inventory(build, found, "rocm-smi" if out is not None else "none")
    out = run(["nvidia-smi", "-L"])
    return Inventory(build, _NVIDIA_SMI.findall(out or ""), "nvidia-smi -L" if out is not None else "none")


def place(inv: Inventory, replicas: int, per_replica: int) -> list[list[str]]:
    """Disjoint device sets, one per replica, in inventory order; LaunchError when too few."""
    need = replicas * per_replica
    if len(inv.devices) < need:
        have = f"{len(inv.devices)}: {inv.describe()}" if inv.devices else f"none ({inv.source})"
        hint = "pass --gpus LIST, or lower --replicas / --gpus-per-replica"
        raise LaunchError(
            f"{replicas} replica(s) x {per_replica} GPU(s) need {need} device(s); this host offers {have}. {hint}"
        )
    return [inv.devices[i * per_replica : (i + 1) * per_replica] for i in range(replicas)]


def cpu_inventory(cores: str | None, affinity: set[int] | None = None) -> Inventory:
    """The CPU build's devices are cores: ``--gpus`` read as a core list when given (``0,1``), else the cores
    this process may run on (its affinity mask: a container's or a scheduler's cpuset included)."""
    import os

    if cores is not None:
        items = parse_list(cores, "--gpus")
        bad = [x for x in items if not x.isdigit()]
        if bad:
            raise ConfigError(f"--gpus {cores}: on --build cpu a list of core numbers, not {', '.join(bad)}")
        return Inventory("cpu", items, "--gpus (cores)")
    mask = affinity if affinity is not None else os.sched_getaffinity(0)
    return Inventory("cpu", [str(c) for c in sorted(mask)], "sched_getaffinity")


def _ranges(cores: list[str]) -> str:
    """``0,1,2,5`` -> ``0-2,5``: the form VLLM_CPU_OMP_THREADS_BIND takes."""
    nums, out = sorted(int(c) for c in cores), []
    start = prev = nums[0]
    for n in [*nums[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}-{prev}" if prev > start else str(start))
        if n is not None:
            start = prev = n
    return ",".join(out)


def child_env(build: str, devices: list[str]) -> tuple[dict[str, str], list[str]]:
    """(variables to set, variables to remove) for a replica given ``devices``. The CPU build binds the
    replica's OpenMP threads to its cores, one thread per core, and hides every GPU from it."""
    if build == "cpu":
        return {
            "VLLM_CPU_OMP_THREADS_BIND": _ranges(devices),
            "OMP_NUM_THREADS": str(len(devices)),
            "CUDA_VISIBLE_DEVICES": "",
        }, []
    value = ",".join(devices)
    if build == "amd":
        return {"HIP_VISIBLE_DEVICES": value}, ["CUDA_VISIBLE_DEVICES"]
    return {"CUDA_VISIBLE_DEVICES": value}, []


__all__ = ["Inventory", "discover", "cpu_inventory", "place", "child_env", "parse_list", "run_quiet", "VISIBLE"]
