"""#41 item 6: every output file goes through the one atomic writer (results/io.py), so a file or symlink planted at
an output's name is replaced, never written through: requests.jsonl, `model make`'s files, trace and datasize
outputs, the request log, plots, the I/O trace log (a stream: unlinked and created exclusively), process logs
(appended without following a link). A source scan keeps it the one writer."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from kvtier.errors import KvtierError
from kvtier.results.io import atomic_file, open_append, open_fresh, write_text_atomic
from tests.conftest import kvtier_cmd

SRC = Path(__file__).resolve().parents[3] / "src" / "kvtier"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    v = tmp_path / "victim.txt"
    v.write_text("precious")
    return v


def _planted(at: Path, victim: Path, kind: str) -> Path:
    if kind == "symlink":
        at.symlink_to(victim)
    else:
        os.link(victim, at)
    return at


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_the_atomic_writer_replaces_a_planted_name_and_never_writes_through_it(tmp_path: Path, victim: Path, kind):
    out = _planted(tmp_path / "out.json", victim, kind)
    write_text_atomic(out, "ours")
    assert victim.read_text() == "precious" and out.read_text() == "ours" and not out.is_symlink()
    with pytest.raises(RuntimeError), atomic_file(out) as f:  # a writer that fails leaves the old file, no temp
        f.write("half")
        raise RuntimeError("stop")
    assert out.read_text() == "ours" and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_streamed_output_unlinks_a_planted_name_first(tmp_path: Path, victim: Path, kind):
    out = _planted(tmp_path / "trace.csv", victim, kind)
    with open_fresh(out) as f:
        f.write(b"ours")
    assert victim.read_text() == "precious" and out.read_bytes() == b"ours"


def test_a_log_is_not_appended_through_a_link(tmp_path: Path, victim: Path):
    log = _planted(tmp_path / "sim.log", victim, "symlink")
    with pytest.raises(OSError):
        open_append(log)
    assert victim.read_text() == "precious"


def test_a_folder_that_cannot_take_the_file_is_a_named_error(tmp_path: Path):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "x").mkdir()  # a folder in the file's place: rename refuses
    with pytest.raises(KvtierError, match=r"--output: cannot write .*x"):
        write_text_atomic(tmp_path / "ro" / "x", "ours")


def test_model_make_trace_stats_and_datasize_outputs_replace_planted_links(tmp_path: Path, victim: Path):
    from kvtier.modelmaker import Geometry, make_model

    d = tmp_path / "model"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "kvtier-model.json"):
        _planted(d / name, victim, "symlink")
    make_model(d, Geometry(), force=True)
    assert victim.read_text() == "precious" and json.loads((d / "config.json").read_text())["model_type"] == "llama"
    assert not any((d / n).is_symlink() for n in os.listdir(d))

    trace = tmp_path / "t.csv"
    trace.write_text("Timestamp,Operation,Object_Size_Bytes,Tier,Key,Phase\n0.0,Write,4096,Tier-2,k,Prefill\n")
    out = _planted(tmp_path / "stats.json", victim, "symlink")
    p = subprocess.run([*kvtier_cmd(), "trace", "stats", str(trace), "--output", str(out)], capture_output=True,
                       text=True, timeout=60)  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "precious" and json.loads(out.read_text())["kind"] == "kvtier trace stats"

    size = _planted(tmp_path / "size.json", victim, "hardlink")
    argv = ["mlperf", "datasize", "--open", "--workloads", "1", "--duration", "5", "--num-users", "2", "--output"]
    p = subprocess.run([*kvtier_cmd(), *argv, str(size)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert victim.read_text() == "precious" and "options" in json.loads(size.read_text())


def test_the_replay_writes_requests_jsonl_through_the_atomic_writer(tmp_path: Path, victim: Path):
    from kvtier.replay.driver import write_outputs

    out = tmp_path / "replay"
    out.mkdir()
    _planted(out / "requests.jsonl", victim, "symlink")
    with pytest.raises(TypeError):  # no result to write: requests.jsonl is written first, and atomically
        write_outputs(object(), [{"user": "u"}], out)  # type: ignore[arg-type]
    assert victim.read_text() == "precious" and (out / "requests.jsonl").read_text() == '{"user": "u"}\n'


WRITES = re.compile(
    r"""(?<![a-z])open\([^)]*["'](?:w|wb|a|ab|w\+|x|xb)["']|\.write_text\(|\.write_bytes\(|tok\.save\("""
)


def test_outputs_are_written_only_through_the_one_writer():
    """No module but results/io.py opens a file for writing by name (descriptor-based writes, os.open with
    O_EXCL/O_NOFOLLOW, are allowed: the sweep's trial.json, the file tier)."""
    found = [f"{p.relative_to(SRC)}:{n}: {line.strip()}"
             for p in SRC.rglob("*.py") if p.name != "io.py" or p.parent.name != "results"
             for n, line in enumerate(p.read_text().splitlines(), 1) if WRITES.search(line)]  # fmt: skip
    assert not found, found
