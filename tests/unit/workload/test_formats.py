"""A reader that cannot read a file says what the file looks like and which command reads it (#44 item 8): the
public formats are recognised by their first line, and a misspelt flag is matched against its own command's flags.
The files are small excerpts written here in each format's shape (the real ones are in ../shared/data)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.errors import DatasetError
from kvtier.workload.formats import sniff

SHAPES = {
    "mooncake.jsonl": '{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47]}\n',
    "azure.csv": "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n",
    "burst.csv": "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,472,18,490,Conv\n",
    "sharegpt.json": json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "hi"}]}]),
    "tau2.json": json.dumps({"info": {}, "simulations": []}),
    "sessions.jsonl": json.dumps({"session_id": "s", "turns": [{"messages": []}]}) + "\n",
    "agent.jsonl": json.dumps({"input": [], "output": "x", "timestamp": 1.0}) + "\n",
}
EXPECTED = {"mooncake.jsonl": "mooncake", "azure.csv": "azure", "burst.csv": "burstgpt", "sharegpt.json": "sharegpt",
            "tau2.json": "tau2", "sessions.jsonl": "sessions", "agent.jsonl": "agent-trace"}  # fmt: skip


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    for name, text in SHAPES.items():
        (tmp_path / name).write_text(text)
        out[name] = tmp_path / name
    return out


def test_each_public_format_is_recognised_by_its_first_line(files: dict[str, Path], tmp_path: Path):
    assert {n: getattr(sniff(p), "name", None) for n, p in files.items()} == EXPECTED
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    assert sniff(tmp_path / "other.csv") is None and sniff(tmp_path / "missing") is None


def test_a_trace_given_to_replay_names_the_command_that_reads_it(files: dict[str, Path]):
    from kvtier.replay.datasets import detect

    with pytest.raises(DatasetError) as e:
        detect(files["mooncake.jsonl"])
    assert "looks like a Mooncake trace" in str(e.value) and "kvtier bench --trace-path" in str(e.value)
    assert "--dataset-format" not in str(e.value)  # no replay format reads it: that flag would not help
    with pytest.raises(DatasetError, match="not valid JSON.*looks like an Azure LLM inference trace"):
        detect(files["azure.csv"])


def test_a_dataset_given_as_a_trace_names_replay_not_a_flag_the_command_lacks(files: dict[str, Path]):
    from kvtier.workload.traces import detect_format

    with pytest.raises(DatasetError) as e:
        detect_format(files["sharegpt.json"])
    assert "ShareGPT dataset" in str(e.value) and "kvtier replay --dataset" in str(e.value)
    assert "--trace-format" not in str(e.value)  # kvtier plan retention, one of this reader's callers, has none


def test_a_csv_given_as_a_sharegpt_file_says_what_it_is(files: dict[str, Path]):
    from kvtier.workload.sharegpt import read_sharegpt_records

    with pytest.raises(DatasetError, match="looks like a BurstGPT trace"):
        read_sharegpt_records(files["burst.csv"])


def test_a_misspelt_flag_is_matched_against_its_own_commands_flags(capsys: pytest.CaptureFixture[str]):
    from kvtier.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "retention", "--trace", "t", "--trace-formt", "x"])
    err = capsys.readouterr().err
    # bench has --trace-format; retention does not: the suggestion is retention's own
    assert "--trace-formt: did you mean --trace?" in err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["benh"])
    assert "benh: did you mean bench?" in capsys.readouterr().err
