"""What a run leaves behind: a killed run's folder is found and removed by the next run (or by
``kvtier clean``), never a folder without kvtier's marker or one a live run holds; a run whose folder
cannot be cleaned still writes its result and says what it left."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvtier.engine.runs import MARKER, RUN_DIR_PREFIX, find_stale_runs
from tests.conftest import TINY_TEMPLATES, kvtier_cmd

pytestmark = pytest.mark.slow

TINY = [
    "--model",
    "tiny-1b",
    "--gpu-mem-gb",
    "0",
    "--cpu-mem-gb",
    "0",
    "--generation-mode",
    "none",
    "--progress",
    "none",
    "--noise-mb",
    "16",
    "--io-chunk-mb",
    "4",
]


def run_dirs(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.startswith(RUN_DIR_PREFIX))


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:  # evicted meanwhile
        return 0


def killed_run(cache: Path, tmp: Path) -> Path:
    """A bench killed with SIGKILL once its folder holds entries: what a crash leaves behind."""
    proc = subprocess.Popen(
        kvtier_cmd()
        + [
            "bench",
            *TINY,
            "--num-users",
            "4",
            "--duration",
            "60",
            "--cache-dir",
            str(cache),
            "--output",
            str(tmp / "killed.json"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dirs = run_dirs(cache)
            # an entry with bytes in it (a file just created is empty: killed then, the folder would hold 0 bytes)
            if dirs and any(p.suffix == ".kv" and _size(p) > 0 for p in dirs[0].iterdir()):
                break
            time.sleep(0.05)
        else:
            raise AssertionError("the run never wrote an entry")
        assert not find_stale_runs(cache), "a live run's folder must not count as stale"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    (stale,) = run_dirs(cache)
    return stale


def small_config(tmp: Path) -> str:
    p = tmp / "small.yaml"
    p.write_text("user_templates:\n  chatbot: " + json.dumps(TINY_TEMPLATES["chatbot"]) + "\n")
    return str(p)


def test_a_killed_runs_folder_is_removed_by_the_next_run_and_others_are_left(tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = killed_run(cache, tmp_path)
    foreign = cache / f"{RUN_DIR_PREFIX}123-notours"  # looks like ours, but has no marker
    foreign.mkdir()
    (foreign / "data.kv").write_bytes(b"x" * 4096)
    out = tmp_path / "r.json"
    p = subprocess.run(
        kvtier_cmd()
        + [
            "bench",
            *TINY,
            "--num-users",
            "2",
            "--duration",
            "1",
            "--cache-dir",
            str(cache),
            "--output",
            str(out),
            "--config",
            small_config(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    # (whether a request completes within the short run does not matter here: the exit status and
    # result say so either way; what matters is what the run did with the folders it found)
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr
    r = json.loads(out.read_text())
    sr = r["setup"]["stale_runs"]
    assert sr["folders"] == [str(stale)] and sr["removed"] and sr["bytes"] > 0 and not sr["problems"]
    w = next(w for w in r["warnings"] if w["code"] == "stale-runs-removed")
    assert w["folders"] == [str(stale)]
    assert not stale.exists() and (foreign / "data.kv").exists()  # ours went, the unmarked one stayed
    assert r["storage"]["detected_free_bytes"] > 0


def test_keep_stale_only_warns_and_kvtier_clean_removes(tmp_path: Path):
    cache = tmp_path / "cache"
    cache.mkdir()
    stale = killed_run(cache, tmp_path)
    out = tmp_path / "r.json"
    p = subprocess.run(
        kvtier_cmd()
        + [
            "bench",
            *TINY,
            "--num-users",
            "2",
            "--duration",
            "1",
            "--cache-dir",
            str(cache),
            "--output",
            str(out),
            "--keep-stale",
            "--config",
            small_config(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode in (0, 1) and "Traceback" not in p.stderr, p.stderr  # status aside (see above)
    r = json.loads(out.read_text())
    assert "stale-runs-found" in {w["code"] for w in r["warnings"]} and stale.exists()
    dry = subprocess.run(kvtier_cmd() + ["clean", str(cache), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and f"would remove {stale}" in dry.stdout and stale.exists()
    done = subprocess.run(kvtier_cmd() + ["clean", str(cache)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and f"removing {stale}" in done.stdout
    assert not stale.exists() and run_dirs(cache) == []


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("chattr") is None, reason="needs root and chattr")
def test_a_folder_that_cannot_be_cleaned_still_gives_a_result(tmp_path: Path):
    from kvtier.bench import run
    from kvtier.config.bench import BenchConfig
    from kvtier.config.tuning import Tuning

    cache = tmp_path / "cache"
    cache.mkdir()
    frozen: list[Path] = []

    def freeze(runner, elapsed):  # as a filesystem remounted read-only after an I/O error would be
        if not frozen:
            (d,) = run_dirs(cache)
            if subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode == 0:
                frozen.append(d)

    cfg = BenchConfig(
        model="tiny-1b",
        num_users=2,
        duration=2,
        gpu_mem_gb=0,
        cpu_mem_gb=0,
        generation_mode="none",
        seed=1,
        cache_dir=str(cache),
        output=str(tmp_path / "r.json"),
        progress="none",
        noise_mb=16,
        io_chunk_mb=4,
        progress_interval=0.5,
        tuning=Tuning.model_validate({"user_templates": TINY_TEMPLATES}),
    )
    try:
        result = run(cfg, on_tick=freeze, handle_signals=False)
    finally:
        for d in frozen:
            subprocess.run(["chattr", "-i", str(d)], check=True)
    if not frozen:
        pytest.skip("this filesystem does not support the immutable attribute")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["status"] == result.status
    w = next(w for w in saved["warnings"] if w["code"] == "cleanup-failed")
    assert w["problems"] and "Operation not permitted" in w["problems"][0]
    assert (frozen[0] / MARKER).exists() and find_stale_runs(cache)  # left behind: the next run removes it
