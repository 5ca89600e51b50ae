"""#59 item 3: a large run's files are removed after its result is written, off the user's wait, and never under
another run's load. Removing tens of GB took 4.6-7 s after the window closed (benchmarks/stop_latency.py); the run
now hands its folder to a remover of its own (engine/runs.py ``hand_off_removal``), the next run in the folder
waits for it before its load, and a remover that was killed leaves a folder the next run removes as stale."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from pathlib import Path

import pytest

from kvtier.engine import file as file_mod
from kvtier.engine.file import FileTier
from kvtier.engine.runs import MARKER, REMOVING, RUN_DIR_PREFIX, find_stale_runs, remove_stale_run, wait_removals
from tests.conftest import tiny_bench_config


def _folders(base: Path) -> list[Path]:
    return [p for p in base.iterdir() if p.name.startswith(RUN_DIR_PREFIX)]


def _gone(base: Path, limit_s: float = 30.0) -> bool:
    deadline = time.monotonic() + limit_s
    while _folders(base) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _folders(base)


def _tier_with_entries(base: Path, n: int = 3) -> FileTier:
    t = FileTier(base, capacity_bytes=64 << 20, direct_io="off")
    for i in range(n):
        t.write(f"k{i}", [memoryview(bytes(1 << 20))], 1 << 20)
    return t


def test_a_large_runs_files_go_to_a_remover_of_their_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(file_mod, "BACKGROUND_REMOVAL_BYTES", 2 << 20)  # 3 entries of 1 MiB are large here
    t = _tier_with_entries(tmp_path)
    t.remove_in_background = True
    t.close()
    assert t.removal_pid is not None and t.removal_pid != os.getpid() and t.removal_bytes >= 3 << 20
    assert t.cleanup_problems == []
    assert _gone(tmp_path), "the remover left the run folder"
    small = _tier_with_entries(tmp_path, 1)  # at or under the bound: removed here, at once
    small.remove_in_background = True
    small.close()
    assert small.removal_pid is None and not _folders(tmp_path)


def test_the_next_run_waits_for_a_removal_under_way_and_a_dead_removers_folder_is_stale(tmp_path: Path):
    t = _tier_with_entries(tmp_path)
    (run,) = _folders(tmp_path)
    os.rename(run / MARKER, run / REMOVING)  # what hand_off_removal does; this test stands in for the remover
    t._close_fds()  # the run is over (its lock released)...
    fd = os.open(run / REMOVING, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ...and the "remover" holds the folder
    assert find_stale_runs(tmp_path) == []  # a removal under way is not stale
    threading.Timer(2.0, os.close, [fd]).start()  # the remover dies two seconds in, its files left
    under_way, waited = wait_removals(tmp_path)
    assert under_way == 1 and waited >= 1.5
    (stale,) = find_stale_runs(tmp_path)
    assert stale.files == 3 and remove_stale_run(stale.path) == [] and not _folders(tmp_path)


def test_a_bench_hands_off_its_files_after_the_result_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from kvtier.bench import run
    from kvtier.results import load

    monkeypatch.setattr(file_mod, "BACKGROUND_REMOVAL_BYTES", 0)
    r = run(tiny_bench_config(tmp_path, max_requests=8, duration=30), handle_signals=False)
    td = r.teardown
    assert td is not None and td.removal == "background" and td.removal_pid and td.storage_bytes > 0
    on_disk = load(tmp_path / "r.json")
    assert on_disk.teardown is not None and on_disk.teardown.removal_pid == td.removal_pid  # written after
    assert _gone(tmp_path)


def test_another_users_folder_or_a_fifo_marker_holds_no_run(tmp_path: Path):
    """A shared cache dir: another user's ``kvtier-run-*`` folder with a locked marker is not waited for, and a FIFO
    under the marker's name (an open of it would block until someone writes) is not opened as a marker."""
    if os.geteuid() != 0:
        pytest.skip("making a folder of another user's takes root")
    theirs = tmp_path / f"{RUN_DIR_PREFIX}1-theirs"
    theirs.mkdir()
    (theirs / REMOVING).write_text("{}")
    held = os.open(theirs / REMOVING, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)  # "their" remover, at work for as long as this test lasts
    os.chown(theirs, 65534, 65534)
    os.chown(theirs / REMOVING, 65534, 65534)
    fifo = tmp_path / f"{RUN_DIR_PREFIX}2-fifo"
    fifo.mkdir()
    os.mkfifo(fifo / REMOVING)
    try:
        assert wait_removals(tmp_path, timeout_s=30)[0] == 0  # before: 30 s for theirs, for ever on the FIFO
        assert find_stale_runs(tmp_path) == []  # neither is a run folder of this user's
    finally:
        os.close(held)


def test_a_remover_that_cannot_start_leaves_the_removal_to_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The remover's interpreter cannot run kvtier (here: it exits at once): the run removes its files itself, says
    nothing is in the background, and leaves no folder."""
    import sys

    monkeypatch.setattr(file_mod, "BACKGROUND_REMOVAL_BYTES", 0)
    monkeypatch.setattr(sys, "executable", "/bin/false")
    t = _tier_with_entries(tmp_path)
    t.remove_in_background = True
    t.close()
    assert t.removal_pid is None and t.cleanup_problems == [] and not _folders(tmp_path)
