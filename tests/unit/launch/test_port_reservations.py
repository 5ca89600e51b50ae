"""Two kvtier processes of one user never draw the same port while both live (launch/procs.py ``free_ports``): four
launches started at once drew one port twice in 12 runs, and the second was refused at start."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvtier.launch import procs

DRAW = (
    "import sys; from kvtier.launch.procs import free_ports; "
    "print(' '.join(map(str, free_ports(int(sys.argv[1])))), flush=True); sys.stdin.read()"
)


def test_processes_drawing_at_once_never_share_a_port(tmp_path: Path):
    # 4 x 150 ports from ~12,000: drawn independently about 15 would be shared (none once in 2.7 million)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", DRAW, "150"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )  # fmt: skip
        for _ in range(4)
    ]
    try:
        drawn = [[int(p) for p in k.stdout.readline().split()] for k in kids if k.stdout is not None]
    finally:
        for k in kids:
            k.communicate("", timeout=30)  # each lived until every draw was made
    assert [len(d) for d in drawn] == [150] * 4
    every = [p for d in drawn for p in d]
    assert len(set(every)) == len(every), len(every) - len(set(every))
    folder = tmp_path / f"kvtier-ports-{os.getuid()}"
    assert len([f for f in folder.iterdir() if f.name.isdigit()]) == 600


def test_the_reservations_of_ended_processes_are_dropped(tmp_path: Path, monkeypatch):
    folder = tmp_path / f"kvtier-ports-{os.getuid()}"
    folder.mkdir(mode=0o700)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (folder / "21000").write_text(f"{ended.stdout.strip()} 12345")  # drawn by a process that has ended
    (folder / "21001").write_text(f"{os.getpid()} 0")  # a live pid, but not the process that drew (its start differs)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = procs.free_ports(2)
    left = sorted(int(f.name) for f in folder.iterdir() if f.name.isdigit())
    assert left == sorted(mine) and (folder / str(mine[0])).read_text().startswith(f"{os.getpid()} ")
    assert procs._alive(folder / str(mine[0]))


def test_a_folder_another_could_change_is_not_used(tmp_path: Path, monkeypatch):
    folder = tmp_path / f"kvtier-ports-{os.getuid()}"
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)  # writable by others: its files could lie, so draws go on without them
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert len(procs.free_ports(3)) == 3
    assert not list(folder.iterdir())
