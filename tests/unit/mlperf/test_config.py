"""The MLPerf reference's config.yaml (every key, the reference's values: tests/fixtures/mlperf_config.yaml)
loads verbatim, and each key group changes what the run does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.bench.setup import build_components, derive
from kvtier.config.bench import BenchConfig
from kvtier.config.tuning import Tuning, load_tuning
from kvtier.telemetry.recorder import Recorder

FIXTURE = Path(__file__).parents[2] / "fixtures" / "mlperf_config.yaml"


def leaves(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out |= leaves(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: d}


def tuning_value(t: Tuning, path: str) -> Any:
    node: Any = t.model_dump(mode="python")
    for part in path.split("."):
        node = node[part]
    if isinstance(node, dict) and set(node) == {"low", "high"}:  # a [low, high] range
        return [node["low"], node["high"]]
    return node


def test_the_reference_file_loads_verbatim_and_every_value_lands():
    raw = yaml.safe_load(FIXTURE.read_text())
    t = load_tuning(FIXTURE)
    values = leaves({k: v for k, v in raw.items() if k != "model_configs"})
    assert len(values) == 70  # every key of the file (model_configs aside), none dropped on the way
    for path, want in values.items():
        assert tuning_value(t, path) == pytest.approx(want), path
    assert sorted(t.model_configs) == sorted(raw["model_configs"])
    # kvtier's defaults are the reference's: the file changes nothing but the sharegpt caps
    diff = {p for p, v in values.items() if tuning_value(Tuning(), p) != pytest.approx(v)}
    assert diff == {"sharegpt.max_context_tokens", "sharegpt.max_generation_tokens"}


def plan(tmp_path: Path, text: str = "", **flags: Any):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(merge(text) if text else FIXTURE.read_text())
    base: dict[str, Any] = {"model": "llama3.1-8b", "num_users": 4, "gpu_mem_gb": 0, "cpu_mem_gb": 0.01}
    return derive(BenchConfig(config=str(cfg_file), seed=1, cache_dir=str(tmp_path), **(base | flags)))


def merge(text: str) -> str:
    """The reference file with ``text``'s keys laid over it."""
    raw = yaml.safe_load(FIXTURE.read_text())
    for section, keys in yaml.safe_load(text).items():
        raw[section] |= keys
    return yaml.safe_dump(raw)


def test_conversation_keys(tmp_path):
    p = plan(tmp_path, "conversation: {max_conversations: 7, max_turns_per_conv: 3, end_conversation_probability: 0.5}")
    s = p.workload.settings
    assert p.workload.conversations.max_conversations == 7
    assert (s.max_turns_per_conv, s.end_probability) == (3, 0.5)


def test_prefix_cache_keys(tmp_path):
    p = plan(
        tmp_path, "prefix_cache: {min_prefix_length: 300, max_prefix_entries: 2, system_prompt_hit_probability: 1}"
    )
    s = p.workload.settings
    assert (s.min_prefix_length, s.num_system_prompts, s.system_prompt_probability) == (300, 2, 1.0)


def test_rag_keys_and_the_model_aware_document_sizes(tmp_path):
    small = plan(tmp_path, enable_rag=True).workload.rag
    large = plan(tmp_path, enable_rag=True, model="llama3.1-70b-instruct").workload.rag
    assert small is not None and large is not None
    assert small.settings.doc_tokens == (4000, 12000) and large.settings.doc_tokens == (1024, 4096)
    assert small.settings.top_k == 5 and small.settings.chunk_tokens == 512
    text = (
        "rag: {chunk_size_tokens: 256, top_k_chunks: 2, max_chunk_bytes: 1048576, request_probability: 0.5,"
        " retrieval_distribution: uniform, max_documents: 3}"
    )
    r = plan(tmp_path, text, enable_rag=True).workload.rag
    assert r is not None
    st = r.settings
    assert (st.top_k, st.request_probability, st.distribution, st.max_documents) == (2, 0.5, "uniform", 3)
    assert st.chunk_tokens == 8  # 1 MiB / 128 KiB per token of llama3.1-8b, under chunk_size_tokens
    assert len(r.retained) == 3 and r.evicted_documents == 7
    assert plan(tmp_path, text, enable_rag=True, rag_top_k=4).workload.rag.settings.top_k == 4  # the flag wins


def test_autoscaler_and_saturation_detection_keys(tmp_path):
    text = (
        "autoscaler: {min_users: 2, max_users: 9, scale_up_factor: 1.5, scale_down_factor: 0.5,"
        " consecutive_samples_required: 4}\n"
        "saturation_detection: {read_latency_p95_threshold_ms: 7, write_latency_p95_threshold_ms: 8,"
        " queue_depth_threshold: 9, history_window_size: 3}"
    )
    a = plan(tmp_path, text, enable_autoscaling=True).workload.autoscaler
    assert a is not None
    assert (a.tuning.min_users, a.tuning.max_users, a.tuning.scale_up_factor) == (2, 9, 1.5)
    assert (a.tuning.scale_down_factor, a.tuning.consecutive_samples_required) == (0.5, 4)
    th = a.thresholds
    assert (th.read_latency_p95_threshold_ms, th.write_latency_p95_threshold_ms, th.queue_depth_threshold) == (7, 8, 9)


def test_gpu_backend_keys_bound_the_gpu_tier(tmp_path):
    p = plan(tmp_path, "gpu_backend: {max_eviction_attempts: 3}")
    comp = build_components(p, Recorder())
    try:
        cfg = comp.store.config
        assert cfg.eviction_limit(10_000, "gpu") == 3 and cfg.eviction_limit(10_000, "cpu") == 5000
    finally:
        comp.close()


def test_eviction_keys_reach_the_store_with_kvtiers_wait_beside_them(tmp_path):
    text = "eviction: {target_usage_ratio: 0.7, max_recursion_depth: 3, max_evictions_min: 7, reserve_wait_s: 2.5}"
    comp = build_components(plan(tmp_path, text), Recorder())
    try:
        cfg = comp.store.config
        assert (cfg.target_usage_ratio, cfg.max_recursion, cfg.max_evictions_min) == (0.7, 3, 7)
        assert cfg.reserve_wait_s == 2.5
    finally:
        comp.close()
    comp = build_components(plan(tmp_path, ""), Recorder())
    try:
        assert comp.store.config.reserve_wait_s == 10.0  # kvtier's default (the engine's own is 1 s)
    finally:
        comp.close()


def test_workload_keys(tmp_path):
    text = (
        "decode: {batch_size: 8}\n"
        "generation_timing: {none: 0.0, fast: 0.004, realistic: 0.05}\n"
        "user_templates: {chatbot: {context_range: [100, 200], generation_range: [10, 20], think_time_range: [0, 0]}}"
    )
    p = plan(tmp_path, text, generation_mode="fast")
    assert p.workload.decode_batch == 8 and p.workload.per_token_s == 0.004
    chat = [u for u in p.workload.users if u.profile == "chatbot"]
    assert all(100 <= u.context_tokens <= 200 for u in chat)
