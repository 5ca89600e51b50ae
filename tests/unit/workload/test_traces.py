"""Trace loaders: real files from ../shared/data, fixtures, and malformed input named by file:line."""

from pathlib import Path

import pytest

from kvtier.errors import DatasetError
from kvtier.workload.traces import detect_format, load_trace
from tests.conftest import SHARED_DATA

FIX = Path(__file__).resolve().parents[2] / "fixtures"
AZURE = SHARED_DATA / "azure_llm_inference_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = SHARED_DATA / "mooncake_fast25" / "conversation_trace.jsonl"
needs_data = pytest.mark.skipif(not AZURE.exists(), reason="../shared/data not present")


@needs_data
def test_azure_real_file():
    t = load_trace(AZURE)
    assert t.format == "azure" and len(t.requests) == 19_366
    assert t.requests[0].arrival_s == 0.0 and 3400 < t.requests[-1].arrival_s < 3600
    assert t.requests[0].input_tokens == 374 and t.requests[0].output_tokens == 44


@needs_data
def test_mooncake_real_file():
    t = load_trace(MOONCAKE)
    assert t.format == "mooncake" and len(t.requests) == 12_031 and t.block_tokens == 512
    r = t.requests[0]
    assert r.hash_ids[:3] == (0, 1, 2) and len(r.hash_ids) == -(-r.input_tokens // 512)


def test_burstgpt_v1_directory_and_v2_file():
    v1 = load_trace(FIX / "burstgpt", "burstgpt")
    assert [r.input_tokens for r in v1.requests] == [472, 1087, 417, 233]
    assert v1.skipped_rows == 1
    v2 = load_trace(FIX / "burstgpt_v2_fixture.csv")
    assert v2.format == "burstgpt" and [r.output_tokens for r in v2.requests] == [40, 55, 12]


@pytest.mark.parametrize(
    "name,text,needle",
    [
        (
            "a.jsonl",
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n{bad\n',
            "a.jsonl:2: not valid JSON",
        ),
        (
            "b.jsonl",
            '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1]}\n',
            "b.jsonl:1: 1 hash_ids",
        ),
        (
            "c.jsonl",
            '{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}\n',
            "c.jsonl:1: missing field 'output_length'",
        ),
        (
            "d.csv",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,12,x\n",
            "d.csv:2: GeneratedTokens must be an integer",
        ),
        ("e.csv", "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,12\n", None),
        ("f.csv", "Timestamp,Model,Request tokens,Response tokens\n", "no requests"),
        ("g.csv", "", "empty file"),
    ],
)
def test_malformed_traces_name_file_and_line(tmp_path, name, text, needle):
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(DatasetError) as e:
        load_trace(p, "azure" if name == "e.csv" else "auto")
    assert (needle or "e.csv:1: missing column(s) GeneratedTokens") in str(e.value)


def test_missing_path_and_empty_directory(tmp_path):
    with pytest.raises(DatasetError, match="no such file"):
        load_trace(tmp_path / "nope.csv")
    with pytest.raises(DatasetError, match="holds no"):
        detect_format(tmp_path)
