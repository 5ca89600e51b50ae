"""Device placement from fixture inventories: the devices come from --gpus, the inherited allocation or
the vendor tool (never from the replica index); replicas get disjoint sets; too few devices is refused
before anything starts; AMD children get HIP_VISIBLE_DEVICES and no CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import os
import subprocess

import pytest

from kvtier.config.launch import LaunchConfig
from kvtier.config.replay import ReplayConfig
from kvtier.errors import ConfigError, LaunchError
from kvtier.launch.devices import child_env, discover, place
from kvtier.launch.orchestrate import plan
from kvtier.launch.procs import child_environment
from tests.conftest import kvtier_cmd

NVIDIA_SMI_1 = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-6f1a0c2e-0000-0000-0000-000000000000)\n"
NVIDIA_SMI_8 = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-00000000-0000-0000-0000-00000000000{i})\n" for i in range(8))
ROCM_SMI_2 = """
============================ ROCm System Management Interface ============================
=========================================== ID ===========================================
GPU[0]          : Device Name:          AMD Instinct MI300X
GPU[0]          : Device ID:            0x74a1
GPU[1]          : Device Name:          AMD Instinct MI300X
GPU[1]          : Device ID:            0x74a1
==========================================================================================
"""


class Tool:
    """A command runner fed a fixture: records the calls, answers like the vendor tool (None = missing)."""

    def __init__(self, out: str | None):
        self.out = out
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> str | None:
        self.calls.append(argv)
        return self.out


def test_one_gpu_host_runs_one_replica_and_refuses_two():
    tool = Tool(NVIDIA_SMI_1)
    inv = discover("nvidia", None, {}, tool)
    assert inv.devices == ["0"] and inv.source == "nvidia-smi -L" and tool.calls == [["nvidia-smi", "-L"]]
    assert place(inv, 1, 1) == [["0"]]
    with pytest.raises(LaunchError, match=r"2 replica\(s\) x 1 GPU\(s\) need 2 device\(s\); this host offers 1: 0"):
        place(inv, 2, 1)


def test_eight_gpus_are_dealt_disjoint_consecutive_sets():
    inv = discover("nvidia", None, {}, Tool(NVIDIA_SMI_8))
    assert place(inv, 2, 4) == [["0", "1", "2", "3"], ["4", "5", "6", "7"]]
    sets = place(inv, 3, 2)
    assert sets == [["0", "1"], ["2", "3"], ["4", "5"]]
    flat = [d for s in sets for d in s]
    assert len(flat) == len(set(flat))
    with pytest.raises(LaunchError, match="need 9 device"):
        place(inv, 3, 3)


def test_an_inherited_allocation_is_kept_not_overwritten():
    tool = Tool(NVIDIA_SMI_8)
    inv = discover("nvidia", None, {"CUDA_VISIBLE_DEVICES": "4,5"}, tool)
    assert inv.devices == ["4", "5"] and inv.source == "CUDA_VISIBLE_DEVICES" and tool.calls == []
    assert place(inv, 2, 1) == [["4"], ["5"]]
    assert child_env("nvidia", ["5"]) == ({"CUDA_VISIBLE_DEVICES": "5"}, [])
    # --gpus wins over the environment
    assert discover("nvidia", "GPU-a,GPU-b", {"CUDA_VISIBLE_DEVICES": "4,5"}, tool).devices == ["GPU-a", "GPU-b"]


def test_amd_with_a_stray_cuda_visible_devices():
    env = {"HIP_VISIBLE_DEVICES": "2,3", "CUDA_VISIBLE_DEVICES": "0"}
    inv = discover("amd", None, env, Tool(None))
    assert inv.devices == ["2", "3"] and inv.source == "HIP_VISIBLE_DEVICES"
    assert len(inv.notes) == 1 and "disagrees" in inv.notes[0]
    assert child_env("amd", ["3"]) == ({"HIP_VISIBLE_DEVICES": "3"}, ["CUDA_VISIBLE_DEVICES"])
    # only CUDA_VISIBLE_DEVICES inherited on AMD: HIP honours it, so it is the allocation
    only = discover("amd", None, {"CUDA_VISIBLE_DEVICES": "1"}, Tool(None))
    assert only.devices == ["1"] and only.source == "CUDA_VISIBLE_DEVICES" and not only.notes
    # nothing inherited: rocm-smi
    tool = Tool(ROCM_SMI_2)
    listed = discover("amd", None, {}, tool)
    assert listed.devices == ["0", "1"] and listed.source == "rocm-smi" and tool.calls == [["rocm-smi", "--showid"]]


def test_the_amd_child_environment_has_no_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "6,7")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    lp = plan(
        LaunchConfig(
            tier="gpu",
            engine="vllm",
            build="amd",
            replicas=2,
            dry_run=True,
            replay=ReplayConfig(model="m", dataset="d.jsonl"),
        )
    )
    assert [p.devices for p in lp.replicas] == [("6",), ("7",)]
    assert [w.code for w in lp.warnings] == ["gpu-env-conflict"]
    for p, dev in zip(lp.replicas, ["6", "7"], strict=True):
        env = child_environment({"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "6,7", "PATH": "/bin"}, p)
        assert env["HIP_VISIBLE_DEVICES"] == dev and "CUDA_VISIBLE_DEVICES" not in env
        assert env["DO_NOT_TRACK"] == "1" and env["VLLM_ROCM_USE_AITER"] == "1" and env["PATH"] == "/bin"
    assert lp.lines()[0].startswith("env -u CUDA_VISIBLE_DEVICES ")


def test_not_enough_devices_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch, tmp_path):
    empty = discover("nvidia", None, {"CUDA_VISIBLE_DEVICES": ""}, Tool(NVIDIA_SMI_8))
    assert empty.devices == [] and "no device was allocated" in empty.notes[0]
    with pytest.raises(LaunchError, match=r"offers none \(CUDA_VISIBLE_DEVICES\)"):
        place(empty, 1, 1)
    missing = discover("nvidia", None, {}, Tool(None))
    assert missing.devices == [] and missing.source == "none"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    out = tmp_path / "run"
    cfg = LaunchConfig(tier="gpu", engine="vllm", replicas=2, output=str(out), replay=ReplayConfig(model="m"))
    with pytest.raises(LaunchError, match="need 2 device"):
        plan(cfg)
    assert not out.exists()


def test_device_lists_are_checked():
    with pytest.raises(ConfigError, match="--gpus: device 1 is listed twice"):
        discover("nvidia", "0,1,1", {}, Tool(None))
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES: '0,,1' is not a comma-separated list"):
        discover("nvidia", None, {"CUDA_VISIBLE_DEVICES": "0,,1"}, Tool(None))


def test_the_simulated_engine_places_no_device(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    lp = plan(
        LaunchConfig(
            tier="cpu", engine="sim", replicas=2, dry_run=True, replay=ReplayConfig(model="llama3.1-8b", dataset="d")
        )
    )
    assert lp.inventory is None and all(p.devices == () for p in lp.replicas)
    assert all("CUDA_VISIBLE_DEVICES" not in p.env for p in lp.replicas)
    assert lp.devices()["source"] == "not used (simulated engine)"


def test_cli_dry_run_on_an_inherited_allocation_and_a_one_gpu_refusal(tmp_path):
    """The issue's two checks through the command line: CUDA_VISIBLE_DEVICES=4,5 places the replicas on
    4 and 5; one GPU and two replicas is refused (exit 6) before anything starts or is written."""
    replay = ["--", "--model", "m", "--dataset", "d.jsonl"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "4,5"}
    p = subprocess.run(
        kvtier_cmd() + ["launch", "--tier", "gpu", "--engine", "vllm", "--replicas", "2", "--dry-run", *replay],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 0, p.stderr
    serve = [x for x in p.stdout.splitlines() if " vllm serve m " in x]
    assert [x.split(" ")[0] for x in serve] == ["CUDA_VISIBLE_DEVICES=4", "CUDA_VISIBLE_DEVICES=5"]
    assert "replica0 -> 4, replica1 -> 5" in p.stderr
    out = tmp_path / "run"
    env["CUDA_VISIBLE_DEVICES"] = "0"
    p = subprocess.run(
        kvtier_cmd()
        + ["launch", "--tier", "gpu", "--engine", "vllm", "--replicas", "2", "--output", str(out), *replay],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 6 and "need 2 device(s); this host offers 1: 0 (from CUDA_VISIBLE_DEVICES)" in p.stderr
    assert not out.exists()
