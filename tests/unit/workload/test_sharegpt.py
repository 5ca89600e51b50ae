import json

import pytest

from kvtier.errors import DatasetError
from kvtier.tokenizer import chars_tokenizer, load_tokenizer
from kvtier.workload.sharegpt import load_sharegpt, sharegpt_messages
from tests.conftest import SHARED_DATA

ZH = SHARED_DATA / "sharegpt" / "sharegpt_zh_1K_records_0000-0499.json"
EN = SHARED_DATA / "sharegpt" / "sharegpt_en_single_turn_sample50.json"
CHARS = chars_tokenizer()


@pytest.mark.skipif(not ZH.exists(), reason="../shared/data not present")
def test_real_multi_turn_and_single_turn_files():
    zh = load_sharegpt(ZH, 500, load_tokenizer())
    assert len(zh.conversations) == 500 and max(len(c.turns) for c in zh.conversations) > 5
    assert zh.conversations[0].conv_id == "jyrQzjG"
    en = load_sharegpt(EN, 10, load_tokenizer())
    assert len(en.conversations) == 10 and all(len(c.turns) >= 1 for c in en.conversations)
    assert "tiktoken" in zh.tokenizer  # installed by the test extras


def test_roles_merging_skips_and_limits(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(
        json.dumps(
            [
                {
                    "id": "a",
                    "conversations": [
                        {"from": "system", "value": "x" * 400},
                        {"from": "human", "value": "abcd"},
                        {"from": "human", "value": "efgh"},
                        {"from": "gpt", "value": "i" * 40},
                        {"from": "human", "value": "j" * 8},
                        {"from": "gpt", "value": "k" * 12},
                    ],
                },
                {"id": "b", "conversations": [{"from": "gpt", "value": "orphan reply"}]},
                {"prompt": "p" * 16, "response": "r" * 20, "extra": 1},
                "not a record",
            ]
        )
    )
    d = load_sharegpt(p, 10, CHARS)
    assert [c.turns for c in d.conversations] == [((2, 10), (2, 3)), ((4, 5),)]
    assert d.skipped_records == 2 and d.tokenizer.startswith("chars/4")
    assert len(load_sharegpt(p, 1, CHARS).conversations) == 1
    capped = load_sharegpt(p, 10, CHARS, max_context_tokens=1, max_generation_tokens=4)
    assert [c.turns for c in capped.conversations] == [((1, 4), (1, 3)), ((1, 4),)]


def test_one_reader_for_bench_and_replay():
    rec = {
        "conversations": [
            {"from": "gpt", "value": "orphan"},
            {"role": "user", "content": "q1"},
            {"from": "human", "value": "q2"},
            {"from": "chatgpt", "value": "a1"},
            {"from": "gpt", "value": "a1 again"},
            {"from": "system", "value": "s"},
            {"from": "human", "value": ""},
            {"from": "human", "value": "q3"},
            {"from": "model", "value": "a2"},
        ]
    }
    assert sharegpt_messages(rec) == [
        {"role": "user", "content": "q1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a1"},
        {"role": "user", "content": "q3"},
        {"role": "assistant", "content": "a2"},
    ]
    assert sharegpt_messages({"prompt": "p", "response": "r"}) == [
        {"role": "user", "content": "p"},
        {"role": "assistant", "content": "r"},
    ]
    assert sharegpt_messages("x") == [] and sharegpt_messages({"conversations": "x"}) == []


@pytest.mark.parametrize(
    "text,needle",
    [("[{]", "d.json:1: not valid JSON"), ('{"a": 1}', "expected a JSON array"), ("[]", "no usable conversation")],
)
def test_bad_datasets(tmp_path, text, needle):
    p = tmp_path / "d.json"
    p.write_text(text)
    with pytest.raises(DatasetError, match=needle):
        load_sharegpt(p, 10, CHARS)
    with pytest.raises(DatasetError, match="cannot read"):
        load_sharegpt(tmp_path / "missing.json", 10, CHARS)


def test_fallback_counter_without_tiktoken(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tiktoken(name, *a, **k):
        if name == "tiktoken":
            raise ImportError("not installed")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tiktoken)
    tok = load_tokenizer("auto")
    assert tok.name.startswith("chars/4") and tok.count("abcdefgh") == 2 == len(tok.encode("abcdefgh"))
    assert tok.encode("abcdefgh") == load_tokenizer("chars").encode("abcdefgh")  # deterministic ids
