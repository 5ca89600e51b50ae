"""kvtier plan --hf-config: a released model's geometry from its Hugging Face config.json (fixtures of
Llama-3.1-8B, Qwen3-32B and DeepSeek-V3), and catalog entries whose figures are the spec's named as such."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtier.errors import ConfigError
from kvtier.modelspec import SPEC_GEOMETRY, build_catalog, geometry, spec_from_hf_config
from tests.conftest import kvtier_cmd

HF = Path(__file__).parents[1] / "fixtures" / "hf_configs"


@pytest.mark.parametrize(
    "name,attention,bpt",
    [
        ("llama-3.1-8b", "gqa", 2 * 32 * 8 * 128 * 2),  # 131,072
        ("qwen3-32b", "gqa", 262_144),  # head_dim 128 from the file, not hidden / heads = 80
        ("deepseek-v3", "mla", 61 * (512 + 64) * 2),  # one joint latent per layer: 70,272
    ],
)
def test_bytes_per_token_from_released_configs(name: str, attention: str, bpt: int):
    m = spec_from_hf_config(str(HF / f"{name}.json"))
    assert (m.key, m.attention, m.dtype, m.kv_bytes_per_token) == (name, attention, "bfloat16", bpt)


def test_a_model_folder_and_a_multimodal_text_config(tmp_path: Path):
    inner = json.loads((HF / "llama-3.1-8b.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mllama", "text_config": inner}))
    m = spec_from_hf_config(str(tmp_path))
    assert m.kv_bytes_per_token == 131_072 and m.key == tmp_path.name


@pytest.mark.parametrize(
    "patch,words",
    [
        ({"num_hidden_layers": None}, "num_hidden_layers: required"),
        ({"num_key_value_heads": "8"}, "num_key_value_heads: expected a non-negative integer"),
        ({"torch_dtype": "int3"}, "torch_dtype: 'int3'"),
        ({"hidden_size": 4095, "head_dim": None}, "is no integer"),
    ],
)
def test_bad_configs_name_the_file_and_field(tmp_path: Path, patch: dict, words: str):
    raw = json.loads((HF / "llama-3.1-8b.json").read_text())
    raw.update(patch)
    raw = {k: v for k, v in raw.items() if v is not None}
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=words) as e:
        spec_from_hf_config(str(f))
    assert str(f) in str(e.value)


def test_spec_geometry_is_named_and_the_released_one_is_in_the_catalog():
    cat = build_catalog()
    assert geometry("qwen3-32b") == "spec" and geometry("llama3.1-8b") == "released"
    assert cat["qwen3-32b"].kv_bytes_per_token == 163_840  # the reference's figure, kept for the bench
    assert cat["qwen3-32b-hf"].kv_bytes_per_token == spec_from_hf_config(str(HF / "qwen3-32b.json")).kv_bytes_per_token
    assert set(SPEC_GEOMETRY) <= set(cat)


def test_plan_warns_of_spec_geometry_and_lists_it():
    p = subprocess.run(kvtier_cmd() + ["plan", "bytes", "--model", "qwen3-32b"], capture_output=True, text=True)
    assert p.returncode == 0 and "head_dim 128" in p.stderr and "warning" in p.stderr
    p = subprocess.run(kvtier_cmd() + ["plan", "bytes", "--list", "--json"], capture_output=True, text=True)
    rows = {r["model"]: r["geometry"] for r in json.loads(p.stdout)["models"]}
    assert rows["qwen3-32b"] == "spec" and rows["qwen3-32b-hf"] == "released"
    p = subprocess.run(kvtier_cmd() + ["plan", "bytes", "--hf-config", str(HF / "qwen3-32b.json"), "--json"],
                       capture_output=True, text=True)  # fmt: skip
    assert json.loads(p.stdout)["kv_bytes_per_token"] == 262_144 and not p.stderr
