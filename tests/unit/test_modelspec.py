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
    assert set(cat) == set(SPEC_TABLE) | {"qwen3-32b-hf"}  # the spec's table, and one released geometry
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


# One rule for KV bytes per tensor-parallel rank (bench object sizes, sim, plan): K/V heads split
# across ranks and rounded up (replicated past one head per rank); an MLA latent whole on every rank.
PER_RANK = {
    # model: {TP: bytes per token per rank}
    "llama3.1-8b": {1: 131_072, 2: 65_536, 8: 16_384, 16: 16_384},  # GQA, 8 KV heads
    "llama2-7b": {1: 524_288, 2: 262_144, 8: 65_536},  # MHA, 32 KV heads
    "deepseek-v3": {1: 70_272, 2: 70_272, 8: 70_272},  # MLA: 61 x 576 x 2 on every rank
    "tiny-1b": {1: 24_576, 2: 12_288, 8: 6_144},  # 4 KV heads: at TP 8 each rank keeps one
}


@pytest.mark.parametrize("key,tp,bpt", [(k, tp, b) for k, row in PER_RANK.items() for tp, b in row.items()])
def test_kv_bytes_per_rank_pinned(key, tp, bpt):
    m = build_catalog()[key]
    assert m.kv_bytes_per_token_per_rank(tp) == bpt
    assert m.kv_bytes_per_rank(1000, tp) == 1000 * bpt
    from kvtier.costs import kv_bytes_per_token

    assert kv_bytes_per_token(m, tp) == bpt  # the planner uses the same rule
    assert m.shards_like_reference(tp) == (m.kv_bytes_per_token / tp == bpt)


def test_bench_entry_size_is_the_per_rank_rule():
    from kvtier.bench.setup import derive
    from kvtier.config.bench import BenchConfig

    plan = derive(BenchConfig(model="deepseek-v3", tensor_parallel=8, cpu_mem_gb=0.1, num_users=2, seed=1))
    assert plan.entry_bytes(256) == build_catalog()["deepseek-v3"].kv_bytes_per_rank(256, 8) == 256 * 70_272
    (w,) = plan.warnings  # MLA at TP 8 differs from the reference's 1/TP: said, with both figures
    assert w.code == "tp-sharding-differs-from-reference"
    assert (w.kv_bytes_per_token_per_rank, w.reference_kv_bytes_per_token_per_rank) == (70_272, 70_272 / 8)


def test_a_near_miss_model_name_gets_a_suggestion():
    """#58 item 21: "did you mean" for model names (a name cut short first, then the closest spellings)."""
    with pytest.raises(ConfigError, match="'llama3.1-70b'; did you mean 'llama3.1-70b-instruct'"):
        resolve_model("llama3.1-70b", build_catalog())
    with pytest.raises(ConfigError, match="did you mean 'llama3.1-8b'"):
        resolve_model("llama3-8b", build_catalog())
    with pytest.raises(ConfigError) as e:
        resolve_model("zzzz", build_catalog())
    assert "did you mean" not in str(e.value)
