"""Agent-trace variants: time units, session_id kinds, sessions rebuilt from the prompt prefix chain, and
several sessions in one file — each read, and the choice said in the dataset's notes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.replay.datasets import load_sessions
from kvtier.tokenizer import chars_tokenizer


def write(p: Path, rows: list[dict]) -> Path:
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def gaps(sessions) -> list[list[float]]:  # type: ignore[no-untyped-def]
    return [[round(t.gap_s, 6) for t in s.turns] for s in sessions]


@pytest.mark.parametrize(
    "stamps,unit",
    [
        ([1_760_428_436_442_742, 1_760_428_438_442_742], "integer microseconds (Unix epoch)"),
        ([1_760_428_436_442, 1_760_428_438_442], "integer milliseconds (Unix epoch)"),
        ([1_760_428_436, 1_760_428_438], "integer seconds (Unix epoch)"),
        ([1_760_428_436.25, 1_760_428_438.25], "float seconds"),
        ([0, 2_000], "integer milliseconds (relative times; median gap 2000)"),
        ([0, 2_000_000], "integer microseconds (relative times; median gap 2000000)"),
        ([0, 2], "integer seconds (relative times; median gap 2)"),
    ],
)
def test_timestamp_units_are_detected_per_file(tmp_path: Path, stamps: list[float], unit: str):
    f = write(tmp_path / "t.jsonl", [{"timestamp": t, "input": f"call {i}", "output": "ok", "session_id": "s"}
                                     for i, t in enumerate(stamps)])  # fmt: skip
    d = load_sessions(f, "auto", chars_tokenizer().count)
    assert gaps(d.sessions) == [[0.0, 2.0]]
    assert d.notes == [f"t.jsonl: timestamps {unit}; sessions by session_id (1)"]


def test_session_ids_of_every_kind(tmp_path: Path):
    rows = [
        {"timestamp": 1_000_000, "input": "a", "output": "", "session_id": 7},
        {"timestamp": 2_000_000, "input": "b", "output": "", "session_id": "x"},
        {"timestamp": 3_000_000, "input": "c", "output": "", "session_id": 7},
        {"timestamp": 4_000_000, "input": "d", "output": "", "session_id": ""},
        {"timestamp": 5_000_000, "input": "e", "output": ""},
    ]
    d = load_sessions(write(tmp_path / "mixed.jsonl", rows), "auto", chars_tokenizer().count)
    by = {s.session_id: [t.messages[0]["content"] for t in s.turns] for s in d.sessions}
    assert by == {"7": ["a", "c"], "x": ["b"], "mixed": ["d", "e"]}  # no id: the file's session
    assert gaps(d.sessions)[0] == [0.0, 2.0]
    assert d.notes == ["mixed.jsonl: timestamps integer microseconds (relative times; median gap 1000000); "
                       "sessions by session_id (3)"]  # fmt: skip
    d = load_sessions(write(tmp_path / "none.jsonl", [{**r, "session_id": None} for r in rows]), "auto",
                      chars_tokenizer().count)  # fmt: skip
    assert [s.session_id for s in d.sessions] == ["none"] and len(d.sessions[0].turns) == 5
    assert d.notes[0].endswith("no session_id: one session per file")


def test_a_new_id_on_every_call_rebuilds_sessions_from_the_prefix_chain(tmp_path: Path):
    a1 = "system A. user: fix bug 1"
    b1 = "system B. user: write docs"
    rows = [
        {"timestamp": 1.0, "input": a1, "output": "patch", "session_id": "req-1"},
        {"timestamp": 2.0, "input": b1, "output": "draft", "session_id": "req-2"},
        {"timestamp": 3.5, "input": a1 + " assistant: patch user: tests fail", "output": "", "session_id": "req-3"},
        {"timestamp": 4.0, "input": b1 + " assistant: draft user: shorter", "output": "", "session_id": "req-4"},
        {"timestamp": 6.0, "input": a1 + " assistant: patch user: tests fail assistant: ok", "output": "",
         "session_id": "req-5"},
    ]  # fmt: skip
    d = load_sessions(write(tmp_path / "calls.jsonl", rows), "auto", chars_tokenizer().count)
    assert [len(s.turns) for s in d.sessions] == [3, 2]
    assert [s.session_id for s in d.sessions] == ["calls#0", "calls#1"]
    assert gaps(d.sessions) == [[0.0, 2.5, 2.5], [0.0, 2.0]]
    assert d.notes == ["calls.jsonl: timestamps float seconds; session_id differs on every call: 2 sessions "
                       "rebuilt from the prompt prefix chain"]  # fmt: skip


def test_per_call_ids_whose_prompts_link_nothing_are_one_session_in_recorded_order():
    """The aider-style file: each call its own chat-completion id, no prompt extending another. Split by id
    it would be 4 one-turn sessions (no user at all with --num-rounds 2); it is one task, one session."""
    f = Path(__file__).parents[2] / "fixtures" / "aider_per_call.jsonl"
    d = load_sessions(f, "auto", chars_tokenizer().count)
    assert [s.session_id for s in d.sessions] == ["aider_per_call"]
    assert [t.messages[0]["content"].split("\n")[-1] for t in d.sessions[0].turns] == [
        "User: add a --verbose flag to main",
        "Write a one-line commit message.",
        "User: the tests fail with TypeError, fix them",
        "Write a one-line commit message.",
    ]
    assert gaps(d.sessions) == [[0.0, 7.375, 11.5, 12.25]]
    note = (
        "aider_per_call.jsonl: timestamps float seconds; session_id differs on every call and no prompt extends "
        "another: the file is one session (one task) of 4 calls in recorded order"
    )
    assert d.notes == [note]


def test_the_real_traces_say_how_they_were_read():
    from tests.conftest import SHARED_DATA

    folder = SHARED_DATA / "lmcache_agent_trace" / "miniswe"
    if not folder.exists():
        pytest.skip("../shared/data not present")
    d = load_sessions(folder, "auto", chars_tokenizer().count)
    assert d.notes and all("timestamps integer microseconds (Unix epoch)" in n for n in d.notes)
