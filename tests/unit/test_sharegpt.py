import json

import pytest

from kvtier.errors import DatasetError
from kvtier.workload.sharegpt import load_sharegpt, make_token_counter
from tests.conftest import SHARED_DATA

ZH = SHARED_DATA / "sharegpt" / "sharegpt_zh_1K_records_0000-0499.json"
EN = SHARED_DATA / "sharegpt" / "sharegpt_en_single_turn_sample50.json"
CHARS = (lambda t: max(1, (len(t) + 3) // 4), "chars/4")


@pytest.mark.skipif(not ZH.exists(), reason="../shared/data not present")
def test_real_multi_turn_and_single_turn_files():
    zh = load_sharegpt(ZH, 500)
    assert len(zh.conversations) == 500 and max(len(c.turns) for c in zh.conversations) > 5
    assert zh.conversations[0].conv_id == "jyrQzjG"
    en = load_sharegpt(EN, 10)
    assert len(en.conversations) == 10 and all(len(c.turns) >= 1 for c in en.conversations)
    assert "tiktoken" in zh.tokenizer  # installed by the test extras


def test_roles_merging_skips_and_limits(tmp_path):
    p = tmp_path / "d.json"
    p.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "system", "value": "x" * 400}, {"from": "human", "value": "abcd"},
                                      {"from": "human", "value": "efgh"}, {"from": "gpt", "value": "i" * 40},
                                      {"from": "human", "value": "j" * 8}, {"from": "gpt", "value": "k" * 12}]},
        {"id": "b", "conversations": [{"from": "gpt", "value": "orphan reply"}]},
        {"prompt": "p" * 16, "response": "r" * 20, "extra": 1},
        "not a record",
    ]))
    d = load_sharegpt(p, 10, CHARS)
    assert [c.turns for c in d.conversations] == [((2, 10), (2, 3)), ((4, 5),)]
    assert d.skipped_records == 2 and d.tokenizer == "chars/4"
    assert len(load_sharegpt(p, 1, CHARS).conversations) == 1


@pytest.mark.parametrize("text,needle", [("[{]", "d.json:1: not valid JSON"), ('{"a": 1}', "expected a JSON array"),
                                         ("[]", "no usable conversation")])
def test_bad_datasets(tmp_path, text, needle):
    p = tmp_path / "d.json"
    p.write_text(text)
    with pytest.raises(DatasetError, match=needle):
        load_sharegpt(p, 10, CHARS)
    with pytest.raises(DatasetError, match="cannot read"):
        load_sharegpt(tmp_path / "missing.json", 10)


def test_fallback_counter_without_tiktoken(monkeypatch):
    import builtins
    real = builtins.__import__

    def no_tiktoken(name, *a, **k):
        if name == "tiktoken":
            raise ImportError("not installed")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_tiktoken)
    count, name = make_token_counter()
    assert name.startswith("chars/4") and count("abcdefgh") == 2
