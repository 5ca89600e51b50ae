import pytest

from kvtier.errors import ConfigError
from kvtier.modelspec import BUILTIN_MODELS, build_catalog, resolve_model, spec_from_reference

SPEC_TABLE = {
    "tiny-1b": 24_576,
    "mistral-7b": 131_072,
    "llama2-7b": 524_288,
    "llama3.1-8b": 131_072,
    "llama3.1-70b-instruct": 327_680,
    "deepseek-v3": 70_272,
    "qwen3-32b": 163_840,
    "gpt-oss-120b": 73_728,
    "gpt-oss-20b": 49_152,
}


def test_builtin_catalog_reproduces_spec_table():
    cat = build_catalog()
    assert set(cat) == set(SPEC_TABLE)
    for key, bpt in SPEC_TABLE.items():
        assert cat[key].kv_bytes_per_token == bpt, key


def test_mla_latent_layout_and_size():
    ds = build_catalog()["deepseek-v3"]
    assert ds.attention == "mla"
    assert ds.kv_bytes_per_token == 61 * (512 + 64) * 2
    assert ds.entry_shape(100) == (61, 100, 576)


def test_gqa_entry_shape_matches_bytes():
    m = build_catalog()["llama3.1-8b"]
    shape = m.entry_shape(10)
    assert shape == (32, 2, 10, 8, 128)
    n = 1
    for s in shape:
        n *= s
    assert n * 2 == m.kv_bytes(10)


def test_user_model_in_reference_layout_and_override():
    cat = build_catalog(
        {"my": {"name": "Mine", "num_layers": 4, "hidden_dim": 512, "num_heads": 8, "kv_heads": 2, "dtype": "bfloat16"}}
    )
    assert cat["my"].kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert cat["my"].attention == "gqa"
    assert len(cat) == len(BUILTIN_MODELS) + 1


def test_fp4_is_exact_in_bits():
    m = spec_from_reference("x", {"num_layers": 1, "kv_heads": 1, "head_dim": 3, "dtype": "fp4"})
    assert m.kv_bytes_per_token == 3  # 2*1*1*3 elements * 4 bits = 24 bits
    assert m.kv_bytes(3) == 9


@pytest.mark.parametrize(
    "raw,needle",
    [
        ({"num_layers": 2, "hidden_dim": 100, "num_heads": 3, "kv_heads": 1}, "not divisible"),
        ({"num_layers": 2, "kv_heads": 1}, "head_dim"),
        ({"num_layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float13"}, "dtype"),
        ({"num_layers": 2, "kv_heads": 1, "head_dim": 8, "colour": "red"}, "model_configs.x.colour"),
        ({"num_layers": 2, "attention_type": "mla"}, "kv_lora_rank"),
        ({"num_layers": -1, "kv_heads": 1, "head_dim": 8}, "num_layers"),
    ],
)
def test_bad_model_entries_name_the_key(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        spec_from_reference("x", raw)


def test_unknown_model_lists_known():
    with pytest.raises(ConfigError, match="unknown model 'nope'.*llama3.1-8b"):
        resolve_model("nope", build_catalog())
