"""#41 item 5: ``plan sweep`` resumes only trials that were run as the sweep now asks (their ``trial.json``), and works
through descriptors: a symlinked point or trial folder is refused or unlinked, never followed into a deletion
outside the sweep. The replay's status is stood in for (tests/integration/test_plan_sweep.py runs real trials)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.plan import sweep
from kvtier.plan.sweep import TRIAL_FILE, Point, prepare_trial, trial_descriptor
from kvtier.results.sweep import SweepGrid


def _grid(data: Path, **change: object) -> SweepGrid:
    g = {"dataset": str(data), "dataset_format": "auto", "cpu_gb": [0.0], "nvme_gb": [0.0], "concurrency": [2],
         "trials": 1, "budget_s": 0.0, "preset": "h100-llama3-8b", "sim_model": "llama3.1-8b", "gpu_kv_gb": 0.3,
         "num_rounds": 1, "max_tokens_cap": None, "duration_s": 0.0, "nvme_dir": "/n", "replay_args": []}  # fmt: skip
    g.update(change)
    return SweepGrid.model_validate(g)


@pytest.fixture
def data(tmp_path: Path) -> Path:
    d = tmp_path / "data"
    d.mkdir()
    (d / "sessions.jsonl").write_text('{"session_id": "a", "turns": []}\n')
    return d


@pytest.fixture
def complete(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every trial folder's replay result reads as complete."""
    monkeypatch.setattr(sweep, "_replay_status", lambda folder: "complete")


def _ran(out: Path, g: SweepGrid) -> Path:
    """A trial run as ``g`` asks: prepared (trial.json written), then its replay's files."""
    p = Point(0.0, 0.0, 2)
    assert prepare_trial(out, p.name, 0, trial_descriptor(g, p, 0)) is False
    folder = out / p.name / "trial-0"
    (folder / "summary.json").write_text("{}")
    return folder


def test_a_trial_run_as_asked_is_kept(tmp_path: Path, data: Path, complete: None):
    out, g = tmp_path / "out", _grid(data)
    out.mkdir()
    folder = _ran(out, g)
    assert json.loads((folder / TRIAL_FILE).read_text())["gpu_kv_gb"] == 0.3
    assert prepare_trial(out, "cpu0-nvme0-c2", 0, trial_descriptor(g, Point(0.0, 0.0, 2), 0)) is True
    assert (folder / "summary.json").exists()
    assert oct(folder.stat().st_mode & 0o777) == "0o700" and oct(folder.parent.stat().st_mode & 0o777) == "0o700"


@pytest.mark.parametrize("change", [{"gpu_kv_gb": 0.6}, {"preset": "other"}, {"replay_args": ["--seed", "2"]},
                                    {"num_rounds": 2}])  # fmt: skip
def test_a_complete_trial_of_other_settings_is_run_again(tmp_path: Path, data: Path, complete: None, change):
    out = tmp_path / "out"
    out.mkdir()
    folder = _ran(out, _grid(data))
    g2 = _grid(data, **change)
    assert prepare_trial(out, "cpu0-nvme0-c2", 0, trial_descriptor(g2, Point(0.0, 0.0, 2), 0)) is False
    assert not (folder / "summary.json").exists()  # cleared: the trial runs again
    want = json.loads(json.dumps(trial_descriptor(g2, Point(0, 0, 2), 0)))
    assert json.loads((folder / TRIAL_FILE).read_text()) == want


def test_a_changed_or_other_dataset_or_no_record_is_run_again(tmp_path: Path, data: Path, complete: None):
    out, g, p = tmp_path / "out", _grid(data), Point(0.0, 0.0, 2)
    out.mkdir()
    _ran(out, g)
    (data / "sessions.jsonl").write_text('{"session_id": "b", "turns": []}\n\n')  # same name, new content
    assert prepare_trial(out, p.name, 0, trial_descriptor(g, p, 0)) is False
    other = tmp_path / "other"
    other.mkdir()
    (other / "sessions.jsonl").write_text("{}\n")
    assert prepare_trial(out, p.name, 0, trial_descriptor(_grid(other), p, 0)) is False
    (out / p.name / "trial-0" / TRIAL_FILE).unlink()  # a folder an earlier version left, with no record
    assert prepare_trial(out, p.name, 0, trial_descriptor(_grid(other), p, 0)) is False


def test_a_symlinked_point_folder_is_refused_and_nothing_outside_is_deleted(tmp_path: Path, data: Path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    out.mkdir()
    (victim / "trial-0").mkdir(parents=True)
    (victim / "trial-0" / "precious").write_text("keep")
    os.symlink(victim, out / "cpu0-nvme0-c2")
    g, p = _grid(data), Point(0.0, 0.0, 2)
    with pytest.raises(ConfigError, match="a symlink or not a folder"):
        prepare_trial(out, p.name, 0, trial_descriptor(g, p, 0))
    assert (victim / "trial-0" / "precious").read_text() == "keep"


def test_a_symlinked_trial_folder_is_unlinked_not_followed(tmp_path: Path, data: Path):
    out, victim = tmp_path / "out", tmp_path / "victim"
    (out / "cpu0-nvme0-c2").mkdir(parents=True)
    victim.mkdir()
    (victim / "precious").write_text("keep")
    os.symlink(victim, out / "cpu0-nvme0-c2" / "trial-0")
    g, p = _grid(data), Point(0.0, 0.0, 2)
    assert prepare_trial(out, p.name, 0, trial_descriptor(g, p, 0)) is False
    assert (victim / "precious").read_text() == "keep"
    assert (out / p.name / "trial-0").is_dir() and not (out / p.name / "trial-0").is_symlink()
