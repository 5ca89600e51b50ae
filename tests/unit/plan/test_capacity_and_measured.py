import json

import pytest

from kvtier.errors import DatasetError
from kvtier.modelspec import build_catalog
from kvtier.plan import capacity
from kvtier.plan.measured import load_read_costs

CAT = build_catalog()


def test_tensor_parallel_share():
    m = CAT["llama3.1-70b-instruct"]  # 8 KV heads
    assert capacity.kv_bytes_per_token(m, 1) == 327_680
    assert capacity.kv_bytes_per_token(m, 8) == 327_680 / 8
    assert capacity.kv_bytes_per_token(m, 16) == 327_680 / 8  # heads replicated beyond 8 ranks
    assert capacity.kv_bytes_per_token(CAT["deepseek-v3"], 8) == 70_272  # MLA latent replicated


def test_bytes_users_and_million_tokens():
    m = CAT["llama3.1-8b"]
    plan = capacity.bytes_for_tokens(m, 1_000_000, headroom=0.25)
    assert plan.kv_bytes == 131_072e6 and plan.with_headroom_bytes == pytest.approx(1.25 * 131_072e6)
    assert capacity.gib_per_million_tokens(m) == pytest.approx(131_072e6 / 2**30)
    users = capacity.users_per_tier(m, 512e9, 16_384, 0.8)
    assert users == int(512e9 * 0.8 // (16_384 * 131_072))
    assert capacity.users_per_tier(m, 1e9, 1e9) == 0


def _result(tmp_path, tiers):
    p = tmp_path / "r.json"
    p.write_text(json.dumps({"benchmark": "kvtier bench", "model": {"key": "llama3.1-8b"}, "status": "complete",
                             "tiers": tiers}))
    return p


def test_measured_costs_scale_with_bytes(tmp_path):
    p = _result(tmp_path, {"storage": {"read": {"ops": 10, "bytes": 10 * 2**30,
                                                 "latency_ms": {"mean": 500.0, "p95": 1000.0}}},
                           "cpu": {"read": {"ops": 0, "bytes": 0, "latency_ms": {"mean": None, "p95": None}}}})
    costs, meta = load_read_costs(p)
    assert [c.tier for c in costs] == ["storage"] and meta["model"] == "llama3.1-8b"
    c = costs[0]
    assert c.fetch_s(2**30, conservative=False) == pytest.approx(0.5)
    assert c.fetch_s(2**30) == pytest.approx(1.0)
    assert c.extrapolated(2**20) and not c.extrapolated(2**30)


@pytest.mark.parametrize("content,needle", [("{not json", "not valid JSON"), ("{}", "not a kvtier bench result")])
def test_measured_bad_files(tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(DatasetError, match=needle):
        load_read_costs(p)
    with pytest.raises(DatasetError, match="cannot read"):
        load_read_costs(tmp_path / "missing.json")
