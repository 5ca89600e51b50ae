"""kvtier model make: a dummy-weight model folder whose KV geometry kvtier reads back exactly, and whose
tokenizer the replay counts with (``--tokenizer hf:DIR``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")

from kvtier.errors import ConfigError, UnsupportedError
from kvtier.modelmaker import MARKER, Geometry, geometry_like, make_model
from kvtier.modelspec import build_catalog, resolve_model, spec_from_hf_config
from kvtier.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("m") / "tiny", Geometry())


def test_the_default_is_the_issue_s_tiny_llama_at_1_kib_per_token(tiny):
    cfg = json.loads((tiny / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 2
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    spec = spec_from_hf_config(str(tiny))
    assert spec.kv_bytes_per_token == 1024 == Geometry().kv_bytes_per_token and spec.dtype == "bfloat16"
    tc = json.loads((tiny / "tokenizer_config.json").read_text())
    assert "{{ bos_token }}" in tc["chat_template"] and tc["model_max_length"] == 32768
    assert cfg["vocab_size"] == len(json.loads((tiny / "tokenizer.json").read_text())["model"]["vocab"])


@pytest.mark.parametrize("name", ["llama3.1-8b", "llama3.1-70b-instruct", "qwen3-32b"])
def test_like_keeps_a_catalog_model_s_kv_bytes_per_token(tmp_path, name):
    spec = resolve_model(name, build_catalog())
    d = make_model(tmp_path / name, geometry_like(spec, max_position=4096), like=name)
    back = spec_from_hf_config(str(d))
    assert back.kv_bytes_per_token == spec.kv_bytes_per_token
    assert (back.num_layers, back.kv_heads, back.head_dim) == (spec.num_layers, spec.kv_heads, spec.head_dim)
    assert json.loads((d / MARKER).read_text())["like"] == name


def test_the_tokenizer_is_deterministic_and_counts_any_text(tiny, tmp_path):
    again = make_model(tmp_path / "again", Geometry())
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    tok = load_tokenizer(f"hf:{tiny}")
    assert tok.kind == "hf" and "tiny" in tok.name
    for text in ["", "the model cache reads a file", 'ünïcødé 日本語 🙂 {"k": [1, 2]}']:
        ids = tok.encode(text)
        assert tok.count(text) == len(ids)
        assert len(text.encode()) / tok.max_bytes_per_token <= len(ids)  # the bound the replay refuses by
    assert 0 < tok.count("the model cache reads a file") < len("the model cache reads a file") / 2


def test_bad_input_is_refused_with_the_flag_named(tmp_path):
    with pytest.raises(ConfigError, match="--heads 3: must be a multiple of --kv-heads 2"):
        make_model(tmp_path / "x", Geometry(num_heads=3))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="not empty"):
        make_model(tmp_path / "mine", Geometry())
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    with pytest.raises(UnsupportedError, match="MLA"):
        geometry_like(resolve_model("deepseek-v3", build_catalog()))
    with pytest.raises(ConfigError, match="no tokenizer.json"):
        load_tokenizer(f"hf:{tmp_path}")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")  # #58 item 14: a FileExistsError traceback before
    with pytest.raises(ConfigError, match="a symbolic link to .*gone, which does not exist: give a folder"):
        make_model(tmp_path / "dangling", Geometry())
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot make the folder"):
        make_model(tmp_path / "file" / "inside", Geometry())
