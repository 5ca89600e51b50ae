import argparse

import pytest

from kvtier.cli.args import add_config_arguments, config_from_args
from kvtier.config import CacheServerConfig, LaunchConfig, ReplayConfig, SimConfig
from kvtier.config.base import config_argv, field_extra, flag_name, validate_config
from kvtier.config.bench import BenchConfig
from kvtier.config.tuning import Tuning, load_tuning
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
    cfg = validate_config(BenchConfig, {"config": str(p), "model": "my-13b"})
    from kvtier.bench.setup import check_config

    assert check_config(cfg).kv_bytes_per_token == 2 * 40 * 40 * 128 * 2


@pytest.mark.parametrize(
    "text,needle",
    [
        ("eviction:\n  target_usage_ratio: 1.5\n", "eviction.target_usage_ratio"),
        ("eviction:\n  reserve_wait_s: -1\n", "eviction.reserve_wait_s"),
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
        validate_config(BenchConfig, {"num_users": 0, "duration": -1})
    assert "--num-users" in str(e.value) and "--duration" in str(e.value)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        validate_config(BenchConfig, {"prefill_only": True, "decode_only": True})
    with pytest.raises(ConfigError, match="cannot read"):
        validate_config(BenchConfig, {"config": "/nonexistent.yaml"})


# -- one model per command: the fields are the flags --------------------------------------------

MODELS = [BenchConfig, ReplayConfig, SimConfig, CacheServerConfig, LaunchConfig]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_flag_is_a_field_with_its_help(model):
    p = argparse.ArgumentParser()
    add_config_arguments(p, model)
    flags = {a.dest: a for a in p._actions if a.dest != "help"}
    cli_fields = {n for n, f in model.model_fields.items() if field_extra(f).get("cli") is not False}
    assert set(flags) == cli_fields
    for name, action in flags.items():
        info = model.model_fields[name]
        assert info.description, f"{model.__name__}.{name} has no help text"
        assert action.option_strings[0] == flag_name(name)  # --num-users <-> num_users
        assert action.help.startswith(info.description.replace("%", "%%"))


def test_flags_parse_into_the_model_and_back():
    p = argparse.ArgumentParser()
    add_config_arguments(p, BenchConfig)
    args = p.parse_args(["--num_users", "7", "--disable-multi-turn", "--kv-layout", "chunked", "--seed", "3"])
    cfg = config_from_args(args, BenchConfig)
    assert (cfg.num_users, cfg.disable_multi_turn, cfg.kv_layout, cfg.duration) == (7, True, "chunked", 60)
    assert config_from_args(p.parse_args(config_argv(cfg)), BenchConfig) == cfg  # argv re-creates the config
    r = ReplayConfig(model="m", dataset="d", metrics_url=["http://a", "http://b"], agentic_tools=True, concurrency=9)
    q = argparse.ArgumentParser()
    add_config_arguments(q, ReplayConfig)
    assert config_from_args(q.parse_args(config_argv(r)), ReplayConfig) == r
    with pytest.raises(SystemExit):  # Literal fields are choices
        p.parse_args(["--kv-layout", "diagonal"])


def test_a_config_file_path_loads_its_tuning_and_a_result_config_reloads(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("decode:\n  batch_size: 8\nsharegpt:\n  max_context_tokens: 100\n")
    cfg = BenchConfig(config=str(y))  # library use: the YAML is read, not silently ignored
    assert cfg.tuning.decode.batch_size == 8 and cfg.tuning.sharegpt.max_context_tokens == 100
    y.write_text("decode:\n  batch_size: 99\n")  # a result embeds the tuning it ran with: that wins
    assert BenchConfig.model_validate(cfg.model_dump(mode="json")) == cfg


@pytest.mark.parametrize(
    "text,needle",
    [
        ("gpu_backend:\n  memory_fraction: 1.5\n", "gpu_backend.memory_fraction"),
        ("saturation_detection:\n  queue_depth_threshold: 0\n", "saturation_detection.queue_depth_threshold"),
        ("rag:\n  retrieval_distribution: gaussian\n", "rag.retrieval_distribution"),
        ("rag:\n  small_model_doc_tokens_max: 10\n", "small_model_doc_tokens_max \\(10\\) is below"),
        ("autoscaler:\n  scale_down_factor: 1.5\n", "autoscaler.scale_down_factor"),
        ("conversation:\n  end_probability: 0.1\n", "conversation.end_probability: unknown key"),
        ("sharegpt:\n  max_context_tokens: -1\n", "sharegpt.max_context_tokens"),
        ("validation_limits:\n  max_userz: 3\n", "validation_limits.max_userz: unknown key"),
    ],
)
def test_bad_values_and_unknown_keys_name_the_key(tmp_path, text, needle):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=needle):
        load_tuning(p)


def test_validation_limits_apply_to_flags(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("validation_limits:\n  max_users: 10\n  max_duration_seconds: 30\n")
    with pytest.raises(ConfigError) as e:
        validate_config(BenchConfig, {"config": str(p), "num_users": 11, "duration": 31})
    assert "--num-users 11 exceeds validation_limits (10)" in str(e.value)
    assert validate_config(BenchConfig, {"config": str(p), "num_users": 10, "duration": 30}).num_users == 10


def test_launch_owns_the_replay_urls_and_output():
    with pytest.raises(ConfigError, match="--base-url is set by kvtier launch"):
        build = {"tier": "cpu", "engine": "sim", "output": "o", "replay": {"model": "m", "base_url": "http://x"}}
        validate_config(LaunchConfig, build)


def test_a_positional_field_is_a_bare_argument_both_ways():
    """kvtier report's RESULT... is a field of its config (positional=True): parsed as bare arguments, and
    config_argv puts its values after the options."""
    import argparse

    from kvtier.cli.args import add_config_arguments, config_from_args
    from kvtier.config.base import config_argv
    from kvtier.config.report import ReportConfig

    p = argparse.ArgumentParser()
    add_config_arguments(p, ReportConfig)
    cfg = config_from_args(p.parse_args(["a.json", "b", "--html", "r.html"]), ReportConfig)
    assert cfg.results == ["a.json", "b"] and cfg.html == "r.html"
    assert config_argv(cfg) == ["--html", "r.html", "a.json", "b"]
