"""#28: deletion of killed runs' folders cannot be redirected. A ``kvtier-run-*`` symlink to a marked folder
elsewhere is never followed, and a folder swapped in under a run folder's name mid-clean loses nothing: every
unlink goes through the descriptor the marker was proven and locked through."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from kvtier.engine.runs import MARKER, find_stale_runs, remove_stale_run


def _run_folder(d: Path, files: int, marker: bool = True) -> Path:
    d.mkdir(parents=True)
    for i in range(files):
        (d / f"e{i}.kv").write_bytes(b"x")
    if marker:
        (d / MARKER).write_text("{}")
    return d


def test_a_symlinked_run_folder_is_never_followed(tmp_path: Path):
    base, elsewhere = tmp_path / "cache", _run_folder(tmp_path / "precious", 5)
    base.mkdir()
    (base / "kvtier-run-1-aaaa").symlink_to(elsewhere, target_is_directory=True)
    assert find_stale_runs(base) == []
    problems = remove_stale_run(base / "kvtier-run-1-aaaa")
    assert problems and "symlink" in problems[0]
    assert len(list(elsewhere.glob("*.kv"))) == 5 and (elsewhere / MARKER).exists()


def test_a_folder_swapped_in_mid_clean_loses_nothing(tmp_path: Path):
    """Race the clean against a rename that puts an unmarked folder under the run's name (bounded in time)."""
    base = tmp_path / "cache"
    base.mkdir()
    deadline, rounds = time.monotonic() + 8, 0
    while time.monotonic() < deadline and rounds < 30:
        run = _run_folder(base / "kvtier-run-2-bbbb", 400)
        victim = _run_folder(tmp_path / f"victim{rounds}", 400, marker=False)
        swapped = threading.Event()

        def swap(run: Path = run, victim: Path = victim, swapped: threading.Event = swapped, n: int = rounds) -> None:
            try:
                os.rename(run, tmp_path / f"moved{n}")
            except FileNotFoundError:
                pass  # the clean already removed the whole run folder: the victim comes in after it
            os.rename(victim, run)
            swapped.set()

        t = threading.Thread(target=swap)
        t.start()
        remove_stale_run(run)
        t.join()
        assert swapped.is_set()
        # whatever the interleaving, the unmarked folder (now under the run's name) kept every file
        assert len(list(run.glob("*.kv"))) == 400, f"round {rounds}"
        for p in run.iterdir():
            p.unlink()
        run.rmdir()
        rounds += 1
    assert rounds >= 1  # at least one full race, however loaded the machine (more rounds when there is time)


def test_a_stale_run_is_still_removed_whole(tmp_path: Path):
    base = tmp_path / "cache"
    run = _run_folder(base / "kvtier-run-3-cccc", 3)
    (run / "user-notes.txt").write_text("not ours")
    (found,) = find_stale_runs(base)
    assert found.files == 3 and found.bytes == 3
    problems = remove_stale_run(run)
    assert [p for p in problems if "not removed" in p]  # the folder stays: a file that is not ours is in it
    assert (run / "user-notes.txt").exists() and not list(run.glob("*.kv")) and not (run / MARKER).exists()
