"""The remote tiers' flags: the waterfall order, credentials kept out of argv, --gds, the cold threshold."""

import pytest
from pydantic import ValidationError

from kvtier.config.base import validate_config
from kvtier.config.bench import BenchConfig
from kvtier.config.tiers import parse_tier_order
from kvtier.errors import ConfigError

REDIS = {"redis_url": "redis://127.0.0.1:6379/0", "redis_mem_gb": 1}


def test_default_order_puts_redis_between_cpu_and_storage_and_s3_last():
    assert parse_tier_order(None, ["s3", "storage", "cpu", "redis", "gpu"]) == ["gpu", "cpu", "redis", "storage", "s3"]
    assert parse_tier_order("storage,cpu", ["cpu", "storage"]) == ["storage", "cpu"]


@pytest.mark.parametrize(
    ("order", "needle"),
    [
        ("cpu,nvme,storage", "unknown tier 'nvme'"),
        ("cpu,cpu,storage", "'cpu' is named twice"),
        ("cpu,redis,storage", "names 'redis', which is not configured"),
        ("storage", "leaves out the configured 'cpu' tier"),
    ],
)
def test_a_bad_order_is_named(order, needle):
    with pytest.raises(ConfigError, match="--tier-order") as e:
        validate_config(BenchConfig, {"tier_order": order, "gpu_mem_gb": 0})
    assert needle in str(e.value)


def test_order_with_every_tier_is_accepted():
    cfg = validate_config(BenchConfig, {**REDIS, "s3_bucket": "kv-cache", "tier_order": "gpu,cpu,storage,redis,s3"})
    assert cfg.configured_tiers() == ["gpu", "cpu", "redis", "storage", "s3"]


def test_a_password_in_the_redis_url_is_refused_and_the_env_is_named():
    with pytest.raises(ConfigError, match="KVTIER_REDIS_PASSWORD") as e:
        validate_config(BenchConfig, {"redis_url": "redis://:secret@127.0.0.1:6379/0", "redis_mem_gb": 1})
    assert "secret" not in str(e.value)


@pytest.mark.parametrize(
    "url",
    ["redsi://user:secret@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0?password=secret", "http://:secret@h:1"],
)
def test_a_bad_redis_url_never_echoes_its_password_and_query_parameters_are_refused(url):
    """#28 low 7: a mistyped scheme echoed the password; ?password= was accepted, unused, and recorded."""
    with pytest.raises(ConfigError) as e:
        validate_config(BenchConfig, {"redis_url": url, "redis_mem_gb": 1})
    assert "secret" not in str(e.value)
    assert "KVTIER_REDIS_PASSWORD" in str(e.value) or "query parameters are not used" in str(e.value)


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"redis_url": "redis://127.0.0.1:6379"}, "--redis-url needs --redis-mem-gb"),
        ({"redis_mem_gb": 1}, "--redis-mem-gb needs --redis-url"),
        ({"redis_url": "http://127.0.0.1:6379", "redis_mem_gb": 1}, "expected redis://"),
        ({"s3_endpoint": "http://127.0.0.1:9000"}, "--s3-endpoint needs --s3-bucket"),
        ({"s3_cold_threshold": 0.5}, "--s3-cold-threshold needs the S3 tier"),
        ({"s3_bucket": "bucket", "s3_part_mb": 4}, "s3-part-mb"),
        ({"s3_bucket": "B1"}, "not a valid S3 bucket name"),
    ],
)
def test_inconsistent_remote_flags_are_named(values, needle):
    with pytest.raises(ConfigError, match=needle.replace("-", "[-_]")):
        validate_config(BenchConfig, values)


def test_gds_on_without_a_device_is_refused_before_the_run(tmp_path):
    from kvtier.bench.tier_setup import gds_for
    from kvtier.engine.gds import probe_gds

    ok, why = probe_gds()
    if ok:
        pytest.skip("GPUDirect Storage is usable here")
    with pytest.raises(ConfigError, match="--gds on") as e:
        gds_for(validate_config(BenchConfig, {"gds": "on"}), [])
    assert why in str(e.value)
    auto = gds_for(validate_config(BenchConfig, {"gds": "auto"}), [])
    assert auto == {"requested": "auto", "used": False, "reason": why}
    assert gds_for(validate_config(BenchConfig, {"gds": "off"}), [])["reason"] == "--gds off"


def test_the_cold_threshold_is_the_file_tiers_own_target():
    from kvtier.engine.null import NullTier
    from kvtier.engine.tiered import StoreConfig, TieredStore

    store = TieredStore(
        [NullTier("storage", 1000), NullTier("s3", 10_000)],
        StoreConfig(target_usage_ratio=0.9, tier_target_ratios={"storage": 0.25}),
    )
    assert [t.target for t in store._tiers] == [250, 9000]
    with pytest.raises(ValueError, match="storage tier's target ratio"):
        StoreConfig(tier_target_ratios={"storage": 1.5})


def test_a_redis_servers_own_limits_are_warned_of():
    from types import SimpleNamespace

    from kvtier.bench.tier_setup import remote_warnings

    warnings: list = []
    tier = SimpleNamespace(
        name="redis", capacity_bytes=8 << 30, server={"maxmemory_bytes": 1 << 30, "maxmemory_policy": "allkeys-lru"}
    )
    remote_warnings(tier, warnings)
    assert [w.code for w in warnings] == ["remote-tier-limit", "remote-tier-limit"]
    assert "maxmemory (1.00 GiB) is below" in warnings[0].message and "allkeys-lru" in warnings[1].message
    warnings.clear()
    remote_warnings(
        SimpleNamespace(
            name="redis", capacity_bytes=1 << 30, server={"maxmemory_bytes": 0, "maxmemory_policy": "noeviction"}
        ),
        warnings,
    )
    assert warnings == []


def test_a_shared_namespace_is_checked_before_anything_runs():
    from kvtier.config import SimConfig
    from kvtier.config.bench import BenchConfig

    ok = BenchConfig(redis_url="redis://127.0.0.1:6379/0", redis_mem_gb=1, remote_namespace="shared:team-a.v1")
    assert ok.shared_namespace == "team-a.v1" and BenchConfig().shared_namespace is None
    for bad, words in [
        ({"remote_namespace": "shared:x"}, "needs a remote tier"),
        ({"remote_namespace": "shared:a/b", "redis_url": "redis://h/0", "redis_mem_gb": 1}, "pattern"),
        ({"remote_namespace": "shared:x", "redis_url": "redis://h/0", "redis_mem_gb": 1, "enable_rag": True},
         "--enable-rag with --remote-namespace shared:x: not supported"),
    ]:  # fmt: skip
        with pytest.raises(ValidationError, match=words):
            BenchConfig(**bad)
    with pytest.raises(ValidationError, match="sim replicas share an offload tier through kvtier cache-server"):
        SimConfig(remote_namespace="shared:x")


@pytest.mark.parametrize("ttl", [1e20, float("inf"), 3.2e8])
def test_a_remote_ttl_past_ten_years_is_refused_up_front(ttl):
    """#41 item 6: --remote-ttl 1e20 was accepted, and then every write to Redis failed (an expiry past the server's
    clock range); it is refused before the run, the flag named."""
    with pytest.raises(ConfigError, match="remote[-_]ttl"):
        validate_config(BenchConfig, {"remote_ttl": ttl})
    assert validate_config(BenchConfig, {"remote_ttl": 3.1e8}).remote_ttl == 3.1e8
