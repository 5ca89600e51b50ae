import pytest

from kvtier import costs as capacity  # the capacity formulas live in kvtier.costs
from kvtier.errors import DatasetError
from kvtier.modelspec import build_catalog
from kvtier.plan.measured import load_read_costs, read_costs

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


def test_measured_costs_scale_with_bytes(tiny_bench_result):
    result = tiny_bench_result[0].model_copy(deep=True)
    rd = result.tiers["storage"].read
    rd.ops, rd.bytes = 10, 10 * 2**30
    rd.latency_ms.mean, rd.latency_ms.p95 = 500.0, 1000.0
    cpu = result.tiers["cpu"].read
    cpu.ops = 0
    costs = read_costs(result)
    assert [c.tier for c in costs] == ["storage"]
    c = costs[0]
    assert c.fetch_s(2**30, conservative=False) == pytest.approx(0.5)
    assert c.fetch_s(2**30) == pytest.approx(1.0)
    assert c.extrapolated(2**20) and not c.extrapolated(2**30)


def test_measured_costs_from_a_real_result_file(tiny_bench_result):
    result, path = tiny_bench_result
    costs, loaded = load_read_costs(path)
    assert loaded == result and loaded.model.key == "tiny-1b"
    for c in costs:  # the figures are the measured ones, by the documented formulas
        rd = result.tiers[c.tier].read
        assert c.ops == rd.ops and c.mean_bytes == rd.bytes / rd.ops
        assert c.bw_p95 == pytest.approx(c.mean_bytes / (rd.latency_ms.p95 / 1e3))


@pytest.mark.parametrize("content,needle", [("{not json", "not valid JSON"), ("{}", "not a kvtier result")])
def test_measured_bad_files(tmp_path, content, needle):
    p = tmp_path / "bad.json"
    p.write_text(content)
    with pytest.raises(DatasetError, match=needle):
        load_read_costs(p)
    with pytest.raises(DatasetError, match="cannot read"):
        load_read_costs(tmp_path / "missing.json")
