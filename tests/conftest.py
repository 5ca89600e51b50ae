"""Shared fixtures: real directories, small tiers, and helpers to mount tiny filesystems."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.engine.backend import aligned_buffer
from kvtier.engine.noise import NoiseBuffer

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    d = tmp_path / "cache"
    d.mkdir()
    return d


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files that start a real inference engine (marked ``engine``) go first; a stable sort keeps each file's
    order."""
    items.sort(key=lambda item: item.get_closest_marker("engine") is None)


ENGINE_SCOPE = "real inference engines"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: unknown where the plugin is not installed
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """scripts/test.sh's workers (pytest-xdist) take whole files, so module fixtures (a real vLLM, a report's
    results) start once — except the files of real engines (``test_*vllm*.py``), which go to one worker together,
    one after another, handed out first: three CPU vLLMs on two cores at once slowed each other's timed prefills
    enough to fail the real ladder's fit check, and handed out last the longest files ran on alone at the end."""
    from xdist.scheduler import LoadScopeScheduling

    class EnginesTogether(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return ENGINE_SCOPE if "vllm" in Path(path).name else path

    return EnginesTogether(config, log)


def replay_summary(path: Path) -> dict[str, Any]:
    """A replay's summary.json, its counts checked to add up (#41: every request is ok, failed by cause, or cut,
    never counted nowhere)."""
    import json

    s: dict[str, Any] = json.loads(Path(path).read_text())
    c = s["summary"]
    assert c["requests_total"] == c["requests_ok"] + c["requests_failed"] + c["requests_cut_at_stop"], c
    return s


@pytest.fixture(scope="session")
def noise() -> NoiseBuffer:
    return NoiseBuffer(8 * 1024 * 1024, seed=7)


@pytest.fixture
def buf() -> memoryview:
    return aligned_buffer(1024 * 1024)


def _mount(kind: str, size_mb: int, where: Path) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    where.mkdir(parents=True, exist_ok=True)
    if kind == "tmpfs":
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(where)]
    else:
        img = where.with_suffix(".img")
        if subprocess.run(["truncate", "-s", f"{size_mb}M", str(img)]).returncode:
            return False
        if subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], capture_output=True).returncode:
            return False
        cmd = ["mount", "-o", "loop", str(img), str(where)]
    return subprocess.run(cmd, capture_output=True).returncode == 0


@pytest.fixture
def small_fs(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    """A real, tiny filesystem (ext4 on a loop device, 48 MiB) so ENOSPC really happens."""
    where = tmp_path / f"smallfs-{uuid.uuid4().hex[:6]}"
    if not _mount("ext4", 48, where):
        pytest.skip("needs root and loop-device mounts to make a small filesystem")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture
def tmpfs_dir(tmp_path: Path) -> Iterator[Path]:
    """A tmpfs mount: a filesystem that refuses O_DIRECT."""
    where = tmp_path / "tmpfs"
    if not _mount("tmpfs", 64, where):
        pytest.skip("needs root to mount tmpfs")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def kvtier_cmd() -> list[str]:
    return [sys.executable, "-m", "kvtier"]


TINY_TEMPLATES = {
    "chatbot": {"context_range": [64, 512], "generation_range": [8, 64], "think_time_range": [0.01, 0.05]}
}


def tiny_bench_config(d: Path, **overrides: Any):  # type: ignore[no-untyped-def]
    """A short bench run's config (tiny model, chatbot users, file tier in ``d``), with ``overrides``."""
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning

    fields: dict[str, Any] = {
        "model": "tiny-1b",
        "num_users": 2,
        "duration": 2,
        "gpu_mem_gb": 0,
        "cpu_mem_gb": 0,
        "generation_mode": "none",
        "seed": 3,
        "cache_dir": str(d),
        "output": str(d / "r.json"),
        "progress": "none",
        "noise_mb": 16,
        "io_chunk_mb": 4,
        "tuning": Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
    }
    return BenchConfig(**{**fields, **overrides})


@pytest.fixture(scope="session")
def tiny_bench_result(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """A real, short bench run in this process (tiny model, CPU + file tiers): a typed BenchResult
    and the JSON file it wrote, shared by the tests that read results."""
    from kvtier.bench import run
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning

    d = tmp_path_factory.mktemp("tiny-bench")
    (d / "cache").mkdir()
    tuning = Tuning.model_validate({"user_templates": TINY_TEMPLATES})  # chatbot users only
    cfg = BenchConfig(
        model="tiny-1b",
        num_users=3,
        # bounded by work, not time: 1.5 s beside the real-vLLM tests once completed no request (no storage reads
        # for the tests that read them); 40 requests read both tiers (~1 s idle), 120 s only a bound
        max_requests=40,
        duration=120,
        gpu_mem_gb=0,
        cpu_mem_gb=0.004,
        generation_mode="none",
        seed=2,
        cache_dir=str(d / "cache"),
        output=str(d / "r.json"),
        progress="none",
        noise_mb=16,
        io_chunk_mb=4,
        tuning=tuning,
    )
    result = run(cfg, handle_signals=False)
    return result, d / "r.json"


def _has_mpi4py() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


NEEDS_MPI = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed"),
    pytest.mark.skipif(not _has_mpi4py(), reason="mpi4py is not installed (the test extra installs it)"),
]
"""Markers of tests that start real mpirun ranks."""
