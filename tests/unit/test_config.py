import pytest

from kvtier.config.bench import BenchConfig, Tuning, build_bench_config, load_tuning
from kvtier.errors import ConfigError


def test_defaults_match_the_reference_flags():
    c = BenchConfig()
    assert (c.model, c.num_users, c.duration, c.gpu_mem_gb, c.cpu_mem_gb) == ("llama3.1-8b", 100, 60, 16, 32)
    assert (c.generation_mode, c.max_concurrent_allocs, c.rag_num_docs, c.max_conversations) == (
        "realistic",
        0,
        10,
        500,
    )
    t = Tuning()
    assert t.user_templates["coding"].context_range.high == 25000
    assert t.qos_profiles["interactive"].target_latency_p95_ms == 50
    assert t.eviction.target_usage_ratio == 0.8 and t.eviction.large_entry_limit_ratio == 0.95


def test_partial_yaml_merges_over_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "model_configs:\n  my-13b:\n    name: My 13B\n    num_layers: 40\n    hidden_dim: 5120\n"
        "    num_heads: 40\n    kv_heads: 40\n    dtype: float16\n"
        "qos_profiles:\n  batch:\n    target_latency_p95_ms: 2000\n"
    )
    t = load_tuning(p)
    assert "my-13b" in t.model_configs
    assert t.qos_profiles["batch"].target_latency_p95_ms == 2000
    assert t.qos_profiles["batch"].target_latency_p99_ms == 5000  # untouched default
    assert t.user_templates["chatbot"].context_range.low == 512
    cfg = build_bench_config({"config": str(p), "model": "my-13b"})
    from kvtier.bench.setup import check_config

    assert check_config(cfg).kv_bytes_per_token == 2 * 40 * 40 * 128 * 2


@pytest.mark.parametrize(
    "text,needle",
    [
        ("eviction:\n  target_usage_ratio: 1.5\n", "eviction.target_usage_ratio"),
        ("bogus: 1\n", "bogus: unknown key"),
        ("qos_profiles:\n  urgent:\n    priority: 4\n", "qos_profiles.urgent"),
        ("user_templates:\n  chatbot:\n    context_range: [10, 5]\n", "user_templates.chatbot.context_range"),
        ("decode:\n  batch_size: zero\n", "decode.batch_size"),
        ("model_configs:\n  m:\n    num_layers: 0\n", "model_configs.m.num_layers"),
        ("eviction: [\n", "invalid YAML"),
        ("- 1\n- 2\n", "mapping at the top level"),
    ],
)
def test_bad_yaml_names_file_and_key(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_tuning(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_bad_flags_are_named():
    with pytest.raises(ConfigError) as e:
        build_bench_config({"num_users": 0, "duration": -1})
    assert "--num-users" in str(e.value) and "--duration" in str(e.value)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        build_bench_config({"prefill_only": True, "decode_only": True})
    with pytest.raises(ConfigError, match="cannot read"):
        build_bench_config({"config": "/nonexistent.yaml"})


def test_unbuilt_features_fail_instead_of_being_ignored():
    from kvtier.bench.setup import check_config

    with pytest.raises(ConfigError, match="--io-trace-log: not implemented"):
        check_config(build_bench_config({"io_trace_log": "x.log"}))
